//! GPU backends: where the GPU inventory comes from and who creates and destroys MIG
//! instances. [`nvml::NvmlBackend`] talks to the driver; [`sim::SimBackend`] is a simulated
//! host read from a JSON file, for CI and demos, chosen only with `--gpu-backend sim:FILE`.
//! Both enforce the same placement rules and return the same errors.

pub mod nvml;
pub mod sim;
mod usage;

pub use usage::{SliceUsage, UsageSource};

use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::mig::{self, GpuFacts, GpuModel, Layout, VgpuSupport};
use crate::plan::HostGpu;

/// Errors of the GPU backends.
#[derive(Debug, Error)]
pub enum BackendError {
    /// No GPU with that index.
    #[error("No GPU with index {0}: list them with `tenantvm host check`")]
    NoSuchGpu(u32),
    /// No GPU instance with that id on that GPU.
    #[error("GPU {gpu} has no GPU instance {gi}")]
    NoSuchInstance {
        /// GPU index.
        gpu: u32,
        /// GPU-instance id.
        gi: u32,
    },
    /// The GPU has no such MIG profile.
    #[error("GPU {gpu} has no MIG profile id {profile}")]
    UnknownProfile {
        /// GPU index.
        gpu: u32,
        /// Profile id.
        profile: u32,
    },
    /// The slots are taken (NVML_ERROR_INSUFFICIENT_RESOURCES).
    #[error("Insufficient resources on GPU {gpu}: {detail}")]
    InsufficientResources {
        /// GPU index.
        gpu: u32,
        /// What is in the way.
        detail: String,
    },
    /// The placement is not one the profile allows (NVML_ERROR_INVALID_ARGUMENT).
    #[error("Invalid placement on GPU {gpu}: {detail}")]
    InvalidPlacement {
        /// GPU index.
        gpu: u32,
        /// Why.
        detail: String,
    },
    /// The instance or GPU is busy (NVML_ERROR_IN_USE).
    #[error("GPU {gpu} is in use: {detail}; stop its clients first")]
    InUse {
        /// GPU index.
        gpu: u32,
        /// What is in use.
        detail: String,
    },
    /// MIG is disabled on the GPU.
    #[error("MIG is disabled on GPU {0}: enable it first (needs root and an idle GPU)")]
    MigDisabled(u32),
    /// The GPU model does not support MIG.
    #[error("GPU {0} does not support MIG")]
    MigUnsupported(u32),
    /// Needs root.
    #[error("Permission denied by the NVIDIA driver: run as root")]
    NoPermission,
    /// Any other NVML failure.
    #[error("NVML call {call} failed: {detail}")]
    Nvml {
        /// The NVML function.
        call: &'static str,
        /// What NVML said.
        detail: String,
    },
    /// NVML cannot be loaded.
    #[error("NVML is not available ({0}): install the NVIDIA driver, or plan with `--gpu MODEL --count N` or `--gpu-backend sim:FILE`")]
    NvmlUnavailable(String),
    /// The simulated host file is unusable.
    #[error("Simulated host {path}: {detail}")]
    SimFile {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// A `--gpu-backend` value that is not understood.
    #[error("Unknown GPU backend `{0}`: use `nvml` or `sim:FILE`")]
    BadSpec(String),
}

/// One GPU instance (with its compute instance) on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuInstance {
    /// GPU-instance id.
    pub gi_id: u32,
    /// Profile id.
    pub profile_id: u32,
    /// Start slot.
    pub start: u32,
    /// Size in placement units.
    pub size: u32,
    /// Whether its compute instance exists (a crash between the two creates can leave a GPU
    /// instance without one; [`GpuBackend::ensure_compute_instance`] repairs it).
    #[serde(default = "default_true")]
    pub has_compute_instance: bool,
}

fn default_true() -> bool {
    true
}

/// One GPU as a backend reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuInfo {
    /// Index on the host.
    pub index: u32,
    /// Product name.
    pub name: String,
    /// The database model (None: a GPU without MIG support in the database).
    pub model: Option<&'static str>,
    /// PCI address (`0000:18:00.0`).
    pub pci_address: String,
    /// PCI device id (vendor 0x10DE).
    pub pci_device_id: u16,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// Current MIG mode.
    pub mig_enabled: bool,
    /// Whether the GPU is handed out whole (sim only: a GPU bound to vfio-pci is invisible
    /// to NVML).
    pub assigned_whole: bool,
    /// IOMMU group (from sysfs on a live host), if known.
    pub iommu_group: Option<u32>,
    /// Major version of the loaded NVIDIA driver, if known.
    pub driver_major: Option<u32>,
    /// How MIG instances of this GPU can reach a VM (from sysfs on a live host).
    pub vgpu: VgpuSupport,
    /// Existing GPU instances.
    pub instances: Vec<GpuInstance>,
}

impl GpuInfo {
    /// The database model, if any.
    pub fn gpu_model(&self) -> Option<&'static GpuModel> {
        self.model.and_then(|k| mig::model_by_key(k).ok())
    }

    /// What [`mig::decide`] needs to know about this GPU.
    pub fn facts(&self) -> GpuFacts {
        GpuFacts {
            device_id: self.pci_device_id,
            memory_mib: Some(self.memory_mib).filter(|m| *m > 0),
            driver_major: self.driver_major,
            vgpu: self.vgpu.clone(),
        }
    }
}

