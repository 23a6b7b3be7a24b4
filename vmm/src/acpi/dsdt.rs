//! The DSDT: the guest's device tree in AML.
//!
//! It names the S5 sleep state (so Linux powers off through the FADT's sleep control
//! register), the PCI host bridge with its bus, I/O and memory windows, a motherboard
//! resource device that reserves the ECAM window (Linux refuses an MCFG region that is not
//! reserved in e820 or by a PNP0C02 device), the COM ports and pvpanic.

use acpi_tables::aml::{
    AddressSpace, AddressSpaceCacheable, Device, EISAName, Interrupt, Memory32Fixed, Name, Package,
    Path, ResourceTemplate, Scope, IO,
};
use acpi_tables::sdt::Sdt;
use acpi_tables::Aml;

use super::{
    AcpiPlatform, IoPortDevice, PciHostBridge, OEM_ID, OEM_REVISION, OEM_TABLE_ID, S5_SLEEP_TYPE,
};

/// Builds the DSDT for `platform`.
pub(super) fn build(platform: &AcpiPlatform) -> Sdt {
    let mut aml = Vec::new();

    // \_S5_: Package { SLP_TYPa, SLP_TYPb, reserved, reserved }.
    let s5 = Package::new(vec![&S5_SLEEP_TYPE, &S5_SLEEP_TYPE, &0u8, &0u8]);
    Name::new(Path::new("_S5_"), &s5).to_aml_bytes(&mut aml);

    let mut sb_children: Vec<Box<dyn Aml>> = Vec::new();
    if let Some(pci) = &platform.pci {
        sb_children.push(Box::new(pci_host_bridge(pci)));
        sb_children.push(Box::new(ecam_reservation(pci)));
    }
    for (index, port) in platform.serial_ports.iter().enumerate() {
        sb_children.push(Box::new(serial_device(index, port)));
    }
    if let Some(port) = platform.pvpanic_port {
        sb_children.push(Box::new(pvpanic_device(port)));
    }
    let refs: Vec<&dyn Aml> = sb_children.iter().map(|child| child.as_ref()).collect();
    Scope::new(Path::new("\\_SB_"), refs).to_aml_bytes(&mut aml);

    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    dsdt.append_slice(&aml);
    dsdt
}

/// An AML device whose children are built into owned bytes, so that the borrowed
/// `acpi_tables` builders never outlive this module's temporaries.
struct RawAml(Vec<u8>);

impl Aml for RawAml {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        sink.vec(&self.0);
    }
}

fn to_raw(aml: &dyn Aml) -> RawAml {
    let mut bytes = Vec::new();
    aml.to_aml_bytes(&mut bytes);
    RawAml(bytes)
}

fn pci_host_bridge(pci: &PciHostBridge) -> RawAml {
    let bus = AddressSpace::<u16>::new_bus_number(0, u16::from(pci.last_bus));
    let config_ports = IO::new(0xcf8, 0xcf8, 1, 8);
    let io = AddressSpace::<u16>::new_io(*pci.io.start(), *pci.io.end(), None);
    let mmio32 = AddressSpace::<u32>::new_memory(
        AddressSpaceCacheable::NotCacheable,
        true,
        *pci.mmio32.start(),
        *pci.mmio32.end(),
        None,
    );
    let mmio64 = AddressSpace::<u64>::new_memory(
        AddressSpaceCacheable::PreFetchable,
        true,
        *pci.mmio64.start(),
        *pci.mmio64.end(),
        None,
    );
    let crs = ResourceTemplate::new(vec![&bus, &config_ports, &io, &mmio32, &mmio64]);
    let hid = EISAName::new("PNP0A08");
    let cid = EISAName::new("PNP0A03");
    let name_hid = Name::new(Path::new("_HID"), &hid);
    let name_cid = Name::new(Path::new("_CID"), &cid);
    let name_adr = Name::new(Path::new("_ADR"), &0u8);
    let name_seg = Name::new(Path::new("_SEG"), &0u8);
    let name_uid = Name::new(Path::new("_UID"), &0u8);
    let name_bbn = Name::new(Path::new("_BBN"), &0u8);
    let name_crs = Name::new(Path::new("_CRS"), &crs);
    let prt = interrupt_routing();
    let name_prt = Name::new(Path::new("_PRT"), &prt);
    to_raw(&Device::new(
        Path::new("PCI0"),
        vec![
            &name_hid, &name_cid, &name_adr, &name_seg, &name_uid, &name_bbn, &name_crs, &name_prt,
        ],
    ))
}

