//! Probe tenants with a GPU slice (`--gpu-probes auto|off`): on a host whose GPU backend
//! shows GPUs, checks 4, 8 and 10 ask for the smallest slice the host can give (the smallest
//! MIG profile on a MIG card; a whole non-MIG card only where no MIG card exists and that
//! card is free), so that check 4 can drive GPU memory against the slice from inside the
//! guest, check 8 can saturate one slice and time its neighbour's, and check 10 can look for
//! what a departed slice leaves. A host that has GPUs but no
//! free slice makes the GPU part inconclusive, with the daemon's refusal as the reason.

use std::str::FromStr;

use super::host::{GpuView, HostError};
use super::probe::{Probe, Probes};
use super::Ctx;
use crate::api::types::{GpuSlice, TenantView};
use crate::domain::spec::{GpuRequest, TenantSpec};

/// Whether checks 4, 8 and 10 give their probes a GPU slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuProbes {
    /// When the GPU backend (`--gpu-backend`) shows GPUs.
    #[default]
    Auto,
    /// Never: the GPU halves of checks 4, 8 and 10 are reported as not run.
    Off,
}

/// A `--gpu-probes` value that is neither `auto` nor `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--gpu-probes takes auto or off, not {0:?}")]
pub struct BadGpuProbes(pub String);

impl FromStr for GpuProbes {
    type Err = BadGpuProbes;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(GpuProbes::Auto),
            "off" => Ok(GpuProbes::Off),
            other => Err(BadGpuProbes(other.to_string())),
        }
    }
}

/// What a check's GPU half will do.
#[derive(Debug, Clone, PartialEq)]
pub enum GpuPlan {
    /// Not run, and nothing is wrong with that: `--gpu-probes off`, or no GPU on the host.
    NotRun(String),
    /// The host has GPUs but cannot give a probe a slice now: the GPU half is
    /// inconclusive for this reason.
    NoSlice(String),
    /// Ask the daemon for this.
    Ask(GpuRequest),
}

/// The smallest slice to ask for on a host with `gpus`, where `tenants` hold theirs: the
/// smallest MIG profile (by memory) of the MIG-capable GPUs; else a whole non-MIG GPU no
/// tenant holds. No GPUs while tenants hold slices means the operator named no backend:
/// that cannot be judged, and says so.
pub fn choose_slice(gpus: &[GpuView], tenants: &[TenantView]) -> GpuPlan {
    if gpus.is_empty() && tenants.iter().any(|t| t.gpu.is_some()) {
        return GpuPlan::NoSlice(
            "tenants hold GPU slices, but no GPU backend (--gpu-backend nvml or sim:FILE) names the host's GPUs: the GPU half could not run"
                .into(),
        );
    }
    if gpus.is_empty() {
        return GpuPlan::NotRun(
            "no GPU on this host (or no --gpu-backend given): the GPU half is not applicable"
                .into(),
        );
    }
    let smallest = gpus
        .iter()
        .flat_map(|g| g.model.profiles.iter())
        .min_by_key(|p| (p.memory_mib, p.compute_slices));
    if let Some(p) = smallest {
        return GpuPlan::Ask(GpuRequest {
            profile: Some(p.name.to_string()),
            ..GpuRequest::default()
        });
    }
    let held = |g: &GpuView| {
        tenants
            .iter()
            .any(|t| t.gpu.as_ref().is_some_and(|s| g.is(&s.gpu)))
    };
    match gpus.iter().find(|g| !held(g)) {
        Some(_) => GpuPlan::Ask(GpuRequest {
            whole_gpu: true,
            ..GpuRequest::default()
        }),
        None => GpuPlan::NoSlice(format!(
            "no GPU slice free: the host's {} GPU(s) have no MIG and every one is held whole by a tenant",
            gpus.len()
        )),
    }
}

/// What this run's GPU probes will do, as [`choose_slice`] decides on the live host.
pub fn plan(ctx: &Ctx<'_>) -> Result<GpuPlan, HostError> {
    if ctx.config.gpu_probes == GpuProbes::Off {
        return Ok(GpuPlan::NotRun(
            "GPU probes off (--gpu-probes off): the GPU half was not run".into(),
        ));
    }
    let gpus = match ctx.host.gpus() {
        Ok(g) => g,
        Err(e) => {
            return Ok(GpuPlan::NoSlice(format!(
                "the host's GPUs could not be read: {e}"
            )))
        }
    };
    Ok(choose_slice(&gpus, &ctx.host.tenants()?))
}

/// Creates a probe with the slice `plan` asks for (adjusted as `adjust` says). A slice the
/// daemon refuses (no room: a 4xx) leaves a probe without a GPU and the plan turned into
/// [`GpuPlan::NoSlice`] with the refusal; anything else is the caller's error.
pub fn create_with_slice<'p>(
    probes: &'p Probes<'_>,
    role: &str,
    plan: &mut GpuPlan,
    adjust: impl Fn(&mut TenantSpec),
) -> Result<Probe<'p>, HostError> {
    let GpuPlan::Ask(req) = plan.clone() else {
        return probes.create(role, adjust);
    };
    match probes.create(role, |s| {
        adjust(s);
        s.gpu = req.clone();
    }) {
        Ok(p) => Ok(p),
        Err(e) if e.status().is_some_and(|s| (400..500).contains(&s)) => {
            *plan = GpuPlan::NoSlice(format!(
                "the daemon gave the probe no GPU slice ({}): {e}",
                describe(&req)
            ));
            probes.create(role, adjust)
        }
        Err(e) => Err(e),
    }
}

/// The request in words (`MIG profile 1g.10gb`, `a whole GPU`).
pub fn describe(req: &GpuRequest) -> String {
    match &req.profile {
        Some(p) => format!("MIG profile {p}"),
        None => "a whole GPU".into(),
    }
}

/// The memory of `slice` in MiB: its MIG profile's (`<profile>@<start>`), or the whole
/// card's; `None` when its GPU or profile is unknown.
pub fn slice_memory_mib(gpus: &[GpuView], slice: &GpuSlice) -> Option<u64> {
    let g = gpus.iter().find(|g| g.is(&slice.gpu))?;
    match slice.label.split_once('@') {
        Some((profile, _)) => g.model.profile(profile).ok().map(|p| p.memory_mib),
        None => Some(g.model.memory_mib),
    }
}
