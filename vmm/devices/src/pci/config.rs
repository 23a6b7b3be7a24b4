//! A type-0 PCI configuration space: header, BARs with size probing, and a capability list.
//!
//! Every register carries a mask of guest-writable bits and a mask of write-1-to-clear
//! bits, so a guest write can change only what real hardware would let it change. The
//! space is 4 KiB (PCIe extended configuration through ECAM); the legacy 0xCF8/0xCFC
//! mechanism reaches the first 256 bytes.

use crate::narrow::{low_u16, low_u32};

use super::{COMMAND_BUS_MASTER, COMMAND_INTX_DISABLE, COMMAND_IO, COMMAND_MEMORY, PCI_COMMAND};

/// Number of 32-bit registers in a 4 KiB configuration space.
pub const CONFIG_REGS: usize = 1024;
/// Register index of BAR 0.
const BAR0_REG: usize = 4;
/// Number of BARs of a type-0 header.
pub const NUM_BARS: usize = 6;
/// Offset of the capabilities pointer.
const CAP_POINTER: usize = 0x34;
/// First offset available to capabilities (after the standard header).
const FIRST_CAP_OFFSET: usize = 0x40;
/// End of the legacy configuration space, where standard capabilities must fit.
const LEGACY_CONFIG_END: usize = 0x100;
/// Status register: capability list present.
const STATUS_CAP_LIST: u32 = 1 << 4;
/// Status register bits that are write-1-to-clear (error bits 8 and 11-15).
const STATUS_W1C: u32 = 0xf900;

/// Why a configuration space could not be built as asked. These are VMM programming
/// errors, never guest input.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciConfigError {
    /// The BAR index is not 0-5, or a 64-bit BAR was placed at index 5.
    #[error("BAR index {0} is not usable (0-5, and a 64-bit BAR needs two slots)")]
    BarIndex(usize),
    /// The BAR slot is already used.
    #[error("BAR {0} is already in use")]
    BarInUse(usize),
    /// The size is not a power of two, or is too small or too large for the BAR kind.
    #[error("BAR size {size:#x} is not a power of two in the range the BAR kind allows")]
    BarSize {
        /// The rejected size.
        size: u64,
    },
    /// The address is not aligned to the BAR's size or does not fit the BAR kind.
    #[error("BAR address {addr:#x} is not aligned to size {size:#x} or out of range")]
    BarAddress {
        /// The rejected address.
        addr: u64,
        /// The BAR size.
        size: u64,
    },
    /// No room is left in the 256-byte legacy space for another capability.
    #[error("No room for a capability of {0} bytes in configuration space")]
    CapabilitySpace(usize),
    /// A capability must hold at least its ID and next pointer.
    #[error("Capability of {0} bytes is too short (at least 2)")]
    CapabilityLength(usize),
}

/// The kind of a BAR, as the guest sees it in the low bits of the register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarKind {
    /// I/O space.
    Io,
    /// 32-bit memory.
    Memory32 {
        /// Prefetchable memory.
        prefetchable: bool,
    },
    /// 64-bit memory (takes two BAR registers).
    Memory64 {
        /// Prefetchable memory.
        prefetchable: bool,
    },
}

impl BarKind {
    fn flag_bits(self) -> u32 {
        match self {
            BarKind::Io => 0x1,
            BarKind::Memory32 { prefetchable } => u32::from(prefetchable) << 3,
            BarKind::Memory64 { prefetchable } => 0x4 | (u32::from(prefetchable) << 3),
        }
    }

    fn flag_mask(self) -> u32 {
        match self {
            BarKind::Io => 0x3,
            _ => 0xf,
        }
    }

    /// Whether this BAR is in memory space (decoded when the command register's memory bit is set).
    pub fn is_memory(self) -> bool {
        !matches!(self, BarKind::Io)
    }
}

/// A BAR the guest moved while decoding was enabled; the VMM must move its bus mapping
/// (and any ioeventfds inside the BAR) from `old` to `new`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarMove {
    /// BAR index (0-5).
    pub index: usize,
    /// The kind of BAR.
    pub kind: BarKind,
    /// Where the BAR was mapped.
    pub old: u64,
    /// Where the guest placed it.
    pub new: u64,
    /// BAR size in bytes.
    pub size: u64,
}

