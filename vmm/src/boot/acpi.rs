//! Places the ACPI tables (built by [`crate::acpi`]) for this VM's platform in guest memory.

use tenantvm_devices::legacy::{
    ACPI_SLEEP_CONTROL_PORT, ACPI_SLEEP_STATUS_PORT, COM1_IRQ, COM1_LEN, COM1_PORT, PVPANIC_PORT,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::layout::{ACPI_MAX_LEN, ACPI_START};
use super::mptable::{APIC_DEFAULT_PHYS_BASE, IO_APIC_DEFAULT_PHYS_BASE};
use super::BootError;
use crate::acpi::{AcpiPlatform, AcpiTables, IoPortDevice};
use tenantvm_devices::legacy::ACPI_RESET_VALUE;

/// The platform the tables describe for `vcpus` vCPUs: the legacy devices of
/// docs/vmm.md, the I/O APIC with the same id as in the MP table, no PCI yet.
pub fn platform(vcpus: u32) -> AcpiPlatform {
    AcpiPlatform {
        vcpus: vcpus as usize,
        lapic_addr: APIC_DEFAULT_PHYS_BASE,
        ioapic_addr: IO_APIC_DEFAULT_PHYS_BASE,
        ioapic_id: super::mptable::ioapic_id(vcpus),
        sleep_control_port: ACPI_SLEEP_CONTROL_PORT as u16,
        sleep_status_port: ACPI_SLEEP_STATUS_PORT as u16,
        reset_port: ACPI_SLEEP_CONTROL_PORT as u16,
        reset_value: ACPI_RESET_VALUE,
        serial_ports: vec![IoPortDevice {
            port: COM1_PORT as u16,
            len: COM1_LEN as u8,
            irq: Some(COM1_IRQ as u8),
        }],
        pvpanic_port: Some(PVPANIC_PORT as u16),
        pci: None,
    }
}

/// Builds and writes the tables at [`ACPI_START`]; returns the RSDP's address.
pub fn write(mem: &GuestMemoryMmap, vcpus: u32) -> Result<u64, BootError> {
    let tables = AcpiTables::build(&platform(vcpus), ACPI_START, ACPI_MAX_LEN)
        .map_err(|e| BootError::Internal(format!("Cannot build the ACPI tables: {e}")))?;
    mem.write_slice(&tables.bytes, GuestAddress(tables.base))
        .map_err(|e| BootError::Internal(format!("Cannot write the ACPI tables: {e}")))?;
    Ok(tables.rsdp_addr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_land_at_acpi_start_with_rsdp_signature() {
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        let rsdp = write(&m, 2).unwrap();
        assert_eq!(rsdp, ACPI_START);
        let mut sig = [0u8; 8];
        m.read_slice(&mut sig, GuestAddress(rsdp)).unwrap();
        assert_eq!(&sig, b"RSD PTR ");
    }

    #[test]
    fn platform_matches_the_legacy_ports_and_mp_table() {
        let p = platform(4);
        assert_eq!(p.sleep_control_port, 0x600);
        assert_eq!(p.reset_port, 0x600);
        assert_eq!(p.ioapic_id, 5);
        assert_eq!(p.serial_ports[0].irq, Some(4));
    }
}
