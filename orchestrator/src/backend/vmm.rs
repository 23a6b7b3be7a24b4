//! The `tenantvm-vmm` backend: one `tenantvm-vmm` process per VM, jailed, described by a
//! config file the backend writes (the contract's [`VmConfigFile`]) and driven through its
//! control socket (docs/vmm.md). The guest agent is reached over the VM's vsock device.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tenantvm_agent_protocol::AgentEndpoint;
use tenantvm_vmm_api::{
    ExitReport, PassthroughConfig, SeccompMode, SerialConfig, VmCommand, VmConfigFile, VmResponse,
    VsockConfig,
};

use super::control::JsonLines;
use super::report_dir::{self, MAX_REPORT_ENTRIES};
use super::runner::{
    self, Prepared, Runner, RuntimeConfig, StopRequest, VmmDriver, JAIL_SERIAL_LOG, JAIL_VM_DIR,
    RUN_DIR,
};
use super::vfio_nodes::{self, VfioInterface};
use super::{
    BackendError, BackendKind, ExitReason, JailConfig, PassthroughDevice, RunningVm, VmSpec,
    VmState,
};
use crate::jail::{ExitRecord, JailPlan};

/// Name of the control socket in the tenant's `run/` directory.
pub const API_SOCK: &str = "api.sock";
/// Name of the VM's vsock socket in the tenant's `run/` directory (created after the
/// control socket: its appearance seals `/run`).
pub const VSOCK_SOCK: &str = "vsock.sock";
/// The guest's vsock CID. Each VM has its own VMM and its own hybrid-vsock socket, so the
/// CID only has to be valid, not unique on the host.
pub const GUEST_CID: u64 = 3;
/// The config file the backend writes in the tenant directory (root-owned, readable by the
/// tenant's group), mounted read-only into the jail at [`JAIL_CONFIG`].
pub const CONFIG_FILE: &str = "vmm-config.json";
/// Where the VMM reads its config file inside the jail.
pub const JAIL_CONFIG: &str = "/vm/config.json";
/// The directory in the tenant directory (owned by the tenant uid, emptied at each launch)
/// where the VMM writes its exit report; mounted writable at [`JAIL_REPORT_DIR`].
pub const REPORT_DIR: &str = "report";
/// Where the report directory appears inside the jail.
pub const JAIL_REPORT_DIR: &str = "/report";
/// The exit report's file name in the report directory.
pub const EXIT_REPORT: &str = "exit.json";
/// The largest exit report read back (a report of [`tenantvm_vmm_api::MAX_PASSTHROUGH_DEVICES`]
/// devices is well under 4 KiB; the file is written by a process the tenant may control).
pub const MAX_EXIT_REPORT_BYTES: u64 = 64 << 10;

/// Runs VMs with `tenantvm-vmm`.
pub type VmmBackend = Runner<Vmm>;

/// The `tenantvm-vmm` driver.
#[derive(Debug, Clone)]
pub struct Vmm {
    binary: PathBuf,
}

impl Runner<Vmm> {
    /// A backend running `vmm_binary` (the default is `tenantvm-vmm` next to the daemon:
    /// [`runner::sibling_binary`]).
    pub fn new(vmm_binary: PathBuf, config: RuntimeConfig) -> Self {
        Runner::with_driver(Vmm { binary: vmm_binary }, config)
    }
}

