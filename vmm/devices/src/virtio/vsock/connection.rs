//! One vsock connection: its host stream, the guest-to-host buffer (bounded by the
//! credit the device advertises), and the credit bookkeeping of both directions.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;

use super::packet::PacketHeader;
use super::{CONN_BUF_SIZE, HOST_CID, TYPE_STREAM};
// `fwd_cnt` counts bytes modulo 2^32 (virtio-vsock): adding a count's low 32 bits is
// adding the count.
use crate::narrow::low_u32;

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnState {
    /// The host connected and sent CONNECT; the guest has not answered yet.
    HostConnecting,
    /// Both sides may send.
    Established,
}

/// The guest sent more than the credit the device gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("Guest overran the connection's receive buffer")]
pub struct CreditOverrun;

/// What reading the host stream gave.
#[derive(Debug)]
pub enum HostRead {
    /// Bytes for the guest.
    Data(Vec<u8>),
    /// Nothing now.
    WouldBlock,
    /// The host closed its end.
    Eof,
    /// The stream failed.
    Error(io::Error),
}

/// A connection between a guest port and a host Unix stream.
#[derive(Debug)]
pub struct Connection {
    /// The host side.
    pub stream: UnixStream,
    /// Epoll token of the stream.
    pub token: u32,
    /// Host-side port (the guest's destination port).
    pub local_port: u32,
    /// Guest-side port.
    pub peer_port: u32,
    /// Life-cycle state.
    pub state: ConnState,
    /// The stream may have bytes to read (edge-triggered readiness).
    pub readable: bool,
    /// The host closed its end; a SHUTDOWN went to the guest.
    pub host_eof: bool,
    /// Bytes the host sent after its CONNECT line, delivered before the stream's.
    pub host_prefix: Vec<u8>,
    /// The guest will send no more: shut the stream's write side once flushed.
    pub shutdown_send: bool,
    tx_buf: VecDeque<u8>,
    /// Guest bytes the device has forwarded to the host stream.
    pub fwd_cnt: u32,
    /// The `fwd_cnt` last reported to the guest.
    pub last_fwd_cnt_sent: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    rx_cnt: u32,
}

impl Connection {
    /// A connection over `stream` (already non-blocking).
    pub fn new(
        stream: UnixStream,
        token: u32,
        local_port: u32,
        peer_port: u32,
        state: ConnState,
    ) -> Self {
        Self {
            stream,
            token,
            local_port,
            peer_port,
            state,
            readable: true,
            host_eof: false,
            host_prefix: Vec::new(),
            shutdown_send: false,
            tx_buf: VecDeque::new(),
            fwd_cnt: 0,
            last_fwd_cnt_sent: 0,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            rx_cnt: 0,
        }
    }

    /// Records the guest's buffer size and consumption from any of its packets.
    pub fn update_peer_credit(&mut self, hdr: &PacketHeader) {
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = hdr.fwd_cnt;
    }

    /// Bytes the guest can take now. A guest claiming more consumption than it was
    /// sent gets no credit rather than a wrapped-around huge one.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = self.rx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Whether there is something to deliver to the guest.
    pub fn wants_rx(&self) -> bool {
        self.state == ConnState::Established
            && !self.host_eof
            && (self.readable || !self.host_prefix.is_empty())
            && self.peer_credit() > 0
    }

    /// A header from this connection to the guest.
    pub fn header(&self, guest_cid: u64, op: u16, len: u32, flags: u32) -> PacketHeader {
        PacketHeader {
            src_cid: HOST_CID,
            dst_cid: guest_cid,
            src_port: self.local_port,
            dst_port: self.peer_port,
            len,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: CONN_BUF_SIZE,
            fwd_cnt: self.fwd_cnt,
        }
    }

    /// Takes guest payload for the host: straight to the stream when nothing is queued,
    /// the rest into the bounded buffer.
    pub fn push_from_guest(&mut self, data: &[u8]) -> Result<(), CreditOverrun> {
        if self.tx_buf.len() + data.len() > CONN_BUF_SIZE as usize {
            return Err(CreditOverrun);
        }
        let mut written = 0;
        if self.tx_buf.is_empty() {
            while written < data.len() {
                match self.stream.write(&data[written..]) {
                    Ok(0) => break,
                    Ok(n) => written += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                }
            }
        }
        self.fwd_cnt = self.fwd_cnt.wrapping_add(low_u32(written as u64));
        self.tx_buf.extend(&data[written..]);
        Ok(())
    }

