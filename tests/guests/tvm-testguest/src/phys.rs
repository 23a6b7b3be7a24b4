//! Direct access to guest-physical memory through the identity map.

use crate::bootinfo::{BootInfoError, PhysRead};
use core::sync::atomic::{AtomicU64, Ordering};

/// One past the highest identity-mapped physical address (4 GiB from boot.rs; raised by
/// `paging::map_up_to`).
static MAPPED_TOP: AtomicU64 = AtomicU64::new(4 << 30);

/// One past the highest identity-mapped address.
pub fn mapped_top() -> u64 {
    MAPPED_TOP.load(Ordering::Relaxed)
}

/// Records a larger identity map.
pub fn set_mapped_top(top: u64) {
    MAPPED_TOP.store(top, Ordering::Relaxed);
}

/// Reads physical memory through the identity map; address 0 and unmapped ranges are
/// refused rather than faulted on.
pub struct Phys;

impl PhysRead for Phys {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), BootInfoError> {
        let end = addr
            .checked_add(buf.len() as u64)
            .ok_or(BootInfoError::Unreadable(addr))?;
        if addr == 0 || end > mapped_top() {
            return Err(BootInfoError::Unreadable(addr));
        }
        for (i, b) in buf.iter_mut().enumerate() {
            // SAFETY: [addr, end) is non-null and inside the identity map, so the read is of
            // mapped memory; volatile because it is memory the loader wrote, not Rust.
            *b = unsafe { core::ptr::read_volatile((addr + i as u64) as *const u8) };
        }
        Ok(())
    }
}
