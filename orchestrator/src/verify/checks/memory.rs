//! Check 4: memory partitions are enforced. Two probe tenants are created; the kernel's
//! limit in each one's cgroup must exist and be no more than its guest memory plus the VMM
//! overhead allowance (`--max-overhead-mib`); a tenant without a memory limit fails.
//!
//! Then from inside: the first probe's guest agent runs a memory load of its guest memory
//! plus 64 MiB (a process that touches every page, the OOM killer's first choice); the guest
//! kernel (or, failing it, the host cgroup) must stop it, and the second probe's median
//! latency meanwhile must stay within `--max-latency-ratio` of its baseline.
//!
//! Then on the host: a process placed in the first probe's memory cgroup (the OOM killer's
//! first choice there, not the VMM) touches its limit + 64 MiB: the kernel must kill it (a
//! process that finishes shows the limit is not enforced); and the second probe must still
//! run and answer a completion.
//!
//! With GPU probes (`--gpu-probes auto`, a host whose GPU backend shows GPUs) the first
//! probe holds the smallest slice the host can give, and before the overruns its guest
//! allocates GPU memory until the driver refuses ([`super::gpu_memory`]): the allocation
//! must stop at its slice, and the second probe keep its latency.

use std::time::Duration;

use tenantvm_agent_protocol::LoadKind;

use crate::verify::guest_load::{judge_guest_overrun, judge_neighbour, spec, wait_end};
use crate::verify::host::Overrun;
use crate::verify::probe::Probe;
use crate::verify::{Check, CheckId, Ctx, HostError, Outcome, Verdict};

/// How far past its limit the overrun process goes.
const OVERRUN_EXTRA: u64 = 64 << 20;
/// How long the overrun (and the neighbour's answer) may take.
const OVERRUN_TIMEOUT: Duration = Duration::from_secs(30);
/// How far past its guest memory the in-guest overrun asks, MiB.
const GUEST_OVERRUN_EXTRA_MIB: u32 = 64;
/// How long the in-guest overrun holds what it took (the neighbour is sampled meanwhile).
const GUEST_OVERRUN_HOLD_S: u32 = 8;
/// The neighbour's latency samples before the in-guest overrun.
const BASELINE_SAMPLES: usize = 8;
/// Most neighbour samples during it.
const DURING_SAMPLES: usize = 40;
/// How long the daemon may take to notice a VM that ended on its own.
const VM_END_NOTICED: Duration = Duration::from_secs(15);
use crate::domain::lifecycle::LifecycleState;

/// Check 4.
pub struct MemoryPartitionCheck;

/// Judges one tenant's memory limit against its guest memory.
pub fn judge_memory_limit(
    out: &mut Outcome,
    name: &str,
    guest_mib: u32,
    limit_bytes: Option<u64>,
    max_overhead_mib: u64,
) {
    let guest = u64::from(guest_mib) << 20;
    let allowed = guest + (max_overhead_mib << 20);
    match limit_bytes {
        None => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{name}: has no cgroup: its VMM runs without any memory limit"
            ));
        }
        // cgroup v1 reports "no limit" as a huge page-rounded number, v2 as `max`.
        Some(l) if l >= (1u64 << 62) => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{name}: its cgroup has no memory limit: it can take the host's memory from every other tenant"
            ));
            out.add(&format!("{name}.memory_limit_bytes"), l as f64, "bytes");
        }
        Some(l) => {
            out.add(&format!("{name}.memory_limit_bytes"), l as f64, "bytes");
            out.add(&format!("{name}.guest_memory_bytes"), guest as f64, "bytes");
            if l > allowed {
                out.verdict = Verdict::Fail;
                out.findings.push(format!(
                    "{name}: memory limit {} MiB exceeds guest memory {guest_mib} MiB + {max_overhead_mib} MiB overhead",
                    l >> 20
                ));
            } else if l < guest {
                out.findings.push(format!(
                    "{name}: memory limit {} MiB is below its guest memory {guest_mib} MiB (the guest may be killed under load)",
                    l >> 20
                ));
            }
        }
    }
}