#[derive(Debug, Clone, Copy)]
struct Bar {
    kind: BarKind,
    size: u64,
    /// Where the VMM has the BAR mapped (the last accepted address).
    mapped: u64,
}

/// Identity of a function: the read-only part of the header.
#[derive(Debug, Clone, Copy, Default)]
pub struct PciHeader {
    /// Vendor ID.
    pub vendor_id: u16,
    /// Device ID.
    pub device_id: u16,
    /// Revision ID.
    pub revision: u8,
    /// Class code.
    pub class: u8,
    /// Subclass.
    pub subclass: u8,
    /// Programming interface.
    pub prog_if: u8,
    /// Subsystem vendor ID.
    pub subsystem_vendor_id: u16,
    /// Subsystem ID.
    pub subsystem_id: u16,
}

/// A type-0 configuration space.
#[derive(Debug, Clone)]
pub struct PciConfiguration {
    regs: Vec<u32>,
    writable: Vec<u32>,
    w1c: Vec<u32>,
    bars: [Option<Bar>; NUM_BARS],
    /// True for the register holding the high half of a 64-bit BAR.
    bar_high: [bool; NUM_BARS],
    next_cap: usize,
    last_cap: Option<usize>,
}

impl PciConfiguration {
    /// Creates a type-0 header with the given identity and no BARs or capabilities.
    pub fn new(header: PciHeader) -> Self {
        let mut regs = vec![0u32; CONFIG_REGS];
        let mut writable = vec![0u32; CONFIG_REGS];
        let mut w1c = vec![0u32; CONFIG_REGS];
        regs[0] = u32::from(header.vendor_id) | (u32::from(header.device_id) << 16);
        let command_mask =
            u32::from(COMMAND_IO | COMMAND_MEMORY | COMMAND_BUS_MASTER | COMMAND_INTX_DISABLE);
        writable[1] = command_mask;
        w1c[1] = STATUS_W1C << 16;
        regs[2] = u32::from(header.revision)
            | (u32::from(header.prog_if) << 8)
            | (u32::from(header.subclass) << 16)
            | (u32::from(header.class) << 24);
        // Cache line size and latency timer are plain storage.
        writable[3] = 0x0000_ffff;
        regs[11] = u32::from(header.subsystem_vendor_id) | (u32::from(header.subsystem_id) << 16);
        // Interrupt line is storage for the OS; interrupt pin 0 (no INTx).
        writable[15] = 0xff;
        Self {
            regs,
            writable,
            w1c,
            bars: [None; NUM_BARS],
            bar_high: [false; NUM_BARS],
            next_cap: FIRST_CAP_OFFSET,
            last_cap: None,
        }
    }

    /// Adds a BAR of `size` bytes at `addr` (where the VMM mapped it).
    pub fn add_bar(
        &mut self,
        index: usize,
        kind: BarKind,
        addr: u64,
        size: u64,
    ) -> Result<(), PciConfigError> {
        let is64 = matches!(kind, BarKind::Memory64 { .. });
        if index >= NUM_BARS || (is64 && index + 1 >= NUM_BARS) {
            return Err(PciConfigError::BarIndex(index));
        }
        if self.bars[index].is_some()
            || self.bar_high[index]
            || (is64 && (self.bars[index + 1].is_some() || self.bar_high[index + 1]))
        {
            return Err(PciConfigError::BarInUse(index));
        }
        let (min, max) = match kind {
            BarKind::Io => (4, 1 << 16),
            BarKind::Memory32 { .. } => (16, 1 << 31),
            BarKind::Memory64 { .. } => (16, 1 << 63),
        };
        if !size.is_power_of_two() || size < min || size > max {
            return Err(PciConfigError::BarSize { size });
        }
        let limit: u64 = if is64 { u64::MAX } else { u64::from(u32::MAX) };
        if addr % size != 0 || addr.checked_add(size - 1).is_none_or(|end| end > limit) {
            return Err(PciConfigError::BarAddress { addr, size });
        }
        let mask = !(size - 1);
        let reg = BAR0_REG + index;
        self.regs[reg] = (low_u32(addr) & !kind.flag_mask()) | kind.flag_bits();
        self.writable[reg] = low_u32(mask) & !kind.flag_mask();
        if is64 {
            self.regs[reg + 1] = (addr >> 32) as u32;
            self.writable[reg + 1] = (mask >> 32) as u32;
            self.bar_high[index + 1] = true;
        }
        self.bars[index] = Some(Bar {
            kind,
            size,
            mapped: addr,
        });
        Ok(())
    }