    /// Writes buffered guest bytes to the stream. Returns how many moved.
    pub fn flush(&mut self) -> io::Result<usize> {
        let mut moved = 0;
        while !self.tx_buf.is_empty() {
            let (front, _) = self.tx_buf.as_slices();
            match self.stream.write(front) {
                Ok(0) => break,
                Ok(n) => {
                    self.tx_buf.drain(..n);
                    moved += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        self.fwd_cnt = self.fwd_cnt.wrapping_add(low_u32(moved as u64));
        if self.shutdown_send && self.tx_buf.is_empty() {
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
        }
        Ok(moved)
    }

    /// Bytes waiting for the host stream.
    pub fn buffered(&self) -> usize {
        self.tx_buf.len()
    }

    /// Whether enough was forwarded since the guest last heard that it should be told.
    pub fn needs_credit_update(&self) -> bool {
        self.fwd_cnt.wrapping_sub(self.last_fwd_cnt_sent) >= CONN_BUF_SIZE / 2
    }

    /// Reads up to `max` bytes for the guest (the CONNECT leftovers first).
    pub fn read_for_guest(&mut self, max: usize) -> HostRead {
        if max == 0 {
            return HostRead::WouldBlock;
        }
        if !self.host_prefix.is_empty() {
            let n = max.min(self.host_prefix.len());
            let data: Vec<u8> = self.host_prefix.drain(..n).collect();
            return HostRead::Data(data);
        }
        let mut buf = vec![0u8; max];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => return HostRead::Eof,
                Ok(n) => {
                    buf.truncate(n);
                    return HostRead::Data(buf);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return HostRead::WouldBlock,
                Err(e) => return HostRead::Error(e),
            }
        }
    }

    /// Records `n` payload bytes sent to the guest.
    pub fn sent_to_guest(&mut self, n: u32) {
        self.rx_cnt = self.rx_cnt.wrapping_add(n);
        self.last_fwd_cnt_sent = self.fwd_cnt;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn() -> (Connection, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        (
            Connection::new(a, 10, 1 << 30, 1000, ConnState::Established),
            b,
        )
    }

    #[test]
    fn guest_claiming_unsent_consumption_gets_no_credit() {
        let (mut c, _peer) = conn();
        c.update_peer_credit(&PacketHeader {
            buf_alloc: 4096,
            fwd_cnt: 0,
            ..Default::default()
        });
        assert_eq!(c.peer_credit(), 4096);
        c.sent_to_guest(1000);
        assert_eq!(c.peer_credit(), 3096);
        c.update_peer_credit(&PacketHeader {
            buf_alloc: 4096,
            fwd_cnt: 5000,
            ..Default::default()
        });
        assert_eq!(c.peer_credit(), 0);
    }

    #[test]
    fn buffer_is_bounded_by_advertised_credit() {
        let (mut c, _peer) = conn();
        // The peer never reads: the socket buffer fills, then the device buffer.
        let chunk = vec![7u8; 64 << 10];
        let mut overrun = false;
        for _ in 0..200 {
            if c.push_from_guest(&chunk).is_err() {
                overrun = true;
                break;
            }
        }
        assert!(overrun);
        assert!(c.buffered() <= CONN_BUF_SIZE as usize);
    }

    #[test]
    fn flush_moves_buffered_bytes_and_counts_them() {
        let (mut c, mut peer) = conn();
        peer.set_nonblocking(true).unwrap();
        let chunk = vec![1u8; 64 << 10];
        while c.buffered() == 0 {
            c.push_from_guest(&chunk).unwrap();
        }
        let before = c.fwd_cnt;
        let mut sink = vec![0u8; 1 << 20];
        while peer.read(&mut sink).is_ok() {}
        let moved = c.flush().unwrap();
        assert!(moved > 0);
        assert_eq!(
            c.fwd_cnt,
            before.wrapping_add(u32::try_from(moved).unwrap())
        );
    }
}