impl Check for MemoryPartitionCheck {
    fn id(&self) -> CheckId {
        CheckId::MemoryPartition
    }

    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError> {
        let mut gpu = crate::verify::gpu_probe::plan(ctx)?;
        let a = crate::verify::gpu_probe::create_with_slice(ctx.probes, "mem", &mut gpu, |_| {})?;
        let b = ctx.probes.create("mem", |_| {})?;
        let mut out = Outcome::new(Verdict::Pass);
        for p in [&a, &b] {
            let limits = ctx.host.cgroup_limits(&p.name)?;
            judge_memory_limit(
                &mut out,
                &p.name,
                p.spec.memory_mib,
                limits.map(|l| l.memory_bytes),
                ctx.config.max_overhead_mib,
            );
        }
        // GPU memory first: it leaves A's VM running (the overruns below may not).
        super::gpu_memory::gpu_half(ctx, &gpu, &a, &b, || neighbour_ms(ctx, &b), &mut out)?;
        // From inside A's guest first (a host-side overrun could still take A's VMM).
        guest_overrun(ctx, &a, &b, &mut out)?;
        // Exceed A's limit inside A's cgroup: the kernel must stop it there.
        if let Some(limit) = ctx
            .host
            .cgroup_limits(&a.name)?
            .map(|l| l.memory_bytes)
            .filter(|l| *l < (1u64 << 40))
        {
            let bytes = limit + OVERRUN_EXTRA;
            out.add("overrun_bytes", bytes as f64, "bytes");
            match ctx.host.overrun_memory(&a.name, bytes, OVERRUN_TIMEOUT) {
                Ok(Overrun::Killed) => out.findings.push(format!(
                    "a process in {}'s cgroup touching {} MiB (its limit + {} MiB) was killed by the kernel",
                    a.name,
                    bytes >> 20,
                    OVERRUN_EXTRA >> 20
                )),
                Ok(Overrun::Completed) => {
                    out.verdict = Verdict::Fail;
                    out.findings.push(format!(
                        "a process in {}'s cgroup touched {} MiB, past its {} MiB limit, and finished: the limit is not enforced",
                        a.name,
                        bytes >> 20,
                        limit >> 20
                    ));
                }
                Ok(Overrun::TimedOut) => {
                    if out.verdict == Verdict::Pass {
                        out.verdict = Verdict::Inconclusive;
                    }
                    out.findings.push(format!(
                        "the overrun in {}'s cgroup neither finished nor was killed within {} s (swapping?)",
                        a.name,
                        OVERRUN_TIMEOUT.as_secs()
                    ));
                }
                Err(e) => {
                    if out.verdict == Verdict::Pass {
                        out.verdict = Verdict::Inconclusive;
                    }
                    out.findings
                        .push(format!("the overrun could not be run: {e}"));
                }
            }
        }
        // B is unaffected: still running and serving.
        match ctx.host.tenant(&b.name)? {
            Some(t) if t.state == LifecycleState::Running => {
                match ctx.host.complete_paced(
                    &b.name,
                    &b.token,
                    "the neighbour is still serving",
                    4,
                    OVERRUN_TIMEOUT,
                ) {
                    Ok(d) => out.add("neighbour_latency_ms", d.as_secs_f64() * 1e3, "ms"),
                    Err(e) => {
                        out.verdict = Verdict::Fail;
                        out.findings.push(format!(
                            "{}: runs but no longer serves beside {}: {e}",
                            b.name, a.name
                        ));
                    }
                }
            }
            other => {
                out.verdict = Verdict::Fail;
                out.findings.push(format!(
                    "{}: no longer running beside {} (state {:?})",
                    b.name,
                    a.name,
                    other.map(|t| t.state)
                ));
            }
        }
        Ok(out)
    }
}

