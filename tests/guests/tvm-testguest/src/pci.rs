//! Minimal PCI: find the ECAM window through the ACPI MCFG (RSDP by the legacy scan of
//! 0xe0000-0xfffff, then the XSDT), read and write configuration space through it (or
//! through ports 0xCF8/0xCFC), enumerate bus 0, size BARs and place them.

use crate::report::Detail;

/// The bytes of a physical range, read volatile through the identity map.
fn phys_u8(addr: u64) -> u8 {
    // SAFETY: callers only pass addresses below 4 GiB (identity-mapped at boot): the ACPI
    // area and ECAM. The read has no side effects on RAM or configuration space.
    unsafe { core::ptr::read_volatile(addr as *const u8) }
}

fn phys_u32(addr: u64) -> u32 {
    u32::from_le_bytes([
        phys_u8(addr),
        phys_u8(addr + 1),
        phys_u8(addr + 2),
        phys_u8(addr + 3),
    ])
}

fn phys_u64(addr: u64) -> u64 {
    u64::from(phys_u32(addr)) | (u64::from(phys_u32(addr + 4)) << 32)
}

fn checksum_ok(addr: u64, len: u64) -> bool {
    (0..len).fold(0u8, |s, i| s.wrapping_add(phys_u8(addr + i))) == 0
}

/// Finds the RSDP in 0xe0000-0xfffff (16-byte aligned, "RSD PTR ", checksummed).
pub fn find_rsdp() -> Option<u64> {
    (0xe0000u64..0x100000)
        .step_by(16)
        .find(|&a| (0..8).all(|i| phys_u8(a + i) == b"RSD PTR "[i as usize]) && checksum_ok(a, 20))
}

/// The ECAM base of segment 0, bus 0 from the MCFG, found through the RSDP's XSDT (or its
/// RSDT when the RSDP is revision 0, as SeaBIOS makes it).
pub fn find_ecam() -> Result<u64, Detail> {
    let rsdp =
        find_rsdp().ok_or_else(|| Detail::fmt(format_args!("No RSDP in 0xe0000-0xfffff")))?;
    let (table, sig, entry) = if phys_u8(rsdp + 15) >= 2 {
        (phys_u64(rsdp + 24), b"XSDT", 8)
    } else {
        (u64::from(phys_u32(rsdp + 16)), b"RSDT", 4)
    };
    let name = core::str::from_utf8(sig).unwrap_or("?");
    if table >= 1 << 32 || phys_u32(table) != u32::from_le_bytes(*sig) {
        return Err(Detail::fmt(format_args!(
            "{name} at {table:#x} is not an {name}"
        )));
    }
    let len = u64::from(phys_u32(table + 4));
    if !(36..=4096).contains(&len) || !checksum_ok(table, len) {
        return Err(Detail::fmt(format_args!(
            "{name} length {len} or checksum bad"
        )));
    }
    for i in 0..(len - 36) / entry {
        let at = table + 36 + entry * i;
        let t = if entry == 8 {
            phys_u64(at)
        } else {
            u64::from(phys_u32(at))
        };
        if t >= 1 << 32 || phys_u32(t) != u32::from_le_bytes(*b"MCFG") {
            continue;
        }
        let tlen = u64::from(phys_u32(t + 4));
        if tlen < 44 + 16 || !checksum_ok(t, tlen) {
            return Err(Detail::fmt(format_args!(
                "MCFG length {tlen} or checksum bad"
            )));
        }
        // First allocation: base u64, segment u16, start bus u8, end bus u8.
        let base = phys_u64(t + 44);
        let segment = phys_u32(t + 52) & 0xffff;
        let start_bus = phys_u8(t + 54);
        if segment != 0 || start_bus != 0 {
            return Err(Detail::fmt(format_args!(
                "MCFG allocation is segment {segment} bus {start_bus}, not 0/0"
            )));
        }
        return Ok(base);
    }
    Err(Detail::fmt(format_args!("No MCFG in the {name}")))
}

/// Configuration space access for bus 0.
#[derive(Clone, Copy)]
pub enum ConfigAccess {
    /// Memory-mapped (ECAM at this base).
    Ecam(u64),
    /// Ports 0xCF8/0xCFC.
    Ports,
}

impl ConfigAccess {
    fn ecam_addr(base: u64, slot: u8, offset: u16) -> u64 {
        base + (u64::from(slot) << 15) + u64::from(offset)
    }

    /// Reads a dword at `offset` (4-aligned) of `slot`'s function 0.
    pub fn read32(self, slot: u8, offset: u16) -> u32 {
        match self {
            // SAFETY: ECAM lies in the identity-mapped first 4 GiB; an MMIO read of
            // configuration space has no effect on memory.
            ConfigAccess::Ecam(base) => unsafe {
                core::ptr::read_volatile(Self::ecam_addr(base, slot, offset) as *const u32)
            },
            ConfigAccess::Ports => {
                port_address(slot, offset);
                inl(0xcfc)
            }
        }
    }

    /// Writes a dword.
    pub fn write32(self, slot: u8, offset: u16, value: u32) {
        match self {
            // SAFETY: as for read32; writes go to the device's configuration space.
            ConfigAccess::Ecam(base) => unsafe {
                core::ptr::write_volatile(Self::ecam_addr(base, slot, offset) as *mut u32, value)
            },
            ConfigAccess::Ports => {
                port_address(slot, offset);
                outl(0xcfc, value);
            }
        }
    }

