//! The one parser of guest vsock packets, and the gather/scatter helpers that move
//! packet bytes between descriptor chains and host buffers.
//!
//! A TX chain is a 44-byte header followed by `len` payload bytes, spread over
//! device-readable descriptors in any framing. An RX chain is device-writable
//! descriptors with room for at least a header. Everything is checked here: chain
//! length, direction flags, buffers inside guest memory, header fields against the
//! guest's CID and the protocol, and the payload length against what the chain holds.

use std::ops::Deref;

use virtio_queue::DescriptorChain;
use vm_memory::GuestMemory;

use crate::virtio::chain::ChainError;

use super::{op, HOST_CID, MAX_PKT_PAYLOAD, TYPE_STREAM};

/// Size of the packet header.
pub const HEADER_SIZE: usize = 44;

/// Why a guest packet or chain was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum VsockPacketError {
    /// The chain is empty, longer than the queue (a loop) or broken.
    #[error("Descriptor chain is empty, broken or longer than the queue")]
    BadChain,
    /// A buffer lies outside guest memory.
    #[error("Buffer {addr:#x}+{len:#x} is outside guest memory")]
    OutsideMemory {
        /// Address.
        addr: u64,
        /// Length.
        len: u32,
    },
    /// A TX chain holds a device-writable buffer, or an RX chain a device-readable one.
    #[error("Descriptor direction is wrong for this queue")]
    WrongDirection,
    /// The chain is shorter than a header.
    #[error("Chain holds {0} bytes, less than a 44-byte header")]
    Short(usize),
    /// The source CID is not the guest's.
    #[error("Source CID {0} is not the guest's")]
    SourceCid(u64),
    /// The destination CID is not the host.
    #[error("Destination CID {0} is not the host (2)")]
    DestinationCid(u64),
    /// The socket type is not stream.
    #[error("Socket type {0} is not supported (stream only)")]
    Type(u16),
    /// The operation is unknown.
    #[error("Unknown operation {0}")]
    Op(u16),
    /// The payload length is larger than allowed, than the chain holds, or non-zero on a
    /// control packet.
    #[error("Payload length {0} is invalid for this packet")]
    Length(u32),
    /// Shutdown flags outside RCV|SEND.
    #[error("Shutdown flags {0:#x} are invalid")]
    Flags(u32),
}

/// A vsock packet header (little-endian on the wire).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacketHeader {
    /// Source CID.
    pub src_cid: u64,
    /// Destination CID.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length.
    pub len: u32,
    /// Socket type.
    pub type_: u16,
    /// Operation.
    pub op: u16,
    /// Operation flags.
    pub flags: u32,
    /// Sender's receive buffer size.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed from its receive buffer.
    pub fwd_cnt: u32,
}

impl PacketHeader {
    /// Decodes a header; `bytes` must hold at least 44 bytes.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let b = bytes.get(..HEADER_SIZE)?;
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap_or_default());
        Some(Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        })
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

/// Checks a guest header. `available` is the payload room the chain has after the header.
pub fn validate_tx(
    hdr: &PacketHeader,
    guest_cid: u64,
    available: usize,
) -> Result<(), VsockPacketError> {
    if hdr.src_cid != guest_cid {
        return Err(VsockPacketError::SourceCid(hdr.src_cid));
    }
    if hdr.dst_cid != HOST_CID {
        return Err(VsockPacketError::DestinationCid(hdr.dst_cid));
    }
    if hdr.type_ != TYPE_STREAM {
        return Err(VsockPacketError::Type(hdr.type_));
    }
    match hdr.op {
        op::RW => {
            if hdr.len as usize > MAX_PKT_PAYLOAD || hdr.len as usize > available {
                return Err(VsockPacketError::Length(hdr.len));
            }
        }
        op::REQUEST
        | op::RESPONSE
        | op::RST
        | op::SHUTDOWN
        | op::CREDIT_UPDATE
        | op::CREDIT_REQUEST => {
            if hdr.len != 0 {
                return Err(VsockPacketError::Length(hdr.len));
            }
        }
        other => return Err(VsockPacketError::Op(other)),
    }
    if hdr.op == op::SHUTDOWN && hdr.flags & !0x3 != 0 {
        return Err(VsockPacketError::Flags(hdr.flags));
    }
    Ok(())
}

