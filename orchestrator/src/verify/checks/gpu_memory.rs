//! Check 4's GPU half: from inside a probe holding a GPU slice, its guest agent's
//! `gpu-memory` load allocates GPU memory through the CUDA driver until the driver says out
//! of memory; the allocation must stop at or below the slice's memory (plus a small
//! tolerance), and the neighbour probe must keep serving within the latency bound
//! meanwhile. A guest without a CUDA driver, or a host that gave no slice, leaves the GPU
//! half inconclusive, never a pass.

use std::time::{Duration, Instant};

use tenantvm_agent_protocol::{LoadKind, LoadReport, LoadState, MAX_LOAD_GPU_MIB};

use crate::verify::gpu_probe::{describe, slice_memory_mib, GpuPlan};
use crate::verify::guest_load::{
    exit_and_error, judge_neighbour, spec, start_or_inconclusive, wait_end,
};
use crate::verify::probe::Probe;
use crate::verify::{Ctx, HostError, Outcome, Verdict};

/// How long the GPU memory load holds what it took (the neighbour is sampled meanwhile).
const GPU_HOLD_S: u32 = 8;
/// How far past the slice plus tolerance the load's cap is, MiB: a driver that does not
/// bound the slice lets it reach the cap, which the judgement sees.
const CAP_EXTRA_MIB: u64 = 1024;
/// The neighbour's latency samples before the load.
const BASELINE_SAMPLES: usize = 8;
/// Most neighbour samples during it.
const DURING_SAMPLES: usize = 40;
/// How long past its hold the load may take to end.
const END_TIMEOUT: Duration = Duration::from_secs(60);

/// How far past its slice's memory a GPU memory load may get before check 4 fails: 256 MiB
/// or 2 % of the slice, whichever is more (the profile's figure is NVML's rounded
/// `memorySizeMB`; a driver may count its own context differently).
pub fn gpu_tolerance_mib(slice_mib: u64) -> u64 {
    (slice_mib / 50).max(256)
}

fn inconclusive(out: &mut Outcome, finding: String) {
    if out.verdict == Verdict::Pass {
        out.verdict = Verdict::Inconclusive;
    }
    out.findings.push(finding);
}

/// Judges check 4's GPU memory load in `name`, whose slice has `slice_mib`: the driver must
/// have stopped the allocation at or below the slice (plus [`gpu_tolerance_mib`]); a guest
/// without a CUDA driver, or a load that ended otherwise, is inconclusive (never a pass).
pub fn judge_gpu_memory(out: &mut Outcome, name: &str, slice_mib: u64, r: &LoadReport) {
    let tolerance = gpu_tolerance_mib(slice_mib);
    let asked = r.spec.map_or(0, |s| u64::from(s.amount));
    out.add("gpu_slice_mib", slice_mib as f64, "MiB");
    out.add("gpu_tolerance_mib", tolerance as f64, "MiB");
    out.add("gpu_alloc_cap_mib", asked as f64, "MiB");
    out.add("gpu_allocated_mib", r.progress as f64, "MiB");
    match r.state {
        LoadState::Finished if r.progress > slice_mib + tolerance => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "inside {name} the CUDA driver gave {} MiB of GPU memory, past its {slice_mib} MiB slice (+ {tolerance} MiB tolerance): the slice does not bound GPU memory",
                r.progress
            ));
        }
        LoadState::Finished if r.progress == 0 => inconclusive(
            out,
            format!("inside {name} the CUDA driver gave no GPU memory at all: the bound shows nothing"),
        ),
        LoadState::Finished => out.findings.push(format!(
            "inside {name} GPU memory allocation stopped at {} MiB (slice {slice_mib} MiB, tolerance {tolerance} MiB, cap {asked} MiB)",
            r.progress
        )),
        LoadState::Failed
            if r
                .error
                .as_deref()
                .is_some_and(|e| e.contains("no CUDA driver")) =>
        {
            inconclusive(
                out,
                format!(
                    "the GPU half could not run in {name}: {} (build the probe image with the NVIDIA driver's user-space libraries)",
                    crate::untrusted::one_line(r.error.as_deref().unwrap_or(""))
                ),
            );
        }
        other => inconclusive(
            out,
            format!(
                "the GPU memory load in {name} ended {other:?} at {} MiB ({}): it shows nothing",
                r.progress,
                exit_and_error(r)
            ),
        ),
    }
}

