//! Where the VMM puts things in guest physical memory (x86_64).
//!
//! Everything the VMM writes for boot lives in the first megabyte, below the kernel:
//! ```text
//! 0x0500  GDT                    0x7000  zero page (Linux boot)
//! 0x0520  IDT (empty)            0x8ff0  initial stack pointer (grows down)
//! 0xe0000 ACPI tables (RSDP first, where legacy scans look)
//! 0x6000  PVH hvm_start_info     0x9000  PML4, 0xa000 PDPT, 0xb000-0xefff PDs
//! 0x6040  PVH module list        0x20000 kernel command line
//! 0x6100  PVH memory map         0x9fc00 EBDA start (reserved to 1 MiB)
//! 0xf0000 MP table               0x100000 high memory: kernel, initramfs at the top
//! ```

/// Guest address of the GDT.
pub const GDT_START: u64 = 0x500;
/// Guest address of the (empty) IDT.
pub const IDT_START: u64 = 0x520;
/// Guest address of PVH's `hvm_start_info`.
pub const PVH_INFO_START: u64 = 0x6000;
/// Guest address of PVH's module list (one entry: the initramfs).
pub const PVH_MODLIST_START: u64 = 0x6040;
/// Guest address of PVH's memory map.
pub const PVH_MEMMAP_START: u64 = 0x6100;
/// Guest address of the Linux zero page (`boot_params`).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer for the 64-bit entry.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Guest address of the PML4 page of the boot identity map.
pub const PML4_START: u64 = 0x9000;
/// Guest address of the PDPT page of the boot identity map.
pub const PDPTE_START: u64 = 0xa000;
/// Guest address of the first of four page directories of the boot identity map.
pub const PDE_START: u64 = 0xb000;
/// Guest address of the kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Longest accepted kernel command line, terminating NUL included.
pub const CMDLINE_MAX_SIZE: usize = 4096;
/// Start of the Extended BIOS Data Area; RAM below it is usable.
pub const EBDA_START: u64 = 0x9fc00;
/// Guest address of the ACPI tables; the RSDP is their first structure.
pub const ACPI_START: u64 = 0xe0000;
/// Bytes reserved for the ACPI tables (up to the MP table).
pub const ACPI_MAX_LEN: usize = 0x10000;
/// Start of the MP table area (the floating pointer is at its start).
pub const MPTABLE_START: u64 = 0xf0000;
/// First byte of high memory; kernels load at or above it.
pub const HIMEM_START: u64 = 0x10_0000;
/// Start of the 32-bit hole (MMIO: PCI, IOAPIC, LAPIC).
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
/// First byte above 4 GiB.
pub const FOUR_GIB: u64 = 0x1_0000_0000;
/// Default highest initramfs address for kernels that do not say (ELF vmlinux, PVH).
pub const DEFAULT_INITRD_ADDR_MAX: u64 = 0x7fff_ffff;
/// Bytes of guest memory the identity map covers (the first 4 GiB, 2 MiB pages).
pub const IDENTITY_MAP_SIZE: u64 = FOUR_GIB;
/// Guest address of the KVM TSS (three pages, in the 32-bit hole).
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// Guest address of the KVM identity-map page (one page, just below the TSS).
pub const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;

/// E820 type of usable RAM.
pub const E820_RAM: u32 = 1;
/// E820 type of reserved memory.
pub const E820_RESERVED: u32 = 2;

/// The guest RAM ranges for `size` bytes of memory: one range below the 32-bit hole and,
/// for guests above 3 GiB, one from 4 GiB.
pub fn ram_ranges(size: u64) -> Vec<(u64, u64)> {
    if size <= MMIO_HOLE_START {
        vec![(0, size)]
    } else {
        vec![(0, MMIO_HOLE_START), (FOUR_GIB, size - MMIO_HOLE_START)]
    }
}

/// One entry of the guest's physical memory map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryMapEntry {
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub size: u64,
    /// E820 type ([`E820_RAM`] or [`E820_RESERVED`]).
    pub kind: u32,
}

/// The memory map handed to the guest (e820 or PVH memmap) for `size` bytes of RAM.
pub fn memory_map(size: u64) -> Vec<MemoryMapEntry> {
    let mut map = vec![
        MemoryMapEntry {
            addr: 0,
            size: EBDA_START,
            kind: E820_RAM,
        },
        MemoryMapEntry {
            addr: EBDA_START,
            size: HIMEM_START - EBDA_START,
            kind: E820_RESERVED,
        },
    ];
    for (start, len) in ram_ranges(size) {
        let start = start.max(HIMEM_START);
        let end = if start == HIMEM_START {
            len
        } else {
            start + len
        };
        if end > start {
            map.push(MemoryMapEntry {
                addr: start,
                size: end - start,
                kind: E820_RAM,
            });
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_guest_has_one_ram_range_and_map_skips_legacy_hole() {
        let size = 128 << 20;
        assert_eq!(ram_ranges(size), vec![(0, size)]);
        let map = memory_map(size);
        assert_eq!(
            map[0],
            MemoryMapEntry {
                addr: 0,
                size: EBDA_START,
                kind: E820_RAM
            }
        );
        assert_eq!(map[1].kind, E820_RESERVED);
        assert_eq!(
            map[2],
            MemoryMapEntry {
                addr: HIMEM_START,
                size: size - HIMEM_START,
                kind: E820_RAM
            }
        );
    }

    #[test]
    fn large_guest_splits_around_the_32bit_hole() {
        let size = 5 << 30;
        assert_eq!(
            ram_ranges(size),
            vec![(0, MMIO_HOLE_START), (FOUR_GIB, size - MMIO_HOLE_START)]
        );
        let map = memory_map(size);
        assert_eq!(map.len(), 4);
        assert_eq!(map[2].addr + map[2].size, MMIO_HOLE_START);
        assert_eq!(
            map[3],
            MemoryMapEntry {
                addr: FOUR_GIB,
                size: size - MMIO_HOLE_START,
                kind: E820_RAM
            }
        );
    }
}
