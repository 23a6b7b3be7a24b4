//! BAR address allocation in the two PCI memory windows the host bridge advertises: a
//! 32-bit window below 4 GiB and a 64-bit window above RAM, large and aligned enough for
//! a GPU's 128 GiB BAR. The same allocator checks guest BAR moves: a BAR may only move
//! to a free, aligned range inside a window.

use vm_allocator::{AddressAllocator, AllocPolicy, RangeInclusive};

use super::config::BarKind;

/// Base of the 32-bit MMIO window (start of the 32-bit hole).
pub const MMIO32_BASE: u64 = 0xc000_0000;
/// Size of the 32-bit MMIO window.
pub const MMIO32_SIZE: u64 = 0x2000_0000;
/// Base of the ECAM region, right after the 32-bit window (256 MiB, bus 0 used).
pub const ECAM_BASE: u64 = 0xe000_0000;
/// Size reserved for ECAM (256 buses; the host bridge decodes bus 0 only).
pub const ECAM_SIZE: u64 = 0x1000_0000;
/// Alignment of the 64-bit window: the largest BAR it must hold naturally aligned
/// (an H100's BAR1).
pub const MMIO64_ALIGN: u64 = 128 << 30;
/// Default size of the 64-bit window: one 128 GiB BAR plus room for the rest.
pub const MMIO64_DEFAULT_SIZE: u64 = 256 << 30;

/// Why a BAR could not be placed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BarAllocatorError {
    /// The 64-bit window does not fit in the guest's physical address width.
    #[error(
        "The 64-bit PCI window {base:#x}+{size:#x} needs more than {phys_bits} physical address bits; use less memory or a smaller window"
    )]
    AddressWidth {
        /// Window base.
        base: u64,
        /// Window size.
        size: u64,
        /// Physical address bits of the guest.
        phys_bits: u8,
    },
    /// The size is not a power of two of at least 16 bytes.
    #[error("BAR size {0:#x} is not a power of two of at least 16 bytes")]
    Size(u64),
    /// No free range of that size is left.
    #[error("No room for a {size:#x}-byte BAR in the {window} window")]
    Exhausted {
        /// Requested size.
        size: u64,
        /// Which window.
        window: &'static str,
    },
    /// The range is not a free, aligned range inside a window.
    #[error("BAR range {addr:#x}+{size:#x} is not a free aligned range in a PCI window")]
    Range {
        /// Requested address.
        addr: u64,
        /// BAR size.
        size: u64,
    },
    /// The allocator refused the window itself.
    #[error("Invalid PCI window: {0}")]
    Window(String),
}

/// The PCI memory windows of the host bridge (for the DSDT's `_CRS` and the allocator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciWindows {
    /// Base of the 32-bit window.
    pub mmio32_base: u64,
    /// Size of the 32-bit window.
    pub mmio32_size: u64,
    /// Base of the 64-bit window.
    pub mmio64_base: u64,
    /// Size of the 64-bit window.
    pub mmio64_size: u64,
}

impl PciWindows {
    /// Windows for a guest whose RAM ends at `ram_end` (exclusive, including any RAM
    /// above 4 GiB) and whose CPUs have `phys_bits` physical address bits.
    pub fn new(ram_end: u64, phys_bits: u8, mmio64_size: u64) -> Result<Self, BarAllocatorError> {
        let base = ram_end.max(1 << 32).next_multiple_of(MMIO64_ALIGN);
        let limit = 1u128 << phys_bits.min(64);
        if u128::from(base) + u128::from(mmio64_size) > limit {
            return Err(BarAllocatorError::AddressWidth {
                base,
                size: mmio64_size,
                phys_bits,
            });
        }
        Ok(Self {
            mmio32_base: MMIO32_BASE,
            mmio32_size: MMIO32_SIZE,
            mmio64_base: base,
            mmio64_size,
        })
    }
}

/// Allocates BAR addresses and validates guest moves.
#[derive(Debug)]
pub struct BarAllocator {
    mmio32: AddressAllocator,
    mmio64: AddressAllocator,
}

fn window_error(e: vm_allocator::Error) -> BarAllocatorError {
    BarAllocatorError::Window(e.to_string())
}

impl BarAllocator {
    /// Creates an allocator over `windows`.
    pub fn new(windows: PciWindows) -> Result<Self, BarAllocatorError> {
        Ok(Self {
            mmio32: AddressAllocator::new(windows.mmio32_base, windows.mmio32_size)
                .map_err(window_error)?,
            mmio64: AddressAllocator::new(windows.mmio64_base, windows.mmio64_size)
                .map_err(window_error)?,
        })
    }

