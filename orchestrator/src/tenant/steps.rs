//! The steps of create, start, stop and destroy. Each is idempotent (running it twice has
//! the effect of running it once) and is recorded in the store before and after it runs,
//! so that [`crate::reconcile`] can resume an operation a crash interrupted: steps recorded
//! `done` are skipped, a step recorded `started` runs again.

use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::PathBuf;
use std::time::Instant;

use crate::backend::{BackendError, JailConfig, ResourceLimits, RunningVm, VmSpec, VmState};
use crate::store::{ResourceKind, TenantRecord};
use crate::tenant::fault::Boundary;
use crate::tenant::service::{ServiceConfig, TenantService, TenantServiceError};
use crate::tenant::spec::TenantSpec;
use crate::tenant::{agent_steps, departure, disk_steps};

/// An operation on a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Provision a new tenant and boot it.
    Create,
    /// Boot a stopped tenant again.
    Start,
    /// Stop the VM, keep everything else.
    Stop,
    /// Release everything.
    Destroy,
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
    /// Clean any stale jail, then launch the VMM and record its process and cgroup.
    LaunchVm,
    /// Wait until the VMM reports the guest running.
    AwaitRunning,
    /// Stop the VM (gracefully for stop, quickly for destroy) and forget its process.
    StopVm,
    /// Kill whatever is left in the tenant's cgroup, remove the cgroup and jail root.
    CleanupJail,
    /// Destroy the placement's MIG instance (no-op without one).
    DestroyGpuInstance,
    /// Release the GPU reservation.
    ReleaseGpu,
    /// Remove the tenant directory (logs, sockets).
    RemoveFiles,
    /// Return the uid to the pool.
    ReleaseUid,
    /// Revoke the tenant's tokens.
    RevokeTokens,
    /// Create the tenant's key and encrypted disk image (no-op with `disk_gib = 0`).
    CreateDisk,
    /// Departure: take the tenant's gateway route off (no gateway yet: recorded as such).
    RouteOff,
    /// Departure: reset the tenant's GPU device (recorded "no device" without one).
    DeviceReset,
    /// Departure: scrub and verify the GPU memory; quarantine the slice if it does not verify.
    ScrubGpu,
    /// Departure: crypto-shred the disk (header, wrapped key, image).
    CryptoShred,
    /// Departure: append the receipt to the signed audit log.
    WriteReceipt,
    /// Guest image: wait until the guest agent answers on its channel.
    AwaitAgent,
    /// Guest image: deliver the disk key if the disk is locked, mount it if it is not.
    UnlockDisk,
    /// Guest image: start the payload unless it runs.
    StartPayload,
    /// Guest image: wait until the payload answers its health check.
    AwaitPayload,
}

impl Op {
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
        [Op::Create, Op::Start, Op::Stop, Op::Destroy]
            .into_iter()
            .find(|o| o.name() == s)
    }

    /// The steps, in order.
    pub fn steps(self) -> &'static [Step] {
        use Step::*;
        match self {
            Op::Create => &[
                AllocateUid,
                ReserveGpu,
                CreateGpuInstance,
                PrepareDir,
                CreateDisk,
                LaunchVm,
                AwaitRunning,
                AwaitAgent,
                UnlockDisk,
                StartPayload,
                AwaitPayload,
            ],
            Op::Start => &[
                LaunchVm,
                AwaitRunning,
                AwaitAgent,
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
    pub fn success_state(self) -> crate::tenant::lifecycle::LifecycleState {
        use crate::tenant::lifecycle::LifecycleState::*;
        match self {
            Op::Create | Op::Start => Running,
            Op::Stop => Stopped,
            Op::Destroy => Destroyed,
        }
    }
}

impl Step {
    /// The name stored and used by the fault hook.
    pub fn name(self) -> &'static str {
        match self {
            Step::AllocateUid => "allocate-uid",
            Step::ReserveGpu => "reserve-gpu",
            Step::CreateGpuInstance => "create-gpu-instance",
            Step::PrepareDir => "prepare-dir",
            Step::LaunchVm => "launch-vm",
            Step::AwaitRunning => "await-running",
            Step::StopVm => "stop-vm",
            Step::CleanupJail => "cleanup-jail",
            Step::DestroyGpuInstance => "destroy-gpu-instance",
            Step::ReleaseGpu => "release-gpu",
            Step::RemoveFiles => "remove-files",
            Step::ReleaseUid => "release-uid",
            Step::RevokeTokens => "revoke-tokens",
            Step::CreateDisk => "create-disk",
            Step::RouteOff => "route-off",
            Step::DeviceReset => "device-reset",
            Step::ScrubGpu => "scrub-gpu",
            Step::CryptoShred => "crypto-shred",
            Step::WriteReceipt => "write-receipt",
            Step::AwaitAgent => "await-agent",
            Step::UnlockDisk => "unlock-disk",
            Step::StartPayload => "start-payload",
            Step::AwaitPayload => "await-payload",
        }
    }
}

