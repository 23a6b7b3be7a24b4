//! The seams the tenant steps drive the host's GPUs through, one per purpose:
//!
//! - [`Placement`]: where a request goes on the host, and making the reserved share real
//!   (its MIG instance, the card's MIG mode);
//! - [`DeviceRoute`]: how a share reaches its VM and is given back (plan, prepare, bind,
//!   reset, rebind, detach), over the record the daemon stores for it;
//! - [`Cleaning`]: the departure's reset and memory scrub of a released share;
//! - [`Describe`]: what a share is and how busy it is, and the host's GPUs.
//!
//! [`GpuHost`] is all four, the one object the daemon hands the tenant service. Each seam is
//! implemented for the real [`super::BackendPlanner`] in a file of its own
//! ([`super::placement`], [`super::route`], [`super::scrub::departure`],
//! [`super::describe`]) and for the refusing [`super::NoGpus`].

use tenantvm_gpu::backend::{GpuInfo, SliceUsage};

use super::error::GpuError;
use super::scrub::ScrubOutcome;
use super::types::{AssignedGpu, DeviceRecord, DeviceResetOutcome, MigRestore};
use crate::backend::PassthroughDevice;
use crate::domain::spec::GpuRequest;
use crate::store::GpuPlacement;

/// Places a GPU request: the exact planner over the host's current instances, the shares
/// the ledger holds (reservations and quarantined slices) and the new tenant. The store's
/// ledger then reserves the placement atomically (a concurrent create that took it first
/// makes the caller place again).
pub trait Placement: Send + Sync {
    /// The placement for `tenant`'s `request` (never called for a request without a GPU)
    /// around `held`, the ledger's shares. A refusal says why (full, fragmented, or a GPU
    /// that cannot be shared) and what to do.
    fn place(
        &self,
        tenant: &str,
        request: &GpuRequest,
        held: &[GpuPlacement],
    ) -> Result<GpuPlacement, GpuError>;

    /// Makes a reserved placement real on the GPU (creates its MIG instance). Idempotent.
    /// The default does nothing (whole GPUs and planners without hardware).
    fn materialize(&self, _placement: &GpuPlacement) -> Result<(), GpuError> {
        Ok(())
    }

    /// Undoes [`Placement::materialize`] (destroys the MIG instance). Idempotent.
    fn release(&self, _placement: &GpuPlacement) -> Result<(), GpuError> {
        Ok(())
    }

    /// Whether card `gpu` has MIG mode on (None: this planner has no cards to ask).
    fn mig_enabled(&self, _gpu: &str) -> Result<Option<bool>, GpuError> {
        Ok(None)
    }

    /// The card's last MIG tenant is gone and the daemon had turned MIG on for one of its
    /// tenants: MIG off again. Idempotent. The default has no MIG mode to restore.
    fn restore_mig_off(&self, _gpu: &str) -> Result<MigRestore, GpuError> {
        Ok(MigRestore::AlreadyOff)
    }
}

/// How a placed share reaches the VM and is given back: each call either decides and
/// returns a [`DeviceRecord`] (touching nothing, so the step records it first) or acts on
/// the recorded one, idempotently.
pub trait DeviceRoute: Send + Sync {
    /// Decides how `placement` reaches the VM and reads what that will do; touches nothing
    /// (prepare-gpu-host records it first). The default hands nothing over.
    fn plan_device(&self, _placement: &GpuPlacement) -> Result<DeviceRecord, GpuError> {
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
    ) -> Result<(), GpuError> {
        Ok(())
    }

