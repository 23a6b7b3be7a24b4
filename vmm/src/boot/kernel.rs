//! Kernel and initramfs loading: ELF vmlinux (with or without a PVH note) and bzImage.
//!
//! The image is checked before linux-loader copies it, so that a kernel that does not fit
//! in guest memory is told apart from one that is not a kernel at all.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use linux_loader::bootparam::setup_header;
use linux_loader::elf::{Elf64_Ehdr, Elf64_Phdr};
use linux_loader::loader::elf::PvhBootCapability;
use linux_loader::loader::{BzImage, Elf, KernelLoader};
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryMmap};

use super::layout::{DEFAULT_INITRD_ADDR_MAX, HIMEM_START};
use super::{BootError, BootProtocol};

/// Offset of the setup header in a bzImage.
const SETUP_HEADER_OFFSET: u64 = 0x1f1;
/// "HdrS", the setup header magic.
const SETUP_HEADER_MAGIC: u32 = 0x5372_6448;
/// Oldest boot protocol with `xloadflags` (and so a declared 64-bit entry).
const BOOT_PROTOCOL_2_12: u16 = 0x020c;
/// `xloadflags` bit: the kernel has a 64-bit entry at +0x200.
const XLF_KERNEL_64: u16 = 1 << 0;
/// Offset of the 64-bit entry from the protected-mode kernel's load address.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
/// ELF machine number of x86_64.
const EM_X86_64: u16 = 62;
/// ELF class of 64-bit objects.
const ELFCLASS64: u8 = 2;
/// ELF program header type of loadable segments.
const PT_LOAD: u32 = 1;
/// Most program headers accepted (a vmlinux has a handful).
const MAX_PHDRS: u16 = 64;

/// How the vCPU enters the loaded kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryPoint {
    /// 64-bit long mode at `entry` with the zero page in `rsi` (ELF vmlinux, bzImage).
    Linux64 {
        /// Guest physical entry address.
        entry: u64,
    },
    /// 32-bit protected mode at `entry` with `hvm_start_info` in `ebx`.
    Pvh {
        /// Guest physical entry address.
        entry: u64,
    },
}

/// A kernel copied into guest memory.
#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    /// Where the vCPU starts.
    pub entry: EntryPoint,
    /// First byte after the kernel (including the memory it claims beyond its file).
    pub end: u64,
    /// The bzImage setup header, to copy into the zero page.
    pub setup_header: Option<setup_header>,
}

impl LoadedKernel {
    /// Highest address an initramfs may end at, as the kernel declares it.
    pub fn initrd_addr_max(&self) -> u64 {
        match self.setup_header {
            Some(hdr) if hdr.version >= 0x0203 && hdr.initrd_addr_max != 0 => {
                u64::from(hdr.initrd_addr_max)
            }
            _ => DEFAULT_INITRD_ADDR_MAX,
        }
    }
}

/// Loads the kernel at `path` into `mem`, whose low RAM ends at `low_end`.
pub fn load_kernel(
    mem: &GuestMemoryMmap,
    low_end: u64,
    path: &Path,
    protocol: BootProtocol,
) -> Result<LoadedKernel, BootError> {
    let open_err = |source| BootError::KernelOpen {
        path: path.to_owned(),
        source,
    };
    let mut file = File::open(path).map_err(open_err)?;
    let file_len = file.metadata().map_err(open_err)?.len();
    if !file.metadata().map_err(open_err)?.is_file() {
        return Err(BootError::KernelFormat("it is not a regular file".into()));
    }
    let mut magic = [0u8; 4];
    if file_len < 4 || file.read_exact(&mut magic).is_err() {
        return Err(BootError::KernelFormat("the file is too short".into()));
    }
    if magic == *b"\x7fELF" {
        load_elf(mem, low_end, &mut file, file_len, protocol)
    } else {
        match read_setup_header(&mut file)? {
            Some(hdr) => load_bzimage(mem, low_end, &mut file, hdr, protocol),
            None => Err(BootError::KernelFormat(
                "it is neither an ELF vmlinux nor a bzImage (no ELF magic, no HdrS header)".into(),
            )),
        }
    }
}