/// Runs the steps of `op` not yet recorded as done.
pub(crate) fn run(
    svc: &TenantService,
    t: &TenantRecord,
    op_id: i64,
    op: Op,
) -> Result<(), TenantServiceError> {
    let done: Vec<String> = svc
        .store
        .steps(op_id)?
        .into_iter()
        .filter(|s| s.status == "done")
        .map(|s| s.step)
        .collect();
    for &step in op.steps() {
        if done.iter().any(|d| d == step.name()) {
            continue;
        }
        svc.fault.check(op.name(), step.name(), Boundary::Before)?;
        svc.store.step_started(t.id, op_id, step.name())?;
        let started_at = crate::receipt::now_rfc3339();
        let mut result = run_step(svc, t, op, step);
        if op == Op::Destroy {
            // The departure receipt's record of this step, persisted before the step is done.
            let err = result.as_ref().err().map(|e| e.to_string());
            let recorded =
                departure::record_existing_step(svc, t, step, &started_at, err.as_deref());
            if result.is_ok() {
                result = recorded;
            }
        }
        let err = result.as_ref().err().map(|e| e.to_string());
        svc.store
            .step_finished(t.id, op_id, step.name(), err.as_deref())?;
        result?;
        svc.fault.check(op.name(), step.name(), Boundary::After)?;
    }
    Ok(())
}

fn step_err(step: Step, message: impl std::fmt::Display) -> TenantServiceError {
    TenantServiceError::Step {
        step: step.name(),
        message: message.to_string(),
    }
}

