//! The GPU planner over a tenantvm-gpu backend (NVML or a simulated host): turns a tenant's
//! GPU request into candidate placements for the store's ledger, and creates or destroys the
//! MIG instance of a reserved placement.
//!
//! A placement's label is `whole` or `<profile>@<start>`; the MIG instance of a placement is
//! found again from (GPU, profile, start), so creating and destroying it are idempotent
//! without storing the instance id.

use std::sync::Arc;

use tenantvm_gpu::backend::{self as gpu_backend, BackendSpec, GpuBackend, GpuInfo};
use tenantvm_gpu::mig::{GpuModel, MigProfile};
use tenantvm_gpu::plan::sizing::{self, KvDtype, WeightDtype};

use crate::domain::spec::GpuRequest;
use crate::store::GpuPlacement;
use crate::tenant::host::{GpuPlanError, GpuPlanner};

/// Context length a `model` request is sized for.
pub const MODEL_CONTEXT: u64 = 8192;
/// Concurrent sequences a `model` request is sized for.
pub const MODEL_CONCURRENCY: u64 = 4;

/// Builds the planner `--gpu-backend` names (`nvml` or `sim:FILE`).
pub fn planner_from_arg(arg: &str) -> anyhow::Result<Arc<dyn GpuPlanner>> {
    let spec: BackendSpec = arg.parse()?;
    let backend = gpu_backend::open(&spec)?;
    Ok(Arc::new(BackendPlanner { backend }))
}

/// A planner over a tenantvm-gpu backend.
pub struct BackendPlanner {
    backend: Box<dyn GpuBackend>,
}

impl BackendPlanner {
    /// A planner over `backend`.
    pub fn new(backend: Box<dyn GpuBackend>) -> BackendPlanner {
        BackendPlanner { backend }
    }
}

fn plan_err(e: impl std::fmt::Display) -> GpuPlanError {
    GpuPlanError::Plan(e.to_string())
}

fn gpu_id(g: &GpuInfo) -> String {
    format!("{}", g.index)
}

fn occupied(g: &GpuInfo) -> u32 {
    g.instances
        .iter()
        .fold(0, |m, i| m | (((1u32 << i.size) - 1) << i.start))
}

fn mig_candidates(g: &GpuInfo, profile: &MigProfile, out: &mut Vec<GpuPlacement>) {
    let used = occupied(g);
    for &start in profile.starts {
        let mask = profile.mask_at(start);
        if used & mask != 0 {
            continue;
        }
        out.push(GpuPlacement {
            gpu: gpu_id(g),
            slots: (start..start + profile.size).collect(),
            label: format!("{}@{start}", profile.name),
        });
    }
}

/// The smallest profile of `model` with at least `bytes` of memory.
fn smallest_fitting(model: &GpuModel, bytes: u64) -> Option<&MigProfile> {
    model
        .profiles
        .iter()
        .filter(|p| p.memory_bytes() >= bytes)
        .min_by_key(|p| (p.memory_mib, p.size))
}

impl GpuPlanner for BackendPlanner {
    fn candidates(&self, request: &GpuRequest) -> Result<Vec<GpuPlacement>, GpuPlanError> {
        let gpus = self.backend.gpus().map_err(plan_err)?;
        let need = match request {
            GpuRequest::Model { preset } => {
                let shape = sizing::preset(preset).map_err(plan_err)?;
                let need = sizing::need(
                    &shape,
                    WeightDtype::Bf16,
                    KvDtype::Fp16,
                    MODEL_CONTEXT,
                    MODEL_CONCURRENCY,
                    None,
                )
                .map_err(plan_err)?;
                Some(need.total)
            }
            _ => None,
        };
        let mut out = Vec::new();
        let mut known_profile = false;
        for g in &gpus {
            let Some(model) = g.gpu_model() else { continue };
            match request {
                GpuRequest::None => return Ok(Vec::new()),
                GpuRequest::Whole => {
                    if g.instances.is_empty() && !g.assigned_whole {
                        out.push(GpuPlacement {
                            gpu: gpu_id(g),
                            slots: (0..model.placement_units).collect(),
                            label: "whole".into(),
                        });
                    }
                }
                GpuRequest::Mig { profile } => {
                    if let Ok(p) = model.profile(profile) {
                        known_profile = true;
                        if g.mig_enabled && !g.assigned_whole {
                            mig_candidates(g, p, &mut out);
                        }
                    }
                }
                GpuRequest::Model { .. } => {
                    let bytes = need.unwrap_or(0);
                    if let Some(p) = smallest_fitting(model, bytes) {
                        known_profile = true;
                        if g.mig_enabled && !g.assigned_whole {
                            mig_candidates(g, p, &mut out);
                        }
                    } else if model.memory_bytes() >= bytes {
                        known_profile = true;
                        if g.instances.is_empty() && !g.assigned_whole {
                            out.push(GpuPlacement {
                                gpu: gpu_id(g),
                                slots: (0..model.placement_units).collect(),
                                label: "whole".into(),
                            });
                        }
                    }
                }
            }
        }
        match request {
            GpuRequest::Mig { profile } if !known_profile => Err(GpuPlanError::Plan(format!(
                "no GPU on this host offers MIG profile {profile:?}; see `tenantvm host check`"
            ))),
            GpuRequest::Model { preset } if !known_profile => Err(GpuPlanError::Plan(format!(
                "no GPU on this host has memory enough for {preset} ({} needed)",
                sizing::gib(need.unwrap_or(0))
            ))),
            _ => Ok(out),
        }
    }