impl Vmm {
    /// The VMM's config for `spec`, with paths as seen inside the jail: the guest files
    /// under /vm, serial.log, the control socket and the vsock device in /run, the
    /// passthrough devices at their sysfs paths (which the jail mounts) opened through
    /// `vfio` (the interface whose nodes the jail gets), the VM's UUID, and the exit report
    /// in /report. An mdev is refused: tenantvm-vmm passes PCI functions only.
    pub fn config_file(spec: &VmSpec, vfio: VfioInterface) -> Result<VmConfigFile, BackendError> {
        let vm = Path::new(JAIL_VM_DIR);
        let run = Path::new("/run");
        let disks = runner::jail_disks(spec);
        runner::check_devices(spec)?;
        let devices = spec
            .devices
            .iter()
            .map(|d| match d {
                PassthroughDevice::Pci { .. } => Ok(PassthroughConfig {
                    iommu: vfio.vmm_mode(),
                    ..PassthroughConfig::new(d.sysfs_path())
                }),
                PassthroughDevice::Mdev { uuid, .. } => Err(BackendError::InvalidSpec(format!(
                    "mdev {uuid}: tenantvm-vmm passes PCI functions only; run a tenant with an mdev vGPU (vGPU 16 and older) on the QEMU backend"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(VmConfigFile {
            kernel: Some(vm.join("kernel")),
            initramfs: spec.initramfs.as_ref().map(|_| vm.join("initramfs")),
            cmdline: Some(spec.cmdline.clone()),
            memory_mib: Some(spec.memory_mib.into()),
            vcpus: Some(spec.vcpus),
            serial: Some(SerialConfig::File(JAIL_SERIAL_LOG.into())),
            api_sock: Some(run.join(API_SOCK)),
            boot: None,
            disks: (!disks.is_empty()).then_some(disks),
            vsock: Some(VsockConfig {
                guest_cid: GUEST_CID,
                uds_path: run.join(VSOCK_SOCK),
            }),
            rng: Some(true),
            seccomp: Some(SeccompMode::On),
            devices: (!devices.is_empty()).then_some(devices),
            uuid: spec.uuid,
            exit_report: Some(Path::new(JAIL_REPORT_DIR).join(EXIT_REPORT)),
            hugepages: spec.hugepages,
        })
    }

    /// The VMM's argv: its config file, and the VM's UUID as a flag too. NVIDIA's vGPU
    /// manager ties a vGPU to its VM by the `-uuid` on the VMM's command line (it reads
    /// QEMU's; a UUID only inside the config file is invisible to it), so the flag is
    /// written in QEMU's spelling, which tenantvm-vmm takes as its `--uuid`.
    pub fn args(spec: &VmSpec) -> Vec<String> {
        let mut args = vec!["--config".to_string(), JAIL_CONFIG.to_string()];
        if let Some(uuid) = spec.uuid {
            args.extend(["-uuid".to_string(), uuid.to_string()]);
        }
        args
    }

    /// Empties (or creates) the report directory, owned by the tenant uid, mode 0700: no
    /// report of an earlier run is ever read as this one's.
    fn prepare_report_dir(spec: &VmSpec, jail: &JailConfig) -> Result<PathBuf, BackendError> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = spec.tenant_dir.join(REPORT_DIR);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| BackendError::Io { path, source }
        };
        match fs::symlink_metadata(&dir) {
            Ok(meta) if !meta.is_dir() => fs::remove_file(&dir).map_err(io(&dir))?,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(io(&dir)(source)),
        }
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(io(&dir)(source)),
        }
        for entry in fs::read_dir(&dir).map_err(io(&dir))? {
            let path = entry.map_err(io(&dir))?.path();
            if path.is_dir() && !path.is_symlink() {
                fs::remove_dir_all(&path).map_err(io(&path))?;
            } else {
                fs::remove_file(&path).map_err(io(&path))?;
            }
        }
        std::os::unix::fs::lchown(&dir, Some(jail.uid), Some(jail.gid)).map_err(io(&dir))?;
        Ok(dir)
    }

    /// Reads the exit report the VMM left in the tenant directory: `None` when there is
    /// none. Refused when it is not a regular file, is larger than
    /// [`MAX_EXIT_REPORT_BYTES`], or is not an [`ExitReport`].
    /// The report directory is capped first ([`report_dir`]).
    pub fn read_exit_report(tenant_dir: &Path) -> Result<Option<ExitReport>, BackendError> {
        use std::io::Read;
        report_dir::cap_entries(&tenant_dir.join(REPORT_DIR), MAX_REPORT_ENTRIES)?;
        let path = tenant_dir.join(REPORT_DIR).join(EXIT_REPORT);
        let io = |source| BackendError::Io {
            path: path.clone(),
            source,
        };
        let file = match fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(io(source)),
        };
        let meta = file.metadata().map_err(io)?;
        let bad = |why: String| BackendError::Control {
            path: path.clone(),
            message: format!("the VMM's exit report {why}"),
        };
        if !meta.is_file() {
            return Err(bad("is not a regular file".into()));
        }
        let mut text = String::new();
        file.take(MAX_EXIT_REPORT_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| bad(format!("cannot be read as UTF-8 text: {e}")))?;
        if text.len() as u64 > MAX_EXIT_REPORT_BYTES {
            return Err(bad(format!("is larger than {MAX_EXIT_REPORT_BYTES} bytes")));
        }
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| bad(format!("does not parse: {e}")))
    }

