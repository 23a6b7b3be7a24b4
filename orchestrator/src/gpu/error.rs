//! The wing's one error: why a GPU could not be planned or handed over, with the cause the
//! backend, the planner or the host returned kept as its `#[source]`.

use thiserror::Error;

/// What went wrong underneath: the error of the GPU backend, the exact planner or a sysfs
/// step, or a message of the wing's own (a GPU gone, an unreadable placement).
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why no GPU placement could be offered, or a device not handed over or taken back.
#[derive(Debug, Error)]
pub enum GpuError {
    /// The daemon runs without a GPU backend.
    #[error("This daemon has no GPU backend (started with --gpu-backend none): remove the `gpu` request or restart tenantvmd with --gpu-backend nvml or sim:FILE")]
    NoGpuBackend,
    /// The planner refused the request, or could not read the host to plan it.
    #[error("GPU request cannot be planned: {0}")]
    Plan(#[source] Cause),
    /// Handing a device to a VM or taking it back failed on the host (bind, reset,
    /// rebind, vGPU type, mdev).
    #[error("GPU device: {0}")]
    Device(#[source] Cause),
}

/// A placement (or the reading of the host it needs) failed: [`GpuError::Plan`].
pub fn plan_err(e: impl Into<Cause>) -> GpuError {
    GpuError::Plan(e.into())
}

/// Host device work failed (not a placement: the cause says what the host refused):
/// [`GpuError::Device`].
pub fn device_err(e: impl Into<Cause>) -> GpuError {
    GpuError::Device(e.into())
}
