//! The one parser of virtio-blk requests. Everything the guest put in a descriptor chain
//! is checked here, once: chain shape and length, descriptor direction flags, that every
//! buffer lies inside guest memory, header and status sizes, sector alignment, sector
//! ranges against the disk size (checked arithmetic throughout), and the features the
//! driver negotiated. Code after it works on a typed [`Request`] only.
//!
//! Framing: the 16-byte header is the first descriptor (device-readable, at least 16
//! bytes), the status is the last byte of the last descriptor (device-writable), and the
//! data buffers lie in between, as every Linux and Windows driver lays them out.

use std::ops::Deref;

use virtio_queue::DescriptorChain;
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemory, Permissions};

use super::{
    features, request_type, status, ID_BYTES, MAX_DISCARD_SECTORS, MAX_REQUEST_BYTES, SECTOR_SHIFT,
    SECTOR_SIZE,
};

/// Size of the request header.
pub const HEADER_SIZE: u32 = 16;
/// Size of one discard / write-zeroes segment.
pub const DISCARD_SEGMENT_SIZE: u64 = 16;
/// Discard / write-zeroes segments accepted per request (`max_discard_seg`).
pub const MAX_DISCARD_SEGMENTS: u32 = 1;
/// Write-zeroes flag: the device may deallocate the range.
const WRITE_ZEROES_UNMAP: u32 = 1;

/// Why a request was refused. Each maps to a status byte and a counter.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum BlockRequestError {
    /// The chain has no descriptors (head index past the table, or an unreadable table).
    #[error("Descriptor chain is empty or its head is out of range")]
    EmptyChain,
    /// The chain has more descriptors than the queue (a loop, or a hostile chain), or
    /// ends in a descriptor that still points to a next one.
    #[error("Descriptor chain is longer than the queue or broken")]
    ChainTooLong,
    /// A buffer lies (partly) outside guest memory.
    #[error("Buffer {addr:#x}+{len:#x} is outside guest memory")]
    OutsideMemory {
        /// Buffer address.
        addr: u64,
        /// Buffer length.
        len: u32,
    },
    /// The header descriptor is device-writable or shorter than 16 bytes.
    #[error("Request header is not a device-readable buffer of 16 bytes")]
    BadHeader,
    /// The status descriptor is device-readable or empty.
    #[error("Request has no device-writable status byte")]
    BadStatus,
    /// A data buffer has the wrong direction for the request type.
    #[error("Data buffer direction does not match the request type")]
    WrongDirection,
    /// The data length is not a whole number of sectors, or is zero where data is needed.
    #[error("Data length {0} is not a non-zero multiple of 512 bytes")]
    Unaligned(u64),
    /// The data is larger than one request may move.
    #[error("Request moves {0} bytes, more than the limit")]
    TooLarge(u64),
    /// The sector range runs past the end of the disk (or overflows).
    #[error("Sectors {sector}+{count} run past the end of the disk")]
    PastEnd {
        /// First sector.
        sector: u64,
        /// Number of sectors.
        count: u64,
    },
    /// A write, discard or write-zeroes to a read-only disk.
    #[error("Write to a read-only disk")]
    ReadOnly,
    /// The request type is unknown or its feature was not negotiated.
    #[error("Unsupported request type {0}")]
    Unsupported(u32),
    /// Discard/write-zeroes segments are malformed (count, size or flags).
    #[error("Malformed discard or write-zeroes segments")]
    BadSegments,
}

impl BlockRequestError {
    /// The status byte the driver gets.
    pub fn status(&self) -> u8 {
        match self {
            BlockRequestError::Unsupported(_) => status::UNSUPP,
            _ => status::IOERR,
        }
    }
}

/// One descriptor as the parser sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    /// Guest address of the buffer.
    pub addr: GuestAddress,
    /// Buffer length.
    pub len: u32,
    /// Whether the device may write it.
    pub write_only: bool,
}

/// What the parser needs to know about the disk.
#[derive(Debug, Clone, Copy)]
pub struct DiskGeometry {
    /// Size in sectors.
    pub sectors: u64,
    /// Read-only disk.
    pub read_only: bool,
    /// Features the driver accepted.
    pub acked_features: u64,
}

/// A sector range of a discard or write-zeroes request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectorRange {
    /// First sector.
    pub sector: u64,
    /// Number of sectors.
    pub count: u32,
    /// Write-zeroes may deallocate.
    pub unmap: bool,
}