    /// Writes the config file of `spec` into the tenant directory, readable by the
    /// tenant's group only (the VMM runs as the tenant; root owns the file, so the VMM
    /// cannot change what a later launch reads).
    fn write_config(
        spec: &VmSpec,
        jail: &JailConfig,
        vfio: VfioInterface,
    ) -> Result<PathBuf, BackendError> {
        let path = spec.tenant_dir.join(CONFIG_FILE);
        let io = |source| BackendError::Io {
            path: path.clone(),
            source,
        };
        let text = Self::config_file(spec, vfio)?.to_json().map_err(|e| {
            BackendError::InvalidSpec(format!("the VM config cannot be written as JSON: {e}"))
        })?;
        let tmp = spec.tenant_dir.join(format!("{CONFIG_FILE}.tmp"));
        let _ = fs::remove_file(&tmp);
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o440)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(io)?;
        file.write_all(text.as_bytes()).map_err(io)?;
        file.sync_all().map_err(io)?;
        std::os::unix::fs::fchown(&file, Some(0), Some(jail.gid)).map_err(io)?;
        fs::rename(&tmp, &path).map_err(io)?;
        Ok(path)
    }

    fn request(
        vm: &RunningVm,
        command: VmCommand,
        timeout: Duration,
    ) -> Result<VmResponse, BackendError> {
        let mut conn = JsonLines::connect(&vm.api_sock, timeout, vm.uid)?;
        conn.send_line(&command.to_line())?;
        let line = conn.receive_line()?;
        let answer = VmResponse::parse(&line).map_err(|e| BackendError::Control {
            path: vm.api_sock.clone(),
            message: format!("unexpected answer to {}: {e}", command.name()),
        })?;
        match answer {
            VmResponse::Error { error, .. } => Err(BackendError::Control {
                path: vm.api_sock.clone(),
                message: format!(
                    "{} refused: {}",
                    command.name(),
                    crate::logs::sanitize(&error)
                ),
            }),
            answer => Ok(answer),
        }
    }
}

/// The one graceful step: `shutdown`, then the whole grace period to exit (status 6).
const STOP: &[StopRequest] = &[StopRequest {
    name: "shutdown",
    grace_percent: 100,
    clean_exit: None,
}];

impl VmmDriver for Vmm {
    fn kind(&self) -> BackendKind {
        BackendKind::TenantvmVmm
    }

    fn program(&self) -> (&'static str, &Path) {
        ("tenantvm-vmm", &self.binary)
    }

