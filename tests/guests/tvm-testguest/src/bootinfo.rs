//! The boot information the loader hands over: the command line and the memory map, read
//! from the Linux zero page (`boot_params`) or from PVH's `hvm_start_info`, and copied into
//! the guest's own memory so that tests may then overwrite all of RAM.

use crate::boot::EntryKind;

/// Longest command line kept (longer ones are reported as an error).
pub const CMDLINE_MAX: usize = 2048;
/// Most memory map entries kept (the zero page holds at most 128).
pub const MEMMAP_MAX: usize = 128;

/// e820 / PVH memory type of usable RAM.
pub const MEM_TYPE_RAM: u32 = 1;

const ZERO_PAGE_SIZE: usize = 4096;
const ZP_E820_ENTRIES: usize = 0x1e8;
const ZP_HDR_MAGIC: usize = 0x202;
const ZP_CMD_LINE_PTR: usize = 0x228;
const ZP_EXT_CMD_LINE_PTR: usize = 0x0c8;
const ZP_E820_TABLE: usize = 0x2d0;
const E820_ENTRY_SIZE: usize = 20;

const PVH_MAGIC: u32 = 0x336e_c578;
const PVH_INFO_SIZE: usize = 56;
const PVH_MEMMAP_ENTRY_SIZE: usize = 24;

/// Why the boot information could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootInfoError {
    /// The loader passed a null boot information pointer.
    NullPointer,
    /// A pointer in the boot information points outside readable memory.
    Unreadable(u64),
    /// `hvm_start_info` does not start with the PVH magic.
    BadPvhMagic(u32),
    /// PVH `hvm_start_info` version 0 has no memory map.
    NoPvhMemmap,
    /// The memory map is empty.
    EmptyMemmap,
    /// The memory map has more entries than the guest keeps.
    MemmapTooLarge(usize),
    /// The command line is not terminated within `CMDLINE_MAX` bytes.
    CmdlineTooLong,
}

impl core::fmt::Display for BootInfoError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NullPointer => write!(
                f,
                "Boot information pointer is null; the loader must pass it"
            ),
            Self::Unreadable(a) => {
                write!(f, "Boot information points at unreadable address {a:#x}")
            }
            Self::BadPvhMagic(m) => {
                write!(f, "hvm_start_info magic is {m:#x}, expected {PVH_MAGIC:#x}")
            }
            Self::NoPvhMemmap => write!(
                f,
                "hvm_start_info version 0 carries no memory map; pass version 1"
            ),
            Self::EmptyMemmap => write!(f, "The memory map is empty"),
            Self::MemmapTooLarge(n) => {
                write!(f, "The memory map has {n} entries, more than {MEMMAP_MAX}")
            }
            Self::CmdlineTooLong => {
                write!(f, "The command line is longer than {CMDLINE_MAX} bytes")
            }
        }
    }
}

/// Reads guest-physical memory; the guest reads it directly, unit tests from a buffer.
pub trait PhysRead {
    /// Fills `buf` from physical address `addr`.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), BootInfoError>;
}

/// One memory map entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemRegion {
    /// First byte.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// e820 type (1 = RAM).
    pub kind: u32,
}

impl MemRegion {
    /// One past the last byte (saturating).
    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.len)
    }
}

/// The command line and memory map, copied out of the loader's structures.
pub struct BootInfo {
    /// How the guest was entered.
    pub entry: EntryKind,
    cmdline: [u8; CMDLINE_MAX],
    cmdline_len: usize,
    regions: [MemRegion; MEMMAP_MAX],
    region_count: usize,
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from(u32_at(b, off)) | (u64::from(u32_at(b, off + 4)) << 32)
}

impl BootInfo {
    /// Reads the zero page (Linux 64-bit and bzImage entries) or `hvm_start_info` (PVH).
    pub fn read(entry: EntryKind, info: u64, mem: &dyn PhysRead) -> Result<Self, BootInfoError> {
        if info == 0 {
            return Err(BootInfoError::NullPointer);
        }
        let mut bi = BootInfo {
            entry,
            cmdline: [0; CMDLINE_MAX],
            cmdline_len: 0,
            regions: [MemRegion::default(); MEMMAP_MAX],
            region_count: 0,
        };
        let cmdline_addr = match entry {
            EntryKind::Pvh => bi.read_pvh(info, mem)?,
            EntryKind::Linux64 | EntryKind::BzImage => bi.read_zero_page(info, mem)?,
        };
        if bi.region_count == 0 {
            return Err(BootInfoError::EmptyMemmap);
        }
        if cmdline_addr != 0 {
            bi.read_cmdline(cmdline_addr, mem)?;
        }
        Ok(bi)
    }

