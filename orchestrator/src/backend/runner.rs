//! What both backends share: the [`Runner`], which prepares the tenant directory and the
//! jail, starts the launcher and waits for readiness, finds out whether the process still
//! runs, stops it (asking first, killing the cgroup when it does not answer) and kills it;
//! around a [`VmmDriver`], which says what one kind of VMM program does differently.

use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tenantvm_agent_protocol::AgentEndpoint;
use tenantvm_vmm_api::{
    BlockConfig, ExitReport, RateLimitConfig, MAX_GUEST_CID, MAX_PASSTHROUGH_DEVICES, MIN_GUEST_CID,
};

use super::control::MAX_SOCKET_PATH;
use super::vfio_nodes::VfioInterface;
use super::{
    BackendError, BackendKind, ExitReason, JailConfig, PeerSocketError, RunningVm, VmBackend,
    VmSpec, VmState,
};
use crate::jail::process::{self, spawn_launcher, wait_nohang};
use crate::jail::{
    reap_exited, CgroupHandle, Cgroups, DeviceAllowance, ExitRecord, JailPlan, JailRlimits, Seal,
};
use crate::logs::{LogKind, LogPolicy, TenantLogs};

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
/// Open files a VMM may hold (vCPU fds, eventfds, disks, sockets).
const VMM_NOFILE: u64 = 4096;
/// What RLIMIT_MEMLOCK allows beyond guest RAM for a VM with passthrough devices: VFIO pins
/// all guest RAM for DMA, plus the VMM's own small pinned buffers.
pub const MEMLOCK_MARGIN_BYTES: u64 = 64 << 20;

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

/// The tenant directory, made ready for a launch.
pub struct Prepared {
    /// `<tenant dir>/run`, owned by the tenant uid, empty.
    pub run_dir: PathBuf,
    /// serial.log, writable by the tenant uid.
    pub serial_log: PathBuf,
    /// vmm.log, open for appending (the launcher's stdout and stderr).
    pub vmm_log: fs::File,
    /// The tenant's cgroup, created with the limits.
    pub cgroup: CgroupHandle,
}

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

fn invalid(message: String) -> BackendError {
    BackendError::InvalidSpec(message)
}

