//! The launcher's process: starting it and waiting until the VMM answers, finding out
//! whether it still runs, waiting for its end, and killing its whole cgroup.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{check_binary, Prepared, RuntimeConfig};
use crate::backend::{BackendError, BackendKind, ExitReason, JailConfig, RunningVm, VmSpec};
use crate::jail::process::{self, spawn_launcher, wait_nohang};
use crate::jail::{reap_exited, ExitRecord, JailPlan};
use crate::logs::{LogKind, LogPolicy, TenantLogs};

/// Whether the launcher still runs, and if not, how it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ProcessStatus {
    Alive,
    Exited(ExitRecord),
    Gone,
}

fn exit_file(vm: &RunningVm) -> PathBuf {
    vm.tenant_dir.join(crate::jail::plan::EXIT_FILE)
}

/// Looks at the launcher: reaps it when it is our exited child, otherwise checks pid +
/// start time, and reads the exit record the jail left.
pub(super) fn process_status(vm: &RunningVm) -> Result<ProcessStatus, BackendError> {
    if let Some(status) = wait_nohang(vm.pid) {
        let record =
            ExitRecord::read(&exit_file(vm))?.unwrap_or(ExitRecord::from_wait_status(status));
        return Ok(ProcessStatus::Exited(record));
    }
    if process::is_alive(vm.pid, vm.start_time_ticks)? {
        return Ok(ProcessStatus::Alive);
    }
    Ok(match ExitRecord::read(&exit_file(vm))? {
        Some(record) => ProcessStatus::Exited(record),
        None => ProcessStatus::Gone,
    })
}

/// Waits up to `timeout` for the launcher to end.
pub(super) fn wait_exit(vm: &RunningVm, timeout: Duration) -> Result<ProcessStatus, BackendError> {
    let deadline = Instant::now() + timeout;
    loop {
        let status = process_status(vm)?;
        if status != ProcessStatus::Alive || Instant::now() >= deadline {
            return Ok(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILLs every process of the VM (the whole cgroup), reaps the launcher, and records
/// the kill unless an exit was recorded already. Idempotent.
pub(super) fn kill(vm: &RunningVm) -> Result<(), BackendError> {
    vm.cgroup.kill_all(reap_exited)?;
    // The launcher may already be gone from the cgroup but not reaped.
    let _ = wait_nohang(vm.pid);
    if vm.tenant_dir.is_dir() {
        ExitRecord::Signal(libc::SIGKILL).write_if_absent(&exit_file(vm))?;
    }
    Ok(())
}

/// The last lines of vmm.log, for error messages.
fn vmm_log_tail(spec: &VmSpec) -> String {
    let parent = spec.tenant_dir.parent().unwrap_or(Path::new("/"));
    TenantLogs::open(parent, &spec.tenant, LogPolicy::default())
        .and_then(|logs| logs.tail(LogKind::Vmm, 20))
        .map(|lines| lines.join("\n"))
        .unwrap_or_default()
}

/// How long a VM given devices may pin its guest RAM before it answers, per GiB: the
/// kernel pins every page of guest RAM for DMA before the VMM opens its socket. Measured
/// in the nested host (docs/benchmarks.md, "huge pages with a device"): 4.7-8.7 s per GiB
/// on 4 KiB pages under emulation; a real host pins several GiB a second.
const DMA_PIN_ALLOWANCE_PER_GIB: Duration = Duration::from_secs(10);

/// The launch deadline for `spec`: `base`, plus the DMA pinning allowance for its guest RAM
/// when devices are passed through (a 2 GiB GPU guest on 4 KiB pages did not answer within
/// the fixed 10 s in the nested host). Still bounded: the guest runs no code before then.
pub(super) fn ready_timeout_for(base: Duration, spec: &VmSpec) -> Duration {
    if spec.devices.is_empty() {
        return base;
    }
    let gib = u64::from(spec.memory_mib).div_ceil(1024);
    base + DMA_PIN_ALLOWANCE_PER_GIB.saturating_mul(u32::try_from(gib).unwrap_or(u32::MAX))
}

/// One launch in progress: what [`Launch::start`] needs to start the launcher and build
/// the [`RunningVm`].
pub(super) struct Launch<'a> {
    pub(super) kind: BackendKind,
    pub(super) spec: &'a VmSpec,
    pub(super) jail: &'a JailConfig,
    pub(super) prepared: &'a Prepared,
    pub(super) api_sock: PathBuf,
}

impl Launch<'_> {
    /// Starts the launcher with `plan` and waits until `ready` says the VMM answers, the
    /// process ends (an error carrying its exit reason, read by `decode`, and vmm.log), or
    /// the ready timeout passes (the VM is killed).
    pub(super) fn start(
        self,
        cfg: &RuntimeConfig,
        plan: &JailPlan,
        ready: &dyn Fn(&RunningVm) -> bool,
        decode: &dyn Fn(ExitRecord) -> ExitReason,
    ) -> Result<RunningVm, BackendError> {
        check_binary("tenantvm-jail", &cfg.jail_binary)?;
        let launched = spawn_launcher(&cfg.jail_binary, plan, &self.prepared.vmm_log)?;
        let vm = RunningVm {
            vsock_cid: self.spec.vsock_cid,
            backend: self.kind,
            tenant: self.spec.tenant.clone(),
            pid: launched.pid,
            start_time_ticks: launched.start_time_ticks,
            api_sock: self.api_sock,
            tenant_dir: self.spec.tenant_dir.clone(),
            cgroup: self.prepared.cgroup.clone(),
            uid: self.jail.uid,
        };
        let ready_timeout = ready_timeout_for(cfg.ready_timeout, self.spec);
        let deadline = Instant::now() + ready_timeout;
        loop {
            match process_status(&vm)? {
                ProcessStatus::Alive => {}
                ProcessStatus::Exited(record) => {
                    return Err(BackendError::LaunchFailed {
                        reason: decode(record),
                        log_tail: vmm_log_tail(self.spec),
                    });
                }
                ProcessStatus::Gone => {
                    return Err(BackendError::LaunchFailed {
                        reason: ExitReason::JailFailure,
                        log_tail: vmm_log_tail(self.spec),
                    });
                }
            }
            if vm.api_sock.exists() && ready(&vm) {
                return Ok(vm);
            }
            if Instant::now() >= deadline {
                kill(&vm)?;
                return Err(BackendError::NotReady {
                    timeout: ready_timeout,
                    log_tail: vmm_log_tail(self.spec),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
