//! The QEMU backend: `qemu-system-x86_64` with `-accel kvm` or `-accel tcg`, jailed like
//! `tenantvm-vmm`, serial console appended to serial.log, QMP on a Unix socket for state
//! and a graceful stop (`system_powerdown`, then `quit`). The command line is the
//! contract's [`QemuCommand`]; the guest agent is reached over vhost-vsock (`AF_VSOCK` to
//! the VM's CID, one connection per request) where the host has `/dev/vhost-vsock`, else
//! over a virtio-serial port.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;
use tenantvm_agent_protocol::AgentEndpoint;
use tenantvm_agent_protocol::VIRTIO_SERIAL_PORT_NAME;
use tenantvm_vmm_api::{QemuAccel, QemuCommand, SerialPort, VhostVsock};

use super::control::JsonLines;
use super::runner::{
    self, Prepared, Runner, RuntimeConfig, StopRequest, VmmDriver, JAIL_SERIAL_LOG, JAIL_VM_DIR,
    RUN_DIR,
};
use super::{
    BackendError, BackendKind, ExitReason, JailConfig, PassthroughDevice, RunningVm, VmSpec,
    VmState,
};
use crate::jail::{ExitRecord, JailPlan};

/// Name of the QMP socket in the tenant's `run/` directory.
pub const QMP_SOCK: &str = "qmp.sock";
/// Name of the guest agent's channel socket in the tenant's `run/` directory.
pub const AGENT_SOCK: &str = "agent.sock";
/// The host kernel's vhost-vsock device: QEMU opens it for `-device vhost-vsock-pci`.
pub const VHOST_VSOCK_DEV: &str = "/dev/vhost-vsock";
/// Host directories QEMU reads firmware (SeaBIOS, option ROMs such as pvh.bin and
/// linuxboot_dma.bin) and modules (accel-tcg) from; mounted read-only where they exist.
const QEMU_DATA_DIRS: [&str; 3] = [
    "/usr/share/qemu",
    "/usr/share/seabios",
    "/usr/lib/x86_64-linux-gnu/qemu",
];

/// Runs VMs with QEMU.
pub type QemuBackend = Runner<Qemu>;

/// The QEMU driver.
#[derive(Debug, Clone)]
pub struct Qemu {
    binary: PathBuf,
    accel: QemuAccel,
    transport: AgentTransport,
}

/// How a QEMU VM's agent channel is carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentTransport {
    /// `-device vhost-vsock-pci,guest-cid=N`: one `AF_VSOCK` connection per request
    /// (concurrent requests, streamed answers, model push).
    VhostVsock,
    /// One virtio-serial port (`org.tenantvm.agent.0`) behind a Unix socket.
    VirtioSerial,
}

impl AgentTransport {
    /// vhost-vsock where `device` (normally [`VHOST_VSOCK_DEV`]) opens for reading and
    /// writing (the `vhost_vsock` module loaded, the node present), else virtio-serial,
    /// with the reason it was not vhost-vsock.
    pub fn detect(device: &Path) -> (Self, Option<String>) {
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(device)
        {
            Ok(_) => (Self::VhostVsock, None),
            Err(e) => (
                Self::VirtioSerial,
                Some(format!(
                    "{} cannot be opened ({e}); load the vhost_vsock module for concurrent agent connections",
                    device.display()
                )),
            ),
        }
    }

    /// `vhost-vsock` or `virtio-serial`.
    pub fn name(self) -> &'static str {
        match self {
            Self::VhostVsock => "vhost-vsock",
            Self::VirtioSerial => "virtio-serial",
        }
    }
}

impl Runner<Qemu> {
    /// A backend running `qemu_binary` (usually /usr/bin/qemu-system-x86_64) with `accel`,
    /// reaching guest agents over `transport` ([`AgentTransport::detect`] decides it for a
    /// host).
    pub fn new(
        qemu_binary: PathBuf,
        accel: QemuAccel,
        transport: AgentTransport,
        config: RuntimeConfig,
    ) -> Self {
        Runner::with_driver(
            Qemu {
                binary: qemu_binary,
                accel,
                transport,
            },
            config,
        )
    }
}