/// Checks the spec, creates `run/` (owned by the tenant uid) and the log files (serial.log
/// writable by the tenant uid), and creates the cgroup with the limits.
fn prepare(
    spec: &VmSpec,
    jail: &JailConfig,
    cfg: &RuntimeConfig,
) -> Result<Prepared, BackendError> {
    crate::jail::validate_tenant_name(&spec.tenant)?;
    if spec.vcpus == 0 || spec.vcpus > 256 {
        return Err(invalid(format!("{} vCPUs: give 1 to 256", spec.vcpus)));
    }
    if spec.memory_mib == 0 {
        return Err(invalid("0 MiB of guest memory: give at least 1".into()));
    }
    if spec.cmdline.contains('\0') || spec.cmdline.len() > 4096 {
        return Err(invalid(
            "the kernel command line must be under 4096 bytes without NUL bytes".into(),
        ));
    }
    if jail.uid == 0 || jail.gid == 0 {
        return Err(invalid("uid/gid 0: a jailed VMM never runs as root".into()));
    }
    check_devices(spec)?;
    if let Some(cid) = spec.vsock_cid {
        if !(MIN_GUEST_CID..=MAX_GUEST_CID).contains(&cid) {
            return Err(invalid(format!(
                "vsock CID {cid}: give {MIN_GUEST_CID} to {MAX_GUEST_CID} (0-2 are reserved)"
            )));
        }
    }
    let mut files = vec![("kernel", &spec.kernel)];
    if let Some(initramfs) = &spec.initramfs {
        files.push(("initramfs", initramfs));
    }
    for disk in &spec.disks {
        files.push(("disk", &disk.path));
    }
    for (what, path) in files {
        if !path.is_absolute() || !path.exists() {
            return Err(invalid(format!(
                "{what} {} does not exist (give an absolute host path)",
                path.display()
            )));
        }
    }
    let dir = &spec.tenant_dir;
    let meta = fs::symlink_metadata(dir).map_err(|source| BackendError::Io {
        path: dir.clone(),
        source,
    })?;
    if !meta.is_dir()
        || !dir.is_absolute()
        || dir.file_name().and_then(|n| n.to_str()) != Some(spec.tenant.as_str())
    {
        return Err(invalid(format!(
            "tenant dir {} must be an absolute directory (not a symlink) named after the tenant {:?}",
            dir.display(),
            spec.tenant
        )));
    }
    // One VM per tenant: kill and stop act on the whole cgroup, so a second VM in it would
    // share the first one's fate. Checked before anything (sockets, limits) is touched.
    let members = cfg.cgroups.handle(&spec.tenant)?.members()?;
    if !members.is_empty() {
        return Err(BackendError::AlreadyRunning {
            tenant: spec.tenant.clone(),
            pids: members,
        });
    }
    let parent = dir.parent().unwrap_or(Path::new("/"));
    let logs = TenantLogs::open(parent, &spec.tenant, LogPolicy::default())
        .map_err(|e| invalid(e.to_string()))?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BackendError::Io { path, source }
    };
    // A new run: no earlier stop explains its exit.
    match fs::remove_file(dir.join(STOPPED_BY_FILE)) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(source) => {
            return Err(BackendError::Io {
                path: dir.join(STOPPED_BY_FILE),
                source,
            })
        }
    }
    let run_dir = dir.join(RUN_DIR);
    match fs::DirBuilder::new().mode(0o700).create(&run_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(BackendError::Io {
                path: run_dir,
                source,
            })
        }
    }
    // Stale sockets from a previous run would make the VMM refuse to start.
    for entry in fs::read_dir(&run_dir).map_err(io(&run_dir))? {
        let entry = entry.map_err(io(&run_dir))?;
        fs::remove_file(entry.path()).map_err(io(&entry.path()))?;
    }
    std::os::unix::fs::lchown(&run_dir, Some(jail.uid), Some(jail.gid)).map_err(io(&run_dir))?;
    fs::set_permissions(&run_dir, fs::Permissions::from_mode(0o700)).map_err(io(&run_dir))?;
    let serial_log = logs.path(LogKind::Serial);
    std::os::unix::fs::lchown(&serial_log, Some(jail.uid), Some(jail.gid))
        .map_err(io(&serial_log))?;
    let vmm_log = logs
        .open_append(LogKind::Vmm)
        .map_err(|e| invalid(e.to_string()))?;
    let cgroup = cfg.cgroups.create(&spec.tenant, &jail.limits)?;
    Ok(Prepared {
        run_dir,
        serial_log,
        vmm_log,
        cgroup,
    })
}

/// Checks the passthrough devices: at most [`MAX_PASSTHROUGH_DEVICES`], each well formed,
/// none twice.
pub fn check_devices(spec: &VmSpec) -> Result<(), BackendError> {
    if spec.devices.len() > MAX_PASSTHROUGH_DEVICES {
        return Err(invalid(format!(
            "{} passthrough devices: a VM takes at most {MAX_PASSTHROUGH_DEVICES}",
            spec.devices.len()
        )));
    }
    for (i, device) in spec.devices.iter().enumerate() {
        device.validate()?;
        if spec.devices[..i].contains(device) {
            return Err(invalid(format!(
                "passthrough device {} is given twice",
                device.sysfs_path().display()
            )));
        }
    }
    Ok(())
}

/// The host path of a socket in `run/`, checked against the sockaddr_un limit.
fn socket_path(spec: &VmSpec, name: &str) -> Result<PathBuf, BackendError> {
    let path = spec.tenant_dir.join(RUN_DIR).join(name);
    if path.as_os_str().len() > MAX_SOCKET_PATH {
        return Err(invalid(format!(
            "socket path {} is longer than {MAX_SOCKET_PATH} bytes; use a shorter tenants directory",
            path.display()
        )));
    }
    Ok(path)
}

