//! The `tenantvm-vmm` backend: one `tenantvm-vmm` process per VM, jailed, driven through its
//! control socket (docs/vmm.md).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use super::control::JsonLines;
use super::runner::{
    self, ProcessStatus, RuntimeConfig, EXIT_SETTLE, JAIL_SERIAL_LOG, JAIL_VM_DIR,
};
use super::{
    BackendError, BackendKind, ExitReason, JailConfig, RunningVm, VmBackend, VmSpec, VmState,
};
use crate::jail::Seal;

/// Name of the control socket in the tenant's `run/` directory.
pub const API_SOCK: &str = "api.sock";

/// Runs VMs with `tenantvm-vmm`.
#[derive(Debug, Clone)]
pub struct VmmBackend {
    vmm_binary: PathBuf,
    config: RuntimeConfig,
}

impl VmmBackend {
    /// A backend running `vmm_binary` (the default is `tenantvm-vmm` next to the daemon:
    /// [`runner::sibling_binary`]).
    pub fn new(vmm_binary: PathBuf, config: RuntimeConfig) -> Self {
        Self { vmm_binary, config }
    }

    /// The command-line arguments for `spec`, with paths as seen inside the jail.
    pub fn vmm_args(spec: &VmSpec) -> Vec<String> {
        let vm = Path::new(JAIL_VM_DIR);
        let mut args = vec![
            "--kernel".into(),
            vm.join("kernel").display().to_string(),
            "--cmdline".into(),
            spec.cmdline.clone(),
            "--memory-mib".into(),
            spec.memory_mib.to_string(),
            "--vcpus".into(),
            spec.vcpus.to_string(),
            "--serial".into(),
            format!("file:{JAIL_SERIAL_LOG}"),
            "--api-sock".into(),
            format!("/run/{API_SOCK}"),
        ];
        if spec.initramfs.is_some() {
            args.push("--initramfs".into());
            args.push(vm.join("initramfs").display().to_string());
        }
        // Disks appear in the jail where the runner bind-mounts them (`disk0`, `disk1`, ...),
        // in order, as virtio-blk devices.
        for (i, disk) in spec.disks.iter().enumerate() {
            args.push("--disk".into());
            let mut value = format!("path={},id=disk{i}", vm.join(format!("disk{i}")).display());
            if disk.read_only {
                value.push_str(",readonly=on");
            }
            if let Some(limit) = disk.limit {
                value.push_str(&format!(
                    ",bps={},iops={}",
                    limit.bytes_per_s, limit.ops_per_s
                ));
            }
            args.push(value);
        }
        args
    }

    fn request(&self, vm: &RunningVm, command: &str) -> Result<serde_json::Value, BackendError> {
        let mut conn = JsonLines::connect(&vm.api_sock, self.config.control_timeout, vm.uid)?;
        let answer = conn.call(&json!({ "command": command }))?;
        if answer["ok"] != json!(true) {
            let message = answer["error"]
                .as_str()
                .unwrap_or("refused without a reason")
                .to_string();
            return Err(BackendError::Control {
                path: vm.api_sock.clone(),
                message,
            });
        }
        Ok(answer)
    }
}