impl Qemu {
    /// The QEMU command for `spec`, with paths as seen inside the jail. A spec with a vsock
    /// CID gets a vhost-vsock device as the agent's channel and no virtio-serial port.
    pub fn command(spec: &VmSpec, accel: QemuAccel) -> QemuCommand {
        let vm = Path::new(JAIL_VM_DIR);
        let run = Path::new("/run");
        QemuCommand {
            name: spec.tenant.clone(),
            accel,
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib.into(),
            kernel: vm.join("kernel"),
            initramfs: spec.initramfs.as_ref().map(|_| vm.join("initramfs")),
            cmdline: spec.cmdline.clone(),
            serial_log: JAIL_SERIAL_LOG.into(),
            // Created before the QMP socket, whose appearance seals /run read-only.
            agent_port: spec.vsock_cid.is_none().then(|| SerialPort {
                socket: run.join(AGENT_SOCK),
                name: VIRTIO_SERIAL_PORT_NAME.into(),
            }),
            vhost_vsock: spec.vsock_cid.map(|guest_cid| VhostVsock { guest_cid }),
            qmp_socket: Some(run.join(QMP_SOCK)),
            disks: runner::jail_disks(spec),
            hugepages: spec.hugepages,
        }
    }

    /// QEMU's arguments for `spec`: [`Qemu::command`]'s, then each passthrough device
    /// (`-device vfio-pci,host=DDDD:BB:DD.F`, or `sysfsdev=/sys/bus/mdev/devices/UUID` for
    /// an mdev) and the VM's `-uuid` (which NVIDIA's vGPU manager reads from the command
    /// line).
    pub fn args(spec: &VmSpec, accel: QemuAccel) -> Result<Vec<String>, BackendError> {
        runner::check_devices(spec)?;
        let mut args = Self::command(spec, accel)
            .args()
            .into_iter()
            .map(|a| {
                a.into_string().map_err(|a| {
                    BackendError::InvalidSpec(format!("QEMU argument {a:?} is not UTF-8"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        for (i, device) in spec.devices.iter().enumerate() {
            // Addresses and UUIDs are checked: neither can hold a comma.
            let source = match device {
                PassthroughDevice::Pci { address, .. } => format!("host={address}"),
                PassthroughDevice::Mdev { .. } => {
                    format!("sysfsdev={}", device.sysfs_path().display())
                }
            };
            args.push("-device".into());
            args.push(format!("vfio-pci,{source},id=hostdev{i}"));
        }
        if let Some(uuid) = spec.uuid {
            args.push("-uuid".into());
            args.push(uuid.to_string());
        }
        Ok(args)
    }

    /// Opens a QMP session (served by `uid`; greeting read, capabilities negotiated), all
    /// within `timeout` together with whatever is asked on it.
    fn qmp(sock: &Path, uid: u32, timeout: Duration) -> Result<JsonLines, BackendError> {
        let mut conn = JsonLines::connect(sock, timeout, uid)?;
        let greeting = conn.receive()?;
        if greeting.get("QMP").is_none() {
            return Err(BackendError::Control {
                path: sock.to_path_buf(),
                message: "no QMP greeting".into(),
            });
        }
        execute(&mut conn, "qmp_capabilities")?;
        Ok(conn)
    }
}

/// Runs one QMP command and returns its `return` value, skipping asynchronous events.
fn execute(conn: &mut JsonLines, command: &str) -> Result<serde_json::Value, BackendError> {
    conn.send(&json!({ "execute": command }))?;
    // Events may arrive before the answer; a hostile or broken peer cannot keep us here
    // (the session has a deadline, and the count is bounded).
    for _ in 0..64 {
        let answer = conn.receive()?;
        if let Some(ret) = answer.get("return") {
            return Ok(ret.clone());
        }
        if let Some(err) = answer.get("error") {
            let message = err["desc"].as_str().unwrap_or("QMP error").to_string();
            return Err(BackendError::Control {
                path: conn.path().to_path_buf(),
                message: format!("{command}: {}", crate::logs::sanitize(&message)),
            });
        }
    }
    Err(BackendError::Control {
        path: conn.path().to_path_buf(),
        message: format!("{command}: no answer among 64 messages"),
    })
}

/// Half the grace period for the guest to power off through ACPI, then QEMU is told to
/// quit (its status 0 then reads as [`ExitReason::Stopped`]).
const STOP: &[StopRequest] = &[
    StopRequest {
        name: "system_powerdown",
        grace_percent: 50,
        clean_exit: None,
    },
    StopRequest {
        name: "quit",
        grace_percent: 50,
        clean_exit: Some(ExitReason::Stopped),
    },
];

impl VmmDriver for Qemu {
    fn kind(&self) -> BackendKind {
        BackendKind::Qemu { accel: self.accel }
    }

    fn program(&self) -> (&'static str, &Path) {
        ("qemu-system-x86_64", &self.binary)
    }

    fn control_socket(&self) -> &'static str {
        QMP_SOCK
    }

    fn last_socket(&self) -> &'static str {
        QMP_SOCK
    }

    fn plan(
        &self,
        spec: &VmSpec,
        jail: &JailConfig,
        prepared: &Prepared,
    ) -> Result<JailPlan, BackendError> {
        let args = Self::args(spec, self.accel)?;
        // Debian's QEMU (7.2) has no iommufd backend: the legacy nodes.
        let mut plan = runner::base_plan(
            spec,
            jail,
            prepared,
            &self.binary,
            args,
            super::vfio_nodes::VfioInterface::Legacy,
        )?;
        if self.accel == QemuAccel::Kvm {
            plan.device(Path::new("/dev/kvm"))?;
        }
        if spec.vsock_cid.is_some() {
            // QEMU opens the node itself; the jail gets it (tenant-owned, 0600) and the
            // cgroup's device allowance lists it.
            plan.device(Path::new(VHOST_VSOCK_DEV))?;
        }
        for dir in QEMU_DATA_DIRS {
            let dir = Path::new(dir);
            if dir.is_dir() {
                plan.bind(dir, dir, false)?;
            }
        }
        // QEMU's modules (accel-tcg-x86_64.so) are dlopen()ed: mount their libraries too.
        let modules = Path::new("/usr/lib/x86_64-linux-gnu/qemu");
        if let Ok(entries) = std::fs::read_dir(modules) {
            for entry in entries.flatten() {
                let name = entry.file_name();
                if name.to_string_lossy().starts_with("accel-") {
                    for lib in crate::jail::plan::shared_libraries(&entry.path())? {
                        plan.bind(&lib, &lib, false)?;
                    }
                }
            }
        }
        Ok(plan)
    }

    fn decode_exit(&self, record: ExitRecord) -> ExitReason {
        ExitReason::from_qemu(record)
    }

    fn query(&self, vm: &RunningVm, timeout: Duration) -> Result<VmState, BackendError> {
        let status = Self::qmp(&vm.api_sock, vm.uid, timeout)
            .and_then(|mut c| execute(&mut c, "query-status"))?;
        match status["status"].as_str() {
            Some("running") => Ok(VmState::Running),
            Some("paused") | Some("suspended") => Ok(VmState::Paused),
            // prelaunch, inmigrate, shutdown, ... are transitional here.
            Some(_) => Ok(VmState::Running),
            None => Err(BackendError::Control {
                path: vm.api_sock.clone(),
                message: "query-status without status".into(),
            }),
        }
    }

    fn stop_requests(&self) -> &'static [StopRequest] {
        STOP
    }

    fn request_stop(
        &self,
        vm: &RunningVm,
        request: &StopRequest,
        timeout: Duration,
    ) -> Result<(), BackendError> {
        let mut conn = Self::qmp(&vm.api_sock, vm.uid, timeout)?;
        execute(&mut conn, request.name).map(|_| ())
    }

    fn agent_endpoint(&self, vm: &RunningVm) -> AgentEndpoint {
        match vm.vsock_cid {
            Some(cid) => AgentEndpoint::vhost_vsock(cid),
            None => AgentEndpoint::Serial(vm.tenant_dir.join(RUN_DIR).join(AGENT_SOCK)),
        }
    }

    fn agent_transport(&self) -> &'static str {
        self.transport.name()
    }

    fn needs_vsock_cid(&self) -> bool {
        self.transport == AgentTransport::VhostVsock
    }

    fn disk_counters(
        &self,
        vm: &RunningVm,
        timeout: Duration,
    ) -> Result<Option<super::DiskCounters>, BackendError> {
        let stats = Self::qmp(&vm.api_sock, vm.uid, timeout)
            .and_then(|mut c| execute(&mut c, "query-blockstats"))?;
        super::disk_stats::from_qmp(&stats).map_err(|e| BackendError::Control {
            path: vm.api_sock.clone(),
            message: format!("query-blockstats: {}", crate::logs::sanitize(&e)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DiskAttachment;

    #[test]
    fn the_command_uses_jail_paths_the_agent_port_and_the_disks() {
        let spec = VmSpec {
            vsock_cid: None,
            tenant: "t".into(),
            kernel: "/host/k".into(),
            initramfs: None,
            cmdline: "console=ttyS0".into(),
            vcpus: 2,
            memory_mib: 256,
            disks: vec![DiskAttachment {
                path: "/host/d".into(),
                read_only: true,
                limit: Some(crate::backend::DiskRateLimit {
                    bytes_per_s: 1 << 20,
                    ops_per_s: 50,
                }),
            }],
            tenant_dir: "/var/lib/tenantvm/tenants/t".into(),
            devices: vec![],
            uuid: None,
            hugepages: None,
        };
        let command = Qemu::command(&spec, QemuAccel::Tcg);
        assert_eq!(command.kernel, PathBuf::from("/vm/kernel"));
        assert_eq!(command.serial_log, PathBuf::from("/log/serial.log"));
        assert_eq!(command.qmp_socket, Some(PathBuf::from("/run/qmp.sock")));
        let port = command.agent_port.clone().unwrap();
        assert_eq!(port.socket, PathBuf::from("/run/agent.sock"));
        assert_eq!(port.name, "org.tenantvm.agent.0");
        assert_eq!(command.disks, runner::jail_disks(&spec));
        let args = command
            .args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            args.contains("-accel tcg,tb-size=64 -cpu max -smp 2 -m 256M"),
            "{args}"
        );
        assert!(
            args.contains("throttling.bps-total=1048576,throttling.iops-total=50"),
            "{args}"
        );
        assert!(!args.contains("/host/"), "{args}");
        assert!(!args.contains("/var/lib"), "{args}");
    }

    #[test]
    fn the_vms_huge_pages_back_its_ram() {
        let spec = VmSpec {
            hugepages: Some(tenantvm_vmm_api::HugePages::Size1G),
            memory_mib: 2048,
            ..vsock_spec(None)
        };
        let args = Qemu::args(&spec, QemuAccel::Kvm).unwrap().join(" ");
        assert!(
            args.contains("memory-backend-memfd,id=ram0,size=2048M,hugetlb=on,hugetlbsize=1G"),
            "{args}"
        );
    }

    #[test]
    fn passthrough_devices_and_the_uuid_reach_the_command_line() {
        let spec = VmSpec {
            vsock_cid: None,
            tenant: "t".into(),
            kernel: "/host/k".into(),
            initramfs: None,
            cmdline: "console=ttyS0".into(),
            vcpus: 1,
            memory_mib: 256,
            disks: vec![],
            tenant_dir: "/var/lib/tenantvm/tenants/t".into(),
            devices: vec![
                PassthroughDevice::Pci {
                    address: "0000:41:00.0".into(),
                    iommu_group: 17,
                },
                PassthroughDevice::Mdev {
                    uuid: "aa2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b".into(),
                    iommu_group: 40,
                },
            ],
            uuid: Some("5c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b".parse().unwrap()),
            hugepages: None,
        };
        let args = Qemu::args(&spec, QemuAccel::Kvm).unwrap().join(" ");
        for part in [
            "-device vfio-pci,host=0000:41:00.0,id=hostdev0",
            "-device vfio-pci,sysfsdev=/sys/bus/mdev/devices/aa2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b,id=hostdev1",
            "-uuid 5c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b",
        ] {
            assert!(args.contains(part), "{part:?} missing from {args}");
        }
        let plain = VmSpec {
            devices: vec![],
            uuid: None,
            ..spec.clone()
        };
        let args = Qemu::args(&plain, QemuAccel::Kvm).unwrap().join(" ");
        assert!(!args.contains("vfio") && !args.contains("-uuid"), "{args}");
        let bad = VmSpec {
            devices: vec![PassthroughDevice::Mdev {
                uuid: "x,sysfsdev=/etc".into(),
                iommu_group: 1,
            }],
            ..spec
        };
        assert!(matches!(
            Qemu::args(&bad, QemuAccel::Kvm),
            Err(BackendError::InvalidSpec(_))
        ));
    }

    fn vsock_spec(cid: Option<u32>) -> VmSpec {
        VmSpec {
            vsock_cid: cid,
            tenant: "t".into(),
            kernel: "/host/k".into(),
            initramfs: None,
            cmdline: "console=ttyS0".into(),
            vcpus: 1,
            memory_mib: 256,
            disks: vec![],
            tenant_dir: "/var/lib/tenantvm/tenants/t".into(),
            devices: vec![],
            uuid: None,
            hugepages: None,
        }
    }

    #[test]
    fn a_vsock_cid_replaces_the_serial_port_with_vhost_vsock() {
        let args = Qemu::args(&vsock_spec(Some(9)), QemuAccel::Kvm)
            .unwrap()
            .join(" ");
        assert!(
            args.contains("-device vhost-vsock-pci,id=vsock0,guest-cid=9"),
            "{args}"
        );
        assert!(!args.contains("virtio-serial"), "{args}");
        assert!(!args.contains("agent.sock"), "{args}");
        let serial = Qemu::args(&vsock_spec(None), QemuAccel::Kvm)
            .unwrap()
            .join(" ");
        assert!(serial.contains("virtserialport"), "{serial}");
        assert!(!serial.contains("vhost-vsock"), "{serial}");
    }

    #[test]
    fn the_agent_is_reached_where_the_vm_was_launched_to_listen() {
        let vm = |cid| RunningVm {
            vsock_cid: cid,
            backend: BackendKind::Qemu {
                accel: QemuAccel::Kvm,
            },
            tenant: "t".into(),
            pid: 1,
            start_time_ticks: 0,
            api_sock: "/t/run/qmp.sock".into(),
            tenant_dir: "/t".into(),
            cgroup: crate::jail::CgroupHandle::V2 {
                path: "/nonexistent".into(),
            },
            uid: 1000,
        };
        let driver = |transport| Qemu {
            binary: "/usr/bin/qemu-system-x86_64".into(),
            accel: QemuAccel::Kvm,
            transport,
        };
        // Whatever the daemon's transport now, a VM launched with a CID is reached there
        // and one launched without it (adopted from before) on its serial port.
        for transport in [AgentTransport::VhostVsock, AgentTransport::VirtioSerial] {
            let d = driver(transport);
            assert_eq!(
                d.agent_endpoint(&vm(Some(5))),
                AgentEndpoint::vhost_vsock(5)
            );
            assert_eq!(
                d.agent_endpoint(&vm(None)),
                AgentEndpoint::Serial("/t/run/agent.sock".into())
            );
        }
        assert!(driver(AgentTransport::VhostVsock).needs_vsock_cid());
        assert!(!driver(AgentTransport::VirtioSerial).needs_vsock_cid());
        assert_eq!(
            driver(AgentTransport::VhostVsock).agent_transport(),
            "vhost-vsock"
        );
    }

    #[test]
    fn detection_opens_the_device_and_says_why_not() {
        let dir = tempfile::tempdir().unwrap();
        let (t, why) = AgentTransport::detect(&dir.path().join("vhost-vsock"));
        assert_eq!(t, AgentTransport::VirtioSerial);
        let why = why.unwrap();
        assert!(
            why.contains("vhost_vsock") && why.contains("cannot be opened"),
            "{why}"
        );
        // Anything that opens read-write counts (the real check is the open itself).
        let node = dir.path().join("node");
        std::fs::write(&node, b"").unwrap();
        assert_eq!(
            AgentTransport::detect(&node),
            (AgentTransport::VhostVsock, None)
        );
    }

    #[test]
    fn a_cid_in_use_on_the_host_is_recognised_in_the_launch_failure() {
        let failed = |tail: &str| BackendError::LaunchFailed {
            reason: ExitReason::VmmError,
            log_tail: tail.into(),
        };
        assert!(failed("qemu-system-x86_64: -device vhost-vsock-pci,id=vsock0,guest-cid=3: vhost-vsock: unable to set guest cid: Address already in use").is_vsock_cid_in_use());
        assert!(!failed("qemu-system-x86_64: -device vhost-vsock-pci,id=vsock0,guest-cid=3: vhost-vsock: failed to open vhost device: Permission denied").is_vsock_cid_in_use());
        assert!(!BackendError::InvalidSpec("guest cid in use".into()).is_vsock_cid_in_use());
    }
}
