//! The steps of create, start, stop and destroy, in one flat table ([`TABLE`]), each
//! implemented in the file of its concern: [`vm`] (uid, launch, boot, stop, jail),
//! [`gpu`] (reservation, MIG instance, reset, scrub), [`disk`] (tenant directory, encrypted
//! disk, crypto-shred, file removal), [`guest`] (the guest agent: bring-up and shutdown) and
//! [`departure`] (route off, tokens, the receipt).
//!
//! Every step is idempotent (running it twice has the effect of running it once) and gets
//! only a [`StepCtx`] and the [`Tenant`]; it returns its departure receipt record, if it has
//! one, and never writes it anywhere itself. The runner ([`crate::tenant::runner`]) records
//! each step before and after it runs, so that [`crate::reconcile`] can resume an operation
//! a crash interrupted: steps recorded `done` are skipped, a step recorded `started` runs
//! again.

pub mod departure;
pub mod device;
pub mod disk;
pub mod gpu;
pub mod guest;
pub mod vm;

use crate::domain::lifecycle::LifecycleState;
use crate::receipt::{DepartureStep, StepRecord};
use crate::tenant::context::{StepCtx, StepError, Tenant};

/// An operation on a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Provision a new tenant and boot it.
    Create,
    /// Boot a stopped tenant again.
    Start,
    /// Stop the VM, keep everything else.
    Stop,
    /// Release everything: the departure.
    Destroy,
}

/// What a failed step leaves behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFailure {
    /// The tenant becomes `failed` (its VM killed; other resources kept for inspection).
    Fail,
    /// The tenant stays in its state with the error; running the operation again resumes
    /// it from the failed step (a departure never gives up half-way).
    Resume,
}

/// A step of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Take a uid/gid from the configured range.
    AllocateUid,
    /// Reserve a GPU placement in the ledger (no-op without a GPU request).
    ReserveGpu,
    /// Create the reserved placement's MIG instance (no-op without one).
    CreateGpuInstance,
    /// Create the tenant directory (0700).
    PrepareDir,
    /// Create the tenant's key and encrypted disk image (no-op with `disk_gib = 0`).
    CreateDisk,
    /// Clean any stale jail, then launch the VMM and record its process and cgroup.
    LaunchVm,
    /// Wait until the VMM reports the guest running.
    AwaitRunning,
    /// Guest image: wait until the guest agent answers on its channel.
    AwaitAgent,
    /// Guest image: deliver the disk key if the disk is locked, mount it if it is not.
    UnlockDisk,
    /// Guest image: start the payload unless it runs.
    StartPayload,
    /// Guest image: wait until the payload answers its health check.
    AwaitPayload,
    /// Departure: close the tenant's inference route, and check that it is closed.
    RouteOff,
    /// Stop the VM (the agent's clean shutdown first, then the VMM's, then kill) and forget
    /// its process; records what it found, sent and saw.
    StopVm,
    /// Kill whatever is left in the tenant's cgroup, remove the cgroup and jail root.
    CleanupJail,
    /// Departure: reset the tenant's GPU device (recorded "no device" without one).
    DeviceReset,
    /// Departure: scrub and verify the GPU memory; quarantine the slice if it does not verify.
    ScrubGpu,
    /// Destroy the placement's MIG instance (no-op without one).
    DestroyGpuInstance,
    /// Release the GPU reservation.
    ReleaseGpu,
    /// Departure: crypto-shred the disk (header, wrapped key, image).
    CryptoShred,
    /// Remove the tenant directory (logs, sockets).
    RemoveFiles,
    /// Return the uid to the pool.
    ReleaseUid,
    /// Revoke the tenant's tokens.
    RevokeTokens,
    /// Departure: append the receipt to the signed audit log.
    WriteReceipt,
    /// Decide and record how the GPU share reaches the VM (with the VM's UUID), then
    /// prepare the card (vGPU: MIG on, then VFs on). No-op without a GPU.
    PrepareGpuHost,
    /// Bind the share for the VM: whole GPU onto vfio-pci, or the vGPU type on a VF
    /// (checked against the planned instance).
    BindGpu,
    /// Record the devices the VM gets (launch-vm passes them to the VMM).
    AttachGpu,
    /// Departure: a whole GPU's devices back on their host drivers (a failure quarantines).
    RebindGpu,
    /// Departure: the vGPU type off its VF (type 0).
    DetachGpu,
    /// Guest image: hand the tenant's vGPU licence token to the agent (no-op without one).
    DeliverLicence,
}

