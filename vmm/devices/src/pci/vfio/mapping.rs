//! One mmapped part of a BAR in the VMM's address space, ready to become a KVM memory
//! slot. The mapping is aligned to min(size, 1 GiB) so that Linux 6.12+ can back a huge
//! BAR with PMD/PUD mappings (vfio-pci's huge_fault) instead of 4 KiB pages.

use std::os::fd::AsRawFd;

use super::backend::MmapSource;

/// Largest alignment asked for (one PUD).
const MAX_ALIGN: u64 = 1 << 30;

/// Why a BAR area could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum MappingError {
    /// The length or offset does not fit the address space.
    #[error("BAR area of {0:#x} bytes cannot be mapped (size or offset out of range)")]
    Size(u64),
    /// mmap failed.
    #[error("mmap of a {len:#x}-byte BAR area failed: {source}")]
    Mmap {
        /// Length asked for.
        len: u64,
        /// What the kernel answered.
        #[source]
        source: std::io::Error,
    },
}

/// An mmapped BAR area; unmapped on drop.
#[derive(Debug)]
pub struct MappedArea {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; it is only handed to
// KVM as a host address and accessed through volatile/raw-pointer paths, never through
// Rust references, so moving or sharing the owner between threads is sound.
unsafe impl Send for MappedArea {}
// SAFETY: as above; `&MappedArea` gives out only the address and length.
unsafe impl Sync for MappedArea {}

impl MappedArea {
    /// Maps `len` bytes of `source` starting `offset` bytes into the region, shared and
    /// read/write, at an address aligned to min(len, 1 GiB) (rounded to a power of two).
    pub fn map(source: MmapSource<'_>, offset: u64, len: u64) -> Result<Self, MappingError> {
        let file_offset = source
            .offset
            .checked_add(offset)
            .and_then(|o| libc::off_t::try_from(o).ok())
            .ok_or(MappingError::Size(len))?;
        let align = len.next_power_of_two().clamp(4096, MAX_ALIGN);
        let len_us = usize::try_from(len).map_err(|_| MappingError::Size(len))?;
        let reserve = len
            .checked_add(align)
            .and_then(|r| usize::try_from(r).ok())
            .ok_or(MappingError::Size(len))?;
        let mmap_err = |len| MappingError::Mmap {
            len,
            source: std::io::Error::last_os_error(),
        };
        // SAFETY: an anonymous PROT_NONE reservation at an address the kernel picks; it
        // overlaps nothing we own.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserve,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(mmap_err(len));
        }
        let base_addr = base as u64;
        let aligned = base_addr.next_multiple_of(align);
        // SAFETY: [aligned, aligned + len) lies inside the reservation made above, which
        // this function owns; MAP_FIXED replaces part of it with the device mapping.
        let addr = unsafe {
            libc::mmap(
                aligned as *mut libc::c_void,
                len_us,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                source.fd.as_raw_fd(),
                file_offset,
            )
        };
        let failed = addr == libc::MAP_FAILED;
        let error = failed.then(|| mmap_err(len));
        // Release the slop before and after the mapping (or the whole reservation).
        let (keep_start, keep_end) = if failed {
            (base_addr, base_addr)
        } else {
            (aligned, aligned + len)
        };
        let reserve_end = base_addr + reserve as u64;
        for (start, end) in [(base_addr, keep_start), (keep_end, reserve_end)] {
            // A part of the reservation, whose length was a usize.
            if let (true, Ok(len)) = (end > start, usize::try_from(end - start)) {
                // SAFETY: the range is part of our own reservation and holds nothing else.
                unsafe { libc::munmap(start as *mut libc::c_void, len) };
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(Self { addr, len: len_us }),
        }
    }

    /// The host virtual address of the first byte.
    pub fn host_addr(&self) -> u64 {
        self.addr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether the mapping is empty (never, for a mapped area).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for MappedArea {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` is exactly the mapping this value created and owns; no
        // reference into it exists (it is only handed out as an integer address).
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::backend::VfioBackend;
    use super::super::model::{ModelGpu, ModelReset, BAR1_SIZE};
    use super::*;

    #[test]
    fn huge_bar_maps_aligned_and_shares_the_device_memory() {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        let area = MappedArea::map(gpu.region_mmap(1).unwrap(), 0, BAR1_SIZE).unwrap();
        assert_eq!(area.host_addr() % (1 << 30), 0);
        assert_eq!(area.len(), BAR1_SIZE);
        let at = area.host_addr() + BAR1_SIZE - 4096;
        // SAFETY: `at` is inside the live mapping; a volatile write of a u32.
        unsafe { std::ptr::write_volatile(at as *mut u32, 0x1234_5678) };
        let mut back = [0u8; 4];
        gpu.region_read(1, BAR1_SIZE - 4096, &mut back).unwrap();
        assert_eq!(u32::from_le_bytes(back), 0x1234_5678);
    }
}