    fn read_zero_page(&mut self, addr: u64, mem: &dyn PhysRead) -> Result<u64, BootInfoError> {
        let mut zp = [0u8; ZERO_PAGE_SIZE];
        mem.read(addr, &mut zp)?;
        let n = usize::from(zp[ZP_E820_ENTRIES]);
        if n > MEMMAP_MAX {
            return Err(BootInfoError::MemmapTooLarge(n));
        }
        for i in 0..n {
            let off = ZP_E820_TABLE + i * E820_ENTRY_SIZE;
            self.regions[i] = MemRegion {
                start: u64_at(&zp, off),
                len: u64_at(&zp, off + 8),
                kind: u32_at(&zp, off + 16),
            };
        }
        self.region_count = n;
        // Without the "HdrS" header there is no command line pointer.
        if u32_at(&zp, ZP_HDR_MAGIC) != 0x5372_6448 && u16_at(&zp, ZP_CMD_LINE_PTR) == 0 {
            return Ok(0);
        }
        let lo = u64::from(u32_at(&zp, ZP_CMD_LINE_PTR));
        let hi = u64::from(u32_at(&zp, ZP_EXT_CMD_LINE_PTR));
        Ok(lo | (hi << 32))
    }

    fn read_pvh(&mut self, addr: u64, mem: &dyn PhysRead) -> Result<u64, BootInfoError> {
        let mut si = [0u8; PVH_INFO_SIZE];
        mem.read(addr, &mut si)?;
        let magic = u32_at(&si, 0);
        if magic != PVH_MAGIC {
            return Err(BootInfoError::BadPvhMagic(magic));
        }
        if u32_at(&si, 4) < 1 {
            return Err(BootInfoError::NoPvhMemmap);
        }
        let memmap = u64_at(&si, 40);
        let n = u32_at(&si, 48) as usize;
        if n > MEMMAP_MAX {
            return Err(BootInfoError::MemmapTooLarge(n));
        }
        let mut entry = [0u8; PVH_MEMMAP_ENTRY_SIZE];
        for i in 0..n {
            mem.read(memmap + (i * PVH_MEMMAP_ENTRY_SIZE) as u64, &mut entry)?;
            self.regions[i] = MemRegion {
                start: u64_at(&entry, 0),
                len: u64_at(&entry, 8),
                kind: u32_at(&entry, 16),
            };
        }
        self.region_count = n;
        Ok(u64_at(&si, 24))
    }

    fn read_cmdline(&mut self, addr: u64, mem: &dyn PhysRead) -> Result<(), BootInfoError> {
        let mut byte = [0u8; 1];
        for i in 0..CMDLINE_MAX {
            mem.read(addr + i as u64, &mut byte)?;
            if byte[0] == 0 {
                self.cmdline_len = i;
                return Ok(());
            }
            self.cmdline[i] = byte[0];
        }
        Err(BootInfoError::CmdlineTooLong)
    }

    /// The command line (non-UTF-8 bytes make it empty).
    pub fn cmdline(&self) -> &str {
        core::str::from_utf8(&self.cmdline[..self.cmdline_len]).unwrap_or("")
    }

    /// The memory map entries, in the loader's order.
    pub fn regions(&self) -> &[MemRegion] {
        &self.regions[..self.region_count]
    }

    /// Total bytes of RAM-type entries.
    pub fn ram_bytes(&self) -> u64 {
        self.regions()
            .iter()
            .filter(|r| r.kind == MEM_TYPE_RAM)
            .map(|r| r.len)
            .sum()
    }

    /// One past the highest RAM byte.
    pub fn ram_top(&self) -> u64 {
        self.regions()
            .iter()
            .filter(|r| r.kind == MEM_TYPE_RAM)
            .map(|r| r.end())
            .max()
            .unwrap_or(0)
    }

    /// Whether `[start, end)` lies inside one RAM entry.
    pub fn is_ram(&self, start: u64, end: u64) -> bool {
        self.regions()
            .iter()
            .any(|r| r.kind == MEM_TYPE_RAM && r.start <= start && end <= r.end())
    }
}

