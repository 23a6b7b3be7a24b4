//! Boot information for the kernel: the Linux zero page (with e820) and PVH's
//! `hvm_start_info` (with its memory map and module list).

use linux_loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use vm_memory::{GuestAddress, GuestMemoryMmap};

use super::kernel::{InitramfsPlacement, LoadedKernel};
use super::layout::{
    memory_map, CMDLINE_START, PVH_INFO_START, PVH_MEMMAP_START, PVH_MODLIST_START, ZERO_PAGE_START,
};
use super::BootError;

/// "HdrS".
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
/// Boot sector signature.
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// Loader type "undefined" (we are not one of the registered boot loaders).
const KERNEL_LOADER_OTHER: u8 = 0xff;
/// Kernel alignment for relocatable kernels, as Linux's own default.
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x100_0000;
/// PVH start_info magic.
const XEN_HVM_START_MAGIC_VALUE: u32 = 0x336e_c578;
/// Most e820 entries the zero page holds.
const E820_MAX_ENTRIES_ZEROPAGE: usize = 128;

/// Writes the Linux zero page at [`ZERO_PAGE_START`].
pub fn write_zero_page(
    mem: &GuestMemoryMmap,
    mem_size: u64,
    kernel: &LoadedKernel,
    cmdline_len: usize,
    initramfs: Option<InitramfsPlacement>,
    rsdp_addr: u64,
) -> Result<(), BootError> {
    let mut params = boot_params {
        acpi_rsdp_addr: rsdp_addr,
        ..Default::default()
    };
    if let Some(hdr) = kernel.setup_header {
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    if let Some(initrd) = initramfs {
        // Both fit in 32 bits: the initramfs lies below initrd_addr_max (< 4 GiB).
        params.hdr.ramdisk_image = initrd.addr as u32;
        params.hdr.ramdisk_size = initrd.size as u32;
    }
    let map = memory_map(mem_size);
    if map.len() > E820_MAX_ENTRIES_ZEROPAGE {
        return Err(BootError::Internal(
            "The e820 map does not fit in the zero page".into(),
        ));
    }
    for (slot, entry) in params.e820_table.iter_mut().zip(&map) {
        *slot = boot_e820_entry {
            addr: entry.addr,
            size: entry.size,
            r#type: entry.kind,
        };
    }
    params.e820_entries = map.len() as u8;
    LinuxBootConfigurator::write_bootparams::<GuestMemoryMmap>(
        &BootParams::new(&params, GuestAddress(ZERO_PAGE_START)),
        mem,
    )
    .map_err(|e| BootError::Internal(format!("Cannot write the zero page: {e}")))
}

/// Writes PVH's `hvm_start_info`, memory map and module list.
pub fn write_pvh_start_info(
    mem: &GuestMemoryMmap,
    mem_size: u64,
    initramfs: Option<InitramfsPlacement>,
    rsdp_addr: u64,
) -> Result<(), BootError> {
    let map: Vec<hvm_memmap_table_entry> = memory_map(mem_size)
        .iter()
        .map(|e| hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind,
            reserved: 0,
        })
        .collect();
    let mut info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC_VALUE,
        version: 1,
        cmdline_paddr: CMDLINE_START,
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: map.len() as u32,
        rsdp_paddr: rsdp_addr,
        ..Default::default()
    };
    let mut params = BootParams::new(&info, GuestAddress(PVH_INFO_START));
    if let Some(initrd) = initramfs {
        info.nr_modules = 1;
        info.modlist_paddr = PVH_MODLIST_START;
        params = BootParams::new(&info, GuestAddress(PVH_INFO_START));
        let module = hvm_modlist_entry {
            paddr: initrd.addr,
            size: initrd.size,
            ..Default::default()
        };
        params.set_modules(&[module], GuestAddress(PVH_MODLIST_START));
    }
    params.set_sections(&map, GuestAddress(PVH_MEMMAP_START));
    PvhBootConfigurator::write_bootparams::<GuestMemoryMmap>(&params, mem)
        .map_err(|e| BootError::Internal(format!("Cannot write the PVH start info: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::boot::kernel::EntryPoint;
    use vm_memory::{Bytes, GuestAddress};

    fn mem(size: usize) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).unwrap()
    }

    #[test]
    fn zero_page_carries_cmdline_initrd_and_e820() {
        let size = 64u64 << 20;
        let m = mem(size as usize);
        let kernel = LoadedKernel {
            entry: EntryPoint::Linux64 { entry: 0x100_0000 },
            end: 0x200_0000,
            setup_header: None,
        };
        let initrd = InitramfsPlacement {
            addr: 0x300_0000,
            size: 0x1234,
        };
        write_zero_page(&m, size, &kernel, 17, Some(initrd), 0xe0000).unwrap();
        let p: boot_params = m.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        let (ptr, img, rsize, magic) = (
            p.hdr.cmd_line_ptr,
            p.hdr.ramdisk_image,
            p.hdr.ramdisk_size,
            p.hdr.header,
        );
        assert_eq!(
            (ptr, img, rsize, magic),
            (CMDLINE_START as u32, 0x300_0000, 0x1234, KERNEL_HDR_MAGIC)
        );
        assert_eq!(p.e820_entries, 3);
        let rsdp = p.acpi_rsdp_addr;
        assert_eq!(rsdp, 0xe0000);
        let last = p.e820_table[2];
        let (addr, len) = (last.addr, last.size);
        assert_eq!(addr + len, size);
    }

    #[test]
    fn pvh_start_info_has_magic_memmap_and_module() {
        let size = 64u64 << 20;
        let m = mem(size as usize);
        let initrd = InitramfsPlacement {
            addr: 0x300_0000,
            size: 0x1000,
        };
        write_pvh_start_info(&m, size, Some(initrd), 0xe0000).unwrap();
        let info: hvm_start_info = m.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
        assert_eq!(info.magic, XEN_HVM_START_MAGIC_VALUE);
        assert_eq!(info.memmap_entries, 3);
        assert_eq!(info.nr_modules, 1);
        assert_eq!(info.rsdp_paddr, 0xe0000);
        let module: hvm_modlist_entry = m.read_obj(GuestAddress(PVH_MODLIST_START)).unwrap();
        assert_eq!((module.paddr, module.size), (0x300_0000, 0x1000));
    }
}