/// Runs one step: the narrow context, the tenant (whose facts the step keeps current), and
/// the operation it runs in. Returns the step's receipt record, if it has one.
pub type StepFn = fn(&StepCtx<'_>, &mut Tenant, Op) -> Result<Option<StepRecord>, StepError>;

/// One row of [`TABLE`].
pub struct StepDef {
    /// The step.
    pub step: Step,
    /// Its name: stored with each run, shown by the CLI, used by the crash hook. Never
    /// renamed (a resumed operation finds its steps by name).
    pub name: &'static str,
    /// What runs it.
    pub run: StepFn,
    /// The line of the departure receipt it accounts for, when it runs in a destroy.
    pub receipt: Option<DepartureStep>,
}

/// Every step, in [`Step`] order: the one place a step is bound to its code.
pub static TABLE: [StepDef; 29] = [
    row(Step::AllocateUid, "allocate-uid", vm::allocate_uid, None),
    row(Step::ReserveGpu, "reserve-gpu", gpu::reserve, None),
    row(
        Step::CreateGpuInstance,
        "create-gpu-instance",
        gpu::create_instance,
        None,
    ),
    row(Step::PrepareDir, "prepare-dir", disk::prepare_dir, None),
    row(Step::CreateDisk, "create-disk", disk::create_disk, None),
    row(Step::LaunchVm, "launch-vm", vm::launch, None),
    row(Step::AwaitRunning, "await-running", vm::await_running, None),
    row(Step::AwaitAgent, "await-agent", guest::await_agent, None),
    row(Step::UnlockDisk, "unlock-disk", guest::unlock_disk, None),
    row(
        Step::StartPayload,
        "start-payload",
        guest::start_payload,
        None,
    ),
    row(
        Step::AwaitPayload,
        "await-payload",
        guest::await_payload,
        None,
    ),
    row(
        Step::RouteOff,
        "route-off",
        departure::route_off,
        Some(DepartureStep::GatewayRouteOff),
    ),
    row(
        Step::StopVm,
        "stop-vm",
        vm::stop,
        Some(DepartureStep::AgentShutdown),
    ),
    row(Step::CleanupJail, "cleanup-jail", vm::cleanup_jail, None),
    row(
        Step::DeviceReset,
        "device-reset",
        gpu::device_reset,
        Some(DepartureStep::DeviceReset),
    ),
    row(
        Step::ScrubGpu,
        "scrub-gpu",
        gpu::scrub,
        Some(DepartureStep::GpuScrub),
    ),
    row(
        Step::DestroyGpuInstance,
        "destroy-gpu-instance",
        gpu::destroy_instance,
        Some(DepartureStep::GpuRelease),
    ),
    row(Step::ReleaseGpu, "release-gpu", gpu::release, None),
    row(
        Step::CryptoShred,
        "crypto-shred",
        disk::crypto_shred,
        Some(DepartureStep::CryptoShred),
    ),
    row(
        Step::RemoveFiles,
        "remove-files",
        disk::remove_files,
        Some(DepartureStep::LogsRemoved),
    ),
    row(Step::ReleaseUid, "release-uid", vm::release_uid, None),
    row(
        Step::RevokeTokens,
        "revoke-tokens",
        departure::revoke_tokens,
        None,
    ),
    row(
        Step::WriteReceipt,
        "write-receipt",
        departure::write_receipt,
        None,
    ),
    row(
        Step::PrepareGpuHost,
        "prepare-gpu-host",
        device::prepare_host,
        None,
    ),
    row(Step::BindGpu, "bind-gpu", device::bind, None),
    row(Step::AttachGpu, "attach-gpu", device::attach, None),
    row(Step::RebindGpu, "rebind-gpu", device::rebind, None),
    row(Step::DetachGpu, "detach-gpu", device::detach, None),
    row(
        Step::DeliverLicence,
        "deliver-licence",
        guest::deliver_licence,
        None,
    ),
];

const fn row(
    step: Step,
    name: &'static str,
    run: StepFn,
    receipt: Option<DepartureStep>,
) -> StepDef {
    StepDef {
        step,
        name,
        run,
        receipt,
    }
}

impl Step {
    /// Whether the step deals with the tenant's GPU share only (nothing to do for a tenant
    /// that wants no GPU: recorded as `skipped`). The vGPU licence is one: only a GPU tenant
    /// may have one.
    pub fn is_gpu(self) -> bool {
        matches!(
            self,
            Step::ReserveGpu
                | Step::CreateGpuInstance
                | Step::DeviceReset
                | Step::ScrubGpu
                | Step::DestroyGpuInstance
                | Step::ReleaseGpu
                | Step::PrepareGpuHost
                | Step::BindGpu
                | Step::AttachGpu
                | Step::RebindGpu
                | Step::DetachGpu
                | Step::DeliverLicence
        )
    }

    /// Its row of [`TABLE`].
    pub fn def(self) -> &'static StepDef {
        &TABLE[self as usize]
    }

    /// The name stored and used by the fault hook.
    pub fn name(self) -> &'static str {
        self.def().name
    }
}

