//! How a placed share reaches its VM and is given back: the step functions the daemon runs,
//! in order, and records one by one. Each step checks what is already done and does only the
//! rest, so a sequence interrupted anywhere (a daemon killed mid-step) converges when it is
//! run again from the start with the same records.
//!
//! - [`whole`]: a whole GPU, its IOMMU group bound to vfio-pci; departure resets the device
//!   (checked), rebinds the host drivers, then the daemon scrubs, verifies and releases.
//! - [`vgpu`]: a MIG instance as a vGPU on an SR-IOV virtual function (vGPU 17+, Hopper and
//!   newer), the VF staying on the nvidia driver; or, on older vGPU releases, an mdev
//!   ([`crate::host::mdev`]).

pub mod vgpu;
pub mod whole;

use serde::Serialize;
use thiserror::Error;

use crate::backend::GpuInfo;
use crate::mig::{self, Sharing, VgpuSupport};
use crate::plan::Share;

/// How a share reaches the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    /// The whole GPU's IOMMU group on vfio-pci ([`whole`]).
    Whole,
    /// A MIG instance as the vGPU of an SR-IOV VF that stays on nvidia ([`vgpu`]).
    SriovVgpu,
    /// A MIG instance as an mdev vGPU ([`crate::host::mdev`]).
    MdevVgpu,
    /// A simulated host: nothing reaches a VM for real.
    Simulated,
}

/// Why a share has no route.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum RouteError {
    /// A MIG share on a GPU that can only be given whole.
    #[error("GPU {gpu} ({name}) can only be given whole: {why}")]
    WholeOnly {
        /// GPU index.
        gpu: u32,
        /// Its name.
        name: String,
        /// Why.
        why: String,
    },
}

/// The route a placed share takes on `gpu` (decided by [`mig::decide`], as placement was).
/// The daemon's one decision of a route: it records what this returns, and never decides
/// again (`orchestrator/src/gpu/route.rs`, `DeviceRoute::plan_device`).
pub fn route_for(gpu: &GpuInfo, share: &Share) -> Result<Route, RouteError> {
    if let Share::WholeGpu { .. } = share {
        return Ok(Route::Whole);
    }
    match mig::decide(&gpu.facts()).sharing {
        Sharing::WholeOnly(w) => Err(RouteError::WholeOnly {
            gpu: gpu.index,
            name: gpu.name.clone(),
            why: w.explain(),
        }),
        Sharing::Mig => Ok(match gpu.vgpu {
            VgpuSupport::Sriov { .. } => Route::SriovVgpu,
            VgpuSupport::Mdev => Route::MdevVgpu,
            VgpuSupport::Simulated | VgpuSupport::Missing { .. } => Route::Simulated,
        }),
    }
}
