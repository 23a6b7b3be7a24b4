//! Check 4: memory partitions are enforced. Two probe tenants are created; the kernel's
//! limit in each one's cgroup must exist and be no more than its guest memory plus the VMM
//! overhead allowance (`--max-overhead-mib`); a tenant without a memory limit fails. Then a
//! process placed in the first probe's memory cgroup touches its limit + 64 MiB: the kernel
//! must kill it (a process that finishes shows the limit is not enforced); and the second
//! probe must still run and answer a completion.
//!
//! Not yet done: driving a probe's guest itself past its memory from inside (today's agent
//! has no command for it) and GPU memory against a MIG slice (needs GPU attach).

use std::time::Duration;

use super::host::Overrun;
use super::{Check, CheckId, Ctx, HostError, Outcome, Verdict};

/// How far past its limit the overrun process goes.
const OVERRUN_EXTRA: u64 = 64 << 20;
/// How long the overrun (and the neighbour's answer) may take.
const OVERRUN_TIMEOUT: Duration = Duration::from_secs(30);
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
        let a = ctx.probes.create("mem", |_| {})?;
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
        out.findings.push(
            "the guest itself is not driven past its RAM from inside (no agent command); GPU memory against a MIG slice is not checked (no GPU attached)".into(),
        );
        Ok(out)
    }
}
