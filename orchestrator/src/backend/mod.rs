//! How a tenant's VM is run: the [`VmBackend`] trait and its implementations.
//!
//! The control plane decides *what* runs ([`VmSpec`]) and *under which identity and limits*
//! ([`JailConfig`]); a backend starts the VMM inside the jail, reports its state, and stops
//! it. [`RunningVm`] is everything needed to find the VM again after a daemon restart, so
//! the control plane stores it (serde) and adopts the VM on start-up.
//!
//! Two backends exist: `tenantvm-vmm` (the default, [`BackendKind::TenantvmVmm`]) and QEMU
//! ([`BackendKind::Qemu`], with KVM or TCG software emulation). Both are a [`runner::Runner`]
//! around a [`runner::VmmDriver`]: the runner owns the jail, the process and the stop
//! sequence; the driver says what differs (the program's arguments, how to ask its state
//! and for a stop, how its exit status reads, where the guest agent is reached). What the
//! drivers say to their programs is written once in tenantvm-vmm-api.

pub mod control;
pub mod disk_stats;
pub mod hugepages;
pub mod qemu;
pub mod report_dir;
pub mod runner;
pub mod socket;
pub mod vfio_nodes;
pub mod vmm;

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tenantvm_agent_protocol::AgentEndpoint;
use tenantvm_vmm_api::{ExitReport, ExitStatus, VmUuid};

use crate::jail::{CgroupHandle, ExitRecord, JailError};

pub use disk_stats::DiskCounters;
pub use qemu::QemuBackend;
pub use runner::RuntimeConfig;
pub use socket::PeerSocketError;
/// The cgroup quotas live with the jail that applies them (the `tenantvm-jail` crate);
/// re-exported here, where [`JailConfig`] and the control plane have always named them.
pub use tenantvm_jail::ResourceLimits;
pub use tenantvm_vmm_api::QemuAccel;
pub use vmm::VmmBackend;

/// Which program runs a tenant's VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum BackendKind {
    /// `tenantvm-vmm`, one process per VM (the default).
    TenantvmVmm,
    /// `qemu-system-x86_64`, for hosts whose GPU stack needs it or guests KVM cannot run here.
    Qemu {
        /// The accelerator QEMU uses.
        accel: QemuAccel,
    },
}

impl std::fmt::Display for BackendKind {
    /// What `GET /v1/health` and people see: `tenantvm-vmm`, `qemu-kvm` or `qemu-tcg`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::TenantvmVmm => "tenantvm-vmm",
            BackendKind::Qemu {
                accel: QemuAccel::Kvm,
            } => "qemu-kvm",
            BackendKind::Qemu {
                accel: QemuAccel::Tcg,
            } => "qemu-tcg",
        })
    }
}

/// A disk handed to the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskAttachment {
    /// Host path of the disk image or block device.
    pub path: PathBuf,
    /// Whether the guest may only read it.
    pub read_only: bool,
    /// The tenant's disk I/O quota, enforced by the VMM per disk (a token bucket in
    /// tenantvm-vmm, block throttling in QEMU). `None`: unlimited.
    #[serde(default)]
    pub limit: Option<DiskRateLimit>,
}

/// A disk I/O quota: sustained bytes and operations per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskRateLimit {
    /// Bytes per second.
    pub bytes_per_s: u64,
    /// Requests per second.
    pub ops_per_s: u64,
}

/// A device passed through to the VM over VFIO. The control plane binds it (or types the
/// vGPU virtual function, or creates the mdev) before the launch; the backend hands it to
/// the VMM and gives the jail exactly its IOMMU group's `/dev/vfio` node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum PassthroughDevice {
    /// A PCI function: a whole GPU (or a companion function of its group) bound to
    /// `vfio-pci`, or a MIG-backed vGPU's SR-IOV virtual function (which stays bound to
    /// NVIDIA's vendor VFIO driver).
    Pci {
        /// Its PCI address, `DDDD:BB:DD.F`.
        address: String,
        /// Its IOMMU group (`/dev/vfio/<group>`).
        iommu_group: u32,
    },
    /// A mediated device (vGPU 16 and older): `/sys/bus/mdev/devices/<uuid>`. Only the QEMU
    /// backend passes one (`sysfsdev=`).
    Mdev {
        /// The mdev's UUID.
        uuid: String,
        /// Its IOMMU group (`/dev/vfio/<group>`).
        iommu_group: u32,
    },
}

