//! The host-side seams the tenant service needs besides the VM backend: cleaning up a
//! tenant's jail and cgroups, and planning GPU placements.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::backend::PassthroughDevice;
use crate::domain::spec::GpuRequest;
use crate::jail::{self, BlockIoLimit, BlockIoOutcome, Cgroups, JailError};
use crate::receipt::{Assurance, StepResult};
use crate::store::GpuPlacement;
use crate::tenant::gpu_device::{DeviceRecord, MigRestore};

/// Tears down what the jail left on the host. Implemented for the real [`Cgroups`].
pub trait JailCleaner: Send + Sync {
    /// Kills every process in the tenant's cgroup and removes the cgroup and jail root.
    /// Idempotent.
    fn cleanup(&self, tenant: &str, tenant_dir: &Path) -> Result<(), JailError>;
    /// Tenants that have a cgroup on the host.
    fn list(&self) -> Result<Vec<String>, JailError>;
    /// Before the VM starts: limits the tenant cgroup's block I/O on the devices holding
    /// `disks` to `limit` (beside the VMM's own throttling).
    fn limit_block_io(
        &self,
        tenant: &str,
        disks: &[PathBuf],
        limit: BlockIoLimit,
    ) -> Result<Vec<BlockIoOutcome>, JailError>;
}

impl JailCleaner for Cgroups {
    fn cleanup(&self, tenant: &str, tenant_dir: &Path) -> Result<(), JailError> {
        jail::cleanup_tenant(self, tenant, tenant_dir)
    }

    fn limit_block_io(
        &self,
        tenant: &str,
        disks: &[PathBuf],
        limit: BlockIoLimit,
    ) -> Result<Vec<BlockIoOutcome>, JailError> {
        Cgroups::limit_block_io(self, tenant, disks, limit)
    }

    fn list(&self) -> Result<Vec<String>, JailError> {
        jail::list_tenant_cgroups(self)
    }
}

/// What a device reset did, for the receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceResetOutcome {
    /// How it was done.
    pub method: String,
    /// `ok`, or `skipped` when the device has no reset of its own.
    pub result: StepResult,
    /// How much was checked.
    pub assurance: Assurance,
    /// Device ids and the like.
    pub evidence: BTreeMap<String, String>,
}

/// Why no GPU placement could be offered.
#[derive(Debug, Error)]
pub enum GpuPlanError {
    /// The daemon runs without a GPU backend.
    #[error("This daemon has no GPU backend (started with --gpu-backend none): remove the `gpu` request or restart tenantvmd with --gpu-backend nvml or sim:FILE")]
    NoGpuBackend,
    /// The planner refused the request.
    #[error("GPU request cannot be planned: {0}")]
    Plan(String),
    /// Handing a device to a VM or taking it back failed on the host (bind, reset,
    /// rebind, vGPU type, mdev).
    #[error("GPU device: {0}")]
    Device(String),
}

/// Places a GPU request: the exact planner over the host's current instances, the shares
/// the ledger holds (reservations and quarantined slices) and the new tenant. The store's
/// ledger then reserves the placement atomically (a concurrent create that took it first
/// makes the caller place again).
pub trait GpuPlanner: Send + Sync {
    /// The placement for `tenant`'s `request` (never called for a request without a GPU)
    /// around `held`, the ledger's shares. A refusal says why (full, fragmented, or a GPU
    /// that cannot be shared) and what to do.
    fn place(
        &self,
        tenant: &str,
        request: &GpuRequest,
        held: &[GpuPlacement],
    ) -> Result<GpuPlacement, GpuPlanError>;

    /// Makes a reserved placement real on the GPU (creates its MIG instance). Idempotent.
    /// The default does nothing (whole GPUs and planners without hardware).
    fn materialize(&self, _placement: &GpuPlacement) -> Result<(), GpuPlanError> {
        Ok(())
    }

    /// Undoes [`GpuPlanner::materialize`] (destroys the MIG instance). Idempotent.
    fn release(&self, _placement: &GpuPlacement) -> Result<(), GpuPlanError> {
        Ok(())
    }

    /// Resets the device of a released placement (departure's device-reset step).
    fn reset(&self, placement: &GpuPlacement) -> Result<DeviceResetOutcome, GpuPlanError>;

    /// Zeroes and reads back the memory of a released placement whose MIG instance still
    /// exists (departure's gpu-scrub step, and `tenantvm gpu scrub`).
    fn scrub(&self, placement: &GpuPlacement) -> Result<crate::scrub::ScrubOutcome, GpuPlanError>;

    /// Decides how `placement` reaches the VM and reads what that will do; touches nothing
    /// (prepare-gpu-host records it first). The default hands nothing over.
    fn plan_device(&self, _placement: &GpuPlacement) -> Result<DeviceRecord, GpuPlanError> {
        Ok(DeviceRecord::NotAttached {
            reason: "this planner hands no device to the VM".into(),
            mig_turned_on: None,
        })
    }

    /// Prepares the card of `placement` for the route (vGPU: MIG on, then VFs on; a whole
    /// card recorded in MIG mode: MIG off). Idempotent.
    fn prepare_device(
        &self,
        _placement: &GpuPlacement,
        _record: &DeviceRecord,
    ) -> Result<(), GpuPlanError> {
        Ok(())
    }

