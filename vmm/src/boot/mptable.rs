//! The Intel MultiProcessor Specification 1.4 table: how a guest without ACPI finds its
//! CPUs, its I/O APIC and the ISA interrupt wiring.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::layout::MPTABLE_START;
use super::BootError;

/// Address of the local APICs.
pub const APIC_DEFAULT_PHYS_BASE: u32 = 0xfee0_0000;
/// Address of the I/O APIC.
pub const IO_APIC_DEFAULT_PHYS_BASE: u32 = 0xfec0_0000;
/// Most vCPUs the table describes (APIC ids are 8 bits and the I/O APIC needs one).
pub const MAX_SUPPORTED_CPUS: u32 = 254;

const MPC_SPEC: u8 = 4;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTPROCESSOR: u8 = 2;
/// Family 6 stepping, as Firecracker reports.
const CPU_STEPPING: u32 = 0x600;
/// FPU and APIC present.
const CPU_FEATURE_APIC: u32 = 0x200;
const CPU_FEATURE_FPU: u32 = 0x001;
const MP_PROCESSOR: u8 = 0;
const MP_BUS: u8 = 1;
const MP_IOAPIC: u8 = 2;
const MP_INTSRC: u8 = 3;
const MP_LINTSRC: u8 = 4;
const MP_IRQ_SRC_INT: u8 = 0;
const MP_IRQ_SRC_NMI: u8 = 1;
const MP_IRQ_SRC_EXTINT: u8 = 3;
const ISA_IRQS: u8 = 16;
const FLOATING_POINTER_LEN: usize = 16;
const TABLE_HEADER_LEN: usize = 44;

/// The I/O APIC's id: the first id after the vCPUs' (0..num_cpus).
pub fn ioapic_id(num_cpus: u32) -> u8 {
    u8::try_from(num_cpus + 1).unwrap_or(u8::MAX)
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |acc, b| acc.wrapping_add(*b)))
}

/// Builds the table for `num_cpus` vCPUs (APIC ids 0..num_cpus), as it sits at
/// [`MPTABLE_START`]: floating pointer first, configuration table right after.
pub fn build(num_cpus: u32) -> Result<Vec<u8>, BootError> {
    if num_cpus == 0 || num_cpus > MAX_SUPPORTED_CPUS {
        return Err(BootError::TooManyCpus {
            requested: num_cpus,
            max: MAX_SUPPORTED_CPUS,
        });
    }
    let ioapic_id = ioapic_id(num_cpus);
    let mut entries = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..num_cpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BOOTPROCESSOR } else { 0 };
        entries.extend_from_slice(&[MP_PROCESSOR, cpu as u8, APIC_VERSION, flags]);
        entries.extend_from_slice(&CPU_STEPPING.to_le_bytes());
        entries.extend_from_slice(&(CPU_FEATURE_APIC | CPU_FEATURE_FPU).to_le_bytes());
        entries.extend_from_slice(&[0u8; 8]);
        count += 1;
    }
    entries.extend_from_slice(&[MP_BUS, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    entries.extend_from_slice(&[MP_IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&IO_APIC_DEFAULT_PHYS_BASE.to_le_bytes());
    count += 1;
    for irq in 0..ISA_IRQS {
        // type, irqtype, irqflag (u16: conforming), srcbus, srcbusirq, dstapic, dstirq
        entries.extend_from_slice(&[MP_INTSRC, MP_IRQ_SRC_INT, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    // LINT0 is the PIC's ExtINT, LINT1 the NMI, on every local APIC (0xff).
    entries.extend_from_slice(&[MP_LINTSRC, MP_IRQ_SRC_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[MP_LINTSRC, MP_IRQ_SRC_NMI, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let table_len = TABLE_HEADER_LEN + entries.len();
    let mut table = Vec::with_capacity(table_len);
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&(table_len as u16).to_le_bytes());
    table.extend_from_slice(&[MPC_SPEC, 0]); // checksum patched below
    table.extend_from_slice(b"TENANTVM");
    table.extend_from_slice(b"000000000000");
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&APIC_DEFAULT_PHYS_BASE.to_le_bytes());
    table.extend_from_slice(&0u32.to_le_bytes()); // extended table length, checksum, reserved
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let table_addr = MPTABLE_START as u32 + FLOATING_POINTER_LEN as u32;
    let mut out = Vec::with_capacity(FLOATING_POINTER_LEN + table_len);
    out.extend_from_slice(b"_MP_");
    out.extend_from_slice(&table_addr.to_le_bytes());
    out.extend_from_slice(&[1, MPC_SPEC, 0, 0, 0, 0, 0, 0]); // length in 16-byte units
    out[10] = checksum(&out);
    out.extend_from_slice(&table);
    Ok(out)
}

/// Writes the table for `num_cpus` vCPUs into guest memory at [`MPTABLE_START`].
pub fn write(mem: &GuestMemoryMmap, num_cpus: u32) -> Result<(), BootError> {
    let table = build(num_cpus)?;
    mem.write_slice(&table, GuestAddress(MPTABLE_START))
        .map_err(|e| BootError::Internal(format!("Cannot write the MP table: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    #[test]
    fn table_checksums_to_zero_and_lists_every_cpu() {
        let t = build(4).unwrap();
        assert_eq!(&t[..4], b"_MP_");
        assert_eq!(sum(&t[..16]), 0);
        let table = &t[16..];
        assert_eq!(&table[..4], b"PCMP");
        let len = u16::from_le_bytes([table[4], table[5]]) as usize;
        assert_eq!(len, table.len());
        assert_eq!(sum(table), 0);
        let procs = (0..4)
            .filter(|i| table[44 + i * 20] == MP_PROCESSOR)
            .count();
        assert_eq!(procs, 4);
        assert_eq!(table[44 + 3] & CPU_BOOTPROCESSOR, CPU_BOOTPROCESSOR);
        assert_eq!(table[44 + 20 + 3] & CPU_BOOTPROCESSOR, 0);
        let count = u16::from_le_bytes([table[34], table[35]]);
        assert_eq!(count, 4 + 1 + 1 + 16 + 2);
    }

    #[test]
    fn zero_or_too_many_cpus_are_refused() {
        build(0).unwrap_err();
        build(MAX_SUPPORTED_CPUS + 1).unwrap_err();
        build(MAX_SUPPORTED_CPUS).unwrap();
    }
}
