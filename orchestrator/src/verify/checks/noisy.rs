//! Check 8: a noisy neighbour is held to its quota. Two probe tenants: each must have a CPU
//! quota in its cgroup (a tenant without one fails); then the victim's completion latency
//! is measured idle, and again while the noisy one is saturated with requests up to its
//! concurrency quota; p50 and p99 of both phases are reported, and the p99 ratio loaded/idle
//! must stay within `--max-latency-ratio`.
//!
//! The quota is also exercised: busy processes placed in the noisy probe's CPU cgroup must
//! take no more than it, while the same processes outside any cgroup (the control) show
//! what the host would give. The check never passes when that control failed (the host
//! gave no more outside than the quota allows) or could not run: a quota not shown to bind
//! is not shown to hold.
//!
//! During the loaded phase the noisy guest also runs CPU and disk I/O load of its own (the
//! agent's bounded `load` command): busy threads, twice its vCPUs, and a file on its data
//! disk rewritten and fsynced; what they did is reported, and a load that did not run makes
//! the check inconclusive (its latency ratio would not show a saturated neighbour).
//!
//! Where the host has GPUs, both probes hold a GPU slice and [`super::noisy_gpu`] measures
//! the victim's GPU compute rate beside a saturated neighbour slice; without a GPU that half
//! is reported not applicable.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tenantvm_agent_protocol::LoadKind;

use crate::backend::ResourceLimits;
use crate::verify::gpu_probe::create_with_slice;
use crate::verify::guest_load::{not_run, spec};
use crate::verify::host::CpuOverrun;
use crate::verify::stats::quantile;
use crate::verify::{Check, CheckId, Ctx, HostError, Outcome, Verdict};

/// Check 8.
pub struct NoisyNeighbourCheck;

/// Judges a tenant's CPU quota.
pub fn judge_cpu_quota(out: &mut Outcome, name: &str, vcpus: u32, limits: Option<&ResourceLimits>) {
    match limits {
        None => {
            out.verdict = Verdict::Fail;
            out.findings
                .push(format!("{name}: has no cgroup: no CPU quota"));
        }
        Some(l) if l.cpu_quota_us == u64::MAX || l.cpu_period_us == 0 => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{name}: its cgroup has no CPU quota: it can take every CPU of the host"
            ));
        }
        Some(l) => {
            let cpus = l.cpu_quota_us as f64 / l.cpu_period_us as f64;
            out.add(&format!("{name}.cpu_quota_cpus"), cpus, "cpus");
            if cpus > f64::from(vcpus) + 1.0 {
                out.verdict = Verdict::Fail;
                out.findings.push(format!(
                    "{name}: CPU quota of {cpus:.2} CPUs for {vcpus} vCPU(s)"
                ));
            }
        }
    }
}

/// Judges busy processes in a tenant's CPU cgroup against its quota (CPUs): more than a
/// quarter over it fails; the control (the same processes outside) shows whether the host
/// could have given more at all, and when it did not, a pass becomes inconclusive.
pub fn judge_cpu_enforcement(out: &mut Outcome, name: &str, quota: f64, o: &CpuOverrun) {
    out.add("busy_workers", f64::from(o.workers), "count");
    out.add("busy_outside_cpus", o.outside_cpus, "cpus");
    out.add(&format!("{name}.busy_inside_cpus"), o.inside_cpus, "cpus");
    let slack = quota * 1.25 + 0.05;
    if o.inside_cpus > slack {
        out.verdict = Verdict::Fail;
        out.findings.push(format!(
            "busy processes in {name}'s CPU cgroup took {:.2} CPUs against its quota of {quota:.2}: the quota is not enforced",
            o.inside_cpus
        ));
    } else if o.outside_cpus <= slack {
        if out.verdict == Verdict::Pass {
            out.verdict = Verdict::Inconclusive;
        }
        out.findings.push(format!(
            "the host gave busy processes only {:.2} CPUs even outside any cgroup: the quota of {quota:.2} could not be shown to bind",
            o.outside_cpus
        ));
    } else {
        out.findings.push(format!(
            "{name}'s quota binds: {:.2} CPUs inside its cgroup against {:.2} outside",
            o.inside_cpus, o.outside_cpus
        ));
    }
}

