//! The whole-card route. The daemon runs, recording each step:
//!
//! attach: [`check_free`] → [`vfio::plan_bind`] (record the [`vfio::VfioBinding`]) →
//! [`vfio::apply_bind`] → give the VM [`vfio::device_paths`] (and `/dev/vfio/<group>`);
//!
//! departure: stop the VM → [`reset::reset_gpu`] (checked; [`reset::ResetError::STEP`]) →
//! [`vfio::rebind_host_drivers`] ([`vfio::RebindError::STEP`]) → scrub and verify the memory
//! on the host driver → release the placement. A failed step quarantines the card and the
//! receipt names it.
//!
//! Every step can run again after a crash: `apply_bind` and `rebind_host_drivers` move only
//! the devices not yet where they belong; `reset_gpu` resets again while the devices are on
//! vfio-pci and records that they are back on their host drivers afterwards.

use thiserror::Error;

pub use crate::host::reset::{self, reset_gpu, ResetError, ResetRecord};
pub use crate::host::vfio::{
    self, apply_bind, device_paths, plan_bind, rebind_host_drivers, RebindError, VfioBinding,
};

use crate::backend::GpuInfo;
use crate::host::{sriov, PciAddress, Sysfs};

/// The attach steps, as receipts and the daemon's records name them.
pub const ATTACH_STEPS: &[&str] = &["check-free", "plan-bind", "bind-vfio"];

/// The departure steps, in order (the daemon owns the VM stop, the scrub and the release).
pub const DEPARTURE_STEPS: &[&str] = &[
    "stop-vm",
    ResetError::STEP,
    RebindError::STEP,
    "scrub-verify",
    "release",
];

/// Why a GPU cannot be given whole now.
#[derive(Debug, Error)]
pub enum WholeCardError {
    /// It is in vGPU mode.
    #[error("GPU {gpu} ({pf}) has {vfs} SR-IOV virtual functions enabled: it is in vGPU mode; let its vGPU tenants depart and leave vGPU mode first")]
    InVgpuMode {
        /// GPU index.
        gpu: u32,
        /// PCI address.
        pf: String,
        /// Enabled VFs.
        vfs: u32,
    },
    /// MIG instances exist on it.
    #[error(
        "GPU {gpu} has MIG instances {instances:?}: a GPU is given whole only when it holds none"
    )]
    HasInstances {
        /// GPU index.
        gpu: u32,
        /// Their ids.
        instances: Vec<u32>,
    },
    /// Sysfs could not tell.
    #[error("GPU {gpu}: {detail}")]
    Sysfs {
        /// GPU index.
        gpu: u32,
        /// What failed.
        detail: String,
    },
}

/// Checks that the GPU holds no MIG instance and is not in vGPU mode.
pub fn check_free(sysfs: &Sysfs, gpu: &GpuInfo) -> Result<(), WholeCardError> {
    if !gpu.instances.is_empty() {
        return Err(WholeCardError::HasInstances {
            gpu: gpu.index,
            instances: gpu.instances.iter().map(|i| i.gi_id).collect(),
        });
    }
    let pf = PciAddress::parse(&gpu.pci_address).map_err(|e| WholeCardError::Sysfs {
        gpu: gpu.index,
        detail: e.to_string(),
    })?;
    let vfs = sriov::enabled_vfs(sysfs, &pf).map_err(|e| WholeCardError::Sysfs {
        gpu: gpu.index,
        detail: e.to_string(),
    })?;
    if vfs > 0 {
        return Err(WholeCardError::InVgpuMode {
            gpu: gpu.index,
            pf: gpu.pci_address.clone(),
            vfs,
        });
    }
    Ok(())
}