/// Runs check 4's GPU half as `plan` says: `a` (holding the slice, if any) allocates, `b`
/// is the neighbour; `neighbour_ms` times one of `b`'s completions.
pub fn gpu_half(
    ctx: &Ctx<'_>,
    plan: &GpuPlan,
    a: &Probe<'_>,
    b: &Probe<'_>,
    neighbour_ms: impl Fn() -> Result<f64, HostError>,
    out: &mut Outcome,
) -> Result<(), HostError> {
    let req = match plan {
        GpuPlan::NotRun(why) => {
            out.findings.push(why.clone());
            return Ok(());
        }
        GpuPlan::NoSlice(why) => {
            inconclusive(out, format!("GPU half inconclusive: {why}"));
            return Ok(());
        }
        GpuPlan::Ask(req) => req,
    };
    let Some(slice) = ctx.host.tenant(&a.name)?.and_then(|t| t.gpu) else {
        inconclusive(
            out,
            format!(
                "{}: asked for {} but the daemon shows no GPU slice for it: the GPU half was not run",
                a.name,
                describe(req)
            ),
        );
        return Ok(());
    };
    let Some(slice_mib) = slice_memory_mib(&ctx.host.gpus()?, &slice) else {
        inconclusive(
            out,
            format!(
                "{}: the memory of its slice {}/{} is not known: the GPU half was not run",
                a.name, slice.gpu, slice.label
            ),
        );
        return Ok(());
    };
    out.findings.push(format!(
        "{} holds GPU slice {}/{} ({slice_mib} MiB)",
        a.name, slice.gpu, slice.label
    ));
    let cap = (slice_mib + gpu_tolerance_mib(slice_mib) + CAP_EXTRA_MIB)
        .min(u64::from(MAX_LOAD_GPU_MIB)) as u32;
    let mut baseline = Vec::new();
    for _ in 0..BASELINE_SAMPLES {
        match neighbour_ms() {
            Ok(ms) => baseline.push(ms),
            Err(e) => {
                out.findings
                    .push(format!("{}: no baseline latency: {e}", b.name));
                break;
            }
        }
    }
    let load = spec(LoadKind::GpuMemory, cap, GPU_HOLD_S);
    if !start_or_inconclusive(ctx.host, &a.name, load, "GPU memory", out) {
        return Ok(());
    }
    let mut during = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(u64::from(GPU_HOLD_S) + 30);
    let ended = loop {
        if let Ok(ms) = neighbour_ms() {
            during.push(ms);
        }
        match ctx.host.guest_load_status(&a.name, LoadKind::GpuMemory) {
            Ok(r) if r.state != LoadState::Running => break Ok(r),
            Ok(_) if during.len() >= DURING_SAMPLES || Instant::now() >= deadline => {
                break wait_end(ctx.host, &a.name, LoadKind::GpuMemory, END_TIMEOUT)
            }
            Ok(_) => {}
            Err(e) => break Err(e),
        }
    };
    match ended {
        Ok(r) => judge_gpu_memory(out, &a.name, slice_mib, &r),
        Err(e) => inconclusive(
            out,
            format!(
                "the GPU memory load in {} could not be followed: {e}",
                a.name
            ),
        ),
    }
    // The neighbour's latency during the load, under measures of its own.
    let mut n = Outcome::new(Verdict::Pass);
    judge_neighbour(
        &mut n,
        &b.name,
        &baseline,
        &during,
        ctx.config.max_latency_ratio,
    );
    for m in n.evidence {
        out.add(&format!("gpu_{}", m.name), m.value, &m.unit);
    }
    if n.verdict == Verdict::Fail {
        out.verdict = Verdict::Fail;
    } else if n.verdict == Verdict::Inconclusive && out.verdict == Verdict::Pass {
        out.verdict = Verdict::Inconclusive;
    }
    out.findings.extend(
        n.findings
            .into_iter()
            .map(|f| format!("during the GPU memory load: {f}")),
    );
    Ok(())
}