    fn control_socket(&self) -> &'static str {
        API_SOCK
    }

    fn last_socket(&self) -> &'static str {
        VSOCK_SOCK
    }

    fn plan(
        &self,
        spec: &VmSpec,
        jail: &JailConfig,
        prepared: &Prepared,
    ) -> Result<JailPlan, BackendError> {
        // One choice for the jail's nodes and the VMM's config (iommufd where the host
        // offers it for every device).
        let vfio = vfio_nodes::choose(spec, Path::new("/"), true);
        let config = Self::write_config(spec, jail, vfio)?;
        let report = Self::prepare_report_dir(spec, jail)?;
        let mut plan =
            runner::base_plan(spec, jail, prepared, &self.binary, Self::args(spec), vfio)?;
        plan.bind(&config, Path::new(JAIL_CONFIG), false)?;
        plan.bind(&report, Path::new(JAIL_REPORT_DIR), true)?;
        plan.device(Path::new("/dev/kvm"))?;
        plan.env.push(("RUST_BACKTRACE".into(), "1".into()));
        Ok(plan)
    }

    fn decode_exit(&self, record: ExitRecord) -> ExitReason {
        ExitReason::from_vmm(record)
    }

    fn query(&self, vm: &RunningVm, timeout: Duration) -> Result<VmState, BackendError> {
        // The VMM may write into its report directory while it runs: each look at the VM
        // keeps the directory under its cap.
        if let Err(e) = report_dir::cap_entries(&vm.tenant_dir.join(REPORT_DIR), MAX_REPORT_ENTRIES)
        {
            tracing::warn!(tenant = %vm.tenant, error = %e, "the VMM's report directory");
        }
        match Self::request(vm, VmCommand::Status, timeout)? {
            VmResponse::Status { state, .. } => Ok(match state {
                tenantvm_vmm_api::VmState::Running => VmState::Running,
                tenantvm_vmm_api::VmState::Paused => VmState::Paused,
            }),
            other => Err(BackendError::Control {
                path: vm.api_sock.clone(),
                message: format!("status answered with {other:?}"),
            }),
        }
    }

    fn stop_requests(&self) -> &'static [StopRequest] {
        STOP
    }

    fn request_stop(
        &self,
        vm: &RunningVm,
        _request: &StopRequest,
        timeout: Duration,
    ) -> Result<(), BackendError> {
        Self::request(vm, VmCommand::Shutdown, timeout).map(|_| ())
    }

    fn agent_endpoint(&self, vm: &RunningVm) -> AgentEndpoint {
        AgentEndpoint::vsock(vm.tenant_dir.join(RUN_DIR).join(VSOCK_SOCK))
    }

    fn agent_transport(&self) -> &'static str {
        "hybrid-vsock"
    }

    fn exit_report(&self, vm: &RunningVm) -> Result<Option<ExitReport>, BackendError> {
        Self::read_exit_report(&vm.tenant_dir)
    }

    fn disk_counters(
        &self,
        vm: &RunningVm,
        timeout: Duration,
    ) -> Result<Option<super::DiskCounters>, BackendError> {
        match Self::request(vm, VmCommand::Metrics, timeout)? {
            VmResponse::Metrics { devices, .. } => {
                super::disk_stats::from_vmm(&devices).map_err(|e| BackendError::Control {
                    path: vm.api_sock.clone(),
                    message: format!("metrics: {}", crate::logs::sanitize(&e)),
                })
            }
            other => Err(BackendError::Control {
                path: vm.api_sock.clone(),
                message: format!("metrics answered with {other:?}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DiskAttachment, DiskRateLimit};
    use tenantvm_vmm_api::{BlockConfig, RateLimitConfig};

    fn spec() -> VmSpec {
        VmSpec {
            vsock_cid: None,
            tenant: "t".into(),
            kernel: "/host/k".into(),
            initramfs: Some("/host/i".into()),
            cmdline: "console=ttyS0".into(),
            vcpus: 2,
            memory_mib: 64,
            disks: vec![
                DiskAttachment {
                    path: "/host/tenants/t/disk.img".into(),
                    read_only: false,
                    limit: Some(DiskRateLimit {
                        bytes_per_s: 100 << 20,
                        ops_per_s: 1000,
                    }),
                },
                DiskAttachment {
                    path: "/host/base.img".into(),
                    read_only: true,
                    limit: None,
                },
            ],
            tenant_dir: "/var/lib/tenantvm/tenants/t".into(),
            devices: vec![],
            uuid: None,
            hugepages: None,
        }
    }

    #[test]
    fn the_config_uses_jail_paths_and_gives_the_vm_a_vsock_device() {
        let config = Vmm::config_file(&spec(), VfioInterface::Legacy).unwrap();
        assert_eq!(config.kernel, Some("/vm/kernel".into()));
        assert_eq!(config.initramfs, Some("/vm/initramfs".into()));
        assert_eq!(
            config.serial,
            Some(SerialConfig::File("/log/serial.log".into()))
        );
        assert_eq!(config.api_sock, Some("/run/api.sock".into()));
        assert_eq!(
            config.vsock,
            Some(VsockConfig {
                guest_cid: 3,
                uds_path: "/run/vsock.sock".into()
            })
        );
        assert_eq!((config.vcpus, config.memory_mib), (Some(2), Some(64)));
        // Disks in order, at the paths the runner mounts them, with their quotas.
        assert_eq!(
            config.disks,
            Some(vec![
                BlockConfig {
                    path: "/vm/disk0".into(),
                    read_only: false,
                    id: Some("disk0".into()),
                    rate_limit: Some(RateLimitConfig {
                        bytes_per_sec: Some(100 << 20),
                        ops_per_sec: Some(1000),
                        ..Default::default()
                    }),
                },
                BlockConfig {
                    path: "/vm/disk1".into(),
                    read_only: true,
                    id: Some("disk1".into()),
                    rate_limit: None,
                },
            ])
        );
        let json = config.to_json().unwrap();
        assert!(!json.contains("/host/"), "{json}");
        assert!(!json.contains("/var/lib"), "{json}");
    }

    #[test]
    fn the_written_config_parses_with_the_vmms_own_types() {
        let config = Vmm::config_file(&spec(), VfioInterface::Legacy).unwrap();
        let json = config.to_json().unwrap();
        // The VMM reads the file with the same type, which refuses unknown fields.
        assert_eq!(VmConfigFile::from_json(&json).unwrap(), config);
        let no_initramfs = VmSpec {
            initramfs: None,
            disks: vec![],
            ..spec()
        };
        let json = Vmm::config_file(&no_initramfs, VfioInterface::Legacy)
            .unwrap()
            .to_json()
            .unwrap();
        assert!(
            !json.contains("initramfs") && !json.contains("disks") && !json.contains("devices"),
            "{json}"
        );
        VmConfigFile::from_json(&json).unwrap();
    }

    #[test]
    fn the_config_file_is_root_owned_and_group_readable_only() {
        let tmp = tempfile::tempdir().unwrap();
        let spec = VmSpec {
            tenant_dir: tmp.path().to_path_buf(),
            ..spec()
        };
        let jail = JailConfig {
            uid: 4242,
            gid: 4243,
            limits: crate::backend::ResourceLimits {
                memory_bytes: 1 << 30,
                cpu_quota_us: 100_000,
                cpu_period_us: 100_000,
                pids_max: 32,
            },
        };
        // A stale temporary file (a daemon killed mid-write) does not block the next write.
        fs::write(tmp.path().join(format!("{CONFIG_FILE}.tmp")), "junk").unwrap();
        let written = Vmm::write_config(&spec, &jail, VfioInterface::Legacy);
        // Only root can hand the file to root with another group.
        if !nix::unistd::geteuid().is_root() {
            tenantvm_skip::skip!("needs root (fchown)");
        }
        let path = written.unwrap();
        use std::os::unix::fs::MetadataExt;
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o777),
            (0, 4243, 0o440)
        );
        let text = fs::read_to_string(&path).unwrap();
        assert_eq!(
            VmConfigFile::from_json(&text).unwrap(),
            Vmm::config_file(&spec, VfioInterface::Legacy).unwrap()
        );
    }

    fn gpu_spec() -> VmSpec {
        VmSpec {
            devices: vec![
                PassthroughDevice::Pci {
                    address: "0000:41:00.0".into(),
                    iommu_group: 17,
                },
                PassthroughDevice::Pci {
                    address: "0000:41:00.1".into(),
                    iommu_group: 17,
                },
            ],
            uuid: Some("5c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b".parse().unwrap()),
            hugepages: None,
            ..spec()
        }
    }

    #[test]
    fn passthrough_devices_the_uuid_and_the_exit_report_reach_the_config() {
        let config = Vmm::config_file(&gpu_spec(), VfioInterface::Legacy).unwrap();
        let devices = config.devices.clone().unwrap();
        let legacy = |path: &str| PassthroughConfig {
            iommu: tenantvm_vmm_api::VfioIommuMode::Legacy,
            ..PassthroughConfig::new(path)
        };
        assert_eq!(
            devices,
            vec![
                legacy("/sys/bus/pci/devices/0000:41:00.0"),
                legacy("/sys/bus/pci/devices/0000:41:00.1"),
            ]
        );
        // Each is what `--device vfio,path=...,iommu=legacy` would have given the VMM.
        for d in &devices {
            let flag = format!("vfio,path={},iommu=legacy", d.path.display());
            assert_eq!(&flag.parse::<PassthroughConfig>().unwrap(), d);
        }
        // Through iommufd (the jail then has /dev/iommu and the cdevs), the VMM is told so.
        let through_iommufd = Vmm::config_file(&gpu_spec(), VfioInterface::Iommufd).unwrap();
        assert!(through_iommufd
            .devices
            .unwrap()
            .iter()
            .all(|d| d.iommu == tenantvm_vmm_api::VfioIommuMode::Iommufd));
        assert_eq!(
            config.uuid.unwrap().to_string(),
            "5c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b"
        );
        assert_eq!(config.exit_report, Some("/report/exit.json".into()));
        let json = config.to_json().unwrap();
        assert_eq!(VmConfigFile::from_json(&json).unwrap(), config);
        // Without devices the VM still gets an exit report, and no devices field.
        let plain = Vmm::config_file(&spec(), VfioInterface::Legacy).unwrap();
        assert_eq!((plain.devices, plain.uuid), (None, None));
    }

    #[test]
    fn the_vms_huge_pages_reach_its_config() {
        let on = VmSpec {
            hugepages: Some(tenantvm_vmm_api::HugePages::Size2M),
            ..spec()
        };
        let config = Vmm::config_file(&on, VfioInterface::Legacy).unwrap();
        assert_eq!(config.hugepages, Some(tenantvm_vmm_api::HugePages::Size2M));
        assert!(config.to_json().unwrap().contains("\"hugepages\": \"2M\""));
        let off = Vmm::config_file(&spec(), VfioInterface::Legacy).unwrap();
        assert_eq!(off.hugepages, None);
    }

    /// NVIDIA's vGPU manager reads the VM's UUID from the VMM's command line (QEMU's
    /// `-uuid`), not from a config file: the argv carries it, in QEMU's spelling, which
    /// tenantvm-vmm takes as its `--uuid`.
    #[test]
    fn the_vms_uuid_is_on_the_vmms_argv() {
        assert_eq!(
            Vmm::args(&gpu_spec()),
            [
                "--config",
                "/vm/config.json",
                "-uuid",
                "5c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b"
            ]
        );
        // No UUID, no flag.
        assert_eq!(Vmm::args(&spec()), ["--config", "/vm/config.json"]);
    }

    #[test]
    fn malformed_or_unsupported_devices_are_refused_before_anything_runs() {
        let mdev = VmSpec {
            devices: vec![PassthroughDevice::Mdev {
                uuid: "5c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b".into(),
                iommu_group: 3,
            }],
            ..spec()
        };
        let err = Vmm::config_file(&mdev, VfioInterface::Legacy)
            .unwrap_err()
            .to_string();
        assert!(err.contains("QEMU backend"), "{err}");
        for bad in [
            vec![PassthroughDevice::Pci {
                address: "0000:41:00.0,x-foo=1".into(),
                iommu_group: 1,
            }],
            vec![PassthroughDevice::Pci {
                address: "../../etc".into(),
                iommu_group: 1,
            }],
            vec![
                PassthroughDevice::Pci {
                    address: "0000:41:00.0".into(),
                    iommu_group: 1,
                };
                2
            ],
            (0..9)
                .map(|i| PassthroughDevice::Pci {
                    address: format!("0000:4{i}:00.0"),
                    iommu_group: i,
                })
                .collect(),
        ] {
            let spec = VmSpec {
                devices: bad.clone(),
                ..spec()
            };
            assert!(
                matches!(
                    Vmm::config_file(&spec, VfioInterface::Legacy),
                    Err(BackendError::InvalidSpec(_))
                ),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn the_exit_report_is_read_back_strictly() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(Vmm::read_exit_report(tmp.path()).unwrap().is_none());
        let dir = tmp.path().join(REPORT_DIR);
        fs::create_dir(&dir).unwrap();
        let file = dir.join(EXIT_REPORT);
        let report = ExitReport {
            status: 6,
            devices: vec![tenantvm_vmm_api::DeviceReport {
                path: "/sys/bus/pci/devices/0000:41:00.0".into(),
                reset_at_attach: tenantvm_vmm_api::ResetOutcome::Reset {
                    method: Some("flr".into()),
                },
                reset_at_detach: tenantvm_vmm_api::ResetOutcome::HotReset,
                interface: Some(tenantvm_vmm_api::VfioIommuMode::Legacy),
                dma_map_ms: Some(3),
            }],
        };
        fs::write(&file, serde_json::to_string(&report).unwrap()).unwrap();
        assert_eq!(Vmm::read_exit_report(tmp.path()).unwrap(), Some(report));
        fs::write(&file, r#"{"status":0,"devices":[],"forged":true}"#).unwrap();
        Vmm::read_exit_report(tmp.path()).unwrap_err();
        fs::write(&file, " ".repeat(MAX_EXIT_REPORT_BYTES as usize + 1)).unwrap();
        let err = Vmm::read_exit_report(tmp.path()).unwrap_err().to_string();
        assert!(err.contains("larger"), "{err}");
        fs::remove_file(&file).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &file).unwrap();
        Vmm::read_exit_report(tmp.path()).unwrap_err();
    }

    #[test]
    fn reading_the_exit_report_caps_the_report_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join(REPORT_DIR);
        fs::create_dir(&dir).unwrap();
        // A VMM that filled its report directory, then wrote its report last.
        for i in 0..3 * MAX_REPORT_ENTRIES {
            fs::write(dir.join(format!("junk-{i}")), "x").unwrap();
        }
        let report = ExitReport {
            status: 0,
            devices: Vec::new(),
        };
        let file = dir.join(EXIT_REPORT);
        fs::write(&file, serde_json::to_string(&report).unwrap()).unwrap();
        let later = std::time::SystemTime::now() + Duration::from_secs(60);
        fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(later)
            .unwrap();
        assert_eq!(Vmm::read_exit_report(tmp.path()).unwrap(), Some(report));
        assert_eq!(fs::read_dir(&dir).unwrap().count(), MAX_REPORT_ENTRIES);
    }
}