    /// Appends a capability. `data` starts with the capability ID; its byte 1 (the next
    /// pointer) is filled in here. `writable` gives the guest-writable bits, byte for byte
    /// (shorter than `data` means the rest is read-only). Returns the capability's offset.
    pub fn add_capability(
        &mut self,
        data: &[u8],
        writable: &[u8],
    ) -> Result<usize, PciConfigError> {
        if data.len() < 2 {
            return Err(PciConfigError::CapabilityLength(data.len()));
        }
        let offset = self.next_cap;
        let end = offset + data.len();
        if end > LEGACY_CONFIG_END {
            return Err(PciConfigError::CapabilitySpace(data.len()));
        }
        // The next pointers are one byte; the check above keeps `offset` below 256.
        let Ok(pointer) = u8::try_from(offset) else {
            return Err(PciConfigError::CapabilitySpace(data.len()));
        };
        for (i, byte) in data.iter().enumerate() {
            let value = if i == 1 { 0 } else { *byte };
            self.set_byte(offset + i, value);
            let mask = writable.get(i).copied().unwrap_or(0);
            self.set_mask_byte(offset + i, mask);
        }
        match self.last_cap {
            Some(prev) => self.set_byte(prev + 1, pointer),
            None => {
                self.set_byte(CAP_POINTER, pointer);
                self.regs[1] |= STATUS_CAP_LIST << 16;
            }
        }
        self.last_cap = Some(offset);
        // Capabilities start on dword boundaries.
        self.next_cap = end.next_multiple_of(4);
        Ok(offset)
    }

    fn set_byte(&mut self, offset: usize, value: u8) {
        let shift = (offset % 4) * 8;
        let reg = &mut self.regs[offset / 4];
        *reg = (*reg & !(0xff << shift)) | (u32::from(value) << shift);
    }

    fn set_mask_byte(&mut self, offset: usize, value: u8) {
        let shift = (offset % 4) * 8;
        let reg = &mut self.writable[offset / 4];
        *reg = (*reg & !(0xff << shift)) | (u32::from(value) << shift);
    }

    /// Reads register `reg` (a dword index). Out-of-range indices read all-ones.
    pub fn read_reg(&self, reg: usize) -> u32 {
        self.regs.get(reg).copied().unwrap_or(u32::MAX)
    }

    /// Overwrites register `reg` from the device side (no masks apply).
    pub fn write_reg_device(&mut self, reg: usize, value: u32) {
        if let Some(r) = self.regs.get_mut(reg) {
            *r = value;
        }
    }

    /// The command register.
    pub fn command(&self) -> u16 {
        // The command register is the low half of the dword; the status register the high.
        low_u16(self.regs[PCI_COMMAND / 4].into())
    }

    /// Applies a guest write of `data` (1, 2 or 4 bytes) at byte `offset` (0-3) of
    /// register `reg`, honouring the writable and write-1-to-clear masks. Returns the BARs
    /// the write moved. Writes of other widths or past the register are dropped.
    pub fn write(&mut self, reg: usize, offset: usize, data: &[u8]) -> Vec<BarMove> {
        if reg >= CONFIG_REGS || !matches!(data.len(), 1 | 2 | 4) || offset + data.len() > 4 {
            return Vec::new();
        }
        let mut value = 0u32;
        let mut byte_mask = 0u32;
        for (i, byte) in data.iter().enumerate() {
            value |= u32::from(*byte) << ((offset + i) * 8);
            byte_mask |= 0xff << ((offset + i) * 8);
        }
        let writable = self.writable[reg] & byte_mask;
        let clear = self.w1c[reg] & byte_mask & value;
        let old = self.regs[reg];
        self.regs[reg] = ((old & !writable) | (value & writable)) & !clear;

        let is_bar = (BAR0_REG..BAR0_REG + NUM_BARS).contains(&reg);
        let probing = is_bar && value | !byte_mask == u32::MAX;
        if (is_bar && !probing) || reg == PCI_COMMAND / 4 {
            self.collect_moves()
        } else {
            Vec::new()
        }
    }