/// The disks of `spec` as the VMM sees them in the jail: `/vm/disk0`, `/vm/disk1`, ... (where
/// [`base_plan`] mounts them), in order, each with its index as id and its quota as a rate
/// limit.
pub fn jail_disks(spec: &VmSpec) -> Vec<BlockConfig> {
    spec.disks
        .iter()
        .enumerate()
        .map(|(i, disk)| BlockConfig {
            path: Path::new(JAIL_VM_DIR).join(format!("disk{i}")),
            read_only: disk.read_only,
            id: Some(format!("disk{i}")),
            rate_limit: disk.limit.map(|limit| RateLimitConfig {
                bytes_per_sec: Some(limit.bytes_per_s),
                ops_per_sec: Some(limit.ops_per_s),
                ..Default::default()
            }),
        })
        .collect()
}

/// The jail plan every VMM needs: the program with its libraries, the guest files under
/// /vm, /dev/null and /dev/urandom, the socket directory at /run, serial.log at
/// /log/serial.log, and the passed-through devices' sysfs directories and VFIO nodes for
/// `vfio` ([`vfio_nodes`](super::vfio_nodes)).
pub fn base_plan(
    spec: &VmSpec,
    jail: &JailConfig,
    prepared: &Prepared,
    program: &Path,
    args: Vec<String>,
    vfio: VfioInterface,
) -> Result<JailPlan, BackendError> {
    let rlimits = JailRlimits {
        nofile: VMM_NOFILE,
        nproc: jail.limits.pids_max,
        memlock_bytes: memlock_bytes(spec, jail),
        core_bytes: 0,
    };
    let mut plan = JailPlan::new(
        &spec.tenant,
        jail.uid,
        jail.gid,
        prepared.cgroup.clone(),
        &spec.tenant_dir,
        program,
        args,
        rlimits,
    )?;
    if spec.hugepages.is_some() {
        // Guest RAM on huge pages is a hugetlb memfd the VMM (or QEMU) sizes to the whole
        // RAM, and ftruncate obeys RLIMIT_FSIZE: without this a tenant whose RAM is larger
        // than its largest disk fails at launch with EFBIG.
        plan.allow_file_size(u64::from(spec.memory_mib) << 20);
    }
    let vm = Path::new(JAIL_VM_DIR);
    plan.bind(&spec.kernel, &vm.join("kernel"), false)?;
    if let Some(initramfs) = &spec.initramfs {
        plan.bind(initramfs, &vm.join("initramfs"), false)?;
    }
    for (i, disk) in spec.disks.iter().enumerate() {
        plan.bind(&disk.path, &vm.join(format!("disk{i}")), !disk.read_only)?;
    }
    plan.device(Path::new("/dev/null"))?;
    plan.device(Path::new("/dev/urandom"))?;
    plan.bind(&prepared.run_dir, Path::new("/run"), true)?;
    plan.bind(&prepared.serial_log, Path::new(JAIL_SERIAL_LOG), true)?;
    for node in super::vfio_nodes::nodes(spec, vfio, Path::new("/")) {
        plan.device(&node).map_err(|e| {
            invalid(format!(
                "{}: {e}; is the device bound to vfio-pci (or its vGPU type set) and the vfio modules loaded? `tenantvm host check` says",
                node.display()
            ))
        })?;
    }
    for device in &spec.devices {
        // The VMM finds the device (its IOMMU group, its vfio-dev) through its sysfs
        // directory: read-only, at the path the VMM's config names; and its IOMMU group's
        // directory where the device's relative `iommu_group` link leads from there (the VMM
        // lists the group's members).
        let path = device.sysfs_path();
        plan.bind(&path, &path, false)?;
        if let Some((group, target)) = group_mount(&path, &path) {
            plan.bind(&group, &target, false)?;
        }
    }
    Ok(plan)
}

/// Where the `iommu_group` link of the device directory `host_dir` leads when that
/// directory is mounted at `jail_dir`: (the group's host directory, its path in the jail).
/// sysfs links are relative and a device's canonical directory sits deeper or shallower
/// than `/sys/bus/pci/devices/<address>`, so the group is mounted where the link resolves
/// from the jail path. None when the link is missing or leads nowhere usable.
pub fn group_mount(host_dir: &Path, jail_dir: &Path) -> Option<(PathBuf, PathBuf)> {
    let link = host_dir.join("iommu_group");
    let rel = fs::read_link(&link).ok()?;
    let host_group = link.canonicalize().ok()?;
    let mut target = jail_dir.to_path_buf();
    for part in rel.components() {
        match part {
            std::path::Component::ParentDir => {
                if !target.pop() {
                    return None;
                }
            }
            std::path::Component::Normal(name) => target.push(name),
            std::path::Component::CurDir => {}
            // An absolute link: the group is mounted at that path.
            std::path::Component::RootDir | std::path::Component::Prefix(_) => {
                target = PathBuf::from("/");
            }
        }
    }
    (target != Path::new("/")).then_some((host_group, target))
}

