//! Getting a kernel ready to run: image loading, initramfs, command line, and the boot
//! information the kernel reads (zero page or PVH start info, MP table).

pub mod acpi;
pub mod kernel;
pub mod layout;
pub mod mptable;
pub mod params;

use std::path::{Path, PathBuf};

use linux_loader::loader::{load_cmdline, Cmdline};
use vm_memory::{GuestAddress, GuestMemoryMmap};

pub use kernel::{EntryPoint, InitramfsPlacement, LoadedKernel};

/// Which entry point of the kernel to use (part of the config file: tenantvm-vmm-api).
pub use tenantvm_vmm_api::BootProtocol;

/// Why a kernel could not be made ready to run.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel file cannot be opened or read.
    #[error("Cannot read kernel {}: {source}", path.display())]
    KernelOpen {
        /// The path given.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The kernel file is not a loadable image.
    #[error("The kernel is not a loadable ELF vmlinux or bzImage: {0}")]
    KernelFormat(String),
    /// Guest memory cannot hold the kernel.
    #[error(
        "Guest memory is too small for the kernel: it needs {} MiB of low memory, the guest \
         has {} MiB; raise --memory-mib",
        needed.div_ceil(1 << 20), available >> 20
    )]
    MemoryTooSmall {
        /// Bytes of low memory the kernel needs.
        needed: u64,
        /// Bytes of low memory the guest has.
        available: u64,
    },
    /// The initramfs file cannot be opened or read.
    #[error("Cannot read initramfs {}: {source}", path.display())]
    InitramfsOpen {
        /// The path given.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The initramfs does not fit between the kernel and the top of low memory.
    #[error(
        "The initramfs ({size} bytes) does not fit in guest memory: {room} bytes are free \
         above the kernel; raise --memory-mib or shrink the initramfs"
    )]
    InitramfsTooLarge {
        /// Bytes in the initramfs.
        size: u64,
        /// Bytes free between the kernel and the highest allowed initramfs address.
        room: u64,
    },
    /// The command line is too long or malformed.
    #[error("Invalid kernel command line: {0}")]
    Cmdline(String),
    /// More vCPUs than the MP table can describe.
    #[error("{requested} vCPUs requested; the platform describes at most {max}")]
    TooManyCpus {
        /// vCPUs asked for.
        requested: u32,
        /// Most supported.
        max: u32,
    },
    /// Writing boot structures to guest memory failed.
    #[error("{0}")]
    Internal(String),
}

/// What to boot.
#[derive(Debug, Clone)]
pub struct BootConfig<'a> {
    /// Kernel image path.
    pub kernel: &'a Path,
    /// Optional initramfs path.
    pub initramfs: Option<&'a Path>,
    /// Kernel command line.
    pub cmdline: &'a str,
    /// Entry point choice.
    pub protocol: BootProtocol,
    /// vCPU count (for the MP table).
    pub vcpus: u32,
    /// Guest RAM in bytes.
    pub mem_size: u64,
    /// The PCI host bridge the ACPI tables describe, if any.
    pub pci: Option<crate::acpi::PciHostBridge>,
}

/// Builds a linux-loader command line from `cmdline`, checking its length.
pub fn parse_cmdline(cmdline: &str) -> Result<Cmdline, BootError> {
    if cmdline.len() >= layout::CMDLINE_MAX_SIZE {
        return Err(BootError::Cmdline(format!(
            "it is {} bytes long; the limit is {}",
            cmdline.len(),
            layout::CMDLINE_MAX_SIZE - 1
        )));
    }
    let mut cl =
        Cmdline::new(layout::CMDLINE_MAX_SIZE).map_err(|e| BootError::Cmdline(e.to_string()))?;
    if !cmdline.trim().is_empty() {
        cl.insert_str(cmdline.trim())
            .map_err(|e| BootError::Cmdline(e.to_string()))?;
    }
    Ok(cl)
}

/// Loads everything into `mem` and returns where the boot vCPU starts.
pub fn load(mem: &GuestMemoryMmap, config: &BootConfig<'_>) -> Result<EntryPoint, BootError> {
    let cmdline = parse_cmdline(config.cmdline)?;
    let low_end = layout::ram_ranges(config.mem_size)[0].1;
    let kernel = kernel::load_kernel(mem, low_end, config.kernel, config.protocol)?;
    let initramfs = config
        .initramfs
        .map(|path| kernel::load_initramfs(mem, low_end, &kernel, path))
        .transpose()?;
    load_cmdline(mem, GuestAddress(layout::CMDLINE_START), &cmdline)
        .map_err(|e| BootError::Cmdline(e.to_string()))?;
    mptable::write(mem, config.vcpus)?;
    let rsdp = acpi::write(mem, config.vcpus, config.pci.clone())?;
    match kernel.entry {
        EntryPoint::Linux64 { .. } => params::write_zero_page(
            mem,
            config.mem_size,
            &kernel,
            config.cmdline.trim().len() + 1,
            initramfs,
            rsdp,
        )?,
        EntryPoint::Pvh { .. } => {
            params::write_pvh_start_info(mem, config.mem_size, initramfs, rsdp)?;
        }
    }
    Ok(kernel.entry)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlong_cmdline_is_refused_with_the_limit() {
        let long = "a".repeat(layout::CMDLINE_MAX_SIZE);
        let err = parse_cmdline(&long).unwrap_err().to_string();
        assert!(err.contains("limit"), "{err}");
    }

    #[test]
    fn empty_cmdline_is_accepted() {
        parse_cmdline("").unwrap();
        parse_cmdline("console=ttyS0 panic=1").unwrap();
    }
}
