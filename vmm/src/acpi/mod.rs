//! ACPI tables for a hardware-reduced x86_64 guest: RSDP, XSDT, FADT, MADT, MCFG and a
//! DSDT describing the PCI host bridge, the serial port, pvpanic and the S5 sleep state.
//!
//! The stock distribution kernel finds virtio devices on PCI only through these tables
//! (it has no virtio-mmio command-line devices), and powers off through the FADT's sleep
//! control register. The tables are built from a [`AcpiPlatform`] description, never from
//! guest input, into a contiguous blob placed at a fixed guest address
//! ([`AcpiTables::build`]); the RSDP sits first so that legacy scans of 0xe0000-0xfffff
//! find it too.

mod dsdt;

use std::ops::RangeInclusive;

use acpi_tables::fadt::{FADTBuilder, Flags, PmProfile};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::mcfg::MCFG;
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;

/// OEM id written into every table.
pub const OEM_ID: [u8; 6] = *b"TNTVM ";
/// OEM table id written into every table.
pub const OEM_TABLE_ID: [u8; 8] = *b"TENANTVM";
/// OEM revision written into every table.
pub const OEM_REVISION: u32 = 1;

/// `SLP_TYP` value of the S5 (soft-off) state, as the DSDT's `\_S5_` package gives it.
/// A guest powers off by writing `(S5_SLEEP_TYPE << 2) | SLEEP_ENABLE` to the sleep
/// control register.
pub const S5_SLEEP_TYPE: u8 = 5;
/// `SLP_EN` bit of the hardware-reduced sleep control register.
pub const SLEEP_ENABLE: u8 = 1 << 5;

/// Why ACPI tables could not be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AcpiError {
    /// More vCPUs than xAPIC ids (MADT processor entries carry 8-bit ids).
    #[error("{0} vCPUs do not fit in the MADT's 8-bit APIC ids (at most 254)")]
    TooManyVcpus(usize),
    /// The tables would not fit below the 4 GiB line the 32-bit XSDT pointers need.
    #[error("ACPI tables at {base:#x} (length {len:#x}) do not fit below 4 GiB")]
    AboveFourGib {
        /// Requested base address.
        base: u64,
        /// Total length of the tables.
        len: usize,
    },
    /// The tables grew past the space reserved for them.
    #[error("ACPI tables need {needed:#x} bytes but only {available:#x} are reserved")]
    TooLarge {
        /// Bytes the tables need.
        needed: usize,
        /// Bytes reserved for them.
        available: usize,
    },
    /// An address window is empty or inverted.
    #[error("Invalid {what} window {start:#x}..={end:#x}")]
    InvalidWindow {
        /// Which window.
        what: &'static str,
        /// Its start.
        start: u64,
        /// Its (inclusive) end.
        end: u64,
    },
}

/// The PCI host bridge the DSDT describes and the MCFG points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciHostBridge {
    /// Guest-physical base of the ECAM window (bus 0 starts here).
    pub ecam_base: u64,
    /// Last bus number decoded (the ECAM window is `(last_bus + 1) << 20` bytes).
    pub last_bus: u8,
    /// 32-bit MMIO window for BARs (inclusive range, below 4 GiB).
    pub mmio32: RangeInclusive<u32>,
    /// 64-bit MMIO window for large BARs (GPU BAR1 is up to 128 GiB on an H100).
    pub mmio64: RangeInclusive<u64>,
    /// I/O port window handed to PCI devices (excluding the 0xcf8 config ports).
    pub io: RangeInclusive<u16>,
}

impl PciHostBridge {
    /// Size in bytes of the ECAM window.
    pub fn ecam_len(&self) -> u64 {
        (u64::from(self.last_bus) + 1) << 20
    }
}

/// A legacy I/O-port device the DSDT lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoPortDevice {
    /// First port.
    pub port: u16,
    /// Number of ports.
    pub len: u8,
    /// ISA IRQ, if the device interrupts.
    pub irq: Option<u8>,
}

/// What the guest platform looks like, as far as ACPI tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcpiPlatform {
    /// Number of vCPUs; APIC ids are 0..vcpus.
    pub vcpus: usize,
    /// Guest-physical address of the local APIC.
    pub lapic_addr: u32,
    /// Guest-physical address of the I/O APIC.
    pub ioapic_addr: u32,
    /// APIC id of the I/O APIC (distinct from every vCPU's).
    pub ioapic_id: u8,
    /// I/O port of the hardware-reduced sleep control register (power-off).
    pub sleep_control_port: u16,
    /// I/O port of the sleep status register.
    pub sleep_status_port: u16,
    /// I/O port and value of the reset register.
    pub reset_port: u16,
    /// Value written to the reset port to reset.
    pub reset_value: u8,
    /// COM ports, in order (COM1 first).
    pub serial_ports: Vec<IoPortDevice>,
    /// The pvpanic port, if present.
    pub pvpanic_port: Option<u16>,
    /// The PCI host bridge, if the VM has PCI.
    pub pci: Option<PciHostBridge>,
}

/// Built tables: one contiguous blob to copy to `base`, with the RSDP at `base`.
#[derive(Debug, Clone)]
pub struct AcpiTables {
    /// Guest-physical address of the blob (and of the RSDP).
    pub base: u64,
    /// The bytes of every table, laid out back to back (16-byte aligned).
    pub bytes: Vec<u8>,
}

