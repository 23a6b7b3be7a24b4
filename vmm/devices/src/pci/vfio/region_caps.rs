//! The capability chain VFIO_DEVICE_GET_REGION_INFO returns after `struct
//! vfio_region_info`: sparse mmap areas, "MSI-X table mappable", region type. The bytes
//! come from the kernel on behalf of a device that may be broken or hostile, so the
//! parser checks every offset and length, walks strictly forward (no loops) and stops
//! after [`MAX_REGION_CAPS`] entries.

use std::mem::{offset_of, size_of};

use crate::narrow::{const_u16, const_u32};

use super::abi::{
    vfio_info_cap_header, vfio_region_info, vfio_region_info_cap_sparse_mmap,
    vfio_region_info_cap_type, vfio_region_sparse_mmap_area, VFIO_REGION_INFO_CAP_MSIX_MAPPABLE,
    VFIO_REGION_INFO_CAP_SPARSE_MMAP, VFIO_REGION_INFO_CAP_TYPE,
};

/// Size of `struct vfio_region_info` (the fixed part before the capabilities).
pub const REGION_INFO_SIZE: usize = size_of::<vfio_region_info>();
/// Most capabilities one region may list.
pub const MAX_REGION_CAPS: usize = 16;
/// Most sparse mmap areas one region may list.
pub const MAX_SPARSE_AREAS: u32 = 64;

const CAP_SPARSE_MMAP: u16 = const_u16(VFIO_REGION_INFO_CAP_SPARSE_MMAP as u64);
const CAP_TYPE: u16 = const_u16(VFIO_REGION_INFO_CAP_TYPE as u64);
const CAP_MSIX_MAPPABLE: u16 = const_u16(VFIO_REGION_INFO_CAP_MSIX_MAPPABLE as u64);
/// `struct vfio_info_cap_header` (id, version, next) before each capability's body.
const CAP_HEADER_SIZE: usize = size_of::<vfio_info_cap_header>();
/// Where the header's `next` pointer is.
const CAP_NEXT: usize = offset_of!(vfio_info_cap_header, next);
/// Where a sparse mmap capability's `nr_areas` and areas are, from the body's start.
const SPARSE_NR_AREAS: usize =
    offset_of!(vfio_region_info_cap_sparse_mmap, nr_areas) - CAP_HEADER_SIZE;
const SPARSE_AREAS: usize = offset_of!(vfio_region_info_cap_sparse_mmap, areas) - CAP_HEADER_SIZE;
/// One `struct vfio_region_sparse_mmap_area` (offset, size).
const SPARSE_AREA_SIZE: usize = size_of::<vfio_region_sparse_mmap_area>();
const AREA_SIZE_FIELD: usize = offset_of!(vfio_region_sparse_mmap_area, size);
/// Where a region type capability's `type` and `subtype` are, from the body's start.
const TYPE_KIND: usize = offset_of!(vfio_region_info_cap_type, type_) - CAP_HEADER_SIZE;
const TYPE_SUBTYPE: usize = offset_of!(vfio_region_info_cap_type, subtype) - CAP_HEADER_SIZE;

/// One mmappable part of a region, relative to the region's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseArea {
    /// Offset in the region.
    pub offset: u64,
    /// Length in bytes.
    pub size: u64,
}

/// One capability of a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionCap {
    /// Only these parts of the region may be mmapped.
    SparseMmap(Vec<SparseArea>),
    /// The MSI-X table in this BAR may be mmapped (the kernel protects it otherwise).
    MsixMappable,
    /// A device-specific region type.
    Type {
        /// Type (vendor or class).
        kind: u32,
        /// Subtype.
        subtype: u32,
    },
    /// A capability this VMM does not use.
    Other {
        /// Capability id.
        id: u16,
    },
}

/// Why a region's capability chain was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegionCapError {
    /// A capability header or body lies outside the returned buffer.
    #[error("Region capability at {offset:#x} runs past the {len}-byte region info")]
    OutOfBounds {
        /// Offset of the capability.
        offset: usize,
        /// Length of the buffer.
        len: usize,
    },
    /// A next pointer does not move forward (a loop, or a pointer into the fixed part).
    #[error("Region capability chain does not move forward at {offset:#x} (next {next:#x})")]
    Loop {
        /// Offset of the capability.
        offset: usize,
        /// Its next pointer.
        next: usize,
    },
    /// More capabilities than any device has.
    #[error("Region lists more than {MAX_REGION_CAPS} capabilities")]
    TooMany,
    /// A sparse mmap capability lists more areas than allowed.
    #[error("Sparse mmap capability lists {0} areas (at most {MAX_SPARSE_AREAS})")]
    TooManyAreas(u32),
}