fn load_elf(
    mem: &GuestMemoryMmap,
    low_end: u64,
    file: &mut File,
    file_len: u64,
    protocol: BootProtocol,
) -> Result<LoadedKernel, BootError> {
    let corrupt = |what: &str| BootError::KernelFormat(format!("ELF image is corrupt: {what}"));
    let mut ehdr = Elf64_Ehdr::default();
    file.rewind().map_err(|_| corrupt("cannot seek"))?;
    file.read_exact(ehdr.as_mut_slice())
        .map_err(|_| corrupt("truncated ELF header"))?;
    if ehdr.e_ident[4] != ELFCLASS64 || ehdr.e_machine != EM_X86_64 {
        return Err(BootError::KernelFormat(
            "ELF image is not a 64-bit x86_64 kernel".into(),
        ));
    }
    if ehdr.e_phnum == 0 || ehdr.e_phnum > MAX_PHDRS {
        return Err(corrupt("bad program header count"));
    }
    file.seek(SeekFrom::Start(ehdr.e_phoff))
        .map_err(|_| corrupt("program headers out of the file"))?;
    let mut needed = 0u64;
    for _ in 0..ehdr.e_phnum {
        let mut phdr = Elf64_Phdr::default();
        file.read_exact(phdr.as_mut_slice())
            .map_err(|_| corrupt("truncated program headers"))?;
        if phdr.p_type != PT_LOAD {
            continue;
        }
        let in_file = phdr.p_offset.checked_add(phdr.p_filesz);
        if in_file.is_none_or(|end| end > file_len) || phdr.p_filesz > phdr.p_memsz {
            return Err(corrupt("a segment lies outside the file"));
        }
        if phdr.p_paddr < HIMEM_START {
            return Err(corrupt(
                "a segment loads below 1 MiB, over the boot structures",
            ));
        }
        let end = phdr
            .p_paddr
            .checked_add(phdr.p_memsz)
            .ok_or_else(|| corrupt("a segment overflows the address space"))?;
        needed = needed.max(end);
    }
    if needed == 0 {
        return Err(corrupt("no loadable segment"));
    }
    if needed > low_end {
        return Err(BootError::MemoryTooSmall {
            needed,
            available: low_end,
        });
    }
    let result = Elf::load(mem, None, file, Some(GuestAddress(HIMEM_START)))
        .map_err(|e| BootError::KernelFormat(e.to_string()))?;
    let entry = match (protocol, result.pvh_boot_cap) {
        (BootProtocol::Auto | BootProtocol::Pvh, PvhBootCapability::PvhEntryPresent(addr)) => {
            EntryPoint::Pvh { entry: addr.0 }
        }
        (BootProtocol::Pvh, _) => {
            return Err(BootError::KernelFormat(
                "--boot pvh was asked for but the ELF has no PVH entry note".into(),
            ))
        }
        _ => EntryPoint::Linux64 {
            entry: result.kernel_load.0,
        },
    };
    Ok(LoadedKernel {
        entry,
        end: result.kernel_end,
        setup_header: None,
    })
}

fn read_setup_header(file: &mut File) -> Result<Option<setup_header>, BootError> {
    let mut hdr = setup_header::default();
    if file.seek(SeekFrom::Start(SETUP_HEADER_OFFSET)).is_err()
        || file.read_exact(hdr.as_mut_slice()).is_err()
    {
        return Ok(None);
    }
    let magic = hdr.header;
    Ok((magic == SETUP_HEADER_MAGIC).then_some(hdr))
}

fn load_bzimage(
    mem: &GuestMemoryMmap,
    low_end: u64,
    file: &mut File,
    hdr: setup_header,
    protocol: BootProtocol,
) -> Result<LoadedKernel, BootError> {
    if protocol == BootProtocol::Pvh {
        return Err(BootError::KernelFormat(
            "--boot pvh needs an ELF vmlinux with a PVH note, not a bzImage".into(),
        ));
    }
    let (version, xloadflags, init_size) = (hdr.version, hdr.xloadflags, hdr.init_size);
    if version < BOOT_PROTOCOL_2_12 || xloadflags & XLF_KERNEL_64 == 0 {
        return Err(BootError::KernelFormat(format!(
            "bzImage (boot protocol {version:#x}) has no 64-bit entry point; use a kernel \
             built for x86_64 with boot protocol 2.12 or later"
        )));
    }
    let needed = HIMEM_START + u64::from(init_size);
    if needed > low_end {
        return Err(BootError::MemoryTooSmall {
            needed,
            available: low_end,
        });
    }
    let result = BzImage::load(mem, Some(GuestAddress(HIMEM_START)), file, None)
        .map_err(|e| BootError::KernelFormat(e.to_string()))?;
    Ok(LoadedKernel {
        entry: EntryPoint::Linux64 {
            entry: result.kernel_load.0 + BZIMAGE_64BIT_ENTRY_OFFSET,
        },
        end: result.kernel_end.max(needed),
        setup_header: result.setup_header,
    })
}

/// Where an initramfs was placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitramfsPlacement {
    /// Guest physical address of its first byte.
    pub addr: u64,
    /// Length in bytes.
    pub size: u64,
}