pub use crate::virtio::chain::{gather, scatter, total_len, Buffer};

/// Reads the buffers of a chain (see [`crate::virtio::chain::collect`]).
pub fn collect<M, G>(
    chain: DescriptorChain<M>,
    mem: &G,
    queue_size: u16,
    writable: bool,
) -> Result<Vec<Buffer>, VsockPacketError>
where
    M: Deref,
    M::Target: GuestMemory,
    G: GuestMemory + ?Sized,
{
    crate::virtio::chain::collect(chain, mem, queue_size, writable).map_err(|e| match e {
        ChainError::BadChain => VsockPacketError::BadChain,
        ChainError::WrongDirection => VsockPacketError::WrongDirection,
        ChainError::OutsideMemory { addr, len } => VsockPacketError::OutsideMemory { addr, len },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> PacketHeader {
        PacketHeader {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 1000,
            dst_port: 52,
            len: 0,
            type_: TYPE_STREAM,
            op: op::REQUEST,
            flags: 0,
            buf_alloc: 4096,
            fwd_cnt: 0,
        }
    }

    #[test]
    fn header_round_trips() {
        let h = PacketHeader {
            len: 7,
            op: op::RW,
            ..good()
        };
        assert_eq!(PacketHeader::decode(&h.encode()), Some(h));
        assert_eq!(PacketHeader::decode(&[0u8; 43]), None);
    }

    #[test]
    fn validate_rejects_spoofed_cids_types_ops_and_lengths() {
        assert_eq!(validate_tx(&good(), 3, 0), Ok(()));
        assert_eq!(
            validate_tx(&good(), 4, 0),
            Err(VsockPacketError::SourceCid(3))
        );
        let h = PacketHeader {
            dst_cid: 7,
            ..good()
        };
        assert_eq!(
            validate_tx(&h, 3, 0),
            Err(VsockPacketError::DestinationCid(7))
        );
        let h = PacketHeader { type_: 2, ..good() };
        assert_eq!(validate_tx(&h, 3, 0), Err(VsockPacketError::Type(2)));
        let h = PacketHeader { op: 99, ..good() };
        assert_eq!(validate_tx(&h, 3, 0), Err(VsockPacketError::Op(99)));
        let h = PacketHeader {
            op: op::RW,
            len: 100,
            ..good()
        };
        assert_eq!(validate_tx(&h, 3, 99), Err(VsockPacketError::Length(100)));
        let h = PacketHeader {
            op: op::RW,
            len: u32::MAX,
            ..good()
        };
        assert_eq!(
            validate_tx(&h, 3, usize::MAX),
            Err(VsockPacketError::Length(u32::MAX))
        );
        let h = PacketHeader { len: 1, ..good() };
        assert_eq!(validate_tx(&h, 3, 10), Err(VsockPacketError::Length(1)));
        let h = PacketHeader {
            op: op::SHUTDOWN,
            flags: 4,
            ..good()
        };
        assert_eq!(validate_tx(&h, 3, 0), Err(VsockPacketError::Flags(4)));
    }

    /// Random headers: decode and validate answer, never panic. The fuzz target in
    /// vmm/devices/fuzz does the same with coverage guidance.
    #[test]
    fn validate_survives_random_input() {
        let mut x = 0x853c_49e6_748f_ea9bu64;
        for _ in 0..50_000 {
            let mut bytes = [0u8; HEADER_SIZE];
            for chunk in bytes.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let n = chunk.len();
                chunk.copy_from_slice(&x.to_le_bytes()[..n]);
            }
            if let Some(h) = PacketHeader::decode(&bytes) {
                let _ = validate_tx(&h, 3, (x % 70_000) as usize);
            }
        }
    }
}