/// A validated request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestKind {
    /// Read `len` bytes at `sector` into the data buffers.
    Read,
    /// Write the data buffers at `sector`.
    Write,
    /// Flush to stable storage.
    Flush,
    /// Write the 20-byte ID into the data buffers.
    GetId,
    /// Deallocate ranges.
    Discard(Vec<SectorRange>),
    /// Zero ranges.
    WriteZeroes(Vec<SectorRange>),
}

/// A request that passed every check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// What to do.
    pub kind: RequestKind,
    /// First sector (reads and writes).
    pub sector: u64,
    /// Data buffers, in order, all inside guest memory and of the right direction.
    pub data: Vec<Descriptor>,
    /// Total data length.
    pub data_len: u64,
    /// Where the status byte goes.
    pub status_addr: GuestAddress,
}

/// A refused request: why, and where its status byte goes if the chain has a usable one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// Why.
    pub error: BlockRequestError,
    /// Status byte location, when the chain has a valid one.
    pub status_addr: Option<GuestAddress>,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RequestHeader {
    request_type: u32,
    reserved: u32,
    sector: u64,
}

// SAFETY: plain old data of integers, no padding, every bit pattern valid.
unsafe impl ByteValued for RequestHeader {}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DiscardSegment {
    sector: u64,
    num_sectors: u32,
    flags: u32,
}

// SAFETY: plain old data of integers, no padding, every bit pattern valid.
unsafe impl ByteValued for DiscardSegment {}

/// Reads the descriptors of `chain`, refusing chains longer than the queue (loops) and
/// chains that end while still pointing to a next descriptor.
pub fn collect_chain<M>(
    chain: DescriptorChain<M>,
    queue_size: u16,
) -> Result<Vec<Descriptor>, BlockRequestError>
where
    M: Deref,
    M::Target: GuestMemory,
{
    let mut descs = Vec::new();
    let mut last_has_next = false;
    for desc in chain {
        descs.push(Descriptor {
            addr: desc.addr(),
            len: desc.len(),
            write_only: desc.is_write_only(),
        });
        last_has_next = desc.has_next();
        if descs.len() > usize::from(queue_size) {
            return Err(BlockRequestError::ChainTooLong);
        }
    }
    if descs.is_empty() {
        return Err(BlockRequestError::EmptyChain);
    }
    if last_has_next {
        return Err(BlockRequestError::ChainTooLong);
    }
    Ok(descs)
}

/// Parses a request from its descriptors.
pub fn parse<M: GuestMemory + ?Sized>(
    descs: &[Descriptor],
    mem: &M,
    disk: &DiskGeometry,
) -> Result<Request, Rejected> {
    let reject = |error, status_addr| Rejected { error, status_addr };
    let (Some(first), Some(last)) = (descs.first(), descs.last()) else {
        return Err(reject(BlockRequestError::EmptyChain, None));
    };
    for d in descs {
        if !mem.check_range(d.addr, d.len as usize, Permissions::ReadWrite) {
            return Err(reject(
                BlockRequestError::OutsideMemory {
                    addr: d.addr.0,
                    len: d.len,
                },
                None,
            ));
        }
    }
    // The status byte: the last byte of the last descriptor, which must be writable and
    // must not also be the header.
    if descs.len() < 2 || !last.write_only || last.len == 0 {
        return Err(reject(BlockRequestError::BadStatus, None));
    }
    let status_addr = GuestAddress(last.addr.0 + u64::from(last.len) - 1);
    let rejected = |error| Rejected {
        error,
        status_addr: Some(status_addr),
    };
    if first.write_only || first.len < HEADER_SIZE {
        return Err(rejected(BlockRequestError::BadHeader));
    }
    let header: RequestHeader = mem
        .read_obj(first.addr)
        .map_err(|_| rejected(BlockRequestError::BadHeader))?;
    let request_type = u32::from_le(header.request_type);
    let sector = u64::from_le(header.sector);

    // Data buffers: everything between header and status, plus what the status
    // descriptor holds before its last byte.
    let mut data: Vec<Descriptor> = descs[1..descs.len() - 1].to_vec();
    if last.len > 1 {
        data.push(Descriptor {
            len: last.len - 1,
            ..*last
        });
    }
    let data_len = data
        .iter()
        .try_fold(0u64, |acc, d| acc.checked_add(u64::from(d.len)));
    let data_len = data_len.ok_or_else(|| rejected(BlockRequestError::TooLarge(u64::MAX)))?;
    if data_len > MAX_REQUEST_BYTES {
        return Err(rejected(BlockRequestError::TooLarge(data_len)));
    }
    let direction = |writable: bool| -> Result<(), Rejected> {
        if data.iter().any(|d| d.write_only != writable) {
            Err(rejected(BlockRequestError::WrongDirection))
        } else {
            Ok(())
        }
    };
    let in_disk = |sector: u64, count: u64| -> Result<(), Rejected> {
        match sector.checked_add(count) {
            Some(end) if end <= disk.sectors => Ok(()),
            _ => Err(rejected(BlockRequestError::PastEnd { sector, count })),
        }
    };
    let acked = |feature: u64| disk.acked_features & feature != 0;

    let kind = match request_type {
        request_type::IN | request_type::OUT => {
            let write = request_type == request_type::OUT;
            if write && disk.read_only {
                return Err(rejected(BlockRequestError::ReadOnly));
            }
            direction(!write)?;
            if data_len == 0 || data_len % SECTOR_SIZE != 0 {
                return Err(rejected(BlockRequestError::Unaligned(data_len)));
            }
            in_disk(sector, data_len >> SECTOR_SHIFT)?;
            if write {
                RequestKind::Write
            } else {
                RequestKind::Read
            }
        }
        request_type::FLUSH if acked(features::FLUSH) => {
            direction(false)?;
            RequestKind::Flush
        }
        request_type::GET_ID => {
            direction(true)?;
            if data_len < ID_BYTES as u64 {
                return Err(rejected(BlockRequestError::Unaligned(data_len)));
            }
            RequestKind::GetId
        }
        t @ (request_type::DISCARD | request_type::WRITE_ZEROES) => {
            let feature = if t == request_type::DISCARD {
                features::DISCARD
            } else {
                features::WRITE_ZEROES
            };
            if !acked(feature) {
                return Err(rejected(BlockRequestError::Unsupported(t)));
            }
            if disk.read_only {
                return Err(rejected(BlockRequestError::ReadOnly));
            }
            direction(false)?;
            let ranges = parse_segments(&data, data_len, mem, t == request_type::WRITE_ZEROES)
                .map_err(rejected)?;
            for r in &ranges {
                in_disk(r.sector, u64::from(r.count))?;
            }
            if t == request_type::DISCARD {
                RequestKind::Discard(ranges)
            } else {
                RequestKind::WriteZeroes(ranges)
            }
        }
        other => return Err(rejected(BlockRequestError::Unsupported(other))),
    };
    Ok(Request {
        kind,
        sector,
        data,
        data_len,
        status_addr,
    })
}

