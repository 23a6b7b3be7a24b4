//! What both backends share: the [`Runner`], which prepares the tenant directory and the
//! jail, starts the launcher and waits for readiness, finds out whether the process still
//! runs, stops it (asking first, killing the cgroup when it does not answer) and kills it;
//! around a [`VmmDriver`], which says what one kind of VMM program does differently.
//!
//! `prepare.rs` makes the tenant directory and the jail plan ready; `launch.rs` starts the
//! launcher and watches, waits for and kills its process.

mod launch;
mod prepare;
#[cfg(test)]
mod tests;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tenantvm_agent_protocol::AgentEndpoint;
use tenantvm_vmm_api::ExitReport;

use super::{
    BackendError, BackendKind, ExitReason, JailConfig, PeerSocketError, RunningVm, VmBackend,
    VmSpec, VmState,
};
use crate::jail::{reap_exited, Cgroups, DeviceAllowance, ExitRecord, JailPlan, Seal};
use launch::{kill, process_status, wait_exit, Launch, ProcessStatus};
pub use prepare::{
    base_plan, check_devices, group_mount, jail_disks, memlock_bytes, Prepared,
    MEMLOCK_MARGIN_BYTES,
};
use prepare::{prepare, socket_path};

/// Directory inside the tenant dir (and mounted at /run in the jail) holding the socket.
pub const RUN_DIR: &str = "run";
/// Where the guest kernel, initramfs and disks appear inside the jail.
pub const JAIL_VM_DIR: &str = "/vm";
/// Where serial.log appears inside the jail.
pub const JAIL_SERIAL_LOG: &str = "/log/serial.log";
/// How long `state` waits for a VMM whose socket failed to finish exiting. A guest that
/// ends closes the VMM's socket a moment before the process, its jail init and the
/// launcher have all exited; on a loaded host (CI runs QEMU TCG guests beside it) that
/// took more than a second. Only an error path waits this long.
const EXIT_SETTLE: Duration = Duration::from_secs(5);
/// In the tenant directory (the daemon's, not the VMM's): the name of the stop request an
/// exit with status 0 followed, so a later `stop` or `state` reads that exit as the stop
/// that caused it, as the first `stop` did. Removed at each launch.
const STOPPED_BY_FILE: &str = "vmm.stopped-by";

/// What one kind of VMM program does differently; [`Runner`] does everything else.
pub trait VmmDriver: Send + Sync {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;
    /// The program's name (for messages) and its host path.
    fn program(&self) -> (&'static str, &Path);
    /// The socket in `run/` that answers once the program is ready: [`RunningVm::api_sock`].
    fn control_socket(&self) -> &'static str;
    /// The socket in `run/` the program creates last: once it exists, `/run` turns
    /// read-only inside the jail.
    fn last_socket(&self) -> &'static str;
    /// The jail plan: [`base_plan`] with the program's arguments, plus what else it needs
    /// (devices, data directories, a config file).
    fn plan(
        &self,
        spec: &VmSpec,
        jail: &JailConfig,
        prepared: &Prepared,
    ) -> Result<JailPlan, BackendError>;
    /// What the launcher's exit record means for this program.
    fn decode_exit(&self, record: ExitRecord) -> ExitReason;
    /// Asks the running program whether the guest runs or is paused, within `timeout`.
    fn query(&self, vm: &RunningVm, timeout: Duration) -> Result<VmState, BackendError>;
    /// The graceful stop: requests sent in order, each followed by a wait.
    fn stop_requests(&self) -> &'static [StopRequest];
    /// Sends one of [`Self::stop_requests`] (by name), within `timeout`.
    fn request_stop(
        &self,
        vm: &RunningVm,
        request: &StopRequest,
        timeout: Duration,
    ) -> Result<(), BackendError>;
    /// Where the host reaches the guest agent's channel.
    fn agent_endpoint(&self, vm: &RunningVm) -> AgentEndpoint;
    /// [`VmBackend::agent_transport`].
    fn agent_transport(&self) -> &'static str;
    /// [`VmBackend::needs_vsock_cid`].
    fn needs_vsock_cid(&self) -> bool {
        false
    }
    /// The VMM's exit report of an ended VM ([`VmBackend::exit_report`]); none by default.
    fn exit_report(&self, _vm: &RunningVm) -> Result<Option<ExitReport>, BackendError> {
        Ok(None)
    }
    /// The running VM's disk counters ([`VmBackend::disk_counters`]); none by default.
    fn disk_counters(
        &self,
        _vm: &RunningVm,
        _timeout: Duration,
    ) -> Result<Option<super::DiskCounters>, BackendError> {
        Ok(None)
    }
}

/// One step of a graceful stop.
#[derive(Debug, Clone)]
pub struct StopRequest {
    /// What is asked (the driver's command name; shown in logs).
    pub name: &'static str,
    /// The share of the grace period to wait after it, in percent.
    pub grace_percent: u32,
    /// How an exit with status 0 after it reads, when the program does not say itself
    /// (QEMU exits 0 on `quit` and on power-off alike).
    pub clean_exit: Option<ExitReason>,
}

/// A VM backend: the common runner around one driver.
#[derive(Debug, Clone)]
pub struct Runner<D> {
    driver: D,
    config: RuntimeConfig,
}

impl<D: VmmDriver> Runner<D> {
    /// A backend running `driver`'s program with `config`.
    pub fn with_driver(driver: D, config: RuntimeConfig) -> Self {
        Self { driver, config }
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The shared settings.
    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    fn exited(&self, vm: &RunningVm, record: ExitRecord) -> VmState {
        VmState::Exited {
            status: self.decode_recorded(vm, record),
        }
    }

    /// How an ended VM's exit reads: status 0 after one of our stop requests (recorded in
    /// [`STOPPED_BY_FILE`] when it happened) is that request's clean end, whatever the
    /// program says of status 0 on its own; anything else is the driver's reading.
    fn decode_recorded(&self, vm: &RunningVm, record: ExitRecord) -> ExitReason {
        if record == ExitRecord::Code(0) {
            let by = fs::read_to_string(vm.tenant_dir.join(STOPPED_BY_FILE)).unwrap_or_default();
            if let Some(clean) = self
                .driver
                .stop_requests()
                .iter()
                .find(|r| r.name == by.trim())
                .and_then(|r| r.clean_exit)
            {
                return clean;
            }
        }
        self.driver.decode_exit(record)
    }

    /// Kills the whole cgroup and reports how the process ended: its own exit if it got
    /// there first, else the kill.
    fn kill_and_report(&self, vm: &RunningVm) -> Result<ExitReason, BackendError> {
        kill(vm)?;
        Ok(match process_status(vm)? {
            ProcessStatus::Exited(record) => self.driver.decode_exit(record),
            ProcessStatus::Alive | ProcessStatus::Gone => ExitReason::Signaled {
                signal: libc::SIGKILL,
            },
        })
    }
}

impl<D: VmmDriver> VmBackend for Runner<D> {
    fn kind(&self) -> BackendKind {
        self.driver.kind()
    }