/// Judges the latency phases (ms): p50/p99 of each, and the p99 ratio against `max_ratio`.
pub fn judge_latency(out: &mut Outcome, idle: &[f64], loaded: &[f64], max_ratio: f64) {
    if idle.is_empty() || loaded.is_empty() {
        if out.verdict == Verdict::Pass {
            out.verdict = Verdict::Inconclusive;
        }
        out.findings
            .push("no latency samples: the victim probe did not answer".into());
        return;
    }
    let (i50, i99) = (quantile(idle, 0.5), quantile(idle, 0.99));
    let (l50, l99) = (quantile(loaded, 0.5), quantile(loaded, 0.99));
    let ratio = if i99 > 0.0 { l99 / i99 } else { f64::INFINITY };
    out.add("idle_p50_ms", i50, "ms");
    out.add("idle_p99_ms", i99, "ms");
    out.add("loaded_p50_ms", l50, "ms");
    out.add("loaded_p99_ms", l99, "ms");
    out.add("p99_ratio", ratio, "ratio");
    out.add("max_p99_ratio", max_ratio, "ratio");
    if ratio > max_ratio {
        out.verdict = Verdict::Fail;
        out.findings.push(format!(
            "the victim's p99 latency grew {ratio:.2}x under its neighbour's load (limit {max_ratio:.2}x)"
        ));
    }
}

const PROMPT: &str = "the quick brown fox jumps over the lazy dog and then the dog sleeps";
/// The noisy guest's disk load file, MiB (rewritten for the whole loaded phase).
const DISK_LOAD_MIB: u32 = 32;

/// Starts the noisy guest's own CPU and disk load for `seconds`; the kinds that started.
fn start_guest_loads(
    ctx: &Ctx<'_>,
    noisy: &str,
    vcpus: u32,
    seconds: u32,
    out: &mut Outcome,
) -> Vec<LoadKind> {
    let mut started = Vec::new();
    for load in [
        spec(LoadKind::Cpu, (vcpus * 2).clamp(2, 64), seconds),
        spec(LoadKind::Disk, DISK_LOAD_MIB, seconds),
    ] {
        match ctx.host.guest_load(noisy, load) {
            Ok(()) => started.push(load.kind),
            Err(e) => out.findings.push(format!(
                "{noisy}: the in-guest {} load did not start: {e}",
                load.kind.as_str()
            )),
        }
    }
    started
}

/// Reports what the noisy guest's own loads did; false when one did not run.
fn report_guest_loads(ctx: &Ctx<'_>, noisy: &str, out: &mut Outcome) -> bool {
    let mut all_ran = true;
    for kind in [LoadKind::Cpu, LoadKind::Disk] {
        match ctx.host.guest_load_status(noisy, kind) {
            Ok(r) => {
                let secs = (r.elapsed_ms as f64 / 1e3).max(1e-3);
                match kind {
                    LoadKind::Cpu => {
                        out.add(
                            "noisy_guest_cpu_threads",
                            f64::from(r.spec.map_or(0, |s| s.amount)),
                            "count",
                        );
                        out.add(
                            "noisy_guest_cpu_mrounds_per_s",
                            r.progress as f64 / secs,
                            "1e6/s",
                        );
                    }
                    _ => {
                        out.add("noisy_guest_disk_mib_written", r.progress as f64, "MiB");
                        out.add(
                            "noisy_guest_disk_mib_per_s",
                            r.progress as f64 / secs,
                            "MiB/s",
                        );
                    }
                }
                if let Some(why) = not_run(&r).or_else(|| {
                    (r.state == tenantvm_agent_protocol::LoadState::Idle || r.progress == 0)
                        .then(|| "made no progress".to_string())
                }) {
                    all_ran = false;
                    out.findings.push(format!(
                        "{noisy}: the in-guest {} load {why}",
                        kind.as_str()
                    ));
                }
            }
            Err(e) => {
                all_ran = false;
                out.findings.push(format!(
                    "{noisy}: the in-guest {} load could not be read: {e}",
                    kind.as_str()
                ));
            }
        }
    }
    all_ran
}