fn u16_at(buf: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(buf.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(buf: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(buf.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(buf: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(buf.get(at..at + 8)?.try_into().ok()?))
}

/// Parses the capability chain of a region info buffer (`buf` starts with `struct
/// vfio_region_info`; `first` is its `cap_offset`, 0 for none).
pub fn parse_region_caps(buf: &[u8], first: u32) -> Result<Vec<RegionCap>, RegionCapError> {
    let mut caps = Vec::new();
    let mut offset = first as usize;
    let len = buf.len();
    let oob = |offset| RegionCapError::OutOfBounds { offset, len };
    if offset != 0 && offset < REGION_INFO_SIZE {
        return Err(RegionCapError::Loop {
            offset: 0,
            next: offset,
        });
    }
    while offset != 0 {
        if caps.len() == MAX_REGION_CAPS {
            return Err(RegionCapError::TooMany);
        }
        let id = u16_at(buf, offset).ok_or(oob(offset))?;
        let next = u32_at(buf, offset + CAP_NEXT).ok_or(oob(offset))? as usize;
        let body = offset + CAP_HEADER_SIZE;
        let cap = match id {
            CAP_SPARSE_MMAP => {
                let count = u32_at(buf, body + SPARSE_NR_AREAS).ok_or(oob(offset))?;
                if count > MAX_SPARSE_AREAS {
                    return Err(RegionCapError::TooManyAreas(count));
                }
                let areas = (0..count as usize)
                    .map(|i| {
                        let at = body + SPARSE_AREAS + i * SPARSE_AREA_SIZE;
                        Some(SparseArea {
                            offset: u64_at(buf, at)?,
                            size: u64_at(buf, at + AREA_SIZE_FIELD)?,
                        })
                    })
                    .collect::<Option<Vec<_>>>()
                    .ok_or(oob(offset))?;
                RegionCap::SparseMmap(areas)
            }
            CAP_TYPE => RegionCap::Type {
                kind: u32_at(buf, body + TYPE_KIND).ok_or(oob(offset))?,
                subtype: u32_at(buf, body + TYPE_SUBTYPE).ok_or(oob(offset))?,
            },
            CAP_MSIX_MAPPABLE => RegionCap::MsixMappable,
            id => RegionCap::Other { id },
        };
        caps.push(cap);
        if next != 0 && next < body {
            return Err(RegionCapError::Loop { offset, next });
        }
        offset = next;
    }
    Ok(caps)
}

/// Serialises `caps` after a zeroed `struct vfio_region_info`, as the kernel lays them
/// out; returns the buffer and the first capability's offset. The model device and tests
/// use it.
///
/// # Panics
///
/// If the encoding passes 4 GiB (the kernel's offsets are 32-bit); callers encode a
/// handful of capabilities.
pub fn encode_region_caps(caps: &[RegionCap]) -> (Vec<u8>, u32) {
    let mut buf = vec![0u8; REGION_INFO_SIZE];
    let mut prev_next: Option<usize> = None;
    for cap in caps {
        let at = buf.len();
        if let Some(p) = prev_next {
            let at = u32::try_from(at).expect("region capabilities fit in 4 GiB");
            buf[p..p + 4].copy_from_slice(&at.to_le_bytes());
        }
        let (id, body): (u16, Vec<u8>) = match cap {
            RegionCap::SparseMmap(areas) => {
                let nr_areas = u32::try_from(areas.len()).expect("sparse areas fit a u32");
                let mut b = nr_areas.to_le_bytes().to_vec();
                b.extend_from_slice(&[0; 4]);
                for a in areas {
                    b.extend_from_slice(&a.offset.to_le_bytes());
                    b.extend_from_slice(&a.size.to_le_bytes());
                }
                (CAP_SPARSE_MMAP, b)
            }
            RegionCap::MsixMappable => (CAP_MSIX_MAPPABLE, Vec::new()),
            RegionCap::Type { kind, subtype } => {
                let mut b = kind.to_le_bytes().to_vec();
                b.extend_from_slice(&subtype.to_le_bytes());
                (CAP_TYPE, b)
            }
            RegionCap::Other { id } => (*id, Vec::new()),
        };
        buf.extend_from_slice(&id.to_le_bytes());
        buf.extend_from_slice(&1u16.to_le_bytes());
        prev_next = Some(buf.len());
        buf.extend_from_slice(&0u32.to_le_bytes());
        buf.extend_from_slice(&body);
    }
    let first = if caps.is_empty() {
        0
    } else {
        const { const_u32(REGION_INFO_SIZE as u64) }
    };
    (buf, first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoded_chain_parses_back() {
        let caps = vec![
            RegionCap::SparseMmap(vec![
                SparseArea {
                    offset: 0,
                    size: 0x1000,
                },
                SparseArea {
                    offset: 0x3000,
                    size: 0x1000,
                },
            ]),
            RegionCap::MsixMappable,
            RegionCap::Type {
                kind: 0x10de,
                subtype: 3,
            },
            RegionCap::Other { id: 9 },
        ];
        let (buf, first) = encode_region_caps(&caps);
        assert_eq!(parse_region_caps(&buf, first).unwrap(), caps);
        assert_eq!(parse_region_caps(&buf, 0).unwrap(), vec![]);
    }

    #[test]
    fn chain_that_points_back_is_a_loop_not_a_hang() {
        let (mut buf, first) = encode_region_caps(&[RegionCap::MsixMappable]);
        // next = itself
        buf[first as usize + 4..first as usize + 8].copy_from_slice(&first.to_le_bytes());
        assert!(matches!(
            parse_region_caps(&buf, first),
            Err(RegionCapError::Loop { .. })
        ));
        assert!(matches!(
            parse_region_caps(&buf, 4),
            Err(RegionCapError::Loop { .. })
        ));
    }

    #[test]
    fn truncated_sparse_areas_are_out_of_bounds() {
        let (buf, first) = encode_region_caps(&[RegionCap::SparseMmap(vec![SparseArea {
            offset: 0,
            size: 0x1000,
        }])]);
        let cut = &buf[..buf.len() - 1];
        assert!(matches!(
            parse_region_caps(cut, first),
            Err(RegionCapError::OutOfBounds { .. })
        ));
        let mut many = buf.clone();
        many[first as usize + 8..first as usize + 12].copy_from_slice(&1000u32.to_le_bytes());
        assert_eq!(
            parse_region_caps(&many, first),
            Err(RegionCapError::TooManyAreas(1000))
        );
    }
}