    fn launch(&self, spec: &VmSpec, jail: &JailConfig) -> Result<RunningVm, BackendError> {
        let (what, program) = self.driver.program();
        check_binary(what, program)?;
        let api_sock = socket_path(spec, self.driver.control_socket())?;
        socket_path(spec, self.driver.last_socket())?;
        let prepared = prepare(spec, jail, &self.config)?;
        let result = self
            .driver
            .plan(spec, jail, &prepared)
            .and_then(|mut plan| {
                // Exactly the jail's devices, enforced by the kernel too where the host has
                // a device controller.
                match prepared.cgroup.allow_only_devices(&plan.devices)? {
                    DeviceAllowance::Applied { .. } => {}
                    DeviceAllowance::NotApplied { reason } => {
                        tracing::warn!(tenant = %spec.tenant, %reason, "no cgroup device allowance; the jail's device nodes alone limit the VMM");
                    }
                }
                plan.seal = Some(Seal {
                    when_exists: Path::new("/run").join(self.driver.last_socket()),
                    mount: PathBuf::from("/run"),
                });
                let launch = Launch {
                    kind: self.driver.kind(),
                    spec,
                    jail,
                    prepared: &prepared,
                    api_sock,
                };
                launch.start(
                    &self.config,
                    &plan,
                    &|vm| self.driver.query(vm, self.config.control_timeout).is_ok(),
                    &|record| self.driver.decode_exit(record),
                )
            });
        if result.is_err() {
            // Nothing of a failed launch is left running or accounted: kill whatever got
            // started and remove the cgroup (cleanup_tenant stays idempotent after this).
            if let Err(e) = prepared.cgroup.destroy(reap_exited) {
                tracing::warn!(tenant = %spec.tenant, error = %e, "cannot remove the cgroup of a failed launch");
            }
        }
        result
    }

    fn state(&self, vm: &RunningVm) -> Result<VmState, BackendError> {
        match process_status(vm)? {
            ProcessStatus::Exited(record) => return Ok(self.exited(vm, record)),
            ProcessStatus::Gone => return Ok(VmState::Gone),
            ProcessStatus::Alive => {}
        }
        match self.driver.query(vm, self.config.control_timeout) {
            Ok(state) => Ok(state),
            // It may be exiting: a socket error then is not an error of the VM's state. A
            // VMM that did not answer in time is wedged, not exiting: no waiting for it.
            Err(e) => {
                let settle = if e.is_unresponsive() {
                    Duration::ZERO
                } else {
                    EXIT_SETTLE
                };
                match wait_exit(vm, settle)? {
                    ProcessStatus::Exited(record) => Ok(self.exited(vm, record)),
                    ProcessStatus::Gone => Ok(VmState::Gone),
                    ProcessStatus::Alive => Err(e),
                }
            }
        }
    }

