//! Check 8's GPU half: where the host can give both probes a GPU slice, the victim's own
//! `gpu-compute` load (docs/guest-image.md) measures its slice's compute rate idle, and again
//! while the noisy probe's slice runs the same load flat out. The victim's slowdown (idle
//! rate over loaded rate) must stay within `--max-latency-ratio`: a MIG slice has SMs and
//! memory of its own, time-slicing or MPS does not. A host without a GPU makes the half
//! not applicable, said so; no slice, no CUDA driver in the guest or a load that did not run
//! leave it inconclusive, never a pass.

use std::time::Duration;

use tenantvm_agent_protocol::{LoadKind, LoadReport, LoadState};

use crate::verify::gpu_probe::{describe, GpuPlan};
use crate::verify::guest_load::{
    exit_and_error, inconclusive, spec, start_or_inconclusive, wait_end,
};
use crate::verify::probe::Probe;
use crate::verify::{Ctx, HostError, Outcome, Verdict};

/// Thread blocks per launch of each compute load: enough to fill any slice's SMs many times
/// over (an H100's 132 SMs hold at most 8 blocks of 256 threads each).
pub const GPU_BLOCKS: u32 = 1024;
/// How long the build-up of the noisy load gets before the victim is measured again.
const BUILD_UP: Duration = Duration::from_secs(1);
/// How long past its `seconds` a compute load may take to end.
const END_SLACK: Duration = Duration::from_secs(60);

/// A finished compute load's rate, millions of multiply-adds per second; why not otherwise.
pub fn compute_rate(name: &str, r: &LoadReport) -> Result<f64, String> {
    match r.state {
        LoadState::Finished if r.progress > 0 && r.elapsed_ms > 0 => {
            Ok(r.progress as f64 / (r.elapsed_ms as f64 / 1e3))
        }
        LoadState::Failed
            if r
                .error
                .as_deref()
                .is_some_and(|e| e.contains("no CUDA driver")) =>
        {
            Err(format!(
                "the GPU half could not run in {name}: {} (build the probe image with the NVIDIA driver's user-space libraries)",
                crate::untrusted::one_line(r.error.as_deref().unwrap_or(""))
            ))
        }
        other => Err(format!(
            "the GPU compute load in {name} ended {other:?} after {} million multiply-adds ({}): it shows nothing",
            r.progress,
            exit_and_error(r)
        )),
    }
}

/// Runs one compute load of `seconds` in `name` and returns its rate.
fn measure(ctx: &Ctx<'_>, name: &str, seconds: u32) -> Result<Result<f64, String>, HostError> {
    if let Err(e) = ctx
        .host
        .guest_load(name, spec(LoadKind::GpuCompute, GPU_BLOCKS, seconds))
    {
        return Ok(Err(format!(
            "the GPU compute load could not be started in {name}: {e}"
        )));
    }
    let timeout = Duration::from_secs(u64::from(seconds)) + END_SLACK;
    Ok(
        match wait_end(ctx.host, name, LoadKind::GpuCompute, timeout) {
            Ok(r) => compute_rate(name, &r),
            Err(e) => Err(format!(
                "the GPU compute load in {name} could not be followed: {e}"
            )),
        },
    )
}

/// Judges the victim's compute rates (millions of multiply-adds per second) idle and beside
/// a saturated neighbour: the slowdown may not pass `max_ratio`.
pub fn judge_slowdown(out: &mut Outcome, victim: &str, idle: f64, loaded: f64, max_ratio: f64) {
    let slowdown = if loaded > 0.0 {
        idle / loaded
    } else {
        f64::INFINITY
    };
    out.add("gpu_victim_idle_mfma_per_s", idle, "1e6/s");
    out.add("gpu_victim_loaded_mfma_per_s", loaded, "1e6/s");
    out.add("gpu_victim_slowdown", slowdown, "ratio");
    if slowdown > max_ratio {
        out.verdict = Verdict::Fail;
        out.findings.push(format!(
            "{victim}'s GPU compute rate fell {slowdown:.2}x while its neighbour's slice was saturated (limit {max_ratio:.2}x): the slices share compute"
        ));
    } else {
        out.findings.push(format!(
            "{victim}'s GPU compute rate held beside a saturated neighbour: {idle:.0} idle, {loaded:.0} loaded (millions of multiply-adds/s, {slowdown:.2}x)"
        ));
    }
}

/// Runs check 8's GPU half as `plan` says, `seconds` per measurement.
pub fn gpu_half(
    ctx: &Ctx<'_>,
    plan: &GpuPlan,
    noisy: &Probe<'_>,
    victim: &Probe<'_>,
    seconds: u32,
    out: &mut Outcome,
) -> Result<(), HostError> {
    let req = match plan {
        GpuPlan::NotRun(why) => {
            out.findings.push(format!("GPU half not applicable: {why}"));
            return Ok(());
        }
        GpuPlan::NoSlice(why) => {
            inconclusive(out, format!("GPU half inconclusive: {why}"));
            return Ok(());
        }
        GpuPlan::Ask(req) => req,
    };
    for p in [noisy, victim] {
        match ctx.host.tenant(&p.name)?.and_then(|t| t.gpu) {
            Some(slice) => out.findings.push(format!(
                "{} holds GPU slice {}/{}",
                p.name, slice.gpu, slice.label
            )),
            None => {
                inconclusive(
                    out,
                    format!(
                        "{}: asked for {} but the daemon shows no GPU slice for it: the GPU half was not run",
                        p.name,
                        describe(req)
                    ),
                );
                return Ok(());
            }
        }
    }
    let idle = match measure(ctx, &victim.name, seconds)? {
        Ok(rate) => rate,
        Err(why) => {
            inconclusive(out, why);
            return Ok(());
        }
    };
    // The neighbour's load covers the build-up and the victim's whole second measurement.
    let noisy_s = (seconds * 2 + BUILD_UP.as_secs() as u32 + 2)
        .min(tenantvm_agent_protocol::MAX_LOAD_SECONDS);
    let load = spec(LoadKind::GpuCompute, GPU_BLOCKS, noisy_s);
    if !start_or_inconclusive(ctx.host, &noisy.name, load, "GPU compute", out) {
        return Ok(());
    }
    std::thread::sleep(BUILD_UP);
    let loaded = measure(ctx, &victim.name, seconds)?;
    // The neighbour must have been saturating its slice all along.
    let noisy_report = ctx
        .host
        .guest_load_status(&noisy.name, LoadKind::GpuCompute);
    let noisy_ran = match &noisy_report {
        Ok(r) if r.state == LoadState::Running && r.progress > 0 => Ok(r.progress),
        Ok(r) => compute_rate(&noisy.name, r).map(|_| r.progress),
        Err(e) => Err(format!(
            "the GPU compute load in {} could not be read: {e}",
            noisy.name
        )),
    };
    match noisy_ran {
        Ok(done) => out.add("gpu_noisy_mfma", done as f64, "1e6"),
        Err(why) => {
            inconclusive(
                out,
                format!("{why}: a victim's rate beside it would not show a saturated neighbour"),
            );
            return Ok(());
        }
    }
    match loaded {
        Ok(loaded) => judge_slowdown(
            out,
            &victim.name,
            idle,
            loaded,
            ctx.config.max_latency_ratio,
        ),
        Err(why) => inconclusive(out, why),
    }
    Ok(())
}
