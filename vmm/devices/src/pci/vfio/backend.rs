//! The seam between the passthrough logic and a device: [`VfioBackend`]. The kernel
//! implementation drives a vfio-pci bound device through its VFIO file descriptor; the
//! model GPU (tests) implements the same calls in memory, so every line of the config
//! shadow, BAR placement, sparse mapping and MSI-X wiring runs against both.

use std::os::fd::BorrowedFd;

use tenantvm_vmm_api::ResetOutcome;
use vmm_sys_util::eventfd::EventFd;

use super::region_caps::RegionCap;

/// VFIO's fixed region indices of a PCI device (`VFIO_PCI_*_REGION_INDEX`).
pub mod region_index {
    /// BAR 0 (BARs 0-5 are indices 0-5).
    pub const BAR0: u32 = 0;
    /// The expansion ROM BAR.
    pub const ROM: u32 = 6;
    /// Configuration space.
    pub const CONFIG: u32 = 7;
}

/// A region may be read.
pub const REGION_FLAG_READ: u32 = super::abi::VFIO_REGION_INFO_FLAG_READ;
/// A region may be written.
pub const REGION_FLAG_WRITE: u32 = super::abi::VFIO_REGION_INFO_FLAG_WRITE;
/// A region (or the sparse areas its capability lists) may be mmapped.
pub const REGION_FLAG_MMAP: u32 = super::abi::VFIO_REGION_INFO_FLAG_MMAP;

/// What the device says about one region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// Size in bytes (0: the region does not exist).
    pub size: u64,
    /// `REGION_FLAG_*` bits.
    pub flags: u32,
    /// The region's capabilities (sparse mmap areas, MSI-X mappable, type).
    pub caps: Vec<RegionCap>,
}

impl RegionInfo {
    /// Whether the kernel allows mmap of (parts of) this region.
    pub fn mmappable(&self) -> bool {
        self.flags & REGION_FLAG_MMAP != 0
    }
}

/// The interrupt kinds of a PCI device (`VFIO_PCI_*_IRQ_INDEX`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IrqIndex {
    /// Legacy INTx.
    Intx,
    /// MSI.
    Msi,
    /// MSI-X.
    Msix,
}

impl IrqIndex {
    /// The VFIO index number.
    pub fn vfio_index(self) -> u32 {
        match self {
            IrqIndex::Intx => 0,
            IrqIndex::Msi => 1,
            IrqIndex::Msix => 2,
        }
    }
}

/// What the device says about one interrupt kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IrqInfo {
    /// Number of vectors (0: the kind is not offered).
    pub count: u32,
    /// VFIO's `VFIO_IRQ_INFO_*` flags.
    pub flags: u32,
}

/// Where a region's bytes can be mmapped from: a file and the offset of the region in it.
#[derive(Debug, Clone, Copy)]
pub struct MmapSource<'a> {
    /// The file (the VFIO device fd, or the model's memfd).
    pub fd: BorrowedFd<'a>,
    /// Offset of the region's first byte in `fd`.
    pub offset: u64,
}

/// Why a backend call failed.
#[derive(Debug, thiserror::Error)]
pub enum VfioBackendError {
    /// The region index does not exist on this device.
    #[error("Region {0} does not exist on this device")]
    NoRegion(u32),
    /// The access falls outside the region, or the region refuses it.
    #[error("Access of {len} bytes at {offset:#x} is outside region {index} or not allowed there")]
    Access {
        /// Region index.
        index: u32,
        /// Offset in the region.
        offset: u64,
        /// Access length.
        len: usize,
    },
    /// The kernel refused a call.
    #[error("{op} failed: {source}")]
    Os {
        /// What was asked.
        op: &'static str,
        /// What the kernel answered.
        #[source]
        source: std::io::Error,
    },
    /// The interrupt kind is not offered, or more vectors were asked than it has.
    #[error("Interrupt kind {index:?} cannot take {asked} vectors (device offers {offered})")]
    Irq {
        /// Interrupt kind.
        index: IrqIndex,
        /// Vectors asked for.
        asked: usize,
        /// Vectors offered.
        offered: u32,
    },
}

/// One passed-through PCI function, as the passthrough logic needs it.
///
/// Calls take `&self`: the device is shared by the vCPU threads (trapped BAR and config
/// accesses) and the VMM's set-up code; implementations synchronise inside.
pub trait VfioBackend: Send + Sync {
    /// Reads `data.len()` bytes of the device's configuration space at `offset`.
    fn config_read(&self, offset: u64, data: &mut [u8]) -> Result<(), VfioBackendError> {
        self.region_read(region_index::CONFIG, offset, data)
    }
    /// Writes `data` to the device's configuration space at `offset`.
    fn config_write(&self, offset: u64, data: &[u8]) -> Result<(), VfioBackendError> {
        self.region_write(region_index::CONFIG, offset, data)
    }
    /// The region `index`, or `None` when the device has no such region.
    fn region_info(&self, index: u32) -> Option<RegionInfo>;
    /// Reads region `index` at `offset`.
    fn region_read(&self, index: u32, offset: u64, data: &mut [u8])
        -> Result<(), VfioBackendError>;
    /// Writes region `index` at `offset`.
    fn region_write(&self, index: u32, offset: u64, data: &[u8]) -> Result<(), VfioBackendError>;
    /// Where region `index` can be mmapped from (only for regions flagged mmappable).
    fn region_mmap(&self, index: u32) -> Option<MmapSource<'_>>;
    /// The interrupt kind `index`, or `None` when not offered.
    fn irq_info(&self, index: IrqIndex) -> Option<IrqInfo>;
    /// Signals vector `i` of `index` on `fds[i]` (VFIO_DEVICE_SET_IRQS, ACTION_TRIGGER).
    fn irq_enable(&self, index: IrqIndex, fds: &[&EventFd]) -> Result<(), VfioBackendError>;
    /// Stops signalling `index`.
    fn irq_disable(&self, index: IrqIndex) -> Result<(), VfioBackendError>;
    /// Unmasks `index` (INTx after the guest's EOI).
    fn irq_unmask(&self, index: IrqIndex) -> Result<(), VfioBackendError>;
    /// Unmasks `index` whenever `fd` is signalled (INTx: KVM's resample eventfd, signalled
    /// at the guest's EOI, so the line is unmasked without the VMM).
    fn irq_unmask_on(&self, index: IrqIndex, fd: &EventFd) -> Result<(), VfioBackendError>;
    /// Resets the device (function reset, then a hot reset as the fallback) and says how
    /// it went. Never panics and never hides a failure.
    fn reset(&self) -> ResetOutcome;
}