impl AcpiTables {
    /// Builds every table for `platform`, laid out from `base` and no longer than
    /// `max_len` bytes.
    pub fn build(platform: &AcpiPlatform, base: u64, max_len: usize) -> Result<Self, AcpiError> {
        if platform.vcpus == 0 || platform.vcpus > 254 {
            return Err(AcpiError::TooManyVcpus(platform.vcpus));
        }
        if let Some(pci) = &platform.pci {
            check_window(
                "mmio32",
                u64::from(*pci.mmio32.start()),
                u64::from(*pci.mmio32.end()),
            )?;
            check_window("mmio64", *pci.mmio64.start(), *pci.mmio64.end())?;
            check_window("io", u64::from(*pci.io.start()), u64::from(*pci.io.end()))?;
        }

        let mut layout = Layout::new(base);
        let rsdp_off = layout.reserve(Rsdp::len());

        let dsdt = sdt_bytes(&dsdt::build(platform));
        let dsdt_off = layout.place(dsdt);

        let fadt = fadt_bytes(platform, layout.addr(dsdt_off));
        let fadt_off = layout.place(fadt);

        let madt_off = layout.place(aml_bytes(&madt(platform)));

        let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
        xsdt.add_entry(layout.addr(fadt_off));
        xsdt.add_entry(layout.addr(madt_off));
        if let Some(pci) = &platform.pci {
            let mut mcfg = MCFG::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
            mcfg.add_ecam(pci.ecam_base, 0, 0, pci.last_bus);
            let mcfg_off = layout.place(aml_bytes(&mcfg));
            xsdt.add_entry(layout.addr(mcfg_off));
        }
        let xsdt_off = layout.place(aml_bytes(&xsdt));

        let rsdp = aml_bytes(&Rsdp::new(OEM_ID, layout.addr(xsdt_off)));
        layout.bytes[rsdp_off..rsdp_off + rsdp.len()].copy_from_slice(&rsdp);

        let len = layout.bytes.len();
        if len > max_len {
            return Err(AcpiError::TooLarge {
                needed: len,
                available: max_len,
            });
        }
        if base.checked_add(len as u64).is_none_or(|end| end > 1 << 32) {
            return Err(AcpiError::AboveFourGib { base, len });
        }
        Ok(Self {
            base,
            bytes: layout.bytes,
        })
    }

    /// Guest-physical address of the RSDP (what `boot_params.acpi_rsdp_addr` and PVH's
    /// `rsdp_paddr` carry).
    pub fn rsdp_addr(&self) -> u64 {
        self.base
    }
}

fn check_window(what: &'static str, start: u64, end: u64) -> Result<(), AcpiError> {
    if start > end {
        return Err(AcpiError::InvalidWindow { what, start, end });
    }
    Ok(())
}

/// Tables laid out back to back, each 16-byte aligned.
struct Layout {
    base: u64,
    bytes: Vec<u8>,
}

impl Layout {
    fn new(base: u64) -> Self {
        Self {
            base,
            bytes: Vec::new(),
        }
    }

    fn reserve(&mut self, len: usize) -> usize {
        let offset = self.bytes.len().next_multiple_of(16);
        self.bytes.resize(offset + len, 0);
        offset
    }

    fn place(&mut self, table: Vec<u8>) -> usize {
        let offset = self.reserve(table.len());
        self.bytes[offset..].copy_from_slice(&table);
        offset
    }

    fn addr(&self, offset: usize) -> u64 {
        self.base + offset as u64
    }
}

fn aml_bytes(table: &dyn Aml) -> Vec<u8> {
    let mut bytes = Vec::new();
    table.to_aml_bytes(&mut bytes);
    bytes
}

fn sdt_bytes(sdt: &Sdt) -> Vec<u8> {
    sdt.as_slice().to_vec()
}

fn io_register(port: u16) -> GAS {
    GAS::new(
        AddressSpace::SystemIo,
        8,
        0,
        AccessSize::ByteAccess,
        u64::from(port),
    )
}

fn fadt_bytes(platform: &AcpiPlatform, dsdt_addr: u64) -> Vec<u8> {
    let mut fadt = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::ResetRegSup)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton)
        .flag(Flags::Headless)
        .preferred_pm_profile(PmProfile::EnterpriseServer);
    fadt.reset_reg = io_register(platform.reset_port);
    fadt.reset_value = platform.reset_value;
    fadt.sleep_control_reg = io_register(platform.sleep_control_port);
    fadt.sleep_status_reg = io_register(platform.sleep_status_port);
    // "TNTVM" as the hypervisor vendor identity (FADT 6.x).
    fadt.hypervisor_vendor_identity = u64::from_le_bytes(*b"TNTVMHV\0").into();
    aml_bytes(&fadt.finalize())
}

fn madt(platform: &AcpiPlatform) -> MADT {
    let mut madt = MADT::new(
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
        LocalInterruptController::Address(platform.lapic_addr),
    );
    for cpu in 0..platform.vcpus {
        // `build` checked vcpus <= 254, so the id fits.
        let id = u8::try_from(cpu).unwrap_or(u8::MAX);
        madt.add_structure(ProcessorLocalApic::new(id, id, EnabledStatus::Enabled));
    }
    madt.add_structure(IoApic::new(platform.ioapic_id, platform.ioapic_addr, 0));
    madt
}

#[cfg(test)]
mod tests;