    fn ended(&self, vm: &RunningVm) -> Result<Option<VmState>, BackendError> {
        Ok(match process_status(vm)? {
            ProcessStatus::Exited(record) => Some(self.exited(vm, record)),
            ProcessStatus::Gone => Some(VmState::Gone),
            ProcessStatus::Alive => None,
        })
    }

    fn stop(&self, vm: &RunningVm, grace: Duration) -> Result<ExitReason, BackendError> {
        if let ProcessStatus::Exited(record) = process_status(vm)? {
            return Ok(self.decode_recorded(vm, record));
        }
        for request in self.driver.stop_requests() {
            let wait = grace * request.grace_percent / 100;
            match self
                .driver
                .request_stop(vm, request, self.config.control_timeout)
            {
                Ok(()) => match wait_exit(vm, wait)? {
                    ProcessStatus::Exited(record) => {
                        return Ok(match (record, request.clean_exit) {
                            (ExitRecord::Code(0), Some(clean)) => {
                                let marker = vm.tenant_dir.join(STOPPED_BY_FILE);
                                if let Err(e) = fs::write(&marker, request.name) {
                                    tracing::warn!(tenant = %vm.tenant, error = %e, "cannot record which stop request ended the VM");
                                }
                                clean
                            }
                            (record, _) => self.driver.decode_exit(record),
                        });
                    }
                    ProcessStatus::Gone | ProcessStatus::Alive => {}
                },
                Err(e) => {
                    tracing::warn!(tenant = %vm.tenant, request = request.name, error = %e, "the VMM did not take the stop request; killing it");
                    // A VMM on its way out closes its socket a moment before it exits; one
                    // that did not answer in time, or whose socket another uid serves, is
                    // not worth waiting for.
                    let hopeless = e.is_unresponsive()
                        || matches!(e, BackendError::Socket(PeerSocketError::WrongPeer { .. }));
                    if !hopeless {
                        if let ProcessStatus::Exited(record) = wait_exit(vm, EXIT_SETTLE)? {
                            return Ok(self.driver.decode_exit(record));
                        }
                    }
                    break;
                }
            }
        }
        self.kill_and_report(vm)
    }

    fn kill(&self, vm: &RunningVm) -> Result<(), BackendError> {
        kill(vm)
    }

    fn agent_endpoint(&self, vm: &RunningVm) -> AgentEndpoint {
        self.driver.agent_endpoint(vm)
    }

    fn agent_transport(&self) -> &'static str {
        self.driver.agent_transport()
    }

    fn needs_vsock_cid(&self) -> bool {
        self.driver.needs_vsock_cid()
    }

    fn disk_counters(
        &self,
        vm: &RunningVm,
        timeout: Duration,
    ) -> Result<Option<super::DiskCounters>, BackendError> {
        // Only the process launched is asked (a reused pid is not the tenant's VMM).
        match process_status(vm)? {
            ProcessStatus::Alive => self.driver.disk_counters(vm, timeout),
            ProcessStatus::Exited(_) | ProcessStatus::Gone => Ok(None),
        }
    }

    fn exit_report(&self, vm: &RunningVm) -> Result<Option<ExitReport>, BackendError> {
        // Only an ended VMM's report is its last word.
        match process_status(vm)? {
            ProcessStatus::Alive => Ok(None),
            ProcessStatus::Exited(_) | ProcessStatus::Gone => self.driver.exit_report(vm),
        }
    }
}

/// Settings shared by both backends.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// The `tenantvm-jail` launcher.
    pub jail_binary: PathBuf,
    /// The host's cgroup hierarchy.
    pub cgroups: Cgroups,
    /// How long `launch` waits for the control socket to answer.
    pub ready_timeout: Duration,
    /// Timeout of each control-socket or QMP exchange.
    pub control_timeout: Duration,
}

impl RuntimeConfig {
    /// The launcher next to the running executable, the detected cgroup hierarchy, 10 s to
    /// become ready and 5 s per control exchange.
    pub fn detect() -> Result<Self, BackendError> {
        Ok(Self {
            jail_binary: sibling_binary("tenantvm-jail")?,
            cgroups: Cgroups::detect()?,
            ready_timeout: Duration::from_secs(10),
            control_timeout: Duration::from_secs(5),
        })
    }
}

/// `name` in the directory of the running executable (for a test binary in
/// `target/*/deps`, the directory above, where cargo puts the package's binaries).
pub fn sibling_binary(name: &str) -> Result<PathBuf, BackendError> {
    let exe = std::env::current_exe().map_err(|source| BackendError::Io {
        path: PathBuf::from("/proc/self/exe"),
        source,
    })?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let candidate = dir.join(name);
    if !candidate.exists() && dir.file_name().is_some_and(|n| n == "deps") {
        if let Some(up) = dir.parent() {
            return Ok(up.join(name));
        }
    }
    Ok(candidate)
}

/// Whether the program `what` is at `path`.
fn check_binary(what: &'static str, path: &Path) -> Result<(), BackendError> {
    if path.is_file() {
        Ok(())
    } else {
        Err(BackendError::MissingBinary {
            what,
            path: path.to_path_buf(),
        })
    }
}
