//! The QEMU backend: `qemu-system-x86_64` with `-accel kvm` or `-accel tcg`, jailed like
//! `tenantvm-vmm`, serial console appended to serial.log, QMP on a Unix socket for state
//! and a graceful stop (`system_powerdown`, then `quit`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use super::control::JsonLines;
use super::runner::{
    self, ProcessStatus, RuntimeConfig, EXIT_SETTLE, JAIL_SERIAL_LOG, JAIL_VM_DIR,
};
use super::{
    BackendError, BackendKind, ExitReason, JailConfig, QemuAccel, RunningVm, VmBackend, VmSpec,
    VmState,
};
use crate::jail::Seal;

/// Name of the QMP socket in the tenant's `run/` directory.
pub const QMP_SOCK: &str = "qmp.sock";
/// Name of the guest agent's channel socket in the tenant's `run/` directory.
pub const AGENT_SOCK: &str = "agent.sock";
/// The virtio-serial port name the guest agent looks for.
pub const AGENT_PORT_NAME: &str = "org.tenantvm.agent.0";
/// Host directories QEMU reads firmware (SeaBIOS, option ROMs such as pvh.bin and
/// linuxboot_dma.bin) and modules (accel-tcg) from; mounted read-only where they exist.
const QEMU_DATA_DIRS: [&str; 3] = [
    "/usr/share/qemu",
    "/usr/share/seabios",
    "/usr/lib/x86_64-linux-gnu/qemu",
];

/// The CPU model under KVM: the host's, without IA32_ARCH_CAPABILITIES (MSR 0x10a), which
/// nested hypervisors (this CI machine) refuse to set, aborting QEMU. Guests then assume
/// they need every speculative-execution mitigation: slower at worst, never less safe.
pub const KVM_CPU: &str = "host,-arch-capabilities";

/// Runs VMs with QEMU.
#[derive(Debug, Clone)]
pub struct QemuBackend {
    qemu_binary: PathBuf,
    accel: QemuAccel,
    config: RuntimeConfig,
}

impl QemuBackend {
    /// A backend running `qemu_binary` (usually /usr/bin/qemu-system-x86_64) with `accel`.
    pub fn new(qemu_binary: PathBuf, accel: QemuAccel, config: RuntimeConfig) -> Self {
        Self {
            qemu_binary,
            accel,
            config,
        }
    }

    /// The command-line arguments for `spec`, with paths as seen inside the jail.
    pub fn qemu_args(spec: &VmSpec, accel: QemuAccel) -> Vec<String> {
        let vm = Path::new(JAIL_VM_DIR);
        let mut args: Vec<String> = [
            "-name",
            &spec.tenant,
            "-machine",
            "pc",
            "-accel",
            match accel {
                QemuAccel::Kvm => "kvm",
                QemuAccel::Tcg => "tcg",
            },
            "-cpu",
            match accel {
                QemuAccel::Kvm => KVM_CPU,
                QemuAccel::Tcg => "max",
            },
            "-smp",
            &spec.vcpus.to_string(),
            "-m",
            &format!("{}M", spec.memory_mib),
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-vga",
            "none",
            "-kernel",
            &vm.join("kernel").display().to_string(),
            "-append",
            &spec.cmdline,
            "-chardev",
            &format!("file,id=serial0,path={JAIL_SERIAL_LOG},append=on"),
            "-serial",
            "chardev:serial0",
            // The guest agent's channel (docs/guest-image.md): a virtio-serial port whose
            // host end is a Unix socket in run/. Created before the QMP socket, whose
            // appearance seals /run read-only inside the jail.
            "-device",
            "virtio-serial-pci,id=vser0",
            "-chardev",
            &format!("socket,id=agent,path=/run/{AGENT_SOCK},server=on,wait=off"),
            "-device",
            &format!("virtserialport,bus=vser0.0,chardev=agent,name={AGENT_PORT_NAME}"),
            "-qmp",
            &format!("unix:/run/{QMP_SOCK},server=on,wait=off"),
            // A guest reset ends the VM, as with tenantvm-vmm.
            "-action",
            "reboot=shutdown",
            "-sandbox",
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if spec.initramfs.is_some() {
            args.push("-initrd".into());
            args.push(vm.join("initramfs").display().to_string());
        }
        for (i, disk) in spec.disks.iter().enumerate() {
            args.push("-drive".into());
            let mut drive = format!(
                "file={},format=raw,if=virtio,aio=threads,readonly={}",
                vm.join(format!("disk{i}")).display(),
                if disk.read_only { "on" } else { "off" }
            );
            if let Some(limit) = disk.limit {
                drive.push_str(&format!(
                    ",throttling.bps-total={},throttling.iops-total={}",
                    limit.bytes_per_s, limit.ops_per_s
                ));
            }
            args.push(drive);
        }
        args
    }

    /// Opens a QMP session (served by `uid`; greeting read, capabilities negotiated).
    fn qmp(&self, sock: &Path, uid: u32) -> Result<JsonLines, BackendError> {
        let mut conn = JsonLines::connect(sock, self.config.control_timeout, uid)?;
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
    // forever (each read has a timeout, and the count is bounded).
    for _ in 0..64 {
        let answer = conn.receive()?;
        if let Some(ret) = answer.get("return") {
            return Ok(ret.clone());
        }
        if let Some(err) = answer.get("error") {
            let message = err["desc"].as_str().unwrap_or("QMP error").to_string();
            return Err(BackendError::Control {
                path: conn.path().to_path_buf(),
                message: format!("{command}: {message}"),
            });
        }
    }
    Err(BackendError::Control {
        path: conn.path().to_path_buf(),
        message: format!("{command}: no answer among 64 messages"),
    })
}

impl VmBackend for QemuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Qemu { accel: self.accel }
    }

