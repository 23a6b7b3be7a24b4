//! The VM's steps: the tenant's uid, launching the VMM in its jail (with the kernel's block
//! I/O limit on its disks), waiting for it to run, stopping it, and cleaning the jail up.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::backend::{
    BackendError, ExitReason, JailConfig, ResourceLimits, RunningVm, VmSpec, VmState,
};
use crate::domain::spec::TenantSpec;
use crate::jail::error_chain;
use crate::jail::{BlockIoLimit, BlockIoOutcome};
use crate::receipt::{now_rfc3339, Assurance, DepartureStep, StepRecord, StepResult};
use crate::store::{ResourceKind, StoreError};
use crate::tenant::config::ServiceConfig;
use crate::tenant::context::{StepCtx, StepError, Tenant};
use crate::tenant::steps::{disk, guest, Op};

/// allocate-uid: the uid (= gid) the tenant's VMM runs as, unique among tenants.
pub fn allocate_uid(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let cfg = ctx.config;
    t.uid = Some(ctx.store.allocate_uid(t.id, cfg.uid_first, cfg.uid_count)?);
    Ok(None)
}

/// release-uid: returns the tenant's host identities to their pools: the uid, and the
/// guest's vsock CID if it held one (QEMU with vhost-vsock).
pub fn release_uid(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    if let Some(uid) = t.uid.take() {
        ctx.store
            .remove_resource(ResourceKind::Uid, &uid.to_string())?;
    }
    ctx.store.release_vsock_cid(t.id)?;
    Ok(None)
}

/// How many CIDs one launch tries when the kernel reports each one held by another VM on
/// the host (a VMM this daemon does not run) before it fails.
pub const CID_ATTEMPTS: usize = 8;

/// Launches `spec`, with a vsock CID from the store when the backend needs one: a CID the
/// kernel reports held by another VM on the host is set aside and the next free one
/// tried, [`CID_ATTEMPTS`] times at most. The CID the VM runs with stays stored.
fn launch_with_cid(
    ctx: &StepCtx<'_>,
    t: &Tenant,
    mut spec: VmSpec,
    jail: &JailConfig,
) -> Result<RunningVm, StepError> {
    if !ctx.backend.needs_vsock_cid() {
        return ctx
            .backend
            .launch(&spec, jail)
            .map_err(|e| StepError::failed(error_chain(&e)));
    }
    let mut busy = BTreeSet::new();
    for _ in 0..CID_ATTEMPTS {
        let cid = ctx.store.allocate_vsock_cid(t.id, &busy)?;
        spec.vsock_cid = Some(cid);
        match ctx.backend.launch(&spec, jail) {
            Err(e) if e.is_vsock_cid_in_use() => {
                tracing::warn!(tenant = %t.name, cid, "vsock CID held by another VM on this host; trying another");
                busy.insert(cid);
            }
            other => return other.map_err(|e| StepError::failed(error_chain(&e))),
        }
    }
    Err(StepError::failed(format!(
        "vsock CIDs {busy:?} are each held by another VM on this host (another VMM); gave up after {CID_ATTEMPTS} tries: stop those VMs or free their CIDs"
    )))
}