/// The value of `key=` on a command line (the last occurrence wins, as in Linux).
pub fn cmdline_param<'a>(cmdline: &'a str, key: &str) -> Option<&'a str> {
    let mut found = None;
    for word in cmdline.split_ascii_whitespace() {
        if let Some(rest) = word.strip_prefix(key) {
            if let Some(value) = rest.strip_prefix('=') {
                found = Some(value);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec;
    use std::vec::Vec;

    struct Buf(Vec<u8>);

    impl PhysRead for Buf {
        fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), BootInfoError> {
            let start = addr as usize;
            let src = self
                .0
                .get(start..start + buf.len())
                .ok_or(BootInfoError::Unreadable(addr))?;
            buf.copy_from_slice(src);
            Ok(())
        }
    }

    fn put(mem: &mut [u8], off: usize, bytes: &[u8]) {
        mem[off..off + bytes.len()].copy_from_slice(bytes);
    }

    fn zero_page_memory(cmdline: &[u8], entries: &[(u64, u64, u32)]) -> Buf {
        let mut m = vec![0u8; 0x10000];
        let zp = 0x7000;
        put(&mut m, zp + ZP_HDR_MAGIC, b"HdrS");
        put(&mut m, zp + ZP_CMD_LINE_PTR, &0x9000u32.to_le_bytes());
        put(&mut m, 0x9000, cmdline);
        m[zp + ZP_E820_ENTRIES] = entries.len() as u8;
        for (i, (s, l, t)) in entries.iter().enumerate() {
            let off = zp + ZP_E820_TABLE + i * E820_ENTRY_SIZE;
            put(&mut m, off, &s.to_le_bytes());
            put(&mut m, off + 8, &l.to_le_bytes());
            put(&mut m, off + 16, &t.to_le_bytes());
        }
        Buf(m)
    }

    #[test]
    fn zero_page_yields_cmdline_and_e820() {
        let mem = zero_page_memory(
            b"console=ttyS0 tvm.test=smp\0",
            &[(0, 0x9fc00, 1), (0x100000, 0x7f00000, 1)],
        );
        let bi = BootInfo::read(EntryKind::Linux64, 0x7000, &mem).unwrap();
        assert_eq!(bi.cmdline(), "console=ttyS0 tvm.test=smp");
        assert_eq!(bi.regions().len(), 2);
        assert_eq!(bi.ram_top(), 0x8000000);
        assert_eq!(bi.ram_bytes(), 0x9fc00 + 0x7f00000);
        assert!(bi.is_ram(0x8000, 0x9000));
        assert!(!bi.is_ram(0x9f000, 0xa0000));
    }

    #[test]
    fn zero_page_with_too_many_e820_entries_is_refused() {
        let mut mem = zero_page_memory(b"\0", &[(0, 0x1000, 1)]);
        mem.0[0x7000 + ZP_E820_ENTRIES] = 200;
        assert_eq!(
            BootInfo::read(EntryKind::BzImage, 0x7000, &mem).err(),
            Some(BootInfoError::MemmapTooLarge(200))
        );
    }

    #[test]
    fn unterminated_cmdline_is_refused() {
        let mut mem = zero_page_memory(b"", &[(0, 0x1000, 1)]);
        for b in &mut mem.0[0x9000..0x9000 + CMDLINE_MAX + 1] {
            *b = b'x';
        }
        assert_eq!(
            BootInfo::read(EntryKind::Linux64, 0x7000, &mem).err(),
            Some(BootInfoError::CmdlineTooLong)
        );
    }

    #[test]
    fn null_boot_pointer_is_refused() {
        let mem = Buf(vec![0; 16]);
        assert_eq!(
            BootInfo::read(EntryKind::Pvh, 0, &mem).err(),
            Some(BootInfoError::NullPointer)
        );
    }

    fn pvh_memory(magic: u32, version: u32) -> Buf {
        let mut m = vec![0u8; 0x10000];
        let si = 0x6000;
        put(&mut m, si, &magic.to_le_bytes());
        put(&mut m, si + 4, &version.to_le_bytes());
        put(&mut m, si + 24, &0x6800u64.to_le_bytes());
        put(&mut m, si + 40, &0x7000u64.to_le_bytes());
        put(&mut m, si + 48, &2u32.to_le_bytes());
        put(&mut m, 0x6800, b"tvm.test=memory\0");
        for (i, (s, l, t)) in [(0u64, 0x9fc00u64, 1u32), (0x100000, 0x1f00000, 1)]
            .iter()
            .enumerate()
        {
            let off = 0x7000 + i * PVH_MEMMAP_ENTRY_SIZE;
            put(&mut m, off, &s.to_le_bytes());
            put(&mut m, off + 8, &l.to_le_bytes());
            put(&mut m, off + 16, &t.to_le_bytes());
        }
        Buf(m)
    }

    #[test]
    fn pvh_start_info_yields_cmdline_and_memmap() {
        let bi = BootInfo::read(EntryKind::Pvh, 0x6000, &pvh_memory(PVH_MAGIC, 1)).unwrap();
        assert_eq!(bi.cmdline(), "tvm.test=memory");
        assert_eq!(
            bi.regions()[1],
            MemRegion {
                start: 0x100000,
                len: 0x1f00000,
                kind: 1
            }
        );
    }

    #[test]
    fn pvh_with_bad_magic_or_version_0_is_refused() {
        assert_eq!(
            BootInfo::read(EntryKind::Pvh, 0x6000, &pvh_memory(0x1234, 1)).err(),
            Some(BootInfoError::BadPvhMagic(0x1234))
        );
        assert_eq!(
            BootInfo::read(EntryKind::Pvh, 0x6000, &pvh_memory(PVH_MAGIC, 0)).err(),
            Some(BootInfoError::NoPvhMemmap)
        );
    }

    #[test]
    fn cmdline_param_takes_the_last_value() {
        assert_eq!(
            cmdline_param("a tvm.test=smp b tvm.test=memory", "tvm.test"),
            Some("memory")
        );
        assert_eq!(cmdline_param("tvm.testx=1 tvm.test", "tvm.test"), None);
        assert_eq!(cmdline_param("", "tvm.test"), None);
    }
}