fn run_step(
    svc: &TenantService,
    t: &TenantRecord,
    op: Op,
    step: Step,
) -> Result<(), TenantServiceError> {
    let cfg = &svc.config;
    let dir = cfg.tenant_dir(&t.name);
    match step {
        Step::AllocateUid => {
            svc.store.allocate_uid(t.id, cfg.uid_first, cfg.uid_count)?;
        }
        Step::ReserveGpu => {
            if t.spec.gpu.wants_gpu() {
                let candidates = svc.gpu.candidates(&t.spec.gpu)?;
                if svc.store.reserve_gpu(t.id, &candidates)?.is_none() {
                    let quarantined = svc.store.quarantined()?;
                    let held_back = candidates.iter().any(|c| {
                        quarantined
                            .iter()
                            .any(|q| q.gpu == c.gpu && q.slots.iter().any(|s| c.slots.contains(s)))
                    });
                    return Err(step_err(
                        step,
                        if held_back {
                            "every GPU placement that fits the request is taken or quarantined (a scrub did not verify: see `tenantvm gpu quarantine`); destroy a tenant, re-scrub with `tenantvm gpu scrub`, or ask for a smaller profile"
                        } else {
                            "every GPU placement that fits the request is taken; destroy a tenant or ask for a smaller profile"
                        },
                    ));
                }
            }
        }
        Step::CreateGpuInstance => {
            if let Some(p) = svc.store.gpu_placement(t.id)? {
                svc.gpu.materialize(&p)?;
            }
        }
        Step::DestroyGpuInstance => {
            if let Some(p) = svc.store.gpu_placement(t.id)? {
                svc.gpu.release(&p)?;
            }
        }
        Step::PrepareDir => {
            let parent = cfg.state_dir.join("tenants");
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&parent)
                .map_err(|e| step_err(step, format!("{}: {e}", parent.display())))?;
            match fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                Err(e) => return Err(step_err(step, format!("{}: {e}", dir.display()))),
            }
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
                .map_err(|e| step_err(step, format!("{}: {e}", dir.display())))?;
            svc.store
                .add_resource(t.id, ResourceKind::File, &dir.to_string_lossy(), None)?;
        }
        Step::LaunchVm => launch(svc, t, step)?,
        Step::AwaitRunning => {
            let vm = recorded_vm(svc, t)?
                .ok_or_else(|| step_err(step, "no VM was recorded by launch-vm"))?;
            let deadline = Instant::now() + cfg.boot_timeout;
            loop {
                match svc.backend.state(&vm) {
                    Ok(VmState::Running) | Ok(VmState::Paused) => break,
                    Ok(VmState::Exited { status }) => {
                        return Err(step_err(
                            step,
                            format!("the VM exited while booting ({status:?}); see `tenantvm logs {} --stream vmm`", t.name),
                        ))
                    }
                    Ok(VmState::Gone) => {
                        return Err(step_err(step, "the VM process is gone"));
                    }
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!(tenant = %t.name, error = %e, "VM not answering yet");
                    }
                    Err(e) => return Err(step_err(step, e)),
                }
                if Instant::now() >= deadline {
                    return Err(step_err(step, "the VM did not report running in time"));
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
        Step::StopVm => {
            if let Some(vm) = recorded_vm(svc, t)? {
                let grace = if op == Op::Destroy {
                    std::time::Duration::from_millis(500)
                } else {
                    cfg.stop_grace
                };
                // A guest with an agent first shuts down cleanly (disk closed, power-off).
                agent_steps::shutdown_before_stop(svc, t, &vm, cfg.stop_grace);
                match svc.backend.stop(&vm, grace) {
                    Ok(_) | Err(BackendError::NotRunning(_)) => {}
                    Err(e) => {
                        tracing::warn!(tenant = %t.name, error = %e, "graceful stop failed, killing");
                        svc.backend.kill(&vm).map_err(|e| step_err(step, e))?;
                    }
                }
                forget_vm(svc, &vm)?;
            }
        }
        Step::CleanupJail => {
            svc.jail
                .cleanup(&t.name, &dir)
                .map_err(|e| step_err(step, error_chain(&e)))?;
            svc.store.remove_resource(ResourceKind::Cgroup, &t.name)?;
        }
        Step::ReleaseGpu => {
            svc.store.release_gpu(t.id)?;
        }
        Step::RemoveFiles => {
            match fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(step_err(step, format!("{}: {e}", dir.display()))),
            }
            svc.store
                .remove_resource(ResourceKind::File, &dir.to_string_lossy())?;
        }
        Step::ReleaseUid => {
            for r in svc.store.resources(Some(t.id))? {
                if r.kind == ResourceKind::Uid {
                    svc.store.remove_resource(ResourceKind::Uid, &r.key)?;
                }
            }
        }
        Step::RevokeTokens => svc.store.revoke_tenant_tokens(t.id)?,
        Step::CreateDisk => disk_steps::create_disk(svc, t)?,
        Step::AwaitAgent | Step::UnlockDisk | Step::StartPayload | Step::AwaitPayload => {
            agent_steps::run_step(svc, t, step)?
        }
        Step::RouteOff
        | Step::DeviceReset
        | Step::ScrubGpu
        | Step::CryptoShred
        | Step::WriteReceipt => departure::run_step(svc, t, step)?,
    }
    Ok(())
}

