//! Which parts of a BAR are mmapped into the guest (KVM memory slots, no exits) and which
//! stay trapped (every access goes through the VMM): the kernel's sparse-mmap areas (or
//! the whole region), minus the pages holding the MSI-X table and PBA, which the VMM
//! emulates. Area lists come from the device, so each one is checked against the region.

use super::backend::RegionInfo;
use super::region_caps::{RegionCap, SparseArea};

/// Host page size the areas are aligned to.
pub const PAGE_SIZE: u64 = 4096;

/// Why a region's mmap areas were refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AreaError {
    /// A sparse area lies (partly) outside the region.
    #[error("Sparse mmap area {offset:#x}+{size:#x} lies outside the {region:#x}-byte region")]
    OutOfRegion {
        /// Area offset.
        offset: u64,
        /// Area size.
        size: u64,
        /// Region size.
        region: u64,
    },
    /// Two sparse areas overlap.
    #[error("Sparse mmap areas overlap at {0:#x}")]
    Overlap(u64),
}

/// The page-aligned parts of a region to mmap, sorted, none touching a page of
/// `trapped` (byte ranges `(offset, len)` in the region the VMM must see every access
/// to). Areas that are not page aligned are left trapped rather than refused.
pub fn mmap_areas(info: &RegionInfo, trapped: &[(u64, u64)]) -> Result<Vec<SparseArea>, AreaError> {
    if !info.mmappable() || info.size == 0 {
        return Ok(Vec::new());
    }
    let sparse = info.caps.iter().find_map(|c| match c {
        RegionCap::SparseMmap(areas) => Some(areas.clone()),
        _ => None,
    });
    let mut areas = sparse.unwrap_or_else(|| {
        vec![SparseArea {
            offset: 0,
            size: info.size,
        }]
    });
    for a in &areas {
        if a.offset
            .checked_add(a.size)
            .is_none_or(|end| end > info.size)
        {
            return Err(AreaError::OutOfRegion {
                offset: a.offset,
                size: a.size,
                region: info.size,
            });
        }
    }
    areas.retain(|a| a.size > 0 && a.offset % PAGE_SIZE == 0 && a.size % PAGE_SIZE == 0);
    areas.sort_by_key(|a| a.offset);
    for pair in areas.windows(2) {
        if pair[0].offset + pair[0].size > pair[1].offset {
            return Err(AreaError::Overlap(pair[1].offset));
        }
    }
    // Carve the trapped pages out.
    for &(offset, len) in trapped {
        if len == 0 {
            continue;
        }
        let start = offset & !(PAGE_SIZE - 1);
        let end = offset.saturating_add(len).saturating_add(PAGE_SIZE - 1) & !(PAGE_SIZE - 1);
        let mut carved = Vec::with_capacity(areas.len() + 1);
        for a in areas {
            let a_end = a.offset + a.size;
            if a_end <= start || a.offset >= end {
                carved.push(a);
                continue;
            }
            if a.offset < start {
                carved.push(SparseArea {
                    offset: a.offset,
                    size: start - a.offset,
                });
            }
            if a_end > end {
                carved.push(SparseArea {
                    offset: end,
                    size: a_end - end,
                });
            }
        }
        areas = carved;
    }
    Ok(areas)
}

#[cfg(test)]
mod tests {
    use super::super::backend::{REGION_FLAG_MMAP, REGION_FLAG_READ};
    use super::*;

    fn region(size: u64, caps: Vec<RegionCap>) -> RegionInfo {
        RegionInfo {
            size,
            flags: REGION_FLAG_READ | REGION_FLAG_MMAP,
            caps,
        }
    }

    #[test]
    fn whole_region_minus_msix_pages() {
        // Table at a non-page-aligned offset, PBA on another page.
        let areas =
            mmap_areas(&region(0x10_0000, vec![]), &[(0x2200, 0x100), (0x5100, 8)]).unwrap();
        assert_eq!(
            areas,
            vec![
                SparseArea {
                    offset: 0,
                    size: 0x2000
                },
                SparseArea {
                    offset: 0x3000,
                    size: 0x2000
                },
                SparseArea {
                    offset: 0x6000,
                    size: 0xf_a000
                },
            ]
        );
    }

    #[test]
    fn sparse_areas_are_checked_against_the_region() {
        let bad = region(
            0x4000,
            vec![RegionCap::SparseMmap(vec![SparseArea {
                offset: 0x3000,
                size: 0x2000,
            }])],
        );
        assert!(matches!(
            mmap_areas(&bad, &[]),
            Err(AreaError::OutOfRegion { .. })
        ));
        let wrap = region(
            0x4000,
            vec![RegionCap::SparseMmap(vec![SparseArea {
                offset: u64::MAX,
                size: 2,
            }])],
        );
        mmap_areas(&wrap, &[]).unwrap_err();
        let overlap = region(
            0x4000,
            vec![RegionCap::SparseMmap(vec![
                SparseArea {
                    offset: 0x1000,
                    size: 0x2000,
                },
                SparseArea {
                    offset: 0x2000,
                    size: 0x1000,
                },
            ])],
        );
        assert_eq!(mmap_areas(&overlap, &[]), Err(AreaError::Overlap(0x2000)));
    }

    #[test]
    fn unaligned_areas_and_unmappable_regions_stay_trapped() {
        let odd = region(
            0x4000,
            vec![RegionCap::SparseMmap(vec![SparseArea {
                offset: 0x10,
                size: 0x1000,
            }])],
        );
        assert!(mmap_areas(&odd, &[]).unwrap().is_empty());
        let mut plain = region(0x4000, vec![]);
        plain.flags = REGION_FLAG_READ;
        assert!(mmap_areas(&plain, &[]).unwrap().is_empty());
    }
}