impl Op {
    /// Every operation.
    pub const ALL: [Op; 4] = [Op::Create, Op::Start, Op::Stop, Op::Destroy];

    /// The name stored and used by the fault hook.
    pub fn name(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Start => "start",
            Op::Stop => "stop",
            Op::Destroy => "destroy",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|o| o.name() == s)
    }

    /// The steps, in order.
    pub fn steps(self) -> &'static [Step] {
        use Step::*;
        match self {
            Op::Create => &[
                AllocateUid,
                ReserveGpu,
                PrepareGpuHost,
                CreateGpuInstance,
                BindGpu,
                AttachGpu,
                PrepareDir,
                CreateDisk,
                LaunchVm,
                AwaitRunning,
                AwaitAgent,
                DeliverLicence,
                UnlockDisk,
                StartPayload,
                AwaitPayload,
            ],
            Op::Start => &[
                LaunchVm,
                AwaitRunning,
                AwaitAgent,
                DeliverLicence,
                UnlockDisk,
                StartPayload,
                AwaitPayload,
            ],
            Op::Stop => &[StopVm],
            Op::Destroy => &[
                RouteOff,
                StopVm,
                CleanupJail,
                DeviceReset,
                RebindGpu,
                DetachGpu,
                ScrubGpu,
                DestroyGpuInstance,
                ReleaseGpu,
                CryptoShred,
                RemoveFiles,
                ReleaseUid,
                RevokeTokens,
                WriteReceipt,
            ],
        }
    }

    /// Where the tenant goes when every step succeeded.
    pub fn success_state(self) -> LifecycleState {
        match self {
            Op::Create | Op::Start => LifecycleState::Running,
            Op::Stop => LifecycleState::Stopped,
            Op::Destroy => LifecycleState::Destroyed,
        }
    }

    /// What a failed step leaves behind.
    pub fn on_failure(self) -> OnFailure {
        match self {
            Op::Destroy => OnFailure::Resume,
            Op::Create | Op::Start | Op::Stop => OnFailure::Fail,
        }
    }

    /// Whether its steps' receipt records make up a departure receipt.
    pub fn keeps_receipt(self) -> bool {
        self == Op::Destroy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_in_step_order_with_unique_names() {
        let mut names = std::collections::HashSet::new();
        for (i, def) in TABLE.iter().enumerate() {
            assert_eq!(def.step as usize, i, "{} is out of place", def.name);
            assert!(names.insert(def.name), "{} twice", def.name);
        }
    }

    #[test]
    fn every_departure_receipt_line_comes_from_one_destroy_step() {
        let mut lines: Vec<_> = Op::Destroy
            .steps()
            .iter()
            .filter_map(|s| s.def().receipt)
            .collect();
        let n = lines.len();
        lines.sort();
        lines.dedup();
        assert_eq!(lines.len(), n);
        assert_eq!(n, 7);
    }

    #[test]
    fn op_names_round_trip() {
        for op in Op::ALL {
            assert_eq!(Op::parse(op.name()), Some(op));
        }
        assert_eq!(Op::parse("reboot"), None);
    }
}