    /// Allocates a naturally aligned range for a memory BAR of `kind`. 64-bit BARs go to
    /// the 64-bit window; 32-bit BARs to the 32-bit window.
    pub fn allocate(&mut self, kind: BarKind, size: u64) -> Result<u64, BarAllocatorError> {
        if !size.is_power_of_two() || size < 16 {
            return Err(BarAllocatorError::Size(size));
        }
        let (allocator, window) = match kind {
            BarKind::Memory64 { .. } => (&mut self.mmio64, "64-bit"),
            _ => (&mut self.mmio32, "32-bit"),
        };
        allocator
            .allocate(size, size, AllocPolicy::FirstMatch)
            .map(|r| r.start())
            .map_err(|_| BarAllocatorError::Exhausted { size, window })
    }

    /// Releases the range at `addr`.
    pub fn free(&mut self, addr: u64, size: u64) -> Result<(), BarAllocatorError> {
        let range = RangeInclusive::new(addr, addr.saturating_add(size.saturating_sub(1)))
            .map_err(|_| BarAllocatorError::Range { addr, size })?;
        self.mmio32
            .free(&range)
            .or_else(|_| self.mmio64.free(&range))
            .map_err(|_| BarAllocatorError::Range { addr, size })
    }

    /// Moves an allocation from `old` to `new`, as a guest BAR write asks. A 64-bit BAR may
    /// land in either window; a 32-bit one only below 4 GiB. On error nothing changes.
    pub fn relocate(
        &mut self,
        kind: BarKind,
        old: u64,
        new: u64,
        size: u64,
    ) -> Result<(), BarAllocatorError> {
        let refused = BarAllocatorError::Range { addr: new, size };
        if !size.is_power_of_two() || new % size != 0 || new.checked_add(size).is_none() {
            return Err(refused);
        }
        let policy = AllocPolicy::ExactMatch(new);
        self.free(old, size)?;
        let placed = match kind {
            BarKind::Memory64 { .. } => self
                .mmio64
                .allocate(size, size, policy)
                .or_else(|_| self.mmio32.allocate(size, size, policy)),
            _ => self.mmio32.allocate(size, size, policy),
        };
        if placed.is_err() {
            // Put the old allocation back; it was free a moment ago, so this succeeds.
            let back = AllocPolicy::ExactMatch(old);
            let _ = self
                .mmio32
                .allocate(size, size, back)
                .or_else(|_| self.mmio64.allocate(size, size, back));
            return Err(refused);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEM64: BarKind = BarKind::Memory64 { prefetchable: true };
    const MEM32: BarKind = BarKind::Memory32 {
        prefetchable: false,
    };

    #[test]
    fn gpu_sized_bar_fits_the_64bit_window() {
        let windows = PciWindows::new(16 << 30, 46, MMIO64_DEFAULT_SIZE).unwrap();
        assert_eq!(windows.mmio64_base % MMIO64_ALIGN, 0);
        let mut alloc = BarAllocator::new(windows).unwrap();
        let bar1 = alloc.allocate(MEM64, 128 << 30).unwrap();
        assert_eq!(bar1 % (128 << 30), 0);
        let small = alloc.allocate(MEM64, 0x4000).unwrap();
        assert!(small >= windows.mmio64_base && small < windows.mmio64_base + windows.mmio64_size);
        let low = alloc.allocate(MEM32, 0x1000).unwrap();
        assert!((MMIO32_BASE..MMIO32_BASE + MMIO32_SIZE).contains(&low));
    }

    #[test]
    fn window_beyond_address_width_is_refused() {
        let err = PciWindows::new(16 << 30, 36, MMIO64_DEFAULT_SIZE).unwrap_err();
        assert!(matches!(err, BarAllocatorError::AddressWidth { .. }));
    }

    #[test]
    fn exhausted_window_is_an_error() {
        let windows = PciWindows::new(1 << 30, 46, MMIO64_DEFAULT_SIZE).unwrap();
        let mut alloc = BarAllocator::new(windows).unwrap();
        assert!(matches!(
            alloc.allocate(MEM32, 1 << 30),
            Err(BarAllocatorError::Exhausted { .. })
        ));
        assert_eq!(alloc.allocate(MEM32, 3), Err(BarAllocatorError::Size(3)));
    }

    #[test]
    fn relocate_accepts_free_aligned_ranges_only() {
        let windows = PciWindows::new(1 << 30, 46, MMIO64_DEFAULT_SIZE).unwrap();
        let mut alloc = BarAllocator::new(windows).unwrap();
        let a = alloc.allocate(MEM32, 0x1000).unwrap();
        let b = alloc.allocate(MEM32, 0x1000).unwrap();
        // Onto another BAR, misaligned, into RAM: refused, and `a` keeps its range.
        assert!(alloc.relocate(MEM32, a, b, 0x1000).is_err());
        assert!(alloc.relocate(MEM32, a, b + 0x800, 0x1000).is_err());
        assert!(alloc.relocate(MEM32, a, 0x10_0000, 0x1000).is_err());
        assert!(alloc.relocate(MEM32, a, u64::MAX - 0xfff, 0x1000).is_err());
        alloc
            .relocate(MEM32, a, MMIO32_BASE + 0x10_0000, 0x1000)
            .unwrap();
        // The old range is free again.
        alloc.relocate(MEM32, b, a, 0x1000).unwrap();
    }
}