impl VmBackend for VmmBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::TenantvmVmm
    }

    fn supports_disks(&self) -> bool {
        true
    }

    fn launch(&self, spec: &VmSpec, jail: &JailConfig) -> Result<RunningVm, BackendError> {
        runner::check_binary("tenantvm-vmm", &self.vmm_binary)?;
        let api_sock = runner::socket_path(spec, API_SOCK)?;
        let prepared = runner::prepare(spec, jail, &self.config)?;
        let mut plan = runner::base_plan(
            spec,
            jail,
            &prepared,
            &self.vmm_binary,
            Self::vmm_args(spec),
        )?;
        plan.device(Path::new("/dev/kvm"))?;
        // Once the socket exists, /run turns read-only inside the jail.
        plan.seal = Some(Seal {
            when_exists: PathBuf::from(format!("/run/{API_SOCK}")),
            mount: PathBuf::from("/run"),
        });
        plan.env.push(("RUST_BACKTRACE".into(), "1".into()));
        let timeout = self.config.control_timeout;
        let uid = jail.uid;
        let ready = move |sock: &Path| {
            JsonLines::connect(sock, timeout, uid)
                .and_then(|mut c| c.call(&json!({"command": "status"})))
                .is_ok()
        };
        runner::start(
            &self.config,
            self.kind(),
            spec,
            jail,
            &prepared,
            &plan,
            api_sock,
            ExitReason::from_vmm,
            &ready,
        )
    }

    fn state(&self, vm: &RunningVm) -> Result<VmState, BackendError> {
        match runner::process_status(vm)? {
            ProcessStatus::Exited(record) => {
                return Ok(VmState::Exited {
                    status: ExitReason::from_vmm(record),
                })
            }
            ProcessStatus::Gone => return Ok(VmState::Gone),
            ProcessStatus::Alive => {}
        }
        match self.request(vm, "status") {
            Ok(answer) => match answer["state"].as_str() {
                Some("running") => Ok(VmState::Running),
                Some("paused") => Ok(VmState::Paused),
                other => Err(BackendError::Control {
                    path: vm.api_sock.clone(),
                    message: format!("unexpected state {other:?}"),
                }),
            },
            // It may be exiting: a socket error then is not an error of the VM's state.
            Err(e) => match runner::wait_exit(vm, EXIT_SETTLE)? {
                ProcessStatus::Exited(record) => Ok(VmState::Exited {
                    status: ExitReason::from_vmm(record),
                }),
                ProcessStatus::Gone => Ok(VmState::Gone),
                ProcessStatus::Alive => Err(e),
            },
        }
    }

    fn stop(&self, vm: &RunningVm, grace: Duration) -> Result<ExitReason, BackendError> {
        if let ProcessStatus::Exited(record) = runner::process_status(vm)? {
            return Ok(ExitReason::from_vmm(record));
        }
        // A VMM that does not answer is killed after the grace period all the same.
        let asked = self.request(vm, "shutdown");
        match runner::wait_exit(vm, if asked.is_ok() { grace } else { EXIT_SETTLE })? {
            ProcessStatus::Exited(record) => Ok(ExitReason::from_vmm(record)),
            ProcessStatus::Gone => Ok(ExitReason::Signaled {
                signal: libc::SIGKILL,
            }),
            ProcessStatus::Alive => {
                runner::kill(vm)?;
                Ok(ExitReason::Signaled {
                    signal: libc::SIGKILL,
                })
            }
        }
    }

    fn kill(&self, vm: &RunningVm) -> Result<(), BackendError> {
        runner::kill(vm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmm_args_use_jail_paths() {
        let spec = VmSpec {
            tenant: "t".into(),
            kernel: "/host/k".into(),
            initramfs: Some("/host/i".into()),
            cmdline: "console=ttyS0".into(),
            vcpus: 2,
            memory_mib: 64,
            disks: vec![],
            tenant_dir: "/var/lib/tenantvm/tenants/t".into(),
        };
        let args = VmmBackend::vmm_args(&spec).join(" ");
        assert_eq!(
            args,
            "--kernel /vm/kernel --cmdline console=ttyS0 --memory-mib 64 --vcpus 2 --serial file:/log/serial.log --api-sock /run/api.sock --initramfs /vm/initramfs"
        );
        assert!(!args.contains("/host/"));
    }

    #[test]
    fn vmm_args_attach_disks_in_order_at_their_jail_paths() {
        let spec = VmSpec {
            tenant: "t".into(),
            kernel: "/host/k".into(),
            initramfs: None,
            cmdline: String::new(),
            vcpus: 1,
            memory_mib: 64,
            disks: vec![
                super::super::DiskAttachment {
                    path: "/host/tenants/t/disk.img".into(),
                    read_only: false,
                    limit: Some(super::super::DiskRateLimit {
                        bytes_per_s: 100 << 20,
                        ops_per_s: 1000,
                    }),
                },
                super::super::DiskAttachment {
                    path: "/host/base.img".into(),
                    read_only: true,
                    limit: None,
                },
            ],
            tenant_dir: "/var/lib/tenantvm/tenants/t".into(),
        };
        let args = VmmBackend::vmm_args(&spec);
        let disks: Vec<&str> = args
            .windows(2)
            .filter(|pair| pair[0] == "--disk")
            .map(|pair| pair[1].as_str())
            .collect();
        assert_eq!(
            disks,
            vec![
                "path=/vm/disk0,id=disk0,bps=104857600,iops=1000",
                "path=/vm/disk1,id=disk1,readonly=on"
            ]
        );
        assert!(!args.iter().any(|a| a.contains("/host/")));
    }
}
