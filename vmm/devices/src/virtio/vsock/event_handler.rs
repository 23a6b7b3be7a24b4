//! The vsock worker on the device event loop: TX packets from the guest, RX packets to
//! it, the listening socket, and every connection's host stream (edge-triggered).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;

use event_manager::{EventOps, Events, MutEventSubscriber};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::connection::{ConnState, Connection, HostRead};
use super::packet::{self, PacketHeader, HEADER_SIZE};
use super::*;
use crate::inc;
use crate::narrow::{const_u16, const_u32};
use crate::virtio::{GuestMemoryMmap, VirtioInterrupt, VirtioInterruptType};

const RX: usize = 0;
const TX: usize = 1;
const EVQ: usize = 2;
/// The queues' indices as the epoll tokens of their notification eventfds.
const RX_TOKEN: u32 = const_u32(RX as u64);
const TX_TOKEN: u32 = const_u32(TX as u64);
const EVQ_TOKEN: u32 = const_u32(EVQ as u64);
/// The receive and transmit queues' indices as interrupt queue numbers.
const RX_VECTOR: u16 = const_u16(RX as u64);
const TX_VECTOR: u16 = const_u16(TX as u64);
/// A packet header's length, as a used-ring length.
const HEADER_LEN: u32 = const_u32(HEADER_SIZE as u64);
const LISTENER_TOKEN: u32 = 3;
const FIRST_STREAM_TOKEN: u32 = 16;

/// A control packet waiting for an RX buffer (its header is built when sent, so it
/// carries the connection's current credit).
#[derive(Debug, Clone, Copy)]
struct Control {
    op: u16,
    local_port: u32,
    peer_port: u32,
    flags: u32,
}

/// A host connection that has not finished its `CONNECT <port>\n` line.
struct Handshake {
    stream: UnixStream,
    line: Vec<u8>,
}

enum Target {
    Conn((u32, u32)),
    Handshake,
}

/// The vsock device's worker.
pub struct VsockHandler {
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    events: Vec<EventFd>,
    interrupt: Arc<dyn VirtioInterrupt>,
    guest_cid: u64,
    listener: Arc<UnixListener>,
    uds_path: PathBuf,
    conns: BTreeMap<(u32, u32), Connection>,
    tokens: HashMap<u32, Target>,
    handshakes: HashMap<u32, Handshake>,
    control: VecDeque<Control>,
    next_token: u32,
    next_host_port: u32,
    rr_cursor: (u32, u32),
    used: [bool; 2],
    broken: bool,
    metrics: Arc<VsockMetrics>,
}

const STREAM_EVENTS: EventSet = EventSet::IN
    .union(EventSet::OUT)
    .union(EventSet::EDGE_TRIGGERED)
    .union(EventSet::READ_HANG_UP);