/// Places the initramfs at `path` at the top of low memory, page aligned, below the
/// kernel's `initrd_addr_max` and above the kernel.
pub fn load_initramfs(
    mem: &GuestMemoryMmap,
    low_end: u64,
    kernel: &LoadedKernel,
    path: &Path,
) -> Result<InitramfsPlacement, BootError> {
    let open_err = |source| BootError::InitramfsOpen {
        path: path.to_owned(),
        source,
    };
    let mut file = File::open(path).map_err(open_err)?;
    let meta = file.metadata().map_err(open_err)?;
    if !meta.is_file() {
        return Err(BootError::InitramfsOpen {
            path: path.to_owned(),
            source: std::io::Error::other("not a regular file"),
        });
    }
    let size = meta.len();
    let top = low_end.min(kernel.initrd_addr_max().saturating_add(1));
    let room = top.saturating_sub(kernel.end);
    let addr = top.checked_sub(size).map(|a| a & !0xfff);
    let addr = match addr {
        Some(addr) if addr >= kernel.end => addr,
        _ => return Err(BootError::InitramfsTooLarge { size, room }),
    };
    let len = usize::try_from(size).map_err(|_| BootError::InitramfsTooLarge { size, room })?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, len)
        .map_err(|e| BootError::InitramfsOpen {
            path: path.to_owned(),
            source: std::io::Error::other(e.to_string()),
        })?;
    Ok(InitramfsPlacement { addr, size })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const MEM: u64 = 32 << 20;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap()
    }

    /// An x86_64 ELF: one PT_LOAD of `memsz` bytes at 1 MiB, optionally a PVH note whose
    /// entry is 1 MiB + 0x10.
    fn elf(memsz: u64, pvh_note: bool) -> Vec<u8> {
        let phnum: u16 = if pvh_note { 2 } else { 1 };
        let mut img = Vec::new();
        img.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
        img.extend_from_slice(&2u16.to_le_bytes());
        img.extend_from_slice(&EM_X86_64.to_le_bytes());
        img.extend_from_slice(&1u32.to_le_bytes());
        img.extend_from_slice(&HIMEM_START.to_le_bytes());
        img.extend_from_slice(&64u64.to_le_bytes());
        img.extend_from_slice(&0u64.to_le_bytes());
        img.extend_from_slice(&0u32.to_le_bytes());
        for v in [64u16, 56, phnum, 64, 0, 0] {
            img.extend_from_slice(&v.to_le_bytes());
        }
        let phdr =
            |img: &mut Vec<u8>, p_type: u32, off: u64, addr: u64, filesz: u64, memsz: u64| {
                img.extend_from_slice(&p_type.to_le_bytes());
                img.extend_from_slice(&7u32.to_le_bytes());
                for v in [off, addr, addr, filesz, memsz, 4] {
                    img.extend_from_slice(&v.to_le_bytes());
                }
            };
        phdr(
            &mut img,
            PT_LOAD,
            0x1000,
            HIMEM_START,
            0x20,
            memsz.max(0x20),
        );
        if pvh_note {
            phdr(&mut img, 4, 0x800, 0, 20, 20);
        }
        img.resize(0x800, 0);
        if pvh_note {
            for v in [4u32, 4, 18] {
                img.extend_from_slice(&v.to_le_bytes());
            }
            img.extend_from_slice(b"Xen\0");
            img.extend_from_slice(&(HIMEM_START as u32 + 0x10).to_le_bytes());
        }
        img.resize(0x1000, 0);
        img.extend_from_slice(&[0xf4; 0x20]);
        img
    }

    fn bzimage(version: u16, xloadflags: u16, init_size: u32) -> Vec<u8> {
        let mut img = vec![0u8; 1024];
        img[0x1f1] = 1; // setup_sects
        img[0x202..0x206].copy_from_slice(b"HdrS");
        img[0x206..0x208].copy_from_slice(&version.to_le_bytes());
        img[0x211] = 1; // LOADED_HIGH
        img[0x214..0x218].copy_from_slice(&(HIMEM_START as u32).to_le_bytes());
        img[0x22c..0x230].copy_from_slice(&0x00ff_ffffu32.to_le_bytes()); // initrd_addr_max
        img[0x236..0x238].copy_from_slice(&xloadflags.to_le_bytes());
        img[0x260..0x264].copy_from_slice(&init_size.to_le_bytes());
        img.extend_from_slice(&[0xf4; 0x400]);
        img
    }

    fn file_with(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    fn load(bytes: &[u8], protocol: BootProtocol) -> Result<LoadedKernel, BootError> {
        let f = file_with(bytes);
        load_kernel(&mem(), MEM, f.path(), protocol)
    }

    #[test]
    fn elf_without_note_enters_64bit_at_its_entry() {
        let k = load(&elf(0x1000, false), BootProtocol::Auto).unwrap();
        assert_eq!(k.entry, EntryPoint::Linux64 { entry: HIMEM_START });
        assert_eq!(k.end, HIMEM_START + 0x1000);
    }

    #[test]
    fn elf_with_note_prefers_pvh_unless_linux_is_asked_for() {
        let image = elf(0x1000, true);
        let pvh = load(&image, BootProtocol::Auto).unwrap();
        assert_eq!(
            pvh.entry,
            EntryPoint::Pvh {
                entry: HIMEM_START + 0x10
            }
        );
        let linux = load(&image, BootProtocol::Linux).unwrap();
        assert_eq!(linux.entry, EntryPoint::Linux64 { entry: HIMEM_START });
    }

    #[test]
    fn pvh_without_note_is_a_format_error() {
        let err = load(&elf(0x1000, false), BootProtocol::Pvh).unwrap_err();
        assert!(matches!(err, BootError::KernelFormat(_)), "{err}");
    }

    #[test]
    fn elf_larger_than_memory_is_memory_too_small() {
        let err = load(&elf(MEM, false), BootProtocol::Auto).unwrap_err();
        assert!(
            matches!(err, BootError::MemoryTooSmall { available: MEM, .. }),
            "{err}"
        );
    }

    #[test]
    fn non_x86_64_elf_and_empty_file_are_format_errors() {
        let mut arm = elf(0x1000, false);
        arm[18] = 183; // EM_AARCH64
        assert!(matches!(
            load(&arm, BootProtocol::Auto),
            Err(BootError::KernelFormat(_))
        ));
        assert!(matches!(
            load(b"", BootProtocol::Auto),
            Err(BootError::KernelFormat(_))
        ));
    }

    #[test]
    fn bzimage_enters_at_load_address_plus_0x200() {
        let k = load(
            &bzimage(0x020f, XLF_KERNEL_64, 0x10_0000),
            BootProtocol::Auto,
        )
        .unwrap();
        assert_eq!(
            k.entry,
            EntryPoint::Linux64 {
                entry: HIMEM_START + 0x200
            }
        );
        assert_eq!(k.end, HIMEM_START + 0x10_0000);
        assert_eq!(k.initrd_addr_max(), 0x00ff_ffff);
    }

    #[test]
    fn bzimage_without_64bit_entry_or_too_big_is_refused() {
        let old = load(&bzimage(0x0206, 0, 0x1000), BootProtocol::Auto).unwrap_err();
        assert!(matches!(old, BootError::KernelFormat(_)), "{old}");
        let no64 = load(&bzimage(0x020f, 0, 0x1000), BootProtocol::Auto).unwrap_err();
        assert!(matches!(no64, BootError::KernelFormat(_)), "{no64}");
        let big = load(
            &bzimage(0x020f, XLF_KERNEL_64, MEM as u32),
            BootProtocol::Auto,
        )
        .unwrap_err();
        assert!(matches!(big, BootError::MemoryTooSmall { .. }), "{big}");
        let pvh = load(&bzimage(0x020f, XLF_KERNEL_64, 0x1000), BootProtocol::Pvh).unwrap_err();
        assert!(matches!(pvh, BootError::KernelFormat(_)), "{pvh}");
    }

    #[test]
    fn initramfs_goes_page_aligned_to_the_top_below_initrd_addr_max() {
        let m = mem();
        let kernel = LoadedKernel {
            entry: EntryPoint::Linux64 { entry: HIMEM_START },
            end: 2 << 20,
            setup_header: None,
        };
        let f = file_with(&[0xab; 5000]);
        let placed = load_initramfs(&m, MEM, &kernel, f.path()).unwrap();
        assert_eq!(placed.size, 5000);
        assert_eq!(placed.addr % 0x1000, 0);
        assert!(placed.addr + placed.size <= MEM && placed.addr + placed.size > MEM - 0x2000);
        let byte: u8 = m.read_obj(GuestAddress(placed.addr)).unwrap();
        assert_eq!(byte, 0xab);

        let bz = load(&bzimage(0x020f, XLF_KERNEL_64, 0x1000), BootProtocol::Auto).unwrap();
        let placed = load_initramfs(&m, MEM, &bz, f.path()).unwrap();
        assert!(
            placed.addr + placed.size <= 0x0100_0000,
            "below initrd_addr_max"
        );
    }

    #[test]
    fn initramfs_that_would_overlap_the_kernel_is_refused() {
        let kernel = LoadedKernel {
            entry: EntryPoint::Linux64 { entry: HIMEM_START },
            end: MEM - 0x1000,
            setup_header: None,
        };
        let f = file_with(&[0; 0x2000]);
        let err = load_initramfs(&mem(), MEM, &kernel, f.path()).unwrap_err();
        assert!(
            matches!(err, BootError::InitramfsTooLarge { size: 0x2000, .. }),
            "{err}"
        );
    }
}