/// `_PRT`: INTA-INTD of every slot of bus 0 to I/O APIC pins 16-23 (`pci::intx_gsi`), for
/// passed-through devices without MSI. Entries: { address (slot << 16 | 0xffff), pin,
/// source 0 (a GSI, not a link device), GSI }.
fn interrupt_routing() -> RawAml {
    let entries: Vec<RawAml> = (1..tenantvm_devices::pci::PCI_SLOTS)
        .flat_map(|slot| {
            (0..4u8).map(move |pin| {
                let address = (u32::from(slot) << 16) | 0xffff;
                let gsi = tenantvm_devices::pci::intx_gsi(slot, pin);
                to_raw(&Package::new(vec![&address, &pin, &0u8, &gsi]))
            })
        })
        .collect();
    let refs: Vec<&dyn Aml> = entries.iter().map(|e| e as &dyn Aml).collect();
    to_raw(&Package::new(refs))
}

fn ecam_reservation(pci: &PciHostBridge) -> RawAml {
    // The ECAM window sits below 4 GiB in every layout tenantvm uses; a QWord range would
    // be needed otherwise.
    let base = u32::try_from(pci.ecam_base).unwrap_or(u32::MAX);
    let len = u32::try_from(pci.ecam_len()).unwrap_or(u32::MAX);
    let mem = Memory32Fixed::new(false, base, len);
    let crs = ResourceTemplate::new(vec![&mem]);
    let hid = EISAName::new("PNP0C02");
    let name_hid = Name::new(Path::new("_HID"), &hid);
    let name_uid = Name::new(Path::new("_UID"), &"ECAM");
    let name_crs = Name::new(Path::new("_CRS"), &crs);
    to_raw(&Device::new(
        Path::new("MRES"),
        vec![&name_hid, &name_uid, &name_crs],
    ))
}

fn serial_device(index: usize, port: &IoPortDevice) -> RawAml {
    let io = IO::new(port.port, port.port, 1, port.len);
    let irq = port
        .irq
        .map(|irq| Interrupt::new(true, true, false, false, u32::from(irq)));
    let mut resources: Vec<&dyn Aml> = vec![&io];
    if let Some(irq) = &irq {
        resources.push(irq);
    }
    let crs = ResourceTemplate::new(resources);
    let hid = EISAName::new("PNP0501");
    let uid = u8::try_from(index).unwrap_or(u8::MAX);
    let name_hid = Name::new(Path::new("_HID"), &hid);
    let name_uid = Name::new(Path::new("_UID"), &uid);
    let name_crs = Name::new(Path::new("_CRS"), &crs);
    // COM1 is "COM0" in AML names: four characters, unique per port.
    let name = format!("COM{}", index.min(9));
    to_raw(&Device::new(
        Path::new(&name),
        vec![&name_hid, &name_uid, &name_crs],
    ))
}

fn pvpanic_device(port: u16) -> RawAml {
    let io = IO::new(port, port, 1, 1);
    let crs = ResourceTemplate::new(vec![&io]);
    // Linux's pvpanic driver binds to QEMU0001 on ACPI systems.
    let name_hid = Name::new(Path::new("_HID"), &"QEMU0001");
    let name_crs = Name::new(Path::new("_CRS"), &crs);
    to_raw(&Device::new(Path::new("PEVT"), vec![&name_hid, &name_crs]))
}