impl VsockHandler {
    /// A worker over the rx, tx and event queues (in that order).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        events: Vec<EventFd>,
        interrupt: Arc<dyn VirtioInterrupt>,
        guest_cid: u64,
        listener: Arc<UnixListener>,
        uds_path: PathBuf,
        metrics: Arc<VsockMetrics>,
    ) -> Self {
        Self {
            mem,
            queues,
            events,
            interrupt,
            guest_cid,
            listener,
            uds_path,
            conns: BTreeMap::new(),
            tokens: HashMap::new(),
            handshakes: HashMap::new(),
            control: VecDeque::new(),
            next_token: FIRST_STREAM_TOKEN,
            next_host_port: FIRST_HOST_PORT,
            rr_cursor: (0, 0),
            used: [false; 2],
            broken: false,
            metrics,
        }
    }

    fn mark_broken(&mut self, what: &str) {
        inc(&self.metrics.queue_errors);
        warn_limited!("virtio-vsock: {what}; the device needs a reset");
        self.broken = true;
        self.interrupt.signal_needs_reset();
    }

    fn token(&mut self) -> u32 {
        loop {
            let t = self.next_token;
            self.next_token = self.next_token.checked_add(1).unwrap_or(FIRST_STREAM_TOKEN);
            if !self.tokens.contains_key(&t) {
                return t;
            }
        }
    }

    fn push_control(&mut self, op: u16, local_port: u32, peer_port: u32, flags: u32) {
        if self.control.len() >= MAX_PENDING_CONTROL {
            inc(&self.metrics.control_dropped);
            return;
        }
        if op == op::RST {
            inc(&self.metrics.rst_sent);
        }
        self.control.push_back(Control {
            op,
            local_port,
            peer_port,
            flags,
        });
    }

    fn close(&mut self, key: (u32, u32), ops: &mut EventOps, send_rst: bool) {
        if let Some(conn) = self.conns.remove(&key) {
            let _ = ops.remove(Events::empty(&conn.stream));
            self.tokens.remove(&conn.token);
        }
        if send_rst {
            self.push_control(op::RST, key.0, key.1, 0);
        }
    }

    fn add_used(&mut self, q: usize, head: u16, len: u32) -> bool {
        let mem = self.mem.clone();
        match self.queues[q].add_used(&mem, head, len) {
            Ok(()) => {
                self.used[q] = true;
                true
            }
            Err(e) => {
                self.mark_broken(&format!("cannot return a chain: {e}"));
                false
            }
        }
    }

    /// Handles the guest's TX queue, at most one queue's worth of packets.
    pub fn process_tx(&mut self, ops: &mut EventOps) {
        if self.broken {
            return;
        }
        let mem = self.mem.clone();
        let size = self.queues[TX].size();
        let chains: Vec<_> = match self.queues[TX].iter(&mem) {
            Ok(iter) => iter.take(usize::from(size)).collect(),
            Err(e) => return self.mark_broken(&format!("bad TX available ring: {e}")),
        };
        let mut seen = vec![false; usize::from(size)];
        for chain in &chains {
            let head = chain.head_index();
            match seen.get_mut(usize::from(head)) {
                Some(true) => {
                    inc(&self.metrics.bad_packets);
                    continue;
                }
                Some(slot) => *slot = true,
                None => {
                    inc(&self.metrics.bad_packets);
                    continue;
                }
            }
            inc(&self.metrics.tx_packets);
            match self.read_tx(chain.clone(), size) {
                Ok((hdr, payload)) => self.handle_packet(hdr, &payload, ops),
                Err((e, hdr)) => {
                    inc(&self.metrics.bad_packets);
                    debug_limited!("virtio-vsock: {e}");
                    // A protocol error resets the connection it names (if any).
                    if let Some(h) = hdr.filter(|h| h.op != op::RST) {
                        self.close((h.dst_port, h.src_port), ops, true);
                    }
                }
            }
            if !self.add_used(TX, head, 0) {
                return;
            }
        }
        if chains.len() == usize::from(size) {
            let _ = self.events[TX].write(1);
        }
    }

    #[allow(clippy::type_complexity)]
    fn read_tx(
        &self,
        chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
        size: u16,
    ) -> Result<(PacketHeader, Vec<u8>), (packet::VsockPacketError, Option<PacketHeader>)> {
        let bufs = packet::collect(chain, &self.mem, size, false).map_err(|e| (e, None))?;
        let total = packet::total_len(&bufs);
        let mut raw = [0u8; HEADER_SIZE];
        if total < HEADER_SIZE || !packet::gather(&self.mem, &bufs, 0, &mut raw) {
            return Err((packet::VsockPacketError::Short(total), None));
        }
        let hdr =
            PacketHeader::decode(&raw).ok_or((packet::VsockPacketError::Short(total), None))?;
        packet::validate_tx(&hdr, self.guest_cid, total - HEADER_SIZE)
            .map_err(|e| (e, Some(hdr)))?;
        let mut payload = vec![
            0u8;
            if hdr.op == op::RW {
                hdr.len as usize
            } else {
                0
            }
        ];
        if !packet::gather(&self.mem, &bufs, HEADER_SIZE, &mut payload) {
            return Err((packet::VsockPacketError::Length(hdr.len), Some(hdr)));
        }
        Ok((hdr, payload))
    }

    fn handle_packet(&mut self, hdr: PacketHeader, payload: &[u8], ops: &mut EventOps) {
        let key = (hdr.dst_port, hdr.src_port);
        let exists = self.conns.contains_key(&key);
        match hdr.op {
            op::REQUEST if !exists => self.guest_connect(&hdr, ops),
            op::RST => self.close(key, ops, false),
            _ if !exists => self.push_control(op::RST, key.0, key.1, 0),
            op::RESPONSE => {
                let conn = self.conns.get_mut(&key).expect("checked above");
                conn.update_peer_credit(&hdr);
                let reply = format!("OK {}\n", conn.local_port);
                let ok = conn.state == ConnState::HostConnecting
                    && conn.stream.write(reply.as_bytes()).ok() == Some(reply.len());
                if ok {
                    conn.state = ConnState::Established;
                    inc(&self.metrics.connections);
                } else {
                    self.close(key, ops, true);
                }
            }
            op::RW => {
                let conn = self.conns.get_mut(&key).expect("checked above");
                conn.update_peer_credit(&hdr);
                if conn.state != ConnState::Established || conn.shutdown_send {
                    return self.close(key, ops, true);
                }
                if conn.push_from_guest(payload).is_err() {
                    inc(&self.metrics.credit_overruns);
                    return self.close(key, ops, true);
                }
                self.metrics
                    .tx_bytes
                    .fetch_add(payload.len() as u64, std::sync::atomic::Ordering::Relaxed);
                if conn.needs_credit_update() {
                    self.push_control(op::CREDIT_UPDATE, key.0, key.1, 0);
                }
            }
            op::SHUTDOWN => {
                let conn = self.conns.get_mut(&key).expect("checked above");
                conn.update_peer_credit(&hdr);
                if hdr.flags & (SHUTDOWN_RCV | SHUTDOWN_SEND) == SHUTDOWN_RCV | SHUTDOWN_SEND {
                    // Both directions done: flush what the host can take now, then the
                    // RST completes the close on the guest's side.
                    let _ = conn.flush();
                    self.close(key, ops, true);
                } else if hdr.flags & SHUTDOWN_SEND != 0 {
                    conn.shutdown_send = true;
                    let _ = conn.flush();
                }
            }
            op::CREDIT_UPDATE => {
                let conn = self.conns.get_mut(&key).expect("checked above");
                conn.update_peer_credit(&hdr);
            }
            op::CREDIT_REQUEST => {
                let conn = self.conns.get_mut(&key).expect("checked above");
                conn.update_peer_credit(&hdr);
                self.push_control(op::CREDIT_UPDATE, key.0, key.1, 0);
            }
            // A REQUEST for a connection that exists.
            _ => self.close(key, ops, true),
        }
    }

    /// The guest connects to host port `hdr.dst_port`: `<uds_path>_<port>`.
    fn guest_connect(&mut self, hdr: &PacketHeader, ops: &mut EventOps) {
        let key = (hdr.dst_port, hdr.src_port);
        if self.conns.len() >= MAX_CONNECTIONS {
            inc(&self.metrics.connect_failures);
            return self.push_control(op::RST, key.0, key.1, 0);
        }
        let mut path = self.uds_path.clone().into_os_string();
        path.push(format!("_{}", hdr.dst_port));
        let stream =
            match UnixStream::connect(&path).and_then(|s| s.set_nonblocking(true).map(|()| s)) {
                Ok(stream) => stream,
                Err(e) => {
                    inc(&self.metrics.connect_failures);
                    debug_limited!("virtio-vsock: guest connect to {path:?}: {e}");
                    return self.push_control(op::RST, key.0, key.1, 0);
                }
            };
        let token = self.token();
        if ops
            .add(Events::with_data(&stream, token, STREAM_EVENTS))
            .is_err()
        {
            return self.push_control(op::RST, key.0, key.1, 0);
        }
        let mut conn = Connection::new(stream, token, key.0, key.1, ConnState::Established);
        conn.update_peer_credit(hdr);
        self.conns.insert(key, conn);
        self.tokens.insert(token, Target::Conn(key));
        inc(&self.metrics.connections);
        self.push_control(op::RESPONSE, key.0, key.1, 0);
    }

    fn accept(&mut self, ops: &mut EventOps) {
        loop {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            if self.handshakes.len() >= MAX_PENDING_HANDSHAKES
                || self.conns.len() >= MAX_CONNECTIONS
                || stream.set_nonblocking(true).is_err()
            {
                inc(&self.metrics.bad_handshakes);
                continue;
            }
            let token = self.token();
            if ops
                .add(Events::with_data(&stream, token, STREAM_EVENTS))
                .is_ok()
            {
                self.tokens.insert(token, Target::Handshake);
                self.handshakes.insert(
                    token,
                    Handshake {
                        stream,
                        line: Vec::new(),
                    },
                );
                // Bytes may already be there; edge-triggered epoll will not say so again.
                self.handshake_readable(token, ops);
            }
        }
    }

    fn handshake_readable(&mut self, token: u32, ops: &mut EventOps) {
        let Some(hs) = self.handshakes.get_mut(&token) else {
            return;
        };
        let mut buf = [0u8; MAX_HANDSHAKE_LINE];
        let outcome = loop {
            match hs.stream.read(&mut buf) {
                Ok(0) => break Err(()),
                Ok(n) => {
                    hs.line.extend_from_slice(&buf[..n]);
                    if let Some(pos) = hs.line.iter().position(|&b| b == b'\n') {
                        break Ok(Some(pos));
                    }
                    if hs.line.len() > MAX_HANDSHAKE_LINE {
                        break Err(());
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break Ok(None),
                Err(_) => break Err(()),
            }
        };
        let port = match outcome {
            Ok(None) => return,
            Ok(Some(pos)) => parse_connect(&hs.line[..pos]),
            Err(()) => None,
        };
        let Some(hs) = self.handshakes.remove(&token) else {
            return;
        };
        let Some(port) = port else {
            inc(&self.metrics.bad_handshakes);
            let _ = ops.remove(Events::empty(&hs.stream));
            self.tokens.remove(&token);
            return;
        };
        let local = self.host_port();
        let key = (local, port);
        let newline = hs
            .line
            .iter()
            .position(|&b| b == b'\n')
            .unwrap_or(hs.line.len());
        let mut conn = Connection::new(hs.stream, token, local, port, ConnState::HostConnecting);
        conn.host_prefix = hs.line.get(newline + 1..).unwrap_or_default().to_vec();
        self.conns.insert(key, conn);
        self.tokens.insert(token, Target::Conn(key));
        self.push_control(op::REQUEST, local, port, 0);
    }

    fn host_port(&mut self) -> u32 {
        loop {
            let port = self.next_host_port;
            self.next_host_port = match port.checked_add(1) {
                Some(p) if p != u32::MAX => p,
                _ => FIRST_HOST_PORT,
            };
            if !self.conns.keys().any(|(local, _)| *local == port) {
                return port;
            }
        }
    }

    fn stream_event(&mut self, key: (u32, u32), set: EventSet, ops: &mut EventOps) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if set.intersects(EventSet::IN | EventSet::READ_HANG_UP | EventSet::HANG_UP) {
            conn.readable = true;
        }
        if set.contains(EventSet::OUT) && conn.buffered() > 0 {
            match conn.flush() {
                Ok(_) if conn.needs_credit_update() => {
                    self.push_control(op::CREDIT_UPDATE, key.0, key.1, 0);
                }
                Ok(_) => {}
                Err(_) => self.close(key, ops, true),
            }
        }
    }

    /// Fills RX buffers with control packets first, then data, round-robin over the
    /// connections that have data and credit.
    pub fn process_rx(&mut self, ops: &mut EventOps) {
        let mem = self.mem.clone();
        let size = self.queues[RX].size();
        for _ in 0..4 * usize::from(size) {
            if self.broken {
                return;
            }
            let next_conn = if self.control.is_empty() {
                self.next_rx_conn()
            } else {
                None
            };
            if self.control.is_empty() && next_conn.is_none() {
                return;
            }
            let chain = match self.queues[RX].iter(&mem) {
                Ok(mut iter) => iter.next(),
                Err(e) => return self.mark_broken(&format!("bad RX available ring: {e}")),
            };
            let Some(chain) = chain else {
                return;
            };
            let head = chain.head_index();
            let bufs = match packet::collect(chain, &mem, size, true) {
                Ok(bufs) if packet::total_len(&bufs) >= HEADER_SIZE => bufs,
                _ => {
                    inc(&self.metrics.bad_rx_buffers);
                    self.add_used(RX, head, 0);
                    continue;
                }
            };
            let room = packet::total_len(&bufs) - HEADER_SIZE;
            if let Some(ctl) = self.control.pop_front() {
                let hdr = match self.conns.get_mut(&(ctl.local_port, ctl.peer_port)) {
                    Some(conn) => {
                        conn.sent_to_guest(0);
                        conn.header(self.guest_cid, ctl.op, 0, ctl.flags)
                    }
                    None => PacketHeader {
                        src_cid: HOST_CID,
                        dst_cid: self.guest_cid,
                        src_port: ctl.local_port,
                        dst_port: ctl.peer_port,
                        type_: TYPE_STREAM,
                        op: ctl.op,
                        flags: ctl.flags,
                        buf_alloc: CONN_BUF_SIZE,
                        ..Default::default()
                    },
                };
                packet::scatter(&mem, &bufs, 0, &hdr.encode());
                inc(&self.metrics.rx_packets);
                self.add_used(RX, head, HEADER_LEN);
                continue;
            }
            let Some(key) = next_conn else {
                continue;
            };
            self.rr_cursor = key;
            let conn = self.conns.get_mut(&key).expect("picked from the map");
            let max = room.min(MAX_PKT_PAYLOAD).min(conn.peer_credit() as usize);
            match conn.read_for_guest(max) {
                HostRead::Data(data) => {
                    // At most `max` bytes, which is at most MAX_PKT_PAYLOAD (64 KiB); a
                    // connection that broke that is closed, not trusted.
                    let Ok(len) = u32::try_from(data.len()) else {
                        self.queues[RX].go_to_previous_position();
                        self.close(key, ops, true);
                        continue;
                    };
                    let hdr = conn.header(self.guest_cid, op::RW, len, 0);
                    conn.sent_to_guest(len);
                    packet::scatter(&mem, &bufs, 0, &hdr.encode());
                    packet::scatter(&mem, &bufs, HEADER_SIZE, &data);
                    inc(&self.metrics.rx_packets);
                    self.metrics
                        .rx_bytes
                        .fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    self.add_used(RX, head, HEADER_LEN + len);
                }
                other => {
                    self.queues[RX].go_to_previous_position();
                    match other {
                        HostRead::Eof => {
                            conn.host_eof = true;
                            conn.readable = false;
                            self.push_control(
                                op::SHUTDOWN,
                                key.0,
                                key.1,
                                SHUTDOWN_RCV | SHUTDOWN_SEND,
                            );
                        }
                        HostRead::Error(_) => self.close(key, ops, true),
                        _ => conn.readable = false,
                    }
                }
            }
        }
        // Work left after the bound: continue on the next loop round.
        let _ = self.events[RX].write(1);
    }

    fn next_rx_conn(&self) -> Option<(u32, u32)> {
        let after = self
            .conns
            .range((
                std::ops::Bound::Excluded(self.rr_cursor),
                std::ops::Bound::Unbounded,
            ))
            .find(|(_, c)| c.wants_rx());
        after
            .or_else(|| self.conns.iter().find(|(_, c)| c.wants_rx()))
            .map(|(k, _)| *k)
    }

    fn raise_interrupts(&mut self) {
        for (q, flag) in [(RX_VECTOR, 0usize), (TX_VECTOR, 1usize)] {
            if std::mem::take(&mut self.used[flag]) {
                if let Err(e) = self.interrupt.trigger(VirtioInterruptType::Queue(q)) {
                    tracing::error!("virtio-vsock: {e}");
                }
            }
        }
    }

    /// Number of live connections (for tests and metrics).
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }
}

