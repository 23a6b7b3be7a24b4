//! The GPU host of a daemon started with `--gpu-backend none`: every GPU request is refused,
//! and there is nothing to hand over, clean or describe.

use super::error::GpuError;
use super::scrub::ScrubOutcome;
use super::seam::{Cleaning, Describe, DeviceRoute, Placement};
use super::types::DeviceResetOutcome;
use crate::domain::spec::GpuRequest;
use crate::store::GpuPlacement;

/// The planner of a daemon started with `--gpu-backend none`: every GPU request is refused.
pub struct NoGpus;

impl Placement for NoGpus {
    fn place(
        &self,
        _tenant: &str,
        _request: &GpuRequest,
        _held: &[GpuPlacement],
    ) -> Result<GpuPlacement, GpuError> {
        Err(GpuError::NoGpuBackend)
    }
}

impl DeviceRoute for NoGpus {}

impl Cleaning for NoGpus {
    fn reset(&self, _placement: &GpuPlacement) -> Result<DeviceResetOutcome, GpuError> {
        Err(GpuError::NoGpuBackend)
    }

    fn scrub(&self, _placement: &GpuPlacement) -> Result<ScrubOutcome, GpuError> {
        Err(GpuError::NoGpuBackend)
    }
}

impl Describe for NoGpus {}
