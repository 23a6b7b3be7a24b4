//! Extends boot.rs's identity map (first 4 GiB, 2 MiB pages) to cover RAM above 4 GiB.

use crate::phys;

const GIB: u64 = 1 << 30;
/// Highest physical address the guest can map: 64 GiB.
pub const MAP_LIMIT: u64 = 64 * GIB;
const EXTRA_PDS: usize = (MAP_LIMIT / GIB) as usize - 4;

#[repr(C, align(4096))]
struct PageDirectories([[u64; 512]; EXTRA_PDS]);
/// Not zeroed at boot (see linker.ld): `map_up_to` writes every entry before use.
#[link_section = ".noinit.page_directories"]
static mut EXTRA: PageDirectories = PageDirectories([[0; 512]; EXTRA_PDS]);

#[cfg(target_os = "none")]
extern "C" {
    static mut pdpt: [u64; 512];
}

/// Identity-maps physical memory up to `top` (rounded up to 1 GiB). Returns the new top of
/// the map, or `None` when `top` is above [`MAP_LIMIT`].
#[cfg(target_os = "none")]
pub fn map_up_to(top: u64) -> Option<u64> {
    if top > MAP_LIMIT {
        return None;
    }
    let gibs = top.div_ceil(GIB).max(4) as usize;
    for g in 4..gibs {
        let pd = g - 4;
        // SAFETY: single-threaded at this point (no AP runs during the memory test); EXTRA
        // and pdpt are the guest's own page-table pages, written through raw pointers only.
        unsafe {
            let table = core::ptr::addr_of_mut!(EXTRA.0[pd]);
            for (i, e) in (*table).iter_mut().enumerate() {
                *e = ((g as u64) * GIB + (i as u64) * (2 << 20)) | 0x83;
            }
            let entries = core::ptr::addr_of_mut!(pdpt);
            (*entries)[g] = (table as u64) | 3;
        }
    }
    // SAFETY: reloading CR3 with its own value only flushes the TLB.
    unsafe {
        core::arch::asm!("mov {t}, cr3", "mov cr3, {t}", t = out(reg) _, options(nostack));
    }
    let mapped = (gibs as u64) * GIB;
    phys::set_mapped_top(mapped);
    Some(mapped)
}

/// Host builds (unit tests) have no page tables to extend.
#[cfg(not(target_os = "none"))]
pub fn map_up_to(top: u64) -> Option<u64> {
    (top <= MAP_LIMIT).then_some(top)
}

/// Identity-maps the 1 GiB around `addr` (below 512 GiB: the first PML4 entry) with 2 MiB
/// pages, using spare page directory `spare` (0-2, taken from the top of those
/// [`map_up_to`] uses, so RAM mapped up to 61 GiB is unaffected). For BARs above RAM.
#[cfg(target_os = "none")]
pub fn map_window(addr: u64, spare: usize) -> Option<u64> {
    let g = (addr / GIB) as usize;
    if !(64..512).contains(&g) || spare > 2 {
        return None;
    }
    let pd = EXTRA_PDS - 1 - spare;
    // SAFETY: single-threaded (no AP runs in the tests that call this); the spare page
    // directory and pdpt are the guest's own page-table pages, written through raw pointers.
    unsafe {
        let table = core::ptr::addr_of_mut!(EXTRA.0[pd]);
        for (i, e) in (*table).iter_mut().enumerate() {
            *e = ((g as u64) * GIB + (i as u64) * (2 << 20)) | 0x83;
        }
        let entries = core::ptr::addr_of_mut!(pdpt);
        (*entries)[g] = (table as u64) | 3;
        core::arch::asm!("mov {t}, cr3", "mov cr3, {t}", t = out(reg) _, options(nostack));
    }
    Some(addr)
}

/// Host builds (unit tests) have no page tables.
#[cfg(not(target_os = "none"))]
pub fn map_window(addr: u64, _spare: usize) -> Option<u64> {
    Some(addr)
}