impl Check for NoisyNeighbourCheck {
    fn id(&self) -> CheckId {
        CheckId::NoisyNeighbour
    }

    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError> {
        // Each a GPU slice where the host has GPUs (the GPU half), the noisy one a disk of
        // its own, for the in-guest disk I/O load.
        let mut plan = crate::verify::gpu_probe::plan(ctx)?;
        let noisy = create_with_slice(ctx.probes, "noisy", &mut plan, |s| {
            s.disk_gib = s.disk_gib.max(1);
        })?;
        // The victim's own rate quota must not throttle its latency samples.
        let victim = create_with_slice(ctx.probes, "victim", &mut plan, |s| {
            s.quotas.requests_per_s = 1000;
        })?;
        let mut out = Outcome::new(Verdict::Pass);
        for p in [&noisy, &victim] {
            judge_cpu_quota(
                &mut out,
                &p.name,
                p.spec.vcpus,
                ctx.host.cgroup_limits(&p.name)?.as_ref(),
            );
        }
        // The quota enforced: busy processes in the noisy probe's CPU cgroup take no more
        // than it, while outside (the control) the host gives them more.
        if let Some(l) = ctx.host.cgroup_limits(&noisy.name)? {
            if l.cpu_quota_us != u64::MAX && l.cpu_period_us > 0 {
                let quota = l.cpu_quota_us as f64 / l.cpu_period_us as f64;
                let host_cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
                let workers = (quota.ceil() as u32 + 1).min(host_cpus.max(1));
                match ctx
                    .host
                    .overrun_cpu(&noisy.name, workers, Duration::from_secs(2))
                {
                    Ok(o) => judge_cpu_enforcement(&mut out, &noisy.name, quota, &o),
                    Err(e) => {
                        if out.verdict == Verdict::Pass {
                            out.verdict = Verdict::Inconclusive;
                        }
                        out.findings.push(format!(
                            "the CPU quota could not be exercised (its control did not run): {e}"
                        ));
                    }
                }
            }
        }
        // The GPU half, before the latency phase's own loads start.
        super::noisy_gpu::gpu_half(
            ctx,
            &plan,
            &noisy,
            &victim,
            ctx.config.gpu_compute_seconds,
            &mut out,
        )?;
        let n = ctx.config.latency_samples.max(2);
        let sample = |into: &mut Vec<f64>| -> Result<(), HostError> {
            for _ in 0..n {
                let d = ctx.host.complete_paced(
                    &victim.name,
                    &victim.token,
                    PROMPT,
                    8,
                    Duration::from_secs(30),
                )?;
                into.push(d.as_secs_f64() * 1e3);
            }
            Ok(())
        };
        // Without answers the latency half cannot be judged; a missing quota still fails.
        let unmeasured = |mut out: Outcome, e: HostError| {
            if out.verdict == Verdict::Pass {
                out.verdict = Verdict::Inconclusive;
            }
            out.findings
                .push(format!("the victim's latency could not be measured: {e}"));
            Ok(out)
        };
        let mut idle = Vec::new();
        if let Err(e) = sample(&mut idle) {
            return unmeasured(out, e);
        }
        // The noisy guest's own CPU and disk load cover the loaded phase: its idle length,
        // three times over, and the build-up.
        let idle_s: f64 = idle.iter().sum::<f64>() / 1e3;
        let seconds =
            ((idle_s * 3.0).ceil() as u32 + 5).clamp(5, tenantvm_agent_protocol::MAX_LOAD_SECONDS);
        let started = start_guest_loads(ctx, &noisy.name, noisy.spec.vcpus, seconds, &mut out);
        let stop = AtomicBool::new(false);
        let sent = AtomicU64::new(0);
        let mut loaded = Vec::new();
        let workers = noisy.spec.quotas.max_concurrency.clamp(1, 16);
        let measured = std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        // Refusals over the quota are the quota working: keep pushing.
                        if ctx
                            .host
                            .complete(&noisy.name, &noisy.token, PROMPT, 64)
                            .is_err()
                        {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        sent.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
            // Let the load build up before measuring.
            std::thread::sleep(Duration::from_millis(500));
            let r = sample(&mut loaded);
            stop.store(true, Ordering::Relaxed);
            r
        });
        if let Err(e) = measured {
            return unmeasured(out, e);
        }
        out.add(
            "noisy_requests_sent",
            sent.load(Ordering::Relaxed) as f64,
            "count",
        );
        let reported = report_guest_loads(ctx, &noisy.name, &mut out);
        let loads_ran = started.len() == 2 && reported;
        judge_latency(&mut out, &idle, &loaded, ctx.config.max_latency_ratio);
        if !loads_ran && out.verdict == Verdict::Pass {
            out.verdict = Verdict::Inconclusive;
            out.findings.push(
                "the noisy guest did not run its own CPU and disk load: a pass would not show a saturated neighbour"
                    .into(),
            );
        }
        Ok(out)
    }
}