    /// Writes a byte.
    pub fn write8(self, slot: u8, offset: u16, value: u8) {
        match self {
            // SAFETY: as for write32.
            ConfigAccess::Ecam(base) => unsafe {
                core::ptr::write_volatile(Self::ecam_addr(base, slot, offset) as *mut u8, value)
            },
            ConfigAccess::Ports => {
                port_address(slot, offset & !3);
                crate::io::outb(0xcfc + (offset & 3), value);
            }
        }
    }

    /// Writes a 16-bit word (2-aligned).
    pub fn write16(self, slot: u8, offset: u16, value: u16) {
        match self {
            // SAFETY: as for write32.
            ConfigAccess::Ecam(base) => unsafe {
                core::ptr::write_volatile(Self::ecam_addr(base, slot, offset) as *mut u16, value)
            },
            ConfigAccess::Ports => {
                port_address(slot, offset & !3);
                outw(0xcfc + (offset & 3), value);
            }
        }
    }
}

fn port_address(slot: u8, offset: u16) {
    outl(
        0xcf8,
        0x8000_0000 | (u32::from(slot) << 11) | u32::from(offset & 0xfc),
    );
}

fn outl(port: u16, value: u32) {
    // SAFETY: a port write has no memory effects.
    unsafe {
        core::arch::asm!("out dx, eax", in("dx") port, in("eax") value, options(nomem, nostack))
    }
}

fn outw(port: u16, value: u16) {
    // SAFETY: as for outl.
    unsafe {
        core::arch::asm!("out dx, ax", in("dx") port, in("ax") value, options(nomem, nostack))
    }
}

fn inl(port: u16) -> u32 {
    let v: u32;
    // SAFETY: a port read has no memory effects.
    unsafe { core::arch::asm!("in eax, dx", in("dx") port, out("eax") v, options(nomem, nostack)) }
    v
}

/// One function found on bus 0.
#[derive(Clone, Copy)]
pub struct Function {
    /// Slot number.
    pub slot: u8,
}

/// Finds the first function on bus 0 with `vendor:device`.
pub fn find(cfg: ConfigAccess, vendor: u16, device: u16) -> Option<Function> {
    (0..32u8).find_map(|slot| {
        let id = cfg.read32(slot, 0);
        (id != u32::MAX && id as u16 == vendor && (id >> 16) as u16 == device)
            .then_some(Function { slot })
    })
}

/// Finds the first function on bus 0 whose class code (base, sub-class, programming
/// interface) is `class` (`0x010802`: an NVMe controller).
pub fn find_class(cfg: ConfigAccess, class: u32) -> Option<Function> {
    (0..32u8).find_map(|slot| {
        let id = cfg.read32(slot, 0);
        (id != u32::MAX && cfg.read32(slot, 8) >> 8 == class).then_some(Function { slot })
    })
}

/// Command register bits.
pub const CMD_MEMORY: u16 = 1 << 1;
/// Bus mastering.
pub const CMD_MASTER: u16 = 1 << 2;

/// Sizes 64-bit BAR 0 of `f` (decoding off, as Linux does), places it at `addr`, and turns
/// memory decoding and bus mastering on. Returns the BAR size.
pub fn place_bar0(cfg: ConfigAccess, f: Function, addr: u64) -> Result<u64, Detail> {
    let slot = f.slot;
    cfg.write16(slot, 0x04, 0);
    let lo = cfg.read32(slot, 0x10);
    if lo & 0x6 != 0x4 {
        return Err(Detail::fmt(format_args!(
            "BAR 0 of slot {slot} is not 64-bit memory ({lo:#x})"
        )));
    }
    cfg.write32(slot, 0x10, u32::MAX);
    cfg.write32(slot, 0x14, u32::MAX);
    let mask = u64::from(cfg.read32(slot, 0x10) & !0xf) | (u64::from(cfg.read32(slot, 0x14)) << 32);
    let size = (!mask).wrapping_add(1);
    if size == 0 || !size.is_power_of_two() || !addr.is_multiple_of(size) {
        return Err(Detail::fmt(format_args!(
            "BAR 0 of slot {slot}: size {size:#x}, target {addr:#x}"
        )));
    }
    cfg.write32(slot, 0x10, addr as u32);
    cfg.write32(slot, 0x14, (addr >> 32) as u32);
    cfg.write16(slot, 0x04, CMD_MEMORY | CMD_MASTER);
    let now = u64::from(cfg.read32(slot, 0x10) & !0xf) | (u64::from(cfg.read32(slot, 0x14)) << 32);
    if now != addr {
        return Err(Detail::fmt(format_args!(
            "BAR 0 of slot {slot} reads {now:#x} after writing {addr:#x}"
        )));
    }
    Ok(size)
}

/// Walks `f`'s capability list: (offset, id) pairs, at most 48 (a loop guard).
pub fn capabilities(cfg: ConfigAccess, slot: u8, mut visit: impl FnMut(u16, u8)) {
    let mut ptr = (cfg.read32(slot, 0x34) & 0xfc) as u16;
    for _ in 0..48 {
        if ptr == 0 {
            return;
        }
        let head = cfg.read32(slot, ptr);
        visit(ptr, head as u8);
        ptr = ((head >> 8) & 0xfc) as u16;
    }
}
