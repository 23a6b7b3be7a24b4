use super::*;

const BASE: u64 = 0xe_0000;
const MAX_LEN: usize = 0x1_0000;

fn platform(vcpus: usize) -> AcpiPlatform {
    AcpiPlatform {
        vcpus,
        lapic_addr: 0xfee0_0000,
        ioapic_addr: 0xfec0_0000,
        ioapic_id: 0xfe,
        sleep_control_port: 0x600,
        sleep_status_port: 0x601,
        reset_port: 0x64,
        reset_value: 0xfe,
        serial_ports: vec![IoPortDevice {
            port: 0x3f8,
            len: 8,
            irq: Some(4),
        }],
        pvpanic_port: Some(0x505),
        pci: Some(PciHostBridge {
            ecam_base: 0xe000_0000,
            last_bus: 0,
            mmio32: 0xc000_0000..=0xdfff_ffff,
            mmio64: 0x100_0000_0000..=0x1ff_ffff_ffff,
            io: 0x1000..=0xffff,
        }),
    }
}

/// A table found by following pointers from the RSDP.
struct Table<'a> {
    signature: [u8; 4],
    bytes: &'a [u8],
}

fn u32_at(bytes: &[u8], offset: usize) -> u32 {
    u32::from_le_bytes(bytes[offset..offset + 4].try_into().unwrap())
}

fn u64_at(bytes: &[u8], offset: usize) -> u64 {
    u64::from_le_bytes(bytes[offset..offset + 8].try_into().unwrap())
}

fn table_at(tables: &AcpiTables, addr: u64) -> Table<'_> {
    let offset = usize::try_from(addr - tables.base).unwrap();
    let len = u32_at(&tables.bytes, offset + 4) as usize;
    let bytes = &tables.bytes[offset..offset + len];
    Table {
        signature: bytes[..4].try_into().unwrap(),
        bytes,
    }
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0u8, |sum, b| sum.wrapping_add(*b))
}

fn xsdt_entries<'a>(tables: &'a AcpiTables) -> Vec<Table<'a>> {
    let rsdp = &tables.bytes[..36];
    let xsdt = table_at(tables, u64_at(rsdp, 24));
    assert_eq!(&xsdt.signature, b"XSDT");
    xsdt.bytes[36..]
        .chunks_exact(8)
        .map(|entry| table_at(tables, u64::from_le_bytes(entry.try_into().unwrap())))
        .collect()
}

fn find<'a>(tables: &'a AcpiTables, signature: &[u8; 4]) -> Table<'a> {
    xsdt_entries(tables)
        .into_iter()
        .find(|table| &table.signature == signature)
        .unwrap_or_else(|| panic!("no {} table", String::from_utf8_lossy(signature)))
}

#[test]
fn rsdp_is_valid_and_first() {
    let tables = AcpiTables::build(&platform(2), BASE, MAX_LEN).unwrap();
    assert_eq!(tables.rsdp_addr(), BASE);
    let rsdp = &tables.bytes[..36];
    assert_eq!(&rsdp[..8], b"RSD PTR ");
    assert_eq!(rsdp[15], 2, "ACPI 2.0+ RSDP");
    assert_eq!(checksum(&rsdp[..20]), 0, "legacy checksum");
    assert_eq!(checksum(rsdp), 0, "extended checksum");
}

#[test]
fn every_table_checksums_to_zero_and_xsdt_lists_them() {
    let tables = AcpiTables::build(&platform(4), BASE, MAX_LEN).unwrap();
    let signatures: Vec<[u8; 4]> = xsdt_entries(&tables).iter().map(|t| t.signature).collect();
    assert_eq!(signatures, vec![*b"FACP", *b"APIC", *b"MCFG"]);
    for table in xsdt_entries(&tables) {
        assert_eq!(
            checksum(table.bytes),
            0,
            "{}",
            String::from_utf8_lossy(&table.signature)
        );
    }
    let fadt = find(&tables, b"FACP");
    let dsdt = table_at(&tables, u64_at(fadt.bytes, 140));
    assert_eq!(&dsdt.signature, b"DSDT");
    assert_eq!(checksum(dsdt.bytes), 0);
}

#[test]
fn fadt_is_hardware_reduced_with_sleep_and_reset_registers() {
    let tables = AcpiTables::build(&platform(1), BASE, MAX_LEN).unwrap();
    let fadt = find(&tables, b"FACP");
    let flags = u32_at(fadt.bytes, 112);
    assert_ne!(flags & (1 << 20), 0, "HW_REDUCED_ACPI");
    assert_ne!(flags & (1 << 10), 0, "RESET_REG_SUP");
    // reset_reg GAS at 116: space id 1 (I/O), address at +4.
    assert_eq!(fadt.bytes[116], 1);
    assert_eq!(u64_at(fadt.bytes, 120), 0x64);
    assert_eq!(fadt.bytes[128], 0xfe);
    // sleep_control_reg GAS at 244, sleep_status_reg at 256.
    assert_eq!(fadt.bytes[244], 1);
    assert_eq!(u64_at(fadt.bytes, 248), 0x600);
    assert_eq!(u64_at(fadt.bytes, 260), 0x601);
}