/// Waits up to `within` for `name` to leave the running state: its state then (`None`:
/// still running).
fn left_running(
    ctx: &Ctx<'_>,
    name: &str,
    within: Duration,
) -> Result<Option<LifecycleState>, HostError> {
    let deadline = std::time::Instant::now() + within;
    loop {
        let state = ctx.host.tenant(name)?.map(|t| t.state);
        match state {
            Some(LifecycleState::Running) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(250));
            }
            Some(LifecycleState::Running) => return Ok(None),
            // Gone altogether counts as stopped too.
            other => return Ok(Some(other.unwrap_or(LifecycleState::Failed))),
        }
    }
}

fn neighbour_ms(ctx: &Ctx<'_>, b: &Probe<'_>) -> Result<f64, HostError> {
    ctx.host
        .complete_paced(
            &b.name,
            &b.token,
            "the neighbour is still serving",
            4,
            OVERRUN_TIMEOUT,
        )
        .map(|d| d.as_secs_f64() * 1e3)
}

/// From inside A's guest: a memory load past its RAM must be stopped, while B keeps its
/// latency.
fn guest_overrun(
    ctx: &Ctx<'_>,
    a: &Probe<'_>,
    b: &Probe<'_>,
    out: &mut Outcome,
) -> Result<(), HostError> {
    let mut baseline = Vec::new();
    for _ in 0..BASELINE_SAMPLES {
        match neighbour_ms(ctx, b) {
            Ok(ms) => baseline.push(ms),
            Err(e) => {
                out.findings
                    .push(format!("{}: no baseline latency: {e}", b.name));
                break;
            }
        }
    }
    let load = spec(
        LoadKind::Memory,
        a.spec.memory_mib + GUEST_OVERRUN_EXTRA_MIB,
        GUEST_OVERRUN_HOLD_S,
    );
    if let Err(e) = ctx.host.guest_load(&a.name, load) {
        if out.verdict == Verdict::Pass {
            out.verdict = Verdict::Inconclusive;
        }
        out.findings.push(format!(
            "the in-guest overrun could not be started in {}: {e}",
            a.name
        ));
        return Ok(());
    }
    // B's latency while A's guest is out of memory; then A's load must have been stopped.
    let mut during = Vec::new();
    let deadline =
        std::time::Instant::now() + Duration::from_secs(u64::from(GUEST_OVERRUN_HOLD_S) + 30);
    let ended = loop {
        if let Ok(ms) = neighbour_ms(ctx, b) {
            during.push(ms);
        }
        match ctx.host.guest_load_status(&a.name, LoadKind::Memory) {
            Ok(r) if r.state != tenantvm_agent_protocol::LoadState::Running => break Ok(r),
            Ok(_) if during.len() >= DURING_SAMPLES || std::time::Instant::now() >= deadline => {
                break wait_end(ctx.host, &a.name, LoadKind::Memory, OVERRUN_TIMEOUT)
            }
            Ok(_) => {}
            Err(e) => break Err(e),
        }
    };
    match ended {
        Ok(r) => judge_guest_overrun(out, &a.name, a.spec.memory_mib, &r),
        Err(e) => {
            // A's VM gone: the host cgroup stopped its VMM, which bounds it too. The daemon
            // notices a VM that ended on its own within seconds: wait for that.
            let state = left_running(ctx, &a.name, VM_END_NOTICED)?;
            out.add(
                "guest_overrun_vm_stopped",
                f64::from(u8::from(state.is_some())),
                "bool",
            );
            if let Some(state) = state {
                out.findings.push(format!(
                    "{}'s VM was stopped during the in-guest overrun (now {state:?}): its own cgroup stopped its VMM (guest memory + VMM overhead over the limit), and its neighbour is judged below; if a guest merely using its RAM is stopped, its VMM overhead allowance is too small",
                    a.name
                ));
            } else if out.verdict == Verdict::Pass {
                out.verdict = Verdict::Inconclusive;
                out.findings.push(format!(
                    "the in-guest overrun in {} could not be followed: {e}",
                    a.name
                ));
            }
        }
    }
    judge_neighbour(
        out,
        &b.name,
        &baseline,
        &during,
        ctx.config.max_latency_ratio,
    );
    Ok(())
}