fn launch(svc: &TenantService, t: &TenantRecord, step: Step) -> Result<(), TenantServiceError> {
    let cfg = &svc.config;
    let dir = cfg.tenant_dir(&t.name);
    // Adopt a VM this step already launched before a crash, if it still runs.
    if let Some(vm) = recorded_vm(svc, t)? {
        if matches!(
            svc.backend.state(&vm),
            Ok(VmState::Running | VmState::Paused)
        ) {
            return Ok(());
        }
        svc.backend.kill(&vm).map_err(|e| step_err(step, e))?;
        forget_vm(svc, &vm)?;
    }
    // A crash between launch and recording leaves an unrecorded VMM in the tenant's
    // cgroup: clear it before launching another.
    svc.jail
        .cleanup(&t.name, &dir)
        .map_err(|e| step_err(step, error_chain(&e)))?;
    let uid = svc
        .store
        .resources(Some(t.id))?
        .into_iter()
        .find(|r| r.kind == ResourceKind::Uid)
        .and_then(|r| r.key.parse::<u32>().ok())
        .ok_or_else(|| step_err(step, "no uid allocated"))?;
    let (kernel, initramfs, cmdline) = resolve_image(cfg, &t.spec)?;
    agent_steps::forget_shutdown(&dir);
    let spec = VmSpec {
        tenant: t.name.clone(),
        kernel,
        initramfs,
        cmdline,
        vcpus: t.spec.vcpus,
        memory_mib: t.spec.memory_mib,
        disks: disk_steps::attachments(cfg, &t.spec),
        tenant_dir: dir,
    };
    let jail = JailConfig {
        uid,
        gid: uid,
        limits: limits_for(cfg, &t.spec),
    };
    // The kernel's block I/O limit beside the VMM's own throttling (docs/jail.md).
    let disks: Vec<PathBuf> = spec.disks.iter().map(|d| d.path.clone()).collect();
    if !disks.is_empty() {
        let limit = crate::jail::BlockIoLimit {
            bytes_per_s: u64::from(t.spec.quotas.disk_mib_per_s) << 20,
            ops_per_s: u64::from(t.spec.quotas.disk_iops),
        };
        for outcome in svc
            .jail
            .limit_block_io(&t.name, &disks, limit)
            .map_err(|e| step_err(step, error_chain(&e)))?
        {
            if let crate::jail::BlockIoOutcome::NotLimited { disk, reason } = outcome {
                tracing::warn!(tenant = %t.name, disk = %disk.display(), %reason, "no kernel block I/O limit; the VMM's own throttling applies");
            }
        }
    }
    let vm = svc
        .backend
        .launch(&spec, &jail)
        .map_err(|e| step_err(step, error_chain(&e)))?;
    let detail = serde_json::to_string(&vm).map_err(|e| step_err(step, e))?;
    let cgroup = serde_json::to_string(&vm.cgroup).map_err(|e| step_err(step, e))?;
    svc.store
        .add_resource(t.id, ResourceKind::Cgroup, &t.name, Some(&cgroup))?;
    svc.store.add_resource(
        t.id,
        ResourceKind::Process,
        &process_key(&vm),
        Some(&detail),
    )?;
    Ok(())
}

/// The store key of a VM process: pid and start time together defeat pid reuse.
pub(crate) fn process_key(vm: &RunningVm) -> String {
    format!("{}:{}", vm.pid, vm.start_time_ticks)
}

/// The VM recorded for a tenant, if any.
pub(crate) fn recorded_vm(
    svc: &TenantService,
    t: &TenantRecord,
) -> Result<Option<RunningVm>, TenantServiceError> {
    for r in svc.store.resources(Some(t.id))? {
        if r.kind == ResourceKind::Process {
            let detail = r.detail.unwrap_or_default();
            let vm = serde_json::from_str(&detail).map_err(|e| {
                TenantServiceError::Store(crate::store::StoreError::Corrupt(format!(
                    "process record {}: {e}",
                    r.key
                )))
            })?;
            return Ok(Some(vm));
        }
    }
    Ok(None)
}

