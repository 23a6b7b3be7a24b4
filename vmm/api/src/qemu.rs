//! The QEMU command line, built in one place: the orchestrator's QEMU backend runs it in the
//! tenant's jail, and the guest image's own end-to-end test runs it directly. Same machine,
//! devices and hardening either way; only the paths differ.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::config::{BlockConfig, HugePages};

/// The CPU model under KVM: the host's, without IA32_ARCH_CAPABILITIES (MSR 0x10a), which
/// nested hypervisors (this CI machine) refuse to set, aborting QEMU. Guests then assume
/// they need every speculative-execution mitigation: slower at worst, never less safe.
pub const KVM_CPU: &str = "host,-arch-capabilities";

/// The `-sandbox` setting: QEMU's own seccomp filter, with no privilege changes, no
/// process spawning and no resource-control calls.
pub const SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// The size of TCG's translation cache (`-accel tcg,tb-size=`), in MiB. Without it QEMU
/// sizes the cache by its own default (up to 1 GiB on 64-bit hosts) and fills it as the
/// guest runs new code, so a long-lived TCG guest's VMM outgrows any fixed allowance and its
/// cgroup kills it. The orchestrator adds this to the VMM's memory allowance under TCG.
pub const TCG_TRANSLATION_CACHE_MIB: u64 = 64;

/// The accelerator a QEMU VM uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QemuAccel {
    /// Hardware virtualisation through /dev/kvm.
    Kvm,
    /// Software emulation (no /dev/kvm needed; slow but runs any guest).
    Tcg,
}

/// A virtio-serial port whose host end is a Unix socket QEMU listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SerialPort {
    /// The socket QEMU creates (`server=on,wait=off`: the guest runs before anyone connects).
    pub socket: PathBuf,
    /// The port name the guest looks for (`/dev/virtio-ports/NAME`).
    pub name: String,
}

/// The smallest guest CID: 0 (hypervisor), 1 (local) and 2 (host) are reserved.
pub const MIN_GUEST_CID: u32 = 3;
/// The largest guest CID QEMU and the kernel accept (`u32::MAX` is `VMADDR_CID_ANY`; QEMU
/// refuses CIDs at or above it).
pub const MAX_GUEST_CID: u32 = u32::MAX - 1;

/// A vhost-vsock device (`-device vhost-vsock-pci`): the guest's virtio-vsock, carried by
/// the host kernel's `vhost_vsock`, which QEMU reaches through `/dev/vhost-vsock`. The host
/// connects to the guest with `AF_VSOCK` and the CID; the kernel refuses a CID another VM
/// on the host holds, and QEMU then fails to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VhostVsock {
    /// The guest's context id, [`MIN_GUEST_CID`]..=[`MAX_GUEST_CID`].
    pub guest_cid: u32,
}

/// What QEMU runs: a direct kernel boot on the `pc` machine, without default devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuCommand {
    /// The VM's name (`-name`; shows in QEMU's messages).
    pub name: String,
    /// KVM or TCG.
    pub accel: QemuAccel,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Kernel (bzImage, or an ELF with a PVH note).
    pub kernel: PathBuf,
    /// Initramfs.
    pub initramfs: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// File the guest's serial console (COM1) is appended to.
    pub serial_log: PathBuf,
    /// The guest agent's channel, created before the QMP socket.
    pub agent_port: Option<SerialPort>,
    /// The guest's vsock device (the agent's channel where the host has vhost-vsock; the
    /// agent listens on vsock when the device exists and on the serial port otherwise).
    pub vhost_vsock: Option<VhostVsock>,
    /// The QMP socket (QEMU listens; created last, so its appearance means every socket
    /// of the VM exists).
    pub qmp_socket: Option<PathBuf>,
    /// virtio-blk disks, in order (`/dev/vda`, `/dev/vdb`, ...): raw images, read-only or
    /// not, with their id as the disk serial and their rate limit as QEMU block throttling.
    pub disks: Vec<BlockConfig>,
    /// Huge pages backing the guest's RAM: a hugetlb memfd memory backend
    /// (`-object memory-backend-memfd,...,hugetlb=on,hugetlbsize=2M|1G`) as the machine's
    /// RAM. QEMU reserves the pages when it maps them, so a host without enough free fails
    /// at start ("unable to map backing store"). Ordinary pages when `None`.
    pub hugepages: Option<HugePages>,
}

/// QEMU's option syntax separates `key=value` pairs with commas; a comma inside a value is
/// written twice.
fn escaped(value: &OsStr) -> OsString {
    let mut out = Vec::with_capacity(value.len());
    for &byte in value.as_bytes() {
        out.push(byte);
        if byte == b',' {
            out.push(b',');
        }
    }
    OsString::from_vec(out)
}

