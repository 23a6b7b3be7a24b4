//! PCI: a type-0 configuration space model, BARs and their allocation, MSI-X, and the
//! PCI root (host bridge plus devices) reachable through ECAM and ports 0xCF8/0xCFC.
//!
//! The guest writes every configuration register and every BAR; nothing it writes can
//! make a lookup panic or move a device outside the windows the VMM allows.

mod allocator;
mod config;
mod msix;
mod root;
pub mod vfio;

pub use allocator::{
    BarAllocator, BarAllocatorError, PciWindows, ECAM_BASE, ECAM_SIZE, MMIO32_BASE, MMIO32_SIZE,
    MMIO64_ALIGN, MMIO64_DEFAULT_SIZE,
};
pub use config::{BarKind, BarMove, PciConfigError, PciConfiguration, PciHeader};
pub use msix::{MsiInterruptSink, MsiMessage, MsiSinkError, MsixConfig, MsixMetrics};
pub use root::{
    BarRelocation, BarRelocationError, PciBarWindow, PciConfigIo, PciConfigMmio, PciDevice,
    PciRoot, PciRootError, PciRootMetrics, SharedPciDevice,
};

/// Standard PCI capability IDs used here.
pub mod cap_id {
    /// MSI-X.
    pub const MSIX: u8 = 0x11;
    /// Vendor specific (virtio-pci uses these).
    pub const VENDOR: u8 = 0x09;
}

/// Offset of the command register.
pub const PCI_COMMAND: usize = 0x04;
/// Command register: I/O space decoding.
pub const COMMAND_IO: u16 = 1 << 0;
/// Command register: memory space decoding.
pub const COMMAND_MEMORY: u16 = 1 << 1;
/// Command register: bus mastering (DMA).
pub const COMMAND_BUS_MASTER: u16 = 1 << 2;
/// Command register: legacy INTx disabled.
pub const COMMAND_INTX_DISABLE: u16 = 1 << 10;

/// First I/O APIC pin (GSI) for PCI INTx; pins 16-23 are free of ISA interrupts.
pub const INTX_GSI_BASE: u32 = 16;
/// I/O APIC pins shared by PCI INTx.
pub const INTX_GSIS: u32 = 8;

/// The GSI that INTx pin `pin` (0 = INTA .. 3 = INTD) of the function in `slot` raises:
/// the usual slot swizzle over pins 16-23. The DSDT's `_PRT` says the same to the guest.
pub const fn intx_gsi(slot: u8, pin: u8) -> u32 {
    INTX_GSI_BASE + (slot as u32 + pin as u32) % INTX_GSIS
}

/// Number of device slots on bus 0.
pub const PCI_SLOTS: u8 = 32;
/// Size of one function's configuration space through ECAM.
pub const ECAM_FUNCTION_SIZE: u64 = 4096;
/// Size of the ECAM window for bus 0 (32 devices, 8 functions each).
pub const ECAM_BUS_SIZE: u64 = ECAM_FUNCTION_SIZE * 8 * PCI_SLOTS as u64;
/// Base of the legacy configuration mechanism #1 ports (0xCF8 address, 0xCFC data).
pub const PCI_CONFIG_IO_PORT: u64 = 0xcf8;
/// Number of ports the legacy configuration mechanism covers.
pub const PCI_CONFIG_IO_PORT_LEN: u64 = 8;