/// launch-vm: adopts a VM an interrupted run of this step launched if it still runs;
/// otherwise empties the tenant's cgroup (a VMM launched just before a crash but never
/// recorded dies there), launches the VMM and records its process and cgroup.
pub fn launch(ctx: &StepCtx<'_>, t: &mut Tenant, _op: Op) -> Result<Option<StepRecord>, StepError> {
    let cfg = ctx.config;
    let dir = cfg.tenant_dir(&t.name);
    if let Some(vm) = t.vm.clone() {
        if matches!(
            ctx.backend.state(&vm),
            Ok(VmState::Running | VmState::Paused)
        ) {
            return Ok(None);
        }
        ctx.backend.kill(&vm).map_err(StepError::failed)?;
        forget_vm(ctx, t)?;
    }
    ctx.jail
        .cleanup(&t.name, &dir)
        .map_err(|e| StepError::failed(error_chain(&e)))?;
    let uid = t.uid()?;
    let (devices, uuid) = crate::tenant::steps::device::for_launch(ctx, t)?;
    let boot = crate::tenant::image::boot_files(cfg, &t.spec, t.guest, ctx.backend.kind())
        .map_err(|e| StepError::failed(format!("guest image: {e}")))?;
    let hugepages = crate::backend::hugepages::choose(
        t.spec.hugepages,
        t.spec.gpu.wants_gpu(),
        t.spec.memory_mib,
        &crate::backend::hugepages::HostPools::new("/"),
    )
    .map_err(|e| StepError::failed(e.to_string()))?;
    let spec = VmSpec {
        vsock_cid: None,
        tenant: t.name.to_string(),
        kernel: boot.kernel,
        initramfs: boot.initramfs,
        cmdline: boot.cmdline,
        vcpus: t.spec.vcpus,
        memory_mib: t.spec.memory_mib,
        disks: disk::attachments(cfg, &t.spec),
        tenant_dir: dir,
        devices,
        uuid,
        hugepages,
    };
    let jail = JailConfig {
        uid,
        gid: uid,
        limits: limits_for(cfg, &t.spec),
    };
    // The kernel's block I/O limit beside the VMM's own throttling (docs/jail.md).
    let disks: Vec<PathBuf> = spec.disks.iter().map(|d| d.path.clone()).collect();
    if !disks.is_empty() {
        let limit = BlockIoLimit {
            bytes_per_s: u64::from(t.spec.quotas.disk_mib_per_s) << 20,
            ops_per_s: u64::from(t.spec.quotas.disk_iops),
        };
        for outcome in ctx
            .jail
            .limit_block_io(&t.name, &disks, limit)
            .map_err(|e| StepError::failed(error_chain(&e)))?
        {
            if let BlockIoOutcome::NotLimited { disk, reason } = outcome {
                tracing::warn!(tenant = %t.name, disk = %disk.display(), %reason, "no kernel block I/O limit; the VMM's own throttling applies");
            }
        }
    }
    let vm = launch_with_cid(ctx, t, spec, &jail)?;
    let detail = serde_json::to_string(&vm).map_err(StepError::failed)?;
    let cgroup = serde_json::to_string(&vm.cgroup).map_err(StepError::failed)?;
    ctx.store
        .add_resource(t.id, ResourceKind::Cgroup, &t.name, Some(&cgroup))?;
    ctx.store.add_resource(
        t.id,
        ResourceKind::Process,
        &process_key(&vm),
        Some(&detail),
    )?;
    t.vm = Some(vm);
    Ok(None)
}

/// await-running: waits until the VMM reports the guest running (or paused).
pub fn await_running(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let vm = recorded(t)?;
    let deadline = Instant::now() + ctx.config.boot_timeout;
    loop {
        match ctx.backend.state(vm) {
            Ok(VmState::Running) | Ok(VmState::Paused) => return Ok(None),
            Ok(VmState::Exited { status }) => {
                return Err(StepError::failed(format!(
                    "the VM exited while booting ({status:?}); see `tenantvm logs {} --stream vmm`",
                    t.name
                )))
            }
            Ok(VmState::Gone) => return Err(StepError::failed("the VM process is gone")),
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(tenant = %t.name, error = %e, "VM not answering yet");
            }
            Err(e) => return Err(StepError::failed(e)),
        }
        if Instant::now() >= deadline {
            return Err(StepError::failed("the VM did not report running in time"));
        }
        ctx.stop.sleep(Duration::from_millis(50))?;
    }
}