/// What a backend can do.
pub trait GpuBackend: Send + Sync {
    /// Short name (`nvml`, `sim`).
    fn kind(&self) -> &'static str;
    /// The GPUs, their MIG mode and existing instances.
    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError>;
    /// Enables or disables MIG on a GPU (refused while instances exist or clients run).
    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<(), BackendError>;
    /// Placements `(start, size)` the profile allows on the GPU (independent of occupancy).
    fn possible_placements(
        &self,
        gpu: u32,
        profile_id: u32,
    ) -> Result<Vec<(u32, u32)>, BackendError>;
    /// How many more instances of the profile fit now.
    fn remaining_capacity(&self, gpu: u32, profile_id: u32) -> Result<u32, BackendError>;
    /// Creates a GPU instance of the profile at `start` (no compute instance yet).
    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        start: u32,
    ) -> Result<GpuInstance, BackendError>;
    /// Creates one compute instance spanning GPU instance `gi_id`, unless it has one already.
    fn ensure_compute_instance(&self, gpu: u32, gi_id: u32) -> Result<(), BackendError>;
    /// Creates a GPU instance at `start` and one compute instance spanning it; returns the GI.
    /// The GPU instance is destroyed again when the compute instance cannot be made.
    fn create_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        start: u32,
    ) -> Result<GpuInstance, BackendError> {
        let gi = self.create_gpu_instance(gpu, profile_id, start)?;
        match self.ensure_compute_instance(gpu, gi.gi_id) {
            Ok(()) => Ok(GpuInstance {
                has_compute_instance: true,
                ..gi
            }),
            Err(e) => {
                if let Err(undo) = self.destroy_instance(gpu, gi.gi_id) {
                    tracing::error!(gpu, gi = gi.gi_id, error = %undo, "destroying a GPU instance whose compute instance failed also failed");
                }
                Err(e)
            }
        }
    }
    /// Destroys the compute instances of a GPU instance, then the GPU instance.
    fn destroy_instance(&self, gpu: u32, gi_id: u32) -> Result<(), BackendError>;
    /// Enumerates the host's GPUs again, after a card was unbound from its driver or bound
    /// back (NVML's session enumerates them when it opens: its indexes and handles are stale
    /// after); nothing to do for a backend that reads the host afresh (the default).
    fn rescan(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Memory and utilisation of GPU `gpu` whole (`gi_id` None) or of its GPU instance
    /// `gi_id`; None from a backend that does not measure them (the default).
    fn usage(&self, _gpu: u32, _gi_id: Option<u32>) -> Result<Option<SliceUsage>, BackendError> {
        Ok(None)
    }
}

/// Which backend to use (`--gpu-backend`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendSpec {
    /// The live host through NVML.
    Nvml,
    /// A simulated host described by a JSON file.
    Sim(PathBuf),
}

impl FromStr for BackendSpec {
    type Err = BackendError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            None if s == "nvml" => Ok(BackendSpec::Nvml),
            Some(("sim", path)) if !path.is_empty() => Ok(BackendSpec::Sim(PathBuf::from(path))),
            _ => Err(BackendError::BadSpec(s.to_string())),
        }
    }
}

/// Opens the backend a spec names.
pub fn open(spec: &BackendSpec) -> Result<Box<dyn GpuBackend>, BackendError> {
    match spec {
        BackendSpec::Nvml => Ok(Box::new(nvml::NvmlBackend::new()?)),
        BackendSpec::Sim(path) => Ok(Box::new(sim::SimBackend::open(path)?)),
    }
}

/// The host as the planner sees it: every GPU with its existing instances, and whether it can
/// be shared or only given whole ([`mig::decide`], the rule `host check` prints).
pub fn host_gpus(gpus: &[GpuInfo]) -> Result<Vec<HostGpu>, BackendError> {
    let mut out = Vec::new();
    for g in gpus {
        let class = mig::decide(&g.facts());
        let model = class.model;
        let mut layout = Layout::empty();
        layout.whole = g.assigned_whole;
        for i in &g.instances {
            let p = model
                .profile_by_id(i.profile_id)
                .ok_or(BackendError::UnknownProfile {
                    gpu: g.index,
                    profile: i.profile_id,
                })?;
            layout
                .place(p, i.start)
                .map_err(|e| BackendError::InsufficientResources {
                    gpu: g.index,
                    detail: e.to_string(),
                })?;
        }
        out.push(HostGpu {
            index: g.index,
            model,
            sharing: class.sharing,
            layout,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_spec_parses_nvml_and_sim_only() {
        assert_eq!("nvml".parse::<BackendSpec>().unwrap(), BackendSpec::Nvml);
        assert_eq!(
            "sim:/tmp/h.json".parse::<BackendSpec>().unwrap(),
            BackendSpec::Sim("/tmp/h.json".into())
        );
        for bad in ["sim:", "fake", "nvml:x", ""] {
            let e = bad.parse::<BackendSpec>().unwrap_err();
            assert!(e.to_string().contains("sim:FILE"), "{e}");
        }
    }
}