impl PassthroughDevice {
    /// The device's IOMMU group.
    pub fn iommu_group(&self) -> u32 {
        match self {
            PassthroughDevice::Pci { iommu_group, .. }
            | PassthroughDevice::Mdev { iommu_group, .. } => *iommu_group,
        }
    }

    /// The device's sysfs directory on the host (`/sys/bus/pci/devices/<address>` or
    /// `/sys/bus/mdev/devices/<uuid>`).
    pub fn sysfs_path(&self) -> PathBuf {
        match self {
            PassthroughDevice::Pci { address, .. } => {
                PathBuf::from(tenantvm_vmm_api::devices::PCI_DEVICES_DIR).join(address)
            }
            PassthroughDevice::Mdev { uuid, .. } => PathBuf::from(MDEV_DEVICES_DIR).join(uuid),
        }
    }

    /// The group's VFIO node, `/dev/vfio/<group>`.
    pub fn vfio_node(&self) -> PathBuf {
        PathBuf::from(VFIO_DEV_DIR).join(self.iommu_group().to_string())
    }

    /// Checks the address or UUID, so nothing malformed reaches a path or a command line.
    pub fn validate(&self) -> Result<(), BackendError> {
        match self {
            PassthroughDevice::Pci { address, .. } => {
                if !tenantvm_vmm_api::devices::is_pci_address(address) {
                    return Err(BackendError::InvalidSpec(format!(
                        "passthrough device address {address:?} is not a PCI address; give DDDD:BB:DD.F"
                    )));
                }
            }
            PassthroughDevice::Mdev { uuid, .. } => {
                if uuid.parse::<VmUuid>().is_err() || uuid.to_lowercase() != *uuid {
                    return Err(BackendError::InvalidSpec(format!(
                        "mdev {uuid:?} is not a lower-case hyphenated UUID"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Where the kernel lists mediated devices.
pub const MDEV_DEVICES_DIR: &str = "/sys/bus/mdev/devices";
/// Where the VFIO group nodes live.
pub const VFIO_DEV_DIR: &str = "/dev/vfio";
/// The VFIO container node every legacy VFIO user opens.
pub const VFIO_CONTAINER: &str = "/dev/vfio/vfio";

/// What to run: the guest and its size. All paths are host paths; the backend bind-mounts
/// them read-only (disks read-write unless `read_only`) into the tenant's jail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    /// The tenant's name, already validated by the control plane (`[a-z0-9][a-z0-9-]{0,62}`);
    /// the backend checks it again because it reaches paths and cgroup names.
    pub tenant: String,
    /// Guest kernel (ELF vmlinux or bzImage).
    pub kernel: PathBuf,
    /// Optional initramfs.
    pub initramfs: Option<PathBuf>,
    /// Guest kernel command line.
    pub cmdline: String,
    /// Number of vCPUs (at least 1).
    pub vcpus: u32,
    /// Guest memory in MiB (at least 1).
    pub memory_mib: u32,
    /// Disks, in order: virtio-blk devices in the guest.
    pub disks: Vec<DiskAttachment>,
    /// The tenant's directory (mode 0700, created by the control plane): serial.log,
    /// vmm.log, events.log, the control socket and the jail root live under it.
    pub tenant_dir: PathBuf,
    /// Devices passed through over VFIO, at most
    /// [`tenantvm_vmm_api::devices::MAX_PASSTHROUGH_DEVICES`]; the GPU first.
    #[serde(default)]
    pub devices: Vec<PassthroughDevice>,
    /// The VM's UUID (QEMU `-uuid`, tenantvm-vmm `--uuid`): NVIDIA's vGPU manager ties a
    /// vGPU to its VM by it. Stored with the tenant, the same at every start.
    #[serde(default)]
    pub uuid: Option<VmUuid>,
    /// Huge pages backing the guest's RAM (tenantvm-vmm `hugepages`, QEMU a hugetlb memfd
    /// backend); ordinary pages when `None`. The control plane decides it at each launch
    /// (`backend::hugepages::choose`).
    #[serde(default)]
    pub hugepages: Option<tenantvm_vmm_api::HugePages>,
    /// The guest's vsock context id, for a backend that carries the agent's channel over
    /// the host kernel's vhost-vsock ([`VmBackend::needs_vsock_cid`]): unique among the
    /// host's VMs, allocated and stored by the control plane. `None` elsewhere.
    #[serde(default)]
    pub vsock_cid: Option<u32>,
}

/// Identity and limits of the jail a VM runs in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JailConfig {
    /// The uid the VMM runs as: unique per tenant, never 0.
    pub uid: u32,
    /// The gid the VMM runs as: unique per tenant, never 0. No supplementary groups are kept.
    pub gid: u32,
    /// cgroup and rlimit quotas.
    pub limits: ResourceLimits,
}

/// A VM that was launched: what the control plane stores to find it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunningVm {
    /// The backend that launched it.
    pub backend: BackendKind,
    /// Tenant name (validated).
    pub tenant: String,
    /// Host pid of the jail launcher, whose exit status is the VMM's exit status.
    pub pid: i32,
    /// Field 22 of /proc/PID/stat at launch: together with `pid` it identifies the
    /// process, so a recycled pid is never mistaken for the VM.
    pub start_time_ticks: u64,
    /// Host path of the VMM's control socket (tenantvm-vmm) or QMP socket (QEMU).
    pub api_sock: PathBuf,
    /// The tenant's directory.
    pub tenant_dir: PathBuf,
    /// The tenant's cgroup(s).
    pub cgroup: CgroupHandle,
    /// The uid the VMM runs as.
    pub uid: u32,
    /// The guest's vsock context id when the agent's channel is vhost-vsock (QEMU on a host
    /// with `/dev/vhost-vsock`); absent otherwise and in records from before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_cid: Option<u32>,
}

/// What a VM is doing now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum VmState {
    /// The guest runs.
    Running,
    /// The vCPUs are paused.
    Paused,
    /// The VMM exited; its status is known.
    Exited {
        /// Why it exited.
        status: ExitReason,
    },
    /// No process and no recorded exit status: the VM is gone (e.g. the host rebooted).
    Gone,
}

/// Why a VMM process ended, decoded from its exit status (see docs/vmm.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "reason")]
pub enum ExitReason {
    /// The guest powered off cleanly (status 0).
    PowerOff,
    /// VMM runtime error (status 1).
    VmmError,
    /// Usage or config error (status 2).
    ConfigError,
    /// The guest asked for a reset (status 3).
    Reset,
    /// Triple fault (status 4).
    TripleFault,
    /// The guest reported a crash through pvpanic (status 5).
    GuestPanic,
    /// Stopped on request through the control socket or QMP (status 6).
    Stopped,
    /// KVM could not run the guest (status 7).
    GuestRunFailure,
    /// The VM could not start (statuses 10..=19: kernel, initramfs, memory, vCPUs, socket,
    /// /dev/kvm, serial file, disk, vsock socket); `code` says which.
    StartFailure {
        /// The exit status.
        code: i32,
    },
    /// A VMM thread made a system call outside its seccomp filter (status 20): either a
    /// path the filters do not know yet or a compromised VMM; vmm.log names the call.
    SeccompViolation,
    /// The jail could not be set up (status 120 of the jail launcher; details in vmm.log).
    JailFailure,
    /// QEMU exited with status 0 on its own: the guest powered off, or QEMU was told to quit
    /// (a quit command, or a terminating signal such as SIGTERM or SIGHUP: QEMU exits 0 on
    /// both), and QEMU does not say which.
    QemuExitedZero,
    /// Any other exit status.
    OtherStatus {
        /// The exit status.
        code: i32,
    },
    /// Killed by a signal (SIGKILL on `kill`, the OOM killer, ...).
    Signaled {
        /// The signal number.
        signal: i32,
    },
}

/// Errors of a backend operation.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The spec cannot be run as given.
    #[error("Invalid VM spec: {0}")]
    InvalidSpec(String),
    /// A program the backend runs is not there.
    #[error("Cannot find {what} at {path}: install it or set its path in the daemon config")]
    MissingBinary {
        /// Which program.
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// Setting up the jail or cgroup failed.
    #[error("Jail setup failed")]
    Jail(#[from] JailError),
    /// Starting the jail launcher failed.
    #[error("Cannot start {what}")]
    Spawn {
        /// Which program.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The VMM's control socket or QMP could not be reached in time, or is served by
    /// another uid.
    #[error(transparent)]
    Socket(#[from] PeerSocketError),
    /// The VMM's control socket or QMP did not answer as expected.
    #[error("Control socket {path}: {message}")]
    Control {
        /// The socket.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The tenant already has processes in its cgroup (a VM runs).
    #[error("Tenant {tenant} already has running processes {pids:?}: stop or kill its VM before launching another")]
    AlreadyRunning {
        /// The tenant.
        tenant: String,
        /// The processes in its cgroup.
        pids: Vec<i32>,
    },
    /// The VM ended while starting.
    #[error("The VM ended while starting ({reason:?}); last lines of vmm.log:\n{log_tail}")]
    LaunchFailed {
        /// How it ended.
        reason: ExitReason,
        /// The end of vmm.log.
        log_tail: String,
    },
    /// The VM did not answer on its socket in time (it was killed).
    #[error("The VM did not answer on its control socket within {timeout:?} and was killed (on a loaded host, raise tenantvmd --launch-timeout-s); last lines of vmm.log:\n{log_tail}")]
    NotReady {
        /// The wait.
        timeout: Duration,
        /// The end of vmm.log.
        log_tail: String,
    },
    /// The VM already exited.
    #[error("The VM is not running (it exited: {0:?})")]
    NotRunning(ExitReason),
    /// The VMM's report directory could not be kept under its cap.
    #[error(transparent)]
    ReportDir(#[from] report_dir::ReportDirError),
    /// A file in the tenant directory could not be read or written.
    #[error("Cannot access {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl BackendError {
    /// Whether the VMM did not answer before the deadline (wedged, stopped, or too slow):
    /// asking it anything more only wastes time; stop kills it instead.
    pub fn is_unresponsive(&self) -> bool {
        matches!(self, BackendError::Socket(PeerSocketError::Timeout { .. }))
    }

    /// Whether the VM could not start because its vsock CID is held by another VM on the
    /// host (QEMU: "vhost-vsock: unable to set guest cid: Address already in use"): the
    /// caller picks another CID and launches again.
    pub fn is_vsock_cid_in_use(&self) -> bool {
        match self {
            BackendError::LaunchFailed { log_tail, .. } => log_tail.lines().any(|l| {
                l.contains("vhost-vsock") && l.contains("guest cid") && l.contains("in use")
            }),
            _ => false,
        }
    }
}

/// Runs VMs. Implementations are cheap to share between the daemon's tasks; every method
/// blocks (call it from `spawn_blocking`), and each one ends in bounded time whatever the
/// VM's process does.
pub trait VmBackend: Send + Sync {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;
    /// Creates the tenant's cgroup with `jail.limits`, builds the jail, and starts the VMM in
    /// it. Returns once the process runs (the guest may still be booting).
    fn launch(&self, spec: &VmSpec, jail: &JailConfig) -> Result<RunningVm, BackendError>;
    /// Asks the VMM (control socket / QMP) after checking the process is still the one launched.
    fn state(&self, vm: &RunningVm) -> Result<VmState, BackendError>;
    /// Whether the VM's process has ended, from the process table and the jail's exit
    /// record only: no socket I/O, so it returns at once whatever the VMM does. `None`
    /// while the process (the one launched) lives; otherwise how it ended
    /// ([`VmState::Exited`] or [`VmState::Gone`]).
    fn ended(&self, vm: &RunningVm) -> Result<Option<VmState>, BackendError>;
    /// Stops the VM gracefully (control socket `shutdown` / QMP `system_powerdown` then
    /// `quit`), waiting up to `grace`, then kills it. A VMM that does not answer within
    /// the control timeout is killed at once. Returns how it ended.
    fn stop(&self, vm: &RunningVm, grace: Duration) -> Result<ExitReason, BackendError>;
    /// Kills every process of the VM (SIGKILL to the whole cgroup). Idempotent.
    fn kill(&self, vm: &RunningVm) -> Result<(), BackendError>;
    /// What the VMM reported about its passed-through devices as it ended (their resets),
    /// once it has ended; `None` when the backend's VMM writes no such report (QEMU) or
    /// wrote none (killed by SIGKILL). The report comes from a process the tenant may
    /// control: it is size-capped and parsed strictly.
    fn exit_report(&self, _vm: &RunningVm) -> Result<Option<ExitReport>, BackendError> {
        Ok(None)
    }
    /// The disk counters of a running VM (all its disks together), asked of its VMM
    /// within `timeout`; `None` when the VMM has no disk or reports no counters.
    fn disk_counters(
        &self,
        _vm: &RunningVm,
        _timeout: Duration,
    ) -> Result<Option<DiskCounters>, BackendError> {
        Ok(None)
    }
    /// Where the host reaches the guest agent's channel of `vm` (every VM gets one; a
    /// guest without the agent leaves it unanswered). Connect with
    /// [`AgentClient::connect_checked`](tenantvm_agent_protocol::AgentClient::connect_checked), which checks that the tenant's uid serves it.
    fn agent_endpoint(&self, vm: &RunningVm) -> AgentEndpoint;
    /// How this backend carries the guest agent's channel, for people (health, `show`):
    /// `virtio-serial`, `hybrid-vsock` or `vhost-vsock`.
    fn agent_transport(&self) -> &'static str;
    /// Whether a [`VmSpec`] for this backend must carry a vsock CID (`VmSpec::vsock_cid`):
    /// QEMU on a host with `/dev/vhost-vsock`.
    fn needs_vsock_cid(&self) -> bool {
        false
    }
}

impl ExitReason {
    /// Decodes how a `tenantvm-vmm` jail ended (the VMM's [`ExitStatus`], or the jail
    /// launcher's own failure status).
    pub fn from_vmm(record: ExitRecord) -> Self {
        let code = match record {
            ExitRecord::Signal(signal) => return ExitReason::Signaled { signal },
            ExitRecord::Code(code) => code,
        };
        match ExitStatus::from_code(code) {
            Some(ExitStatus::PowerOff) => ExitReason::PowerOff,
            Some(ExitStatus::VmmError) => ExitReason::VmmError,
            Some(ExitStatus::ConfigError) => ExitReason::ConfigError,
            Some(ExitStatus::Reset) => ExitReason::Reset,
            Some(ExitStatus::TripleFault) => ExitReason::TripleFault,
            Some(ExitStatus::GuestPanic) => ExitReason::GuestPanic,
            Some(ExitStatus::Stopped) => ExitReason::Stopped,
            Some(ExitStatus::GuestUnrunnable) => ExitReason::GuestRunFailure,
            Some(ExitStatus::SeccompViolation) => ExitReason::SeccompViolation,
            Some(status) if status.is_start_failure() => ExitReason::StartFailure { code },
            _ if code == crate::jail::process::JAIL_SETUP_FAILED => ExitReason::JailFailure,
            _ => ExitReason::OtherStatus { code },
        }
    }

    /// Decodes how a QEMU jail ended. QEMU exits 0 when the guest powers off, on `quit` and
    /// on a terminating signal alike (the backend's `stop` reports [`ExitReason::Stopped`]
    /// itself; any other status 0 is [`ExitReason::QemuExitedZero`]), and 1 on errors.
    pub fn from_qemu(record: ExitRecord) -> Self {
        match record {
            ExitRecord::Signal(signal) => ExitReason::Signaled { signal },
            ExitRecord::Code(0) => ExitReason::QemuExitedZero,
            ExitRecord::Code(1) => ExitReason::VmmError,
            ExitRecord::Code(crate::jail::process::JAIL_SETUP_FAILED) => ExitReason::JailFailure,
            ExitRecord::Code(code) => ExitReason::OtherStatus { code },
        }
    }

    /// A one-line description for people.
    pub fn describe(&self) -> String {
        match self {
            ExitReason::PowerOff => "the guest powered off".into(),
            ExitReason::VmmError => "VMM runtime error (see vmm.log)".into(),
            ExitReason::ConfigError => "VMM usage or config error (see vmm.log)".into(),
            ExitReason::Reset => "the guest asked for a reset".into(),
            ExitReason::TripleFault => "the guest triple-faulted".into(),
            ExitReason::GuestPanic => "the guest reported a crash".into(),
            ExitReason::Stopped => "stopped on request".into(),
            ExitReason::GuestRunFailure => "KVM could not run the guest".into(),
            ExitReason::StartFailure { code } => format!(
                "the VM could not start: {}",
                ExitStatus::from_code(*code)
                    .map_or("unknown start failure", ExitStatus::description)
            ),
            ExitReason::SeccompViolation => {
                "a VMM thread made a system call its seccomp filter refuses (see vmm.log)".into()
            }
            ExitReason::JailFailure => "the jail could not be set up (see vmm.log)".into(),
            ExitReason::QemuExitedZero => "QEMU exited with status 0: the guest powered off, or QEMU was told to quit (a quit command, or a signal such as SIGTERM or SIGHUP); QEMU does not say which".into(),
            ExitReason::OtherStatus { code } => format!("exited with status {code}"),
            ExitReason::Signaled { signal } => format!("killed by signal {signal}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmm_statuses_map_to_reasons() {
        let cases = [
            (0, ExitReason::PowerOff),
            (1, ExitReason::VmmError),
            (2, ExitReason::ConfigError),
            (3, ExitReason::Reset),
            (4, ExitReason::TripleFault),
            (5, ExitReason::GuestPanic),
            (6, ExitReason::Stopped),
            (7, ExitReason::GuestRunFailure),
            (10, ExitReason::StartFailure { code: 10 }),
            (17, ExitReason::StartFailure { code: 17 }),
            (19, ExitReason::StartFailure { code: 19 }),
            (20, ExitReason::SeccompViolation),
            (120, ExitReason::JailFailure),
            (42, ExitReason::OtherStatus { code: 42 }),
        ];
        for (code, reason) in cases {
            assert_eq!(
                ExitReason::from_vmm(ExitRecord::Code(code)),
                reason,
                "status {code}"
            );
        }
        assert_eq!(
            ExitReason::from_vmm(ExitRecord::Signal(9)),
            ExitReason::Signaled { signal: 9 }
        );
    }

    #[test]
    fn every_status_of_the_vmm_contract_decodes_and_describes_itself() {
        for status in ExitStatus::ALL {
            let reason = ExitReason::from_vmm(ExitRecord::Code(status.code().into()));
            assert!(
                !matches!(
                    reason,
                    ExitReason::OtherStatus { .. } | ExitReason::JailFailure
                ),
                "{status:?} decodes to {reason:?}"
            );
            if status.is_start_failure() {
                assert!(
                    reason.describe().contains(status.description()),
                    "{}",
                    reason.describe()
                );
            }
        }
    }

    #[test]
    fn qemu_statuses_map_to_reasons() {
        // Status 0 is a power-off or a quit (a command, a SIGHUP): never claimed to be
        // the guest's power-off.
        let zero = ExitReason::from_qemu(ExitRecord::Code(0));
        assert_eq!(zero, ExitReason::QemuExitedZero);
        assert!(
            !zero.describe().starts_with("the guest powered off"),
            "{}",
            zero.describe()
        );
        assert_eq!(
            ExitReason::from_qemu(ExitRecord::Code(1)),
            ExitReason::VmmError
        );
        assert_eq!(
            ExitReason::from_qemu(ExitRecord::Code(120)),
            ExitReason::JailFailure
        );
        assert_eq!(
            ExitReason::from_qemu(ExitRecord::Signal(15)),
            ExitReason::Signaled { signal: 15 }
        );
    }

    #[test]
    fn running_vm_round_trips_through_json() {
        let vm = RunningVm {
            vsock_cid: None,
            backend: BackendKind::Qemu {
                accel: QemuAccel::Tcg,
            },
            tenant: "t".into(),
            pid: 42,
            start_time_ticks: 7,
            api_sock: "/x/t/run/qmp.sock".into(),
            tenant_dir: "/x/t".into(),
            cgroup: CgroupHandle::V2 {
                path: "/sys/fs/cgroup/tenantvm/t".into(),
            },
            uid: 1000,
        };
        let json = serde_json::to_string(&vm).unwrap();
        assert_eq!(serde_json::from_str::<RunningVm>(&json).unwrap(), vm);
        serde_json::from_str::<RunningVm>(&json.replace("\"uid\"", "\"bogus\":1,\"uid\""))
            .unwrap_err();
    }
}