fn option(prefix: &str, value: &OsStr, suffix: &str) -> OsString {
    let mut out = OsString::from(prefix);
    out.push(escaped(value));
    out.push(suffix);
    out
}

impl QemuCommand {
    /// The arguments, without the program name.
    pub fn args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        let mut push = |a: &[&str]| args.extend(a.iter().map(OsString::from));
        let tcg = format!("tcg,tb-size={TCG_TRANSLATION_CACHE_MIB}");
        let (accel, cpu) = match self.accel {
            QemuAccel::Kvm => ("kvm", KVM_CPU),
            QemuAccel::Tcg => (tcg.as_str(), "max"),
        };
        push(&["-name", &self.name.replace(',', ",,")]);
        let machine = match self.hugepages {
            Some(pages) => {
                push(&[
                    "-object",
                    &format!(
                        "memory-backend-memfd,id=ram0,size={}M,hugetlb=on,hugetlbsize={pages},share=on",
                        self.memory_mib
                    ),
                ]);
                "pc,memory-backend=ram0"
            }
            None => "pc",
        };
        push(&["-machine", machine, "-accel", accel, "-cpu", cpu]);
        push(&["-smp", &self.vcpus.to_string()]);
        push(&["-m", &format!("{}M", self.memory_mib)]);
        push(&["-nodefaults", "-no-user-config", "-display", "none"]);
        push(&["-vga", "none"]);
        args.push("-kernel".into());
        args.push(self.kernel.clone().into());
        if let Some(initramfs) = &self.initramfs {
            args.push("-initrd".into());
            args.push(initramfs.clone().into());
        }
        args.push("-append".into());
        args.push(self.cmdline.clone().into());
        args.push("-chardev".into());
        args.push(option(
            "file,id=serial0,path=",
            self.serial_log.as_os_str(),
            ",append=on",
        ));
        args.extend(["-serial", "chardev:serial0"].map(OsString::from));
        if let Some(port) = &self.agent_port {
            args.extend(["-device", "virtio-serial-pci,id=vser0", "-chardev"].map(OsString::from));
            args.push(option(
                "socket,id=agent,path=",
                port.socket.as_os_str(),
                ",server=on,wait=off",
            ));
            args.push("-device".into());
            args.push(option(
                "virtserialport,bus=vser0.0,chardev=agent,name=",
                OsStr::new(&port.name),
                "",
            ));
        }
        if let Some(vsock) = self.vhost_vsock {
            args.push("-device".into());
            args.push(format!("vhost-vsock-pci,id=vsock0,guest-cid={}", vsock.guest_cid).into());
        }
        for (i, disk) in self.disks.iter().enumerate() {
            args.push("-drive".into());
            let mut drive = option("file=", disk.path.as_os_str(), "");
            drive.push(format!(
                ",format=raw,if=none,id=disk{i},aio=threads,readonly={}",
                if disk.read_only { "on" } else { "off" }
            ));
            if let Some(limit) = disk.rate_limit {
                for (key, value) in [
                    ("bps-total", limit.bytes_per_sec),
                    ("bps-total-max", limit.bytes_burst),
                    ("iops-total", limit.ops_per_sec),
                    ("iops-total-max", limit.ops_burst),
                ] {
                    if let Some(value) = value {
                        drive.push(format!(",throttling.{key}={value}"));
                    }
                }
            }
            args.push(drive);
            args.push("-device".into());
            let mut device = OsString::from(format!("virtio-blk-pci,drive=disk{i}"));
            if let Some(id) = &disk.id {
                device.push(option(",serial=", OsStr::new(id), ""));
            }
            args.push(device);
        }
        if let Some(qmp) = &self.qmp_socket {
            args.push("-qmp".into());
            args.push(option("unix:", qmp.as_os_str(), ",server=on,wait=off"));
        }
        // A guest reset ends the VM, as with tenantvm-vmm.
        args.extend(["-action", "reboot=shutdown", "-sandbox", SANDBOX].map(OsString::from));
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RateLimitConfig;