    /// What binding will do, chosen now that the instance exists (mdev: the type and UUID);
    /// touches nothing, so bind-gpu records it first. The default changes nothing.
    fn plan_bind(
        &self,
        _placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<DeviceRecord, GpuError> {
        Ok(record.clone())
    }

    /// Binds the share for the VM (whole: vfio-pci; vGPU: the type on a VF, checked against
    /// the planned instance); returns the record to store. Idempotent.
    fn bind_device(
        &self,
        _placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<DeviceRecord, GpuError> {
        Ok(record.clone())
    }

    /// The devices the VM gets.
    fn devices(&self, _record: &DeviceRecord) -> Result<Vec<PassthroughDevice>, GpuError> {
        Ok(Vec::new())
    }

    /// The route's own reset at departure (whole: checked PCI reset), or None when the
    /// route has none and [`Cleaning::reset`] applies.
    fn reset_device(&self, _record: &DeviceRecord) -> Result<Option<DeviceResetOutcome>, GpuError> {
        Ok(None)
    }

    /// Gives the devices back to their host drivers (whole). Idempotent.
    fn rebind_device(&self, _record: &DeviceRecord) -> Result<(), GpuError> {
        Ok(())
    }

    /// The driver each device of the record is bound to now, read from sysfs (whole: every
    /// device of the group, None when unbound), for the receipt after rebind-gpu. The
    /// default reads nothing.
    fn device_drivers(
        &self,
        _record: &DeviceRecord,
    ) -> Result<Vec<(String, Option<String>)>, GpuError> {
        Ok(Vec::new())
    }

    /// Takes the vGPU off its VF (type 0). Idempotent.
    fn detach_device(
        &self,
        _placement: &GpuPlacement,
        _record: &DeviceRecord,
    ) -> Result<(), GpuError> {
        Ok(())
    }

    /// The card (`card`, its ledger id) goes back to the mode the tenant found it in: the
    /// last vGPU tenant gone, VFs off and MIG off last; a whole card recorded in MIG mode,
    /// MIG back on. Idempotent.
    fn leave_device_mode(&self, _card: &str, _record: &DeviceRecord) -> Result<(), GpuError> {
        Ok(())
    }

    /// Receipt evidence on how `record`'s route ran: which of its parts ran on the real
    /// host and which were SIMULATED, and what its functions are now. The default says
    /// nothing.
    fn route_evidence(&self, _record: &DeviceRecord) -> Vec<(String, String)> {
        Vec::new()
    }
}

/// The departure's cleaning of a released share, before it is offered again.
pub trait Cleaning: Send + Sync {
    /// Resets the device of a released placement (departure's device-reset step, where the
    /// route has no reset of its own: [`DeviceRoute::reset_device`]).
    fn reset(&self, placement: &GpuPlacement) -> Result<DeviceResetOutcome, GpuError>;

    /// Zeroes and reads back the memory of a released placement whose MIG instance still
    /// exists (departure's gpu-scrub step, and `tenantvm gpu scrub`).
    fn scrub(&self, placement: &GpuPlacement) -> Result<ScrubOutcome, GpuError>;
}

/// What a share is and how busy it is, and the host's GPUs: read only.
pub trait Describe: Send + Sync {
    /// What `placement` is, for `tenantvm gpu-info` (its card, memory, profile, the devices
    /// handed over and the ids the guest should see). The default knows only what the
    /// ledger and the device record say.
    fn describe(
        &self,
        placement: &GpuPlacement,
        record: Option<&DeviceRecord>,
    ) -> Result<AssignedGpu, GpuError> {
        Ok(AssignedGpu::basic(placement, record))
    }

    /// Memory and utilisation of the slice `placement` names, as the GPU backend reads them
    /// (for the tenant's metrics); None from a planner without a backend that measures.
    fn usage(&self, _placement: &GpuPlacement) -> Result<Option<SliceUsage>, GpuError> {
        Ok(None)
    }

    /// The host's GPUs with their instances, as the GPU backend lists them (`GET /v1/host`,
    /// for a placer of many hosts); none from a planner without a backend.
    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        Ok(Vec::new())
    }
}

/// The host's GPUs as the tenant service holds them: every seam of the wing in one object
/// (implemented for whatever implements the four).
pub trait GpuHost: Placement + DeviceRoute + Cleaning + Describe {}

impl<T: Placement + DeviceRoute + Cleaning + Describe + ?Sized> GpuHost for T {}
