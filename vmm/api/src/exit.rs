//! The exit statuses of `tenantvm-vmm`: how the process says why the VM ended or could not
//! start. The VMM exits with [`ExitStatus::code`]; `--help` prints [`help_table`]; the
//! orchestrator decodes a status with [`ExitStatus::from_code`].

use serde::{Deserialize, Serialize};

/// Why a `tenantvm-vmm` process ended (docs/vmm.md, "Exit statuses").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitStatus {
    /// 0: the guest powered off cleanly (ACPI sleep control register, S5).
    PowerOff,
    /// 1: VMM runtime error (a KVM ioctl failed, a device thread died).
    VmmError,
    /// 2: usage or config error (unknown flag or field, bad value).
    ConfigError,
    /// 3: the guest asked for a reset (i8042 0xFE, or the ACPI reset register).
    Reset,
    /// 4: triple fault (KVM_EXIT_SHUTDOWN).
    TripleFault,
    /// 5: the guest reported a crash (pvpanic).
    GuestPanic,
    /// 6: stopped through the control socket (`shutdown`).
    Stopped,
    /// 7: the guest could not be run (KVM internal error, failed entry, emulation failure).
    GuestUnrunnable,
    /// 10: kernel missing or unreadable.
    KernelUnreadable,
    /// 11: kernel is not a loadable ELF vmlinux or bzImage.
    KernelFormat,
    /// 12: initramfs missing, unreadable, or larger than fits in guest memory.
    Initramfs,
    /// 13: guest memory too small for the kernel.
    MemoryTooSmall,
    /// 14: vCPU count is 0 or above what KVM allows on this host.
    VcpuCount,
    /// 15: control socket path busy (a live socket answers there) or not writable.
    ApiSocket,
    /// 16: /dev/kvm missing or not usable.
    KvmUnavailable,
    /// 17: serial output file cannot be opened.
    SerialFile,
    /// 18: a disk image is missing, unreadable or unusable.
    DiskImage,
    /// 19: the vsock socket path is busy, not a socket, or not writable.
    VsockSocket,
    /// 20: a VMM thread made a system call outside its seccomp filter.
    SeccompViolation,
    /// 21: a passed-through device path is not a PCI device.
    VfioDevicePath,
    /// 22: a passed-through device is not registered with VFIO (bound to no driver, or to a
    /// host driver that has not registered it).
    VfioNotBound,
    /// 23: a passed-through device has no IOMMU group, or its group is not viable (another
    /// member is bound to a host driver).
    VfioGroup,
    /// 24: no VFIO on the host (`/dev/vfio/vfio` missing or unusable), or the device could
    /// not be opened through it.
    VfioUnavailable,
    /// 25: guest RAM could not be mapped for device DMA (RLIMIT_MEMLOCK too low).
    VfioDmaMap,
    /// 26: the devices' BARs do not fit the guest's physical address space.
    BarPlacement,
}

impl ExitStatus {
    /// Every status, in code order.
    pub const ALL: [ExitStatus; 25] = [
        ExitStatus::PowerOff,
        ExitStatus::VmmError,
        ExitStatus::ConfigError,
        ExitStatus::Reset,
        ExitStatus::TripleFault,
        ExitStatus::GuestPanic,
        ExitStatus::Stopped,
        ExitStatus::GuestUnrunnable,
        ExitStatus::KernelUnreadable,
        ExitStatus::KernelFormat,
        ExitStatus::Initramfs,
        ExitStatus::MemoryTooSmall,
        ExitStatus::VcpuCount,
        ExitStatus::ApiSocket,
        ExitStatus::KvmUnavailable,
        ExitStatus::SerialFile,
        ExitStatus::DiskImage,
        ExitStatus::VsockSocket,
        ExitStatus::SeccompViolation,
        ExitStatus::VfioDevicePath,
        ExitStatus::VfioNotBound,
        ExitStatus::VfioGroup,
        ExitStatus::VfioUnavailable,
        ExitStatus::VfioDmaMap,
        ExitStatus::BarPlacement,
    ];

    /// The process exit status.
    pub const fn code(self) -> u8 {
        match self {
            ExitStatus::PowerOff => 0,
            ExitStatus::VmmError => 1,
            ExitStatus::ConfigError => 2,
            ExitStatus::Reset => 3,
            ExitStatus::TripleFault => 4,
            ExitStatus::GuestPanic => 5,
            ExitStatus::Stopped => 6,
            ExitStatus::GuestUnrunnable => 7,
            ExitStatus::KernelUnreadable => 10,
            ExitStatus::KernelFormat => 11,
            ExitStatus::Initramfs => 12,
            ExitStatus::MemoryTooSmall => 13,
            ExitStatus::VcpuCount => 14,
            ExitStatus::ApiSocket => 15,
            ExitStatus::KvmUnavailable => 16,
            ExitStatus::SerialFile => 17,
            ExitStatus::DiskImage => 18,
            ExitStatus::VsockSocket => 19,
            ExitStatus::SeccompViolation => 20,
            ExitStatus::VfioDevicePath => 21,
            ExitStatus::VfioNotBound => 22,
            ExitStatus::VfioGroup => 23,
            ExitStatus::VfioUnavailable => 24,
            ExitStatus::VfioDmaMap => 25,
            ExitStatus::BarPlacement => 26,
        }
    }