    fn command() -> QemuCommand {
        QemuCommand {
            name: "t".into(),
            accel: QemuAccel::Tcg,
            vcpus: 2,
            memory_mib: 256,
            kernel: "/vm/kernel".into(),
            initramfs: None,
            cmdline: "console=ttyS0 panic=0".into(),
            serial_log: "/log/serial.log".into(),
            agent_port: Some(SerialPort {
                socket: "/run/agent.sock".into(),
                name: "org.tenantvm.agent.0".into(),
            }),
            qmp_socket: Some("/run/qmp.sock".into()),
            vhost_vsock: None,
            hugepages: None,
            disks: vec![BlockConfig {
                path: "/vm/disk0".into(),
                read_only: true,
                id: Some("disk0".into()),
                rate_limit: Some(RateLimitConfig {
                    bytes_per_sec: Some(1 << 20),
                    ops_per_sec: Some(50),
                    ..Default::default()
                }),
            }],
        }
    }

    fn joined(c: &QemuCommand) -> String {
        c.args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn the_command_line_has_the_machine_devices_and_hardening() {
        let args = joined(&command());
        for part in [
            "-machine pc -accel tcg,tb-size=64 -cpu max -smp 2 -m 256M -nodefaults -no-user-config",
            "-kernel /vm/kernel -append console=ttyS0 panic=0",
            "-chardev file,id=serial0,path=/log/serial.log,append=on -serial chardev:serial0",
            "-device virtserialport,bus=vser0.0,chardev=agent,name=org.tenantvm.agent.0",
            "-drive file=/vm/disk0,format=raw,if=none,id=disk0,aio=threads,readonly=on,throttling.bps-total=1048576,throttling.iops-total=50",
            "-device virtio-blk-pci,drive=disk0,serial=disk0",
            "-qmp unix:/run/qmp.sock,server=on,wait=off",
            "-action reboot=shutdown -sandbox on,obsolete=deny",
        ] {
            assert!(args.contains(part), "{part:?} missing from {args}");
        }
        assert!(!args.contains("-initrd"), "{args}");
        let agent = args
            .find("path=/run/agent.sock,server=on,wait=off")
            .unwrap();
        assert!(
            agent < args.find("-qmp").unwrap(),
            "agent socket before QMP: {args}"
        );
        let kvm = QemuCommand {
            accel: QemuAccel::Kvm,
            ..command()
        };
        assert!(joined(&kvm).contains("-accel kvm -cpu host,-arch-capabilities"));
    }

    #[test]
    fn optional_parts_follow_the_description() {
        let bare = QemuCommand {
            initramfs: Some("/vm/initramfs".into()),
            agent_port: None,
            qmp_socket: None,
            disks: vec![],
            ..command()
        };
        let args = joined(&bare);
        assert!(args.contains("-initrd /vm/initramfs"), "{args}");
        for absent in ["virtio-serial", "-qmp", "-drive", "vhost-vsock"] {
            assert!(!args.contains(absent), "{absent} in {args}");
        }
    }

    /// Huge pages: a hugetlb memfd backend of the guest's size becomes the machine's RAM
    /// (QEMU 7.2's syntax, checked by hand against Debian's QEMU: a pool too small fails
    /// at start with "unable to map backing store").
    #[test]
    fn huge_pages_back_the_ram_with_a_hugetlb_memfd() {
        let args = joined(&QemuCommand {
            hugepages: Some(HugePages::Size1G),
            memory_mib: 2048,
            ..command()
        });
        assert!(
            args.contains("-object memory-backend-memfd,id=ram0,size=2048M,hugetlb=on,hugetlbsize=1G,share=on -machine pc,memory-backend=ram0 "),
            "{args}"
        );
        assert!(args.contains("-m 2048M"), "{args}");
        assert!(!joined(&command()).contains("memory-backend"));
    }

    #[test]
    fn a_vhost_vsock_device_carries_its_cid() {
        let vsock = QemuCommand {
            agent_port: None,
            vhost_vsock: Some(VhostVsock { guest_cid: 42 }),
            ..command()
        };
        let args = joined(&vsock);
        assert!(
            args.contains("-device vhost-vsock-pci,id=vsock0,guest-cid=42"),
            "{args}"
        );
        assert!(!args.contains("virtio-serial"), "{args}");
        assert!(
            args.find("vhost-vsock").unwrap() < args.find("-qmp").unwrap(),
            "{args}"
        );
    }

    #[test]
    fn commas_in_values_are_doubled() {
        let odd = QemuCommand {
            serial_log: "/tmp/a,b/serial.log".into(),
            disks: vec![BlockConfig {
                path: "/tmp/x,format=qcow2".into(),
                read_only: false,
                id: None,
                rate_limit: None,
            }],
            ..command()
        };
        let args = joined(&odd);
        assert!(
            args.contains("path=/tmp/a,,b/serial.log,append=on"),
            "{args}"
        );
        assert!(
            args.contains("file=/tmp/x,,format=qcow2,format=raw"),
            "{args}"
        );
    }
}