#[test]
fn madt_lists_each_vcpu_and_the_ioapic() {
    let tables = AcpiTables::build(&platform(3), BASE, MAX_LEN).unwrap();
    let madt = find(&tables, b"APIC");
    assert_eq!(u32_at(madt.bytes, 36), 0xfee0_0000);
    let mut apic_ids = Vec::new();
    let mut ioapics = Vec::new();
    let mut offset = 44;
    while offset < madt.bytes.len() {
        let (kind, len) = (madt.bytes[offset], madt.bytes[offset + 1] as usize);
        match kind {
            0 => apic_ids.push(madt.bytes[offset + 3]),
            1 => ioapics.push((madt.bytes[offset + 2], u32_at(madt.bytes, offset + 4))),
            other => panic!("unexpected MADT entry type {other}"),
        }
        assert!(len > 0);
        offset += len;
    }
    assert_eq!(apic_ids, vec![0, 1, 2]);
    assert_eq!(ioapics, vec![(0xfe, 0xfec0_0000)]);
}

#[test]
fn mcfg_points_at_the_ecam_window() {
    let tables = AcpiTables::build(&platform(1), BASE, MAX_LEN).unwrap();
    let mcfg = find(&tables, b"MCFG");
    // Allocation structure at 44: base (8), segment (2), start bus, end bus.
    assert_eq!(u64_at(mcfg.bytes, 44), 0xe000_0000);
    assert_eq!(mcfg.bytes[54], 0);
    assert_eq!(mcfg.bytes[55], 0);
}

#[test]
fn without_pci_there_is_no_mcfg() {
    let mut without_pci = platform(1);
    without_pci.pci = None;
    let tables = AcpiTables::build(&without_pci, BASE, MAX_LEN).unwrap();
    let signatures: Vec<[u8; 4]> = xsdt_entries(&tables).iter().map(|t| t.signature).collect();
    assert_eq!(signatures, vec![*b"FACP", *b"APIC"]);
}

#[test]
fn build_rejects_bad_platforms() {
    assert_eq!(
        AcpiTables::build(&platform(0), BASE, MAX_LEN).unwrap_err(),
        AcpiError::TooManyVcpus(0)
    );
    assert_eq!(
        AcpiTables::build(&platform(255), BASE, MAX_LEN).unwrap_err(),
        AcpiError::TooManyVcpus(255)
    );
    let mut inverted = platform(1);
    let (start, end) = (0xd000_0000, 0xc000_0000);
    inverted.pci.as_mut().unwrap().mmio32 = start..=end;
    assert!(matches!(
        AcpiTables::build(&inverted, BASE, MAX_LEN),
        Err(AcpiError::InvalidWindow { what: "mmio32", .. })
    ));
    assert!(matches!(
        AcpiTables::build(&platform(1), BASE, 64),
        Err(AcpiError::TooLarge { available: 64, .. })
    ));
    assert!(matches!(
        AcpiTables::build(&platform(1), 0xffff_ff00, MAX_LEN),
        Err(AcpiError::AboveFourGib { .. })
    ));
}

/// Disassembles the DSDT with ACPICA's `iasl`, the same interpreter family Linux uses,
/// and checks that the devices the guest needs are there.
#[test]
fn dsdt_disassembles_with_iasl() {
    if std::process::Command::new("iasl")
        .arg("-v")
        .output()
        .is_err()
    {
        tenantvm_skip::skip!("iasl (Debian package acpica-tools) is not installed");
    }
    let tables = AcpiTables::build(&platform(2), BASE, MAX_LEN).unwrap();
    let fadt = find(&tables, b"FACP");
    let dsdt = table_at(&tables, u64_at(fadt.bytes, 140));
    let dir = tempfile::tempdir().unwrap();
    let aml = dir.path().join("dsdt.aml");
    std::fs::write(&aml, dsdt.bytes).unwrap();
    let output = std::process::Command::new("iasl")
        .current_dir(dir.path())
        .args(["-d", "dsdt.aml"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "iasl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let dsl = std::fs::read_to_string(dir.path().join("dsdt.dsl")).unwrap();
    for needle in [
        "_S5_",
        "PNP0A08",
        "PNP0C02",
        "PNP0501",
        "QEMU0001",
        "0xE0000000",
    ] {
        assert!(dsl.contains(needle), "DSDT lacks {needle}:\n{dsl}");
    }
    // _PRT: slot 1 INTA -> GSI 17, slot 31 INTD -> GSI 18 (16 + (slot + pin) % 8).
    assert!(dsl.contains("_PRT"), "{dsl}");
    let compact: String = dsl.split_whitespace().collect();
    assert!(compact.contains("0x0001FFFF,Zero,Zero,0x11"), "{dsl}");
    assert!(compact.contains("0x001FFFFF,0x03,Zero,0x12"), "{dsl}");
    // The 64-bit window is decoded as a QWord range the size of two 128 GiB GPU BARs.
    assert!(dsl.contains("QWordMemory"), "{dsl}");
    assert!(dsl.contains("0x0000010000000000"), "{dsl}");
}