    fn materialize(&self, placement: &GpuPlacement) -> Result<(), GpuPlanError> {
        let Some((gpu, profile, start)) = self.mig_of(placement)? else {
            return Ok(());
        };
        let gpus = self.backend.gpus().map_err(plan_err)?;
        let exists = gpus.iter().any(|g| {
            g.index == gpu
                && g.instances
                    .iter()
                    .any(|i| i.profile_id == profile.id && i.start == start)
        });
        if !exists {
            self.backend
                .create_instance(gpu, profile.id, start)
                .map_err(plan_err)?;
        }
        Ok(())
    }

    fn reset(
        &self,
        placement: &GpuPlacement,
    ) -> Result<crate::tenant::host::DeviceResetOutcome, GpuPlanError> {
        crate::tenant::gpu_scrub::reset(self.backend.as_ref(), placement)
    }

    fn scrub(&self, placement: &GpuPlacement) -> Result<crate::scrub::ScrubOutcome, GpuPlanError> {
        crate::tenant::gpu_scrub::scrub(self.backend.as_ref(), placement)
    }

    fn release(&self, placement: &GpuPlacement) -> Result<(), GpuPlanError> {
        let Some((gpu, profile, start)) = self.mig_of(placement)? else {
            return Ok(());
        };
        let gpus = self.backend.gpus().map_err(plan_err)?;
        let found = gpus
            .iter()
            .filter(|g| g.index == gpu)
            .flat_map(|g| g.instances.iter())
            .find(|i| i.profile_id == profile.id && i.start == start);
        if let Some(i) = found {
            self.backend
                .destroy_instance(gpu, i.gi_id)
                .map_err(plan_err)?;
        }
        Ok(())
    }
}

impl BackendPlanner {
    /// The (GPU index, profile, start) of a MIG placement; None for a whole GPU.
    fn mig_of(
        &self,
        placement: &GpuPlacement,
    ) -> Result<Option<(u32, &'static MigProfile, u32)>, GpuPlanError> {
        let Some((name, start)) = placement.label.split_once('@') else {
            return Ok(None);
        };
        let bad = || plan_err(format!("unreadable placement {:?}", placement.label));
        let gpu: u32 = placement.gpu.parse().map_err(|_| bad())?;
        let start: u32 = start.parse().map_err(|_| bad())?;
        let gpus = self.backend.gpus().map_err(plan_err)?;
        let model = gpus
            .iter()
            .find(|g| g.index == gpu)
            .and_then(GpuInfo::gpu_model)
            .ok_or_else(|| plan_err(format!("GPU {gpu} is gone or unknown")))?;
        let profile = model.profile(name).map_err(plan_err)?;
        Ok(Some((gpu, profile, start)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sim(dir: &tempfile::TempDir) -> BackendPlanner {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/hosts/sim-mixed.json");
        let path = dir.path().join("host.json");
        std::fs::copy(src, &path).unwrap();
        BackendPlanner::new(gpu_backend::open(&BackendSpec::Sim(path)).unwrap())
    }

    #[test]
    fn mig_candidates_skip_occupied_slots() {
        let dir = tempfile::tempdir().unwrap();
        let p = sim(&dir);
        let c = p
            .candidates(&GpuRequest::Mig {
                profile: "1g.5gb".into(),
            })
            .unwrap();
        assert!(!c.is_empty());
        // GPU 0 (A100-40GB) has a 2g.10gb at start 2: slots 2 and 3 are never offered.
        for cand in c.iter().filter(|c| c.gpu == "0") {
            assert!(
                !cand.slots.contains(&2) && !cand.slots.contains(&3),
                "{cand:?}"
            );
        }
    }

    #[test]
    fn unknown_profiles_and_presets_are_refused_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let p = sim(&dir);
        let err = p
            .candidates(&GpuRequest::Mig {
                profile: "9g.900gb".into(),
            })
            .unwrap_err();
        assert!(err.to_string().contains("9g.900gb"), "{err}");
        assert!(p
            .candidates(&GpuRequest::Model {
                preset: "no-such-model".into()
            })
            .is_err());
    }

    #[test]
    fn materialize_and_release_are_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let p = sim(&dir);
        let cand = p
            .candidates(&GpuRequest::Mig {
                profile: "1g.18gb".into(),
            })
            .unwrap()
            .remove(0);
        let count = |p: &BackendPlanner| -> usize {
            p.backend
                .gpus()
                .unwrap()
                .iter()
                .map(|g| g.instances.len())
                .sum()
        };
        let before = count(&p);
        p.materialize(&cand).unwrap();
        p.materialize(&cand).unwrap();
        assert_eq!(count(&p), before + 1);
        p.release(&cand).unwrap();
        p.release(&cand).unwrap();
        assert_eq!(count(&p), before);
    }

    #[test]
    fn model_presets_get_a_fitting_slice() {
        let dir = tempfile::tempdir().unwrap();
        let p = sim(&dir);
        let c = p
            .candidates(&GpuRequest::Model {
                preset: "llama-3-8b".into(),
            })
            .unwrap();
        assert!(!c.is_empty());
    }
}
