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
    SeccompMode, SerialConfig, VmCommand, VmConfigFile, VmResponse, VsockConfig,
};

use super::control::JsonLines;
use super::runner::{
    self, Prepared, Runner, RuntimeConfig, StopRequest, VmmDriver, JAIL_SERIAL_LOG, JAIL_VM_DIR,
    RUN_DIR,
};
use super::{BackendError, BackendKind, ExitReason, JailConfig, RunningVm, VmSpec, VmState};
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
    /// under /vm, serial.log, the control socket and the vsock device in /run.
    pub fn config_file(spec: &VmSpec) -> VmConfigFile {
        let vm = Path::new(JAIL_VM_DIR);
        let run = Path::new("/run");
        let disks = runner::jail_disks(spec);
        VmConfigFile {
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
            devices: None,
            uuid: None,
            exit_report: None,
        }
    }

    /// Writes the config file of `spec` into the tenant directory, readable by the
    /// tenant's group only (the VMM runs as the tenant; root owns the file, so the VMM
    /// cannot change what a later launch reads).
    fn write_config(spec: &VmSpec, jail: &JailConfig) -> Result<PathBuf, BackendError> {
        let path = spec.tenant_dir.join(CONFIG_FILE);
        let io = |source| BackendError::Io {
            path: path.clone(),
            source,
        };
        let text = Self::config_file(spec).to_json().map_err(|e| {
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
        let config = Self::write_config(spec, jail)?;
        let args = vec!["--config".to_string(), JAIL_CONFIG.to_string()];
        let mut plan = runner::base_plan(spec, jail, prepared, &self.binary, args)?;
        plan.bind(&config, Path::new(JAIL_CONFIG), false)?;
        plan.device(Path::new("/dev/kvm"))?;
        plan.env.push(("RUST_BACKTRACE".into(), "1".into()));
        Ok(plan)
    }

    fn decode_exit(&self, record: ExitRecord) -> ExitReason {
        ExitReason::from_vmm(record)
    }

    fn query(&self, vm: &RunningVm, timeout: Duration) -> Result<VmState, BackendError> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DiskAttachment, DiskRateLimit};
    use tenantvm_vmm_api::{BlockConfig, RateLimitConfig};

    fn spec() -> VmSpec {
        VmSpec {
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
        }
    }

    #[test]
    fn the_config_uses_jail_paths_and_gives_the_vm_a_vsock_device() {
        let config = Vmm::config_file(&spec());
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
        let config = Vmm::config_file(&spec());
        let json = config.to_json().unwrap();
        // The VMM reads the file with the same type, which refuses unknown fields.
        assert_eq!(VmConfigFile::from_json(&json).unwrap(), config);
        let no_initramfs = VmSpec {
            initramfs: None,
            disks: vec![],
            ..spec()
        };
        let json = Vmm::config_file(&no_initramfs).to_json().unwrap();
        assert!(
            !json.contains("initramfs") && !json.contains("disks"),
            "{json}"
        );
        assert!(VmConfigFile::from_json(&json).is_ok());
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
        let written = Vmm::write_config(&spec, &jail);
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
            Vmm::config_file(&spec)
        );
    }
}