    fn launch(&self, spec: &VmSpec, jail: &JailConfig) -> Result<RunningVm, BackendError> {
        runner::check_binary("qemu-system-x86_64", &self.qemu_binary)?;
        let api_sock = runner::socket_path(spec, QMP_SOCK)?;
        let prepared = runner::prepare(spec, jail, &self.config)?;
        let mut plan = runner::base_plan(
            spec,
            jail,
            &prepared,
            &self.qemu_binary,
            Self::qemu_args(spec, self.accel),
        )?;
        if self.accel == QemuAccel::Kvm {
            plan.device(Path::new("/dev/kvm"))?;
        }
        // Once the socket exists, /run turns read-only inside the jail.
        plan.seal = Some(Seal {
            when_exists: PathBuf::from(format!("/run/{QMP_SOCK}")),
            mount: PathBuf::from("/run"),
        });
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
        let this = self.clone();
        let uid = jail.uid;
        let ready = move |sock: &Path| this.qmp(sock, uid).is_ok();
        runner::start(
            &self.config,
            self.kind(),
            spec,
            jail,
            &prepared,
            &plan,
            api_sock,
            ExitReason::from_qemu,
            &ready,
        )
    }

    fn state(&self, vm: &RunningVm) -> Result<VmState, BackendError> {
        match runner::process_status(vm)? {
            ProcessStatus::Exited(record) => {
                return Ok(VmState::Exited {
                    status: ExitReason::from_qemu(record),
                })
            }
            ProcessStatus::Gone => return Ok(VmState::Gone),
            ProcessStatus::Alive => {}
        }
        let answer = self
            .qmp(&vm.api_sock, vm.uid)
            .and_then(|mut c| execute(&mut c, "query-status"));
        match answer {
            Ok(status) => match status["status"].as_str() {
                Some("running") => Ok(VmState::Running),
                Some("paused") | Some("suspended") => Ok(VmState::Paused),
                // prelaunch, inmigrate, shutdown, ... are transitional here.
                Some(_) => Ok(VmState::Running),
                None => Err(BackendError::Control {
                    path: vm.api_sock.clone(),
                    message: "query-status without status".into(),
                }),
            },
            Err(e) => match runner::wait_exit(vm, EXIT_SETTLE)? {
                ProcessStatus::Exited(record) => Ok(VmState::Exited {
                    status: ExitReason::from_qemu(record),
                }),
                ProcessStatus::Gone => Ok(VmState::Gone),
                ProcessStatus::Alive => Err(e),
            },
        }
    }

    fn stop(&self, vm: &RunningVm, grace: Duration) -> Result<ExitReason, BackendError> {
        if let ProcessStatus::Exited(record) = runner::process_status(vm)? {
            return Ok(ExitReason::from_qemu(record));
        }
        // Half the grace period for the guest to power off through ACPI...
        if let Ok(mut conn) = self.qmp(&vm.api_sock, vm.uid) {
            if execute(&mut conn, "system_powerdown").is_ok() {
                if let ProcessStatus::Exited(record) = runner::wait_exit(vm, grace / 2)? {
                    return Ok(ExitReason::from_qemu(record));
                }
            }
        }
        // ...then QEMU is told to quit, and killed if it does not.
        if let Ok(mut conn) = self.qmp(&vm.api_sock, vm.uid) {
            if execute(&mut conn, "quit").is_ok() {
                match runner::wait_exit(vm, grace / 2)? {
                    ProcessStatus::Exited(crate::jail::ExitRecord::Code(0)) => {
                        return Ok(ExitReason::Stopped)
                    }
                    ProcessStatus::Exited(record) => return Ok(ExitReason::from_qemu(record)),
                    ProcessStatus::Gone | ProcessStatus::Alive => {}
                }
            }
        }
        runner::kill(vm)?;
        Ok(ExitReason::Signaled {
            signal: libc::SIGKILL,
        })
    }

    fn kill(&self, vm: &RunningVm) -> Result<(), BackendError> {
        runner::kill(vm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DiskAttachment;

    #[test]
    fn qemu_args_use_jail_paths_and_accel() {
        let spec = VmSpec {
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
        };
        let args = QemuBackend::qemu_args(&spec, QemuAccel::Tcg).join(" ");
        assert!(
            args.contains("-accel tcg -cpu max -smp 2 -m 256M"),
            "{args}"
        );
        assert!(args.contains("-kernel /vm/kernel"));
        assert!(args.contains("path=/log/serial.log,append=on"));
        assert!(args.contains("-qmp unix:/run/qmp.sock,server=on,wait=off"));
        assert!(args.contains(
            "file=/vm/disk0,format=raw,if=virtio,aio=threads,readonly=on,throttling.bps-total=1048576,throttling.iops-total=50"
        ));
        assert!(!args.contains("/host/"));
        let agent = args
            .find("path=/run/agent.sock,server=on,wait=off")
            .expect(&args);
        assert!(
            agent < args.find("-qmp").unwrap(),
            "agent socket before QMP: {args}"
        );
        assert!(args.contains("virtserialport,bus=vser0.0,chardev=agent,name=org.tenantvm.agent.0"));
        assert!(QemuBackend::qemu_args(&spec, QemuAccel::Kvm)
            .join(" ")
            .contains("-accel kvm -cpu host,-arch-capabilities"));
    }
}