fn parse_segments<M: GuestMemory + ?Sized>(
    data: &[Descriptor],
    data_len: u64,
    mem: &M,
    write_zeroes: bool,
) -> Result<Vec<SectorRange>, BlockRequestError> {
    let count = data_len / DISCARD_SEGMENT_SIZE;
    if data_len == 0
        || data_len % DISCARD_SEGMENT_SIZE != 0
        || count > u64::from(MAX_DISCARD_SEGMENTS)
    {
        return Err(BlockRequestError::BadSegments);
    }
    // Segments must not straddle descriptors.
    let mut ranges = Vec::new();
    for d in data {
        if u64::from(d.len) % DISCARD_SEGMENT_SIZE != 0 {
            return Err(BlockRequestError::BadSegments);
        }
        for i in 0..u64::from(d.len) / DISCARD_SEGMENT_SIZE {
            let seg: DiscardSegment = mem
                .read_obj(GuestAddress(d.addr.0 + i * DISCARD_SEGMENT_SIZE))
                .map_err(|_| BlockRequestError::BadSegments)?;
            let flags = u32::from_le(seg.flags);
            let allowed = if write_zeroes { WRITE_ZEROES_UNMAP } else { 0 };
            let num = u32::from_le(seg.num_sectors);
            if flags & !allowed != 0 || num == 0 || num > MAX_DISCARD_SECTORS {
                return Err(BlockRequestError::BadSegments);
            }
            ranges.push(SectorRange {
                sector: u64::from_le(seg.sector),
                count: num,
                unmap: flags & WRITE_ZEROES_UNMAP != 0,
            });
        }
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::GuestMemoryMmap;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::{Queue, QueueOwnedT};

    const MEM_SIZE: u64 = 0x20_0000;
    const HDR: u64 = 0x10_0000;
    const DATA: u64 = 0x10_1000;
    const STATUS: u64 = 0x11_0000;
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), usize::try_from(MEM_SIZE).unwrap())])
            .unwrap()
    }

    fn disk() -> DiskGeometry {
        DiskGeometry {
            sectors: 2048,
            read_only: false,
            acked_features: features::FLUSH | features::DISCARD | features::WRITE_ZEROES,
        }
    }

    fn header(mem: &GuestMemoryMmap, t: u32, sector: u64) {
        mem.write_obj(
            RequestHeader {
                request_type: t,
                reserved: 0,
                sector,
            },
            GuestAddress(HDR),
        )
        .unwrap();
    }

    fn d(addr: u64, len: u32, write_only: bool) -> Descriptor {
        Descriptor {
            addr: GuestAddress(addr),
            len,
            write_only,
        }
    }

    fn rw(
        t: u32,
        sector: u64,
        len: u32,
        data_writable: bool,
    ) -> (GuestMemoryMmap, Vec<Descriptor>) {
        let m = mem();
        header(&m, t, sector);
        (
            m,
            vec![
                d(HDR, 16, false),
                d(DATA, len, data_writable),
                d(STATUS, 1, true),
            ],
        )
    }

    fn err(descs: &[Descriptor], m: &GuestMemoryMmap, disk: &DiskGeometry) -> BlockRequestError {
        parse(descs, m, disk).unwrap_err().error
    }

    #[test]
    fn parses_read_and_write() {
        let (m, descs) = rw(request_type::IN, 8, 4096, true);
        let req = parse(&descs, &m, &disk()).unwrap();
        assert_eq!(req.kind, RequestKind::Read);
        assert_eq!(
            (req.sector, req.data_len, req.status_addr),
            (8, 4096, GuestAddress(STATUS))
        );
        let (m, descs) = rw(request_type::OUT, 2040, 4096, false);
        assert_eq!(parse(&descs, &m, &disk()).unwrap().kind, RequestKind::Write);
    }

    #[test]
    fn parse_rejects_wrong_direction_flags() {
        let (m, descs) = rw(request_type::IN, 0, 512, false);
        assert_eq!(err(&descs, &m, &disk()), BlockRequestError::WrongDirection);
        let (m, descs) = rw(request_type::OUT, 0, 512, true);
        assert_eq!(err(&descs, &m, &disk()), BlockRequestError::WrongDirection);
        let (m, mut descs) = rw(request_type::IN, 0, 512, true);
        descs[0].write_only = true;
        assert_eq!(err(&descs, &m, &disk()), BlockRequestError::BadHeader);
        descs[0].write_only = false;
        descs[2].write_only = false;
        let rejected = parse(&descs, &m, &disk()).unwrap_err();
        assert_eq!(
            rejected,
            Rejected {
                error: BlockRequestError::BadStatus,
                status_addr: None
            }
        );
    }

    #[test]
    fn parse_rejects_sectors_past_the_end_and_overflow() {
        let (m, descs) = rw(request_type::IN, 2041, 4096, true);
        assert!(matches!(
            err(&descs, &m, &disk()),
            BlockRequestError::PastEnd { .. }
        ));
        let (m, descs) = rw(request_type::OUT, u64::MAX - 1, 4096, false);
        assert!(matches!(
            err(&descs, &m, &disk()),
            BlockRequestError::PastEnd { .. }
        ));
    }

    #[test]
    fn parse_rejects_unaligned_and_oversized_lengths() {
        let (m, descs) = rw(request_type::IN, 0, 513, true);
        assert_eq!(err(&descs, &m, &disk()), BlockRequestError::Unaligned(513));
        let m = mem();
        header(&m, request_type::IN, 0);
        // Two buffers of 4 GiB - 1 each: the sum overflows u32 and exceeds the limit.
        let descs = [
            d(HDR, 16, false),
            d(0, u32::MAX, true),
            d(0, u32::MAX, true),
            d(STATUS, 1, true),
        ];
        assert!(matches!(
            err(&descs, &m, &disk()),
            BlockRequestError::OutsideMemory { .. }
        ));
        let descs = vec![d(HDR, 16, false)]
            .into_iter()
            .chain((0..40).map(|_| d(0, 1 << 20, true)))
            .chain([d(STATUS, 1, true)])
            .collect::<Vec<_>>();
        assert!(matches!(
            err(&descs, &m, &disk()),
            BlockRequestError::TooLarge(_)
        ));
    }

    #[test]
    fn parse_rejects_buffers_outside_guest_memory() {
        let (m, mut descs) = rw(request_type::IN, 0, 4096, true);
        descs[1].addr = GuestAddress(MEM_SIZE - 512);
        assert!(matches!(
            err(&descs, &m, &disk()),
            BlockRequestError::OutsideMemory { .. }
        ));
        descs[1].addr = GuestAddress(u64::MAX - 100);
        assert!(matches!(
            err(&descs, &m, &disk()),
            BlockRequestError::OutsideMemory { .. }
        ));
    }

    #[test]
    fn parse_rejects_write_to_read_only_disk_with_ioerr() {
        let (m, descs) = rw(request_type::OUT, 0, 512, false);
        let ro = DiskGeometry {
            read_only: true,
            ..disk()
        };
        let e = err(&descs, &m, &ro);
        assert_eq!(e, BlockRequestError::ReadOnly);
        assert_eq!(e.status(), status::IOERR);
    }

    #[test]
    fn unknown_or_unnegotiated_types_are_unsupported() {
        let (m, descs) = rw(77, 0, 512, false);
        assert_eq!(err(&descs, &m, &disk()).status(), status::UNSUPP);
        let (m, descs) = rw(request_type::DISCARD, 0, 16, false);
        let plain = DiskGeometry {
            acked_features: 0,
            ..disk()
        };
        assert_eq!(
            err(&descs, &m, &plain),
            BlockRequestError::Unsupported(request_type::DISCARD)
        );
    }

    #[test]
    fn discard_segments_are_validated() {
        let (m, descs) = rw(request_type::WRITE_ZEROES, 0, 16, false);
        m.write_obj(
            DiscardSegment {
                sector: 10,
                num_sectors: 8,
                flags: 1,
            },
            GuestAddress(DATA),
        )
        .unwrap();
        let req = parse(&descs, &m, &disk()).unwrap();
        assert_eq!(
            req.kind,
            RequestKind::WriteZeroes(vec![SectorRange {
                sector: 10,
                count: 8,
                unmap: true
            }])
        );
        // Unmap is not a discard flag; past the end; two segments; zero sectors.
        let (m, descs) = rw(request_type::DISCARD, 0, 16, false);
        m.write_obj(
            DiscardSegment {
                sector: 10,
                num_sectors: 8,
                flags: 1,
            },
            GuestAddress(DATA),
        )
        .unwrap();
        assert_eq!(err(&descs, &m, &disk()), BlockRequestError::BadSegments);
        m.write_obj(
            DiscardSegment {
                sector: 2047,
                num_sectors: 8,
                flags: 0,
            },
            GuestAddress(DATA),
        )
        .unwrap();
        assert!(matches!(
            err(&descs, &m, &disk()),
            BlockRequestError::PastEnd { .. }
        ));
        let (m, descs) = rw(request_type::DISCARD, 0, 32, false);
        assert_eq!(err(&descs, &m, &disk()), BlockRequestError::BadSegments);
        let (m, descs) = rw(request_type::DISCARD, 0, 16, false);
        assert_eq!(err(&descs, &m, &disk()), BlockRequestError::BadSegments);
    }

    #[test]
    fn get_id_needs_twenty_writable_bytes() {
        let (m, descs) = rw(request_type::GET_ID, 0, 20, true);
        assert_eq!(parse(&descs, &m, &disk()).unwrap().kind, RequestKind::GetId);
        let (m, descs) = rw(request_type::GET_ID, 0, 19, true);
        parse(&descs, &m, &disk()).unwrap_err();
    }

    #[test]
    fn collect_refuses_descriptor_loops() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, 16);
        // Descriptor 0 -> 1 -> 0 -> ...
        let descs = [
            RawDescriptor::from(SplitDescriptor::new(HDR, 16, F_NEXT, 1)),
            RawDescriptor::from(SplitDescriptor::new(DATA, 512, F_NEXT | F_WRITE, 0)),
        ];
        vq.add_desc_chains(&descs, 0).unwrap();
        let mut q: Queue = vq.create_queue().unwrap();
        let chain = q.iter(&m).unwrap().next().unwrap();
        assert_eq!(
            collect_chain(chain, 16),
            Err(BlockRequestError::ChainTooLong)
        );
    }

    #[test]
    fn collect_refuses_heads_out_of_range() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, 16);
        vq.avail().ring().ref_at(0).unwrap().store(u16::to_le(200));
        vq.avail().idx().store(1);
        let mut q: Queue = vq.create_queue().unwrap();
        let chain = q.iter(&m).unwrap().next().unwrap();
        assert_eq!(collect_chain(chain, 16), Err(BlockRequestError::EmptyChain));
    }

    /// Random descriptors and headers: the parser answers, never panics. The fuzz target
    /// in vmm/devices/fuzz does the same with coverage guidance.
    #[test]
    fn parse_survives_random_input() {
        let m = mem();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let n = (next() % 6) as usize;
            let descs: Vec<Descriptor> = (0..n)
                .map(|_| {
                    let r = next();
                    let addr = match r % 4 {
                        0 => r >> 8,
                        _ => (r >> 8) % MEM_SIZE,
                    };
                    d(addr, (next() % 0x3000) as u32, next() % 2 == 0)
                })
                .collect();
            header(&m, (next() % 16) as u32, next() % 4096);
            let _ = parse(&descs, &m, &disk());
        }
    }
}