/// RLIMIT_MEMLOCK of the VMM: with passthrough devices, guest RAM plus
/// [`MEMLOCK_MARGIN_BYTES`] (VFIO pins all of guest RAM), never below the cgroup memory
/// limit it had before devices existed; without devices, the cgroup memory limit.
pub fn memlock_bytes(spec: &VmSpec, jail: &JailConfig) -> u64 {
    if spec.devices.is_empty() {
        return jail.limits.memory_bytes;
    }
    (u64::from(spec.memory_mib) << 20)
        .saturating_add(MEMLOCK_MARGIN_BYTES)
        .max(jail.limits.memory_bytes)
}

/// Whether the launcher still runs, and if not, how it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProcessStatus {
    Alive,
    Exited(ExitRecord),
    Gone,
}

fn exit_file(vm: &RunningVm) -> PathBuf {
    vm.tenant_dir.join(crate::jail::plan::EXIT_FILE)
}

/// Looks at the launcher: reaps it when it is our exited child, otherwise checks pid +
/// start time, and reads the exit record the jail left.
fn process_status(vm: &RunningVm) -> Result<ProcessStatus, BackendError> {
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
fn wait_exit(vm: &RunningVm, timeout: Duration) -> Result<ProcessStatus, BackendError> {
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
fn kill(vm: &RunningVm) -> Result<(), BackendError> {
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
fn ready_timeout_for(base: Duration, spec: &VmSpec) -> Duration {
    if spec.devices.is_empty() {
        return base;
    }
    let gib = u64::from(spec.memory_mib).div_ceil(1024);
    base + DMA_PIN_ALLOWANCE_PER_GIB.saturating_mul(u32::try_from(gib).unwrap_or(u32::MAX))
}

/// One launch in progress: what [`Launch::start`] needs to start the launcher and build
/// the [`RunningVm`].
struct Launch<'a> {
    kind: BackendKind,
    spec: &'a VmSpec,
    jail: &'a JailConfig,
    prepared: &'a Prepared,
    api_sock: PathBuf,
}

impl Launch<'_> {
    /// Starts the launcher with `plan` and waits until `ready` says the VMM answers, the
    /// process ends (an error carrying its exit reason, read by `decode`, and vmm.log), or
    /// the ready timeout passes (the VM is killed).
    fn start(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ResourceLimits;
    use crate::jail::CgroupLayout;

    /// A config whose cgroups point into a fake tree (nothing here reaches them).
    fn fake_config(dir: &Path) -> RuntimeConfig {
        RuntimeConfig {
            jail_binary: dir.join("tenantvm-jail"),
            cgroups: Cgroups::with_layout(CgroupLayout::V2 {
                root: dir.join("fake-cgroupfs"),
            }),
            ready_timeout: Duration::from_secs(1),
            control_timeout: Duration::from_secs(1),
        }
    }

    fn spec(dir: &Path, tenant: &str) -> VmSpec {
        let kernel = dir.join("kernel");
        fs::write(&kernel, b"k").unwrap();
        VmSpec {
            vsock_cid: None,
            tenant: tenant.into(),
            kernel,
            initramfs: None,
            cmdline: String::new(),
            vcpus: 1,
            memory_mib: 32,
            disks: vec![],
            tenant_dir: dir.join(tenant),
            devices: vec![],
            uuid: None,
            hugepages: None,
        }
    }

    const JAIL: JailConfig = JailConfig {
        uid: 4242,
        gid: 4242,
        limits: ResourceLimits {
            memory_bytes: 64 << 20,
            cpu_quota_us: 100_000,
            cpu_period_us: 100_000,
            pids_max: 32,
        },
    };

    #[test]
    fn prepare_requires_tenant_dir_named_after_the_tenant() {
        let tmp = tempfile::tempdir().unwrap();
        let mut spec = spec(tmp.path(), "alpha");
        fs::create_dir(tmp.path().join("other")).unwrap();
        spec.tenant_dir = tmp.path().join("other");
        let err = prepare(&spec, &JAIL, &fake_config(tmp.path()))
            .err()
            .unwrap();
        assert!(matches!(err, BackendError::InvalidSpec(_)), "{err}");
    }

    #[test]
    fn prepare_refuses_a_symlinked_tenant_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let spec = spec(tmp.path(), "alpha");
        fs::create_dir(tmp.path().join("real")).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("real"), &spec.tenant_dir).unwrap();
        let err = prepare(&spec, &JAIL, &fake_config(tmp.path()))
            .err()
            .unwrap();
        assert!(matches!(err, BackendError::InvalidSpec(_)), "{err}");
        assert!(!tmp.path().join("real/run").exists());
    }

    #[test]
    fn prepare_rejects_relative_or_missing_guest_files() {
        let tmp = tempfile::tempdir().unwrap();
        let base = spec(tmp.path(), "alpha");
        fs::create_dir(&base.tenant_dir).unwrap();
        for bad in [
            VmSpec {
                kernel: "relative/kernel".into(),
                ..base.clone()
            },
            VmSpec {
                initramfs: Some(tmp.path().join("missing")),
                ..base.clone()
            },
        ] {
            assert!(matches!(
                prepare(&bad, &JAIL, &fake_config(tmp.path())),
                Err(BackendError::InvalidSpec(_))
            ));
        }
        assert!(!base.tenant_dir.join("run").exists());
    }

    #[test]
    fn socket_path_rejects_tenant_dirs_too_long_for_sockaddr_un() {
        let tmp = tempfile::tempdir().unwrap();
        let mut spec = spec(tmp.path(), "alpha");
        socket_path(&spec, "api.sock").unwrap();
        spec.tenant_dir = PathBuf::from(format!("/{}/alpha", "d".repeat(100)));
        assert!(matches!(
            socket_path(&spec, "api.sock"),
            Err(BackendError::InvalidSpec(_))
        ));
    }

    #[test]
    fn a_vm_given_devices_has_time_to_pin_its_ram_and_one_without_does_not() {
        let tmp = tempfile::tempdir().unwrap();
        let base = Duration::from_secs(10);
        let plain = VmSpec {
            memory_mib: 8192,
            ..spec(tmp.path(), "alpha")
        };
        assert_eq!(
            ready_timeout_for(base, &plain),
            base,
            "the control: no devices"
        );
        let with_gpu = VmSpec {
            devices: vec![gpu("0000:41:00.0", 7)],
            ..plain.clone()
        };
        assert_eq!(
            ready_timeout_for(base, &with_gpu),
            Duration::from_secs(10 + 8 * 10)
        );
        let small = VmSpec {
            memory_mib: 512,
            ..with_gpu
        };
        assert_eq!(ready_timeout_for(base, &small), Duration::from_secs(20));
    }

    #[test]
    fn missing_binaries_are_named() {
        let err = check_binary("tenantvm-vmm", Path::new("/no/such/tenantvm-vmm")).unwrap_err();
        assert!(err.to_string().contains("/no/such/tenantvm-vmm"), "{err}");
    }

    fn gpu(address: &str, group: u32) -> crate::backend::PassthroughDevice {
        crate::backend::PassthroughDevice::Pci {
            address: address.into(),
            iommu_group: group,
        }
    }

    #[test]
    fn memlock_covers_guest_ram_plus_a_margin_when_devices_are_passed() {
        let tmp = tempfile::tempdir().unwrap();
        let mut spec = spec(tmp.path(), "alpha");
        spec.memory_mib = 16 << 10;
        let jail = JailConfig {
            limits: ResourceLimits {
                memory_bytes: 1 << 30,
                ..JAIL.limits
            },
            ..JAIL
        };
        assert_eq!(memlock_bytes(&spec, &jail), 1 << 30);
        spec.devices = vec![gpu("0000:41:00.0", 17)];
        assert_eq!(
            memlock_bytes(&spec, &jail),
            (16u64 << 30) + MEMLOCK_MARGIN_BYTES
        );
    }

    #[test]
    fn guest_ram_on_huge_pages_raises_the_file_size_limit_to_the_ram() {
        let tmp = tempfile::tempdir().unwrap();
        let mut spec = spec(tmp.path(), "alpha");
        fs::create_dir(&spec.tenant_dir).unwrap();
        spec.memory_mib = 16 << 10;
        let prepared = || Prepared {
            run_dir: tmp.path().to_path_buf(),
            serial_log: spec.kernel.clone(),
            vmm_log: fs::File::open(&spec.kernel).unwrap(),
            cgroup: CgroupHandle::V2 {
                path: tmp.path().join("cg"),
            },
        };
        let limit = |spec: &VmSpec| {
            base_plan(
                spec,
                &JAIL,
                &prepared(),
                Path::new("/bin/sh"),
                vec![],
                VfioInterface::Legacy,
            )
            .unwrap()
            .file_size_limit
        };
        assert_eq!(limit(&spec), crate::jail::plan::MIN_FILE_SIZE_LIMIT);
        for pages in [
            tenantvm_vmm_api::HugePages::Size2M,
            tenantvm_vmm_api::HugePages::Size1G,
        ] {
            spec.hugepages = Some(pages);
            assert_eq!(limit(&spec), 16 << 30, "{pages}");
        }
    }

    #[test]
    fn a_device_without_its_vfio_node_is_refused_with_what_to_check() {
        if std::path::Path::new("/dev/vfio/4095").exists() {
            tenantvm_skip::skip!("this host has an IOMMU group 4095");
        }
        let tmp = tempfile::tempdir().unwrap();
        let mut spec = spec(tmp.path(), "alpha");
        fs::create_dir(&spec.tenant_dir).unwrap();
        spec.devices = vec![gpu("0000:41:00.0", 4095)];
        let prepared = Prepared {
            run_dir: tmp.path().to_path_buf(),
            serial_log: spec.kernel.clone(),
            vmm_log: fs::File::open(&spec.kernel).unwrap(),
            cgroup: CgroupHandle::V2 {
                path: tmp.path().join("cg"),
            },
        };
        let err = base_plan(
            &spec,
            &JAIL,
            &prepared,
            Path::new("/bin/sh"),
            vec![],
            VfioInterface::Legacy,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("/dev/vfio/4095") && err.contains("vfio-pci"),
            "{err}"
        );
    }

    #[test]
    fn the_group_is_mounted_where_the_devices_relative_link_leads_in_the_jail() {
        // A sysfs-like tree: the device three levels below /sys/devices (behind a bridge),
        // its group under /sys/kernel/iommu_groups, linked relatively as the kernel does.
        let tmp = tempfile::tempdir().unwrap();
        let sys = tmp.path().join("sys");
        let dev = sys.join("devices/pci0000:00/0000:00:01.0/0000:01:00.0");
        let group = sys.join("kernel/iommu_groups/17");
        fs::create_dir_all(&dev).unwrap();
        fs::create_dir_all(group.join("devices")).unwrap();
        std::os::unix::fs::symlink(
            "../../../../kernel/iommu_groups/17",
            dev.join("iommu_group"),
        )
        .unwrap();
        let jail = Path::new("/sys/bus/pci/devices/0000:01:00.0");
        let (host, target) = group_mount(&dev, jail).unwrap();
        assert_eq!(host, group.canonicalize().unwrap());
        // From /sys/bus/pci/devices/0000:01:00.0, four levels up is /sys.
        assert_eq!(target, Path::new("/sys/kernel/iommu_groups/17"));
        // A device on the root bus links one level less far: it resolves elsewhere in the
        // jail, and that is where its group goes.
        let shallow = sys.join("devices/pci0000:00/0000:00:04.0");
        fs::create_dir_all(&shallow).unwrap();
        std::os::unix::fs::symlink(
            "../../../kernel/iommu_groups/17",
            shallow.join("iommu_group"),
        )
        .unwrap();
        let (_, target) =
            group_mount(&shallow, Path::new("/sys/bus/pci/devices/0000:00:04.0")).unwrap();
        assert_eq!(target, Path::new("/sys/bus/kernel/iommu_groups/17"));
        // No link: nothing to mount.
        assert!(group_mount(&group, jail).is_none());
    }
}