/// stop-vm: a guest with an agent first shuts down cleanly (payload stopped, disk closed,
/// power-off); then the backend stops the VMM (a stop request, killed after the grace
/// period: a destroy gives it `destroy_grace`, a stop `stop_grace`), or kills its cgroup if
/// the request fails; then the host checks that it ended. The process record is forgotten.
///
/// Returns the departure's record of it: measured, not assumed. How the VM was found, what
/// was sent, what the agent answered and when, how the VMM ended and how long it all took.
pub fn stop(ctx: &StepCtx<'_>, t: &mut Tenant, op: Op) -> Result<Option<StepRecord>, StepError> {
    let started_at = now_rfc3339();
    let clock = Instant::now();
    let Some(vm) = t.vm.clone() else {
        return Ok(Some(
            StepRecord::new(
                DepartureStep::AgentShutdown,
                "no VM was recorded for the tenant (it was stopped before, or an interrupted run of this step already stopped it): nothing was sent",
                StepResult::Skipped,
                Assurance::NotApplicable,
                started_at,
                now_rfc3339(),
            )
            .with_evidence("found", "no VM recorded"),
        ));
    };
    let grace = if op == Op::Destroy {
        ctx.config.destroy_grace
    } else {
        ctx.config.stop_grace
    };
    let found = ctx.backend.state(&vm);
    let agent = t
        .has_agent()
        .then(|| guest::shutdown(ctx, t, &vm, &found, ctx.config.stop_grace));
    let grace_ms = grace.as_millis();
    let (sent, ended, killed) = match ctx.backend.stop(&vm, grace) {
        Ok(reason) => (
            format!("a stop request to the VMM, to be killed after {grace_ms} ms"),
            reason.describe(),
            matches!(reason, ExitReason::Signaled { .. }),
        ),
        Err(BackendError::NotRunning(reason)) => (
            "nothing: the VMM had already exited".to_string(),
            reason.describe(),
            false,
        ),
        Err(e) => {
            tracing::warn!(tenant = %t.name, error = %e, "stop request failed, killing");
            ctx.backend.kill(&vm).map_err(StepError::failed)?;
            (
                format!("a stop request to the VMM, which failed ({e}); then SIGKILL to the tenant's cgroup"),
                "killed by SIGKILL".to_string(),
                true,
            )
        }
    };
    // Checked, not assumed: the backend's view of the process afterwards.
    let after = ctx.backend.state(&vm);
    let gone = matches!(after, Ok(VmState::Exited { .. } | VmState::Gone));
    forget_vm(ctx, t)?;
    let elapsed_ms = clock.elapsed().as_millis() as u64;
    let found = describe_state(&found);
    let mut method = format!("found {found}; ");
    if let Some(a) = &agent {
        method.push_str(&format!("guest agent {}; ", a.describe()));
    }
    method.push_str(&format!(
        "sent {sent}; the VMM ended: {ended}{}; {elapsed_ms} ms in all",
        if killed { " (SIGKILL)" } else { "" }
    ));
    if !gone {
        method.push_str(&format!(
            "; afterwards the VM is {}",
            describe_state(&after)
        ));
    }
    let answered = matches!(agent, Some(guest::AgentShutdown::Answered { .. }));
    let mut rec = StepRecord::new(
        DepartureStep::AgentShutdown,
        &method,
        StepResult::Ok,
        // The VM's end is checked on the host; what an agent says it did inside the guest
        // cannot be.
        if gone && !answered {
            Assurance::Verified
        } else {
            Assurance::Unverified
        },
        started_at,
        now_rfc3339(),
    )
    .with_evidence("found", found)
    .with_evidence("sent", sent)
    .with_evidence("ended", ended)
    .with_evidence("killed", killed)
    .with_evidence("vm_gone_after", gone)
    .with_evidence("grace_ms", grace_ms)
    .with_evidence("elapsed_ms", elapsed_ms);
    if let Some(a) = agent {
        rec = rec.with_evidence("agent", a.describe());
        if let guest::AgentShutdown::Answered {
            report,
            powered_off_ms,
            ..
        } = a
        {
            rec = rec
                .with_evidence("payload_stopped", report.payload_stopped)
                .with_evidence("unmounted", report.unmounted)
                .with_evidence("disk_closed", report.disk_closed)
                .with_evidence("powered_off", powered_off_ms.is_some());
        }
    }
    Ok(Some(rec))
}

/// How the backend found a VM, for receipts.
fn describe_state(state: &Result<VmState, BackendError>) -> String {
    match state {
        Ok(VmState::Running) => "running".into(),
        Ok(VmState::Paused) => "paused".into(),
        Ok(VmState::Exited { status }) => format!("exited ({})", status.describe()),
        Ok(VmState::Gone) => "gone (no process, no exit status)".into(),
        Err(e) => format!("not answering its control socket ({})", error_chain(e)),
    }
}

/// cleanup-jail: kills whatever is left in the tenant's cgroup, removes the cgroup and the
/// jail root.
pub fn cleanup_jail(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    ctx.jail
        .cleanup(&t.name, &ctx.config.tenant_dir(&t.name))
        .map_err(|e| StepError::failed(error_chain(&e)))?;
    ctx.store.remove_resource(ResourceKind::Cgroup, &t.name)?;
    Ok(None)
}

/// The store key of a VM process: pid and start time together defeat pid reuse.
pub fn process_key(vm: &RunningVm) -> String {
    format!("{}:{}", vm.pid, vm.start_time_ticks)
}

/// The VM a step needs, or its error.
fn recorded(t: &Tenant) -> Result<&RunningVm, StepError> {
    t.vm.as_ref()
        .ok_or_else(|| StepError::failed("no VM is recorded for this tenant"))
}

/// Forgets the tenant's recorded VM (after it was stopped or killed).
fn forget_vm(ctx: &StepCtx<'_>, t: &mut Tenant) -> Result<(), StoreError> {
    if let Some(vm) = t.vm.take() {
        ctx.store
            .remove_resource(ResourceKind::Process, &process_key(&vm))?;
    }
    Ok(())
}

/// Kills a tenant's VM, if one is recorded, and forgets it (a failed operation, a VM found
/// dead, reconciliation).
pub fn kill_vm(ctx: &StepCtx<'_>, t: &mut Tenant) -> Result<(), StepError> {
    if let Some(vm) = &t.vm {
        ctx.backend
            .kill(vm)
            .map_err(|e| StepError::failed(error_chain(&e)))?;
        forget_vm(ctx, t)?;
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