fn forget_vm(svc: &TenantService, vm: &RunningVm) -> Result<(), TenantServiceError> {
    svc.store
        .remove_resource(ResourceKind::Process, &process_key(vm))?;
    Ok(())
}

/// Kills a tenant's VM, if one is recorded, and forgets it.
pub(crate) fn kill_vm(svc: &TenantService, t: &TenantRecord) -> Result<(), TenantServiceError> {
    if let Some(vm) = recorded_vm(svc, t)? {
        svc.backend
            .kill(&vm)
            .map_err(|e| step_err(Step::StopVm, error_chain(&e)))?;
        forget_vm(svc, &vm)?;
    }
    Ok(())
}

/// Cgroup limits for a spec: memory = guest memory + VMM overhead; CPU quota = one period
/// per vCPU; pids = a fixed allowance plus one per vCPU thread.
pub fn limits_for(cfg: &ServiceConfig, spec: &TenantSpec) -> ResourceLimits {
    let period = 100_000;
    ResourceLimits {
        memory_bytes: (u64::from(spec.memory_mib) + cfg.vmm_overhead_mib) << 20,
        cpu_quota_us: u64::from(spec.vcpus) * period,
        cpu_period_us: period,
        pids_max: 32 + u64::from(spec.vcpus),
    }
}

/// The kernel, initramfs and command line a spec boots, checked to exist.
pub fn resolve_image(
    cfg: &ServiceConfig,
    spec: &TenantSpec,
) -> Result<(PathBuf, Option<PathBuf>, String), TenantServiceError> {
    let img = &spec.image;
    let default_cmdline = "console=ttyS0 reboot=k panic=1".to_string();
    if let Some(set) = agent_steps::image_set_dir(cfg, spec) {
        let (kernel, initramfs, cmdline) = agent_steps::boot_files(&set)?;
        let mut files = vec![kernel.as_path()];
        files.extend(initramfs.as_deref());
        crate::tenant::spec::check_boot_files_under(cfg.image_dir.as_deref(), &files)?;
        return Ok((kernel, initramfs, cmdline));
    }
    let (kernel, initramfs, cmdline) = match (&img.name, &img.kernel) {
        (Some(name), None) => {
            let Some(image_dir) = &cfg.image_dir else {
                return Err(TenantServiceError::Image(format!(
                    "named image {name:?} asked for, but tenantvmd runs without --image-dir; give image.kernel or restart the daemon with --image-dir"
                )));
            };
            let base = image_dir.join(name);
            let initramfs = base.join("initramfs");
            let cmdline_file = base.join("cmdline");
            let cmdline = match &img.cmdline {
                Some(c) => c.clone(),
                None => fs::read_to_string(&cmdline_file)
                    .map(|s| s.trim().to_string())
                    .unwrap_or(default_cmdline),
            };
            (
                base.join("kernel"),
                img.initramfs
                    .clone()
                    .or_else(|| initramfs.exists().then_some(initramfs)),
                cmdline,
            )
        }
        (None, Some(kernel)) => (
            kernel.clone(),
            img.initramfs.clone(),
            img.cmdline.clone().unwrap_or(default_cmdline),
        ),
        _ => return Err(crate::tenant::spec::TenantSpecError::ImageChoice.into()),
    };
    if !kernel.is_file() {
        return Err(TenantServiceError::Image(format!(
            "kernel {} does not exist or is not a file",
            kernel.display()
        )));
    }
    let mut files = vec![kernel.as_path()];
    files.extend(initramfs.as_deref());
    crate::tenant::spec::check_boot_files_under(cfg.image_dir.as_deref(), &files)?;
    if let Some(i) = &initramfs {
        if !i.is_file() {
            return Err(TenantServiceError::Image(format!(
                "initramfs {} does not exist or is not a file",
                i.display()
            )));
        }
    }
    Ok((kernel, initramfs, cmdline))
}

/// An error and its sources on one line.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