    /// The status a process exit code stands for; `None` for codes the VMM never uses.
    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|s| i32::from(s.code()) == code)
    }

    /// Whether the VM never ran: the VMM refused its configuration or the host (statuses
    /// 10 to 19, and the passthrough statuses 21 to 26).
    pub const fn is_start_failure(self) -> bool {
        matches!(self.code(), 10..=19 | 21..=26)
    }

    /// What the status means, for people (the line of the `--help` table and
    /// docs/vmm.md).
    pub const fn description(self) -> &'static str {
        match self {
            ExitStatus::PowerOff => "the guest powered off (ACPI sleep control port 0x600, S5)",
            ExitStatus::VmmError => "VMM runtime error (a KVM ioctl failed, a device thread died)",
            ExitStatus::ConfigError => "usage or config error (unknown flag or field, bad value)",
            ExitStatus::Reset => "the guest asked for a reset (i8042 0xFE, ACPI reset)",
            ExitStatus::TripleFault => "triple fault (KVM_EXIT_SHUTDOWN)",
            ExitStatus::GuestPanic => "the guest reported a crash (pvpanic, port 0x505)",
            ExitStatus::Stopped => "stopped through the control socket",
            ExitStatus::GuestUnrunnable => {
                "the guest could not be run (KVM internal error, failed entry)"
            }
            ExitStatus::KernelUnreadable => "kernel missing or unreadable",
            ExitStatus::KernelFormat => "kernel is not a loadable ELF vmlinux or bzImage",
            ExitStatus::Initramfs => "initramfs missing, unreadable, or too large for guest memory",
            ExitStatus::MemoryTooSmall => "guest memory too small for the kernel",
            ExitStatus::VcpuCount => "vCPU count is 0 or above what KVM allows",
            ExitStatus::ApiSocket => "control socket path busy or not writable",
            ExitStatus::KvmUnavailable => "/dev/kvm missing or not usable",
            ExitStatus::SerialFile => "serial output file cannot be opened",
            ExitStatus::DiskImage => "a disk image is missing, unreadable or unusable",
            ExitStatus::VsockSocket => {
                "the vsock socket path is busy, not a socket or not writable"
            }
            ExitStatus::SeccompViolation => {
                "a VMM thread made a system call its seccomp filter does not allow"
            }
            ExitStatus::VfioDevicePath => "a passed-through device path is not a PCI device",
            ExitStatus::VfioNotBound => {
                "a passed-through device is not registered with VFIO by its driver"
            }
            ExitStatus::VfioGroup => {
                "a passed-through device's IOMMU group is missing or not viable"
            }
            ExitStatus::VfioUnavailable => "/dev/vfio missing, or the device cannot be opened",
            ExitStatus::VfioDmaMap => "guest RAM cannot be mapped for DMA (RLIMIT_MEMLOCK)",
            ExitStatus::BarPlacement => "device BARs do not fit the guest physical address space",
        }
    }
}

/// The table of every status and its meaning, one right-aligned status per line, as
/// `tenantvm-vmm --help` prints it.
pub fn help_table() -> String {
    ExitStatus::ALL
        .iter()
        .map(|s| format!("{:>3}  {}\n", s.code(), s.description()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_decode_back() {
        let mut seen = std::collections::BTreeSet::new();
        for status in ExitStatus::ALL {
            assert!(seen.insert(status.code()), "{status:?} repeats a code");
            assert_eq!(ExitStatus::from_code(status.code().into()), Some(status));
        }
        for unused in [-1, 8, 9, 27, 120, 255] {
            assert_eq!(ExitStatus::from_code(unused), None, "{unused}");
        }
    }

    #[test]
    fn start_failures_are_exactly_10_to_19_and_21_to_26() {
        let starts: Vec<u8> = ExitStatus::ALL
            .into_iter()
            .filter(|s| s.is_start_failure())
            .map(ExitStatus::code)
            .collect();
        assert_eq!(starts, (10..=19).chain(21..=26).collect::<Vec<u8>>());
    }

    #[test]
    fn the_help_table_lists_every_status() {
        let table = help_table();
        assert_eq!(table.lines().count(), ExitStatus::ALL.len());
        assert!(table.starts_with("  0  the guest powered off"), "{table}");
        assert!(
            table.contains(" 20  a VMM thread made a system call"),
            "{table}"
        );
    }
}