    /// What binding will do, chosen now that the instance exists (mdev: the type and UUID);
    /// touches nothing, so bind-gpu records it first. The default changes nothing.
    fn plan_bind(
        &self,
        _placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<DeviceRecord, GpuPlanError> {
        Ok(record.clone())
    }

    /// Binds the share for the VM (whole: vfio-pci; vGPU: the type on a VF, checked against
    /// the planned instance); returns the record to store. Idempotent.
    fn bind_device(
        &self,
        _placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<DeviceRecord, GpuPlanError> {
        Ok(record.clone())
    }

    /// The devices the VM gets.
    fn devices(&self, _record: &DeviceRecord) -> Result<Vec<PassthroughDevice>, GpuPlanError> {
        Ok(Vec::new())
    }

    /// The route's own reset at departure (whole: checked PCI reset), or None when the
    /// route has none and [`GpuPlanner::reset`] applies.
    fn reset_device(
        &self,
        _record: &DeviceRecord,
    ) -> Result<Option<DeviceResetOutcome>, GpuPlanError> {
        Ok(None)
    }

    /// Gives the devices back to their host drivers (whole). Idempotent.
    fn rebind_device(&self, _record: &DeviceRecord) -> Result<(), GpuPlanError> {
        Ok(())
    }

    /// The driver each device of the record is bound to now, read from sysfs (whole: every
    /// device of the group, None when unbound), for the receipt after rebind-gpu. The
    /// default reads nothing.
    fn device_drivers(
        &self,
        _record: &DeviceRecord,
    ) -> Result<Vec<(String, Option<String>)>, GpuPlanError> {
        Ok(Vec::new())
    }

    /// Takes the vGPU off its VF (type 0). Idempotent.
    fn detach_device(
        &self,
        _placement: &GpuPlacement,
        _record: &DeviceRecord,
    ) -> Result<(), GpuPlanError> {
        Ok(())
    }

    /// The card (`card`, its ledger id) goes back to the mode the tenant found it in: the
    /// last vGPU tenant gone, VFs off and MIG off last; a whole card recorded in MIG mode,
    /// MIG back on. Idempotent.
    fn leave_device_mode(&self, _card: &str, _record: &DeviceRecord) -> Result<(), GpuPlanError> {
        Ok(())
    }

    /// Whether card `gpu` has MIG mode on (None: this planner has no cards to ask).
    fn mig_enabled(&self, _gpu: &str) -> Result<Option<bool>, GpuPlanError> {
        Ok(None)
    }

    /// The card's last MIG tenant is gone and the daemon had turned MIG on for one of its
    /// tenants: MIG off again. Idempotent. The default has no MIG mode to restore.
    fn restore_mig_off(&self, _gpu: &str) -> Result<MigRestore, GpuPlanError> {
        Ok(MigRestore::AlreadyOff)
    }

    /// What `placement` is, for `tenantvm gpu-info` (its card, memory, profile, the devices
    /// handed over and the ids the guest should see). The default knows only what the
    /// ledger and the device record say.
    fn describe(
        &self,
        placement: &GpuPlacement,
        record: Option<&DeviceRecord>,
    ) -> Result<crate::tenant::gpu_info::AssignedGpu, GpuPlanError> {
        Ok(crate::tenant::gpu_info::AssignedGpu::basic(
            placement, record,
        ))
    }

    /// Receipt evidence on how `record`'s route ran: which of its parts ran on the real
    /// host and which were SIMULATED, and what its functions are now. The default says
    /// nothing.
    fn route_evidence(&self, _record: &DeviceRecord) -> Vec<(String, String)> {
        Vec::new()
    }

    /// Memory and utilisation of the slice `placement` names, as the GPU backend reads them
    /// (for the tenant's metrics); None from a planner without a backend that measures.
    fn usage(
        &self,
        _placement: &GpuPlacement,
    ) -> Result<Option<tenantvm_gpu::backend::SliceUsage>, GpuPlanError> {
        Ok(None)
    }

    /// The host's GPUs with their instances, as the GPU backend lists them (`GET /v1/host`,
    /// for a placer of many hosts); none from a planner without a backend.
    fn gpus(&self) -> Result<Vec<tenantvm_gpu::backend::GpuInfo>, GpuPlanError> {
        Ok(Vec::new())
    }
}

/// The planner of a daemon started with `--gpu-backend none`: every GPU request is refused.
pub struct NoGpus;

impl GpuPlanner for NoGpus {
    fn place(
        &self,
        _tenant: &str,
        _request: &GpuRequest,
        _held: &[GpuPlacement],
    ) -> Result<GpuPlacement, GpuPlanError> {
        Err(GpuPlanError::NoGpuBackend)
    }

    fn reset(&self, _placement: &GpuPlacement) -> Result<DeviceResetOutcome, GpuPlanError> {
        Err(GpuPlanError::NoGpuBackend)
    }

    fn scrub(&self, _placement: &GpuPlacement) -> Result<crate::scrub::ScrubOutcome, GpuPlanError> {
        Err(GpuPlanError::NoGpuBackend)
    }
}