    /// The address currently programmed into BAR `index`.
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        let bar = self.bars.get(index)?.as_ref()?;
        let low = u64::from(self.regs[BAR0_REG + index] & !bar.kind.flag_mask());
        let high = match bar.kind {
            BarKind::Memory64 { .. } => u64::from(self.regs[BAR0_REG + index + 1]) << 32,
            _ => 0,
        };
        Some(high | low)
    }

    /// Size of BAR `index`, if it exists.
    pub fn bar_size(&self, index: usize) -> Option<u64> {
        self.bars.get(index)?.as_ref().map(|b| b.size)
    }

    /// Where the VMM has BAR `index` mapped.
    pub fn bar_mapped(&self, index: usize) -> Option<u64> {
        self.bars.get(index)?.as_ref().map(|b| b.mapped)
    }

    /// Records that the VMM refused `mv`: the mapping stays at `mv.old`.
    pub fn bar_move_refused(&mut self, mv: &BarMove) {
        if let Some(Some(bar)) = self.bars.get_mut(mv.index) {
            bar.mapped = mv.old;
        }
    }

    /// BARs whose programmed address differs from their mapping while decoding is on.
    fn collect_moves(&mut self) -> Vec<BarMove> {
        let command = self.command();
        let mut moves = Vec::new();
        for index in 0..NUM_BARS {
            let Some(addr) = self.bar_address(index) else {
                continue;
            };
            let Some(bar) = self.bars[index].as_mut() else {
                continue;
            };
            let decoding = if bar.kind.is_memory() {
                command & COMMAND_MEMORY != 0
            } else {
                command & COMMAND_IO != 0
            };
            if decoding && addr != bar.mapped {
                moves.push(BarMove {
                    index,
                    kind: bar.kind,
                    old: bar.mapped,
                    new: addr,
                    size: bar.size,
                });
                bar.mapped = addr;
            }
        }
        moves
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> PciHeader {
        PciHeader {
            vendor_id: 0x1af4,
            device_id: 0x1042,
            class: 0x01,
            ..Default::default()
        }
    }

    fn write32(cfg: &mut PciConfiguration, reg: usize, value: u32) -> Vec<BarMove> {
        cfg.write(reg, 0, &value.to_le_bytes())
    }

    #[test]
    fn identity_registers_are_read_only() {
        let mut cfg = PciConfiguration::new(header());
        write32(&mut cfg, 0, 0xdead_beef);
        write32(&mut cfg, 2, 0xdead_beef);
        assert_eq!(cfg.read_reg(0), 0x1042_1af4);
        assert_eq!(cfg.read_reg(2) >> 24, 0x01);
    }

    #[test]
    fn bar32_size_probe_reads_back_mask_and_flags() {
        let mut cfg = PciConfiguration::new(header());
        cfg.add_bar(
            0,
            BarKind::Memory32 { prefetchable: true },
            0xc000_0000,
            0x4000,
        )
        .unwrap();
        assert!(write32(&mut cfg, 4, u32::MAX).is_empty());
        assert_eq!(cfg.read_reg(4), 0xffff_c008);
        write32(&mut cfg, 4, 0xc000_0000);
        assert_eq!(cfg.read_reg(4), 0xc000_0008);
    }

    #[test]
    fn bar64_size_probe_covers_both_halves() {
        let mut cfg = PciConfiguration::new(header());
        let size = 128u64 << 30;
        cfg.add_bar(2, BarKind::Memory64 { prefetchable: true }, 1 << 40, size)
            .unwrap();
        write32(&mut cfg, 6, u32::MAX);
        write32(&mut cfg, 7, u32::MAX);
        let probed = u64::from(cfg.read_reg(6) & !0xf) | (u64::from(cfg.read_reg(7)) << 32);
        assert_eq!(!probed + 1, size);
        assert_eq!(cfg.read_reg(6) & 0xf, 0xc);
    }

    #[test]
    fn bar_move_reported_only_while_decoding() {
        let mut cfg = PciConfiguration::new(header());
        cfg.add_bar(
            0,
            BarKind::Memory64 {
                prefetchable: false,
            },
            0x1_0000_0000,
            0x8000,
        )
        .unwrap();
        // Decoding off: the guest may shuffle addresses freely.
        assert!(write32(&mut cfg, 4, 0xd000_0000).is_empty());
        assert!(write32(&mut cfg, 5, 0).is_empty());
        // Enabling memory decoding reports the move once.
        let moves = write32(&mut cfg, 1, u32::from(COMMAND_MEMORY));
        assert_eq!(
            moves,
            vec![BarMove {
                index: 0,
                kind: BarKind::Memory64 {
                    prefetchable: false
                },
                old: 0x1_0000_0000,
                new: 0xd000_0000,
                size: 0x8000
            }]
        );
        assert!(write32(&mut cfg, 1, u32::from(COMMAND_MEMORY)).is_empty());
        // A size probe with decoding on is not a move.
        assert!(write32(&mut cfg, 4, u32::MAX).is_empty());
    }

    #[test]
    fn refused_move_keeps_old_mapping() {
        let mut cfg = PciConfiguration::new(header());
        cfg.add_bar(
            0,
            BarKind::Memory32 {
                prefetchable: false,
            },
            0xc000_0000,
            0x1000,
        )
        .unwrap();
        write32(&mut cfg, 1, u32::from(COMMAND_MEMORY));
        let moves = write32(&mut cfg, 4, 0x1000);
        assert_eq!(moves.len(), 1);
        cfg.bar_move_refused(&moves[0]);
        assert_eq!(cfg.bar_mapped(0), Some(0xc000_0000));
    }

    #[test]
    fn status_error_bits_are_write_one_to_clear() {
        let mut cfg = PciConfiguration::new(header());
        cfg.write_reg_device(1, 0x8000_0000);
        cfg.write(1, 2, &[0x00, 0x80]);
        assert_eq!(cfg.read_reg(1) & 0x8000_0000, 0);
    }

    #[test]
    fn capabilities_are_chained() {
        let mut cfg = PciConfiguration::new(header());
        let a = cfg.add_capability(&[0x09, 0, 4, 1], &[]).unwrap();
        let b = cfg
            .add_capability(&[0x11, 0, 0, 0, 0, 0], &[0, 0, 0xff])
            .unwrap();
        assert_eq!(
            cfg.read_reg(CAP_POINTER / 4) & 0xff,
            u32::try_from(a).unwrap()
        );
        assert_eq!((cfg.read_reg(a / 4) >> 8) & 0xff, u32::try_from(b).unwrap());
        assert_ne!(cfg.read_reg(1) & (STATUS_CAP_LIST << 16), 0);
        // Only the writable byte changes.
        cfg.write(b / 4, 0, &[0xff, 0xff, 0xff, 0xff]);
        assert_eq!(cfg.read_reg(b / 4), 0x00ff_0011);
    }

    #[test]
    fn garbage_writes_never_panic() {
        let mut cfg = PciConfiguration::new(header());
        cfg.add_bar(
            0,
            BarKind::Memory64 {
                prefetchable: false,
            },
            0x1_0000_0000,
            0x8000,
        )
        .unwrap();
        let mut x = 0x1234_5678u32;
        for reg in 0..CONFIG_REGS + 8 {
            for offset in 0..6 {
                for len in [0usize, 1, 2, 3, 4, 8] {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    let data = x.to_le_bytes().repeat(2);
                    cfg.write(reg, offset, &data[..len]);
                }
            }
        }
        assert_eq!(cfg.read_reg(0), 0x1042_1af4);
        assert_eq!(cfg.read_reg(CONFIG_REGS), u32::MAX);
    }

    #[test]
    fn add_bar_rejects_bad_layouts() {
        let mut cfg = PciConfiguration::new(header());
        let mem64 = BarKind::Memory64 {
            prefetchable: false,
        };
        assert_eq!(
            cfg.add_bar(5, mem64, 0, 0x1000),
            Err(PciConfigError::BarIndex(5))
        );
        assert_eq!(
            cfg.add_bar(0, mem64, 0, 0x1001),
            Err(PciConfigError::BarSize { size: 0x1001 })
        );
        assert_eq!(
            cfg.add_bar(0, mem64, 0x800, 0x1000),
            Err(PciConfigError::BarAddress {
                addr: 0x800,
                size: 0x1000
            })
        );
        cfg.add_bar(0, mem64, 0, 0x1000).unwrap();
        assert_eq!(
            cfg.add_bar(1, mem64, 0, 0x1000),
            Err(PciConfigError::BarInUse(1))
        );
    }
}