/// Parses `CONNECT <port>` (an optional trailing `\r` allowed).
fn parse_connect(line: &[u8]) -> Option<u32> {
    let line = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
    let port = line.strip_prefix("CONNECT ")?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    port.parse().ok()
}

impl MutEventSubscriber for VsockHandler {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let data = events.data();
        match data {
            RX_TOKEN => {
                let _ = self.events[RX].read();
            }
            TX_TOKEN => {
                let _ = self.events[TX].read();
                self.process_tx(ops);
            }
            EVQ_TOKEN => {
                let _ = self.events[EVQ].read();
            }
            LISTENER_TOKEN => self.accept(ops),
            token => match self.tokens.get(&token) {
                Some(Target::Handshake) => self.handshake_readable(token, ops),
                Some(Target::Conn(key)) => {
                    let key = *key;
                    self.stream_event(key, events.event_set(), ops);
                }
                None => {}
            },
        }
        self.process_rx(ops);
        self.raise_interrupts();
    }

    fn init(&mut self, ops: &mut EventOps) {
        // One eventfd per queue, in queue order.
        for (evt, token) in self.events.iter().zip([RX_TOKEN, TX_TOKEN, EVQ_TOKEN]) {
            if let Err(e) = ops.add(Events::with_data(evt, token, EventSet::IN)) {
                tracing::error!("virtio-vsock: cannot watch queue {token}: {e}");
            }
        }
        let fd = self.listener.as_raw_fd();
        if let Err(e) = ops.add(Events::with_data_raw(fd, LISTENER_TOKEN, EventSet::IN)) {
            tracing::error!("virtio-vsock: cannot watch the listener: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_connect;

    #[test]
    fn connect_line_parsing_is_strict() {
        assert_eq!(parse_connect(b"CONNECT 52"), Some(52));
        assert_eq!(parse_connect(b"CONNECT 52\r"), Some(52));
        for bad in [
            &b"CONNECT"[..],
            b"CONNECT ",
            b"CONNECT -1",
            b"CONNECT 99999999999",
            b"connect 5",
            b"CONNECT 5 6",
            b"\xff",
        ] {
            assert_eq!(parse_connect(bad), None, "{bad:?}");
        }
    }
}
