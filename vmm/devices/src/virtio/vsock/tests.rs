//! End-to-end tests of the vsock worker: a real event manager, real Unix sockets on the
//! host side, and a guest driver simulated over MockSplitQueue.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use event_manager::{EventManager, SubscriberOps};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::event_handler::VsockHandler;
use super::packet::{PacketHeader, HEADER_SIZE};
use super::*;
use crate::test_utils::FakeInterrupt;
use crate::virtio::GuestMemoryMmap;

const QSIZE: u16 = 64;
const GUEST_CID: u64 = 3;
const RX_BUFS: u64 = 0x10_0000;
const TX_BUFS: u64 = 0x80_0000;
const BUF_SPAN: u64 = 0x1_1000;
const F_WRITE: u16 = 2;

type Manager = EventManager<Arc<Mutex<VsockHandler>>>;

struct Guest<'a> {
    mem: &'a GuestMemoryMmap,
    rx: MockSplitQueue<'a, GuestMemoryMmap>,
    tx: MockSplitQueue<'a, GuestMemoryMmap>,
    rx_evt: EventFd,
    tx_evt: EventFd,
    rx_seen: u16,
    tx_slot: u16,
}

impl Guest<'_> {
    fn post_rx(&self, slot: u16) {
        let d = SplitDescriptor::new(
            RX_BUFS + u64::from(slot) * BUF_SPAN,
            0x1000 + u32::try_from(HEADER_SIZE).unwrap(),
            F_WRITE,
            0,
        );
        self.rx
            .add_desc_chains(&[RawDescriptor::from(d)], slot)
            .unwrap();
    }

    fn send(&mut self, hdr: PacketHeader, payload: &[u8]) {
        let slot = self.tx_slot % QSIZE;
        self.tx_slot += 1;
        let addr = TX_BUFS + u64::from(slot) * BUF_SPAN;
        let hdr = PacketHeader {
            len: u32::try_from(payload.len()).unwrap(),
            ..hdr
        };
        self.mem
            .write_slice(&hdr.encode(), GuestAddress(addr))
            .unwrap();
        self.mem
            .write_slice(payload, GuestAddress(addr + HEADER_SIZE as u64))
            .unwrap();
        let d = SplitDescriptor::new(
            addr,
            u32::try_from(HEADER_SIZE + payload.len()).unwrap(),
            0,
            0,
        );
        self.tx
            .add_desc_chains(&[RawDescriptor::from(d)], slot)
            .unwrap();
        self.tx_evt.write(1).unwrap();
    }

    /// Packets the device delivered since the last call (buffers re-posted).
    fn receive(&mut self) -> Vec<(PacketHeader, Vec<u8>)> {
        let mut out = Vec::new();
        while self.rx.used().idx().load() != self.rx_seen {
            let e = self
                .rx
                .used()
                .ring()
                .ref_at(usize::from(self.rx_seen % QSIZE))
                .unwrap()
                .load();
            let addr = RX_BUFS + u64::from(e.id()) * BUF_SPAN;
            self.rx_seen = self.rx_seen.wrapping_add(1);
            if e.len() == 0 {
                // A buffer the device refused.
                continue;
            }
            let mut raw = [0u8; HEADER_SIZE];
            self.mem.read_slice(&mut raw, GuestAddress(addr)).unwrap();
            let hdr = PacketHeader::decode(&raw).unwrap();
            let mut data = vec![0u8; hdr.len as usize];
            self.mem
                .read_slice(&mut data, GuestAddress(addr + HEADER_SIZE as u64))
                .unwrap();
            assert_eq!(e.len() as usize, HEADER_SIZE + data.len());
            out.push((hdr, data));
            self.post_rx(u16::try_from(e.id()).unwrap());
            self.rx_evt.write(1).unwrap();
        }
        out
    }
}

fn hdr(op: u16, src_port: u32, dst_port: u32) -> PacketHeader {
    PacketHeader {
        src_cid: GUEST_CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        len: 0,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 1 << 20,
        fwd_cnt: 0,
    }
}

struct Rig {
    _dir: tempfile::TempDir,
    uds: std::path::PathBuf,
    manager: Manager,
    handler: Arc<Mutex<VsockHandler>>,
    irq: Arc<FakeInterrupt>,
    metrics: Arc<VsockMetrics>,
}

fn rig<'a>(mem: &'a GuestMemoryMmap) -> (Rig, Guest<'a>) {
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vsock.sock");
    let listener = UnixListener::bind(&uds).unwrap();
    listener.set_nonblocking(true).unwrap();
    let rx = MockSplitQueue::create(mem, GuestAddress(0), QSIZE);
    let tx = MockSplitQueue::create(mem, GuestAddress(0x1_0000), QSIZE);
    let evq = MockSplitQueue::create(mem, GuestAddress(0x2_0000), QSIZE);
    let events: Vec<EventFd> = (0..3)
        .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
        .collect();
    let rx_evt = events[0].try_clone().unwrap();
    let tx_evt = events[1].try_clone().unwrap();
    let irq = Arc::new(FakeInterrupt::default());
    let metrics = Arc::new(VsockMetrics::default());
    let handler = Arc::new(Mutex::new(VsockHandler::new(
        mem.clone(),
        vec![
            rx.create_queue().unwrap(),
            tx.create_queue().unwrap(),
            evq.create_queue().unwrap(),
        ],
        events,
        irq.clone(),
        GUEST_CID,
        Arc::new(listener),
        uds.clone(),
        metrics.clone(),
    )));
    let mut manager = Manager::new().unwrap();
    manager.add_subscriber(handler.clone());
    let guest = Guest {
        mem,
        rx,
        tx,
        rx_evt,
        tx_evt,
        rx_seen: 0,
        tx_slot: 0,
    };
    for slot in 0..16 {
        guest.post_rx(slot);
    }
    (
        Rig {
            _dir: dir,
            uds,
            manager,
            handler,
            irq,
            metrics,
        },
        guest,
    )
}

impl Rig {
    /// Runs the event loop until `cond` holds (10 s guard against hangs).
    fn pump_until(&mut self, what: &str, mut cond: impl FnMut(&mut Self) -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !cond(self) {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            self.manager.run_with_timeout(5).unwrap();
        }
    }
}

fn mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x200_0000)]).unwrap()
}

fn read_exact_blocking(stream: &mut UnixStream, n: usize) -> Vec<u8> {
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut buf = vec![0u8; n];
    stream.read_exact(&mut buf).unwrap();
    buf
}

#[test]
fn guest_initiated_connection_echoes_both_ways() {
    let m = mem();
    let (mut rig, mut guest) = rig(&m);
    let host_service = UnixListener::bind(format!("{}_5000", rig.uds.display())).unwrap();
    guest.send(hdr(op::REQUEST, 1234, 5000), &[]);
    let mut got = Vec::new();
    rig.pump_until("RESPONSE", |_| {
        got.extend(guest.receive());
        !got.is_empty()
    });
    assert_eq!(
        (got[0].0.op, got[0].0.src_port, got[0].0.dst_port),
        (op::RESPONSE, 5000, 1234)
    );
    let (mut host, _) = host_service.accept().unwrap();

    guest.send(hdr(op::RW, 1234, 5000), b"hello");
    rig.pump_until("the host bytes", |r| {
        r.metrics.tx_bytes.load(Ordering::Relaxed) == 5
    });
    assert_eq!(read_exact_blocking(&mut host, 5), b"hello");

    host.write_all(b"world").unwrap();
    let mut data = Vec::new();
    rig.pump_until("the guest bytes", |_| {
        for (h, d) in guest.receive() {
            assert_eq!(h.op, op::RW);
            data.extend(d);
        }
        data.len() == 5
    });
    assert_eq!(data, b"world");
    assert!(rig
        .irq
        .raised()
        .contains(&crate::virtio::VirtioInterruptType::Queue(0)));

    // The guest closes both directions: the device answers RST and closes the stream.
    guest.send(
        PacketHeader {
            flags: SHUTDOWN_RCV | SHUTDOWN_SEND,
            ..hdr(op::SHUTDOWN, 1234, 5000)
        },
        &[],
    );
    let mut rst = false;
    rig.pump_until("RST", |_| {
        rst |= guest.receive().iter().any(|(h, _)| h.op == op::RST);
        rst
    });
    assert_eq!(host.read(&mut [0u8; 8]).unwrap(), 0);
    assert_eq!(rig.handler.lock().unwrap().connection_count(), 0);
}

#[test]
fn host_initiated_connection_handshake_and_echo() {
    let m = mem();
    let (mut rig, mut guest) = rig(&m);
    let mut host = UnixStream::connect(&rig.uds).unwrap();
    host.write_all(b"CONNECT 52\nhi").unwrap();
    let mut request = None;
    rig.pump_until("REQUEST", |_| {
        request = guest
            .receive()
            .into_iter()
            .find(|(h, _)| h.op == op::REQUEST);
        request.is_some()
    });
    let (req, _) = request.unwrap();
    assert_eq!((req.dst_port, req.src_port), (52, FIRST_HOST_PORT));
    guest.send(hdr(op::RESPONSE, 52, req.src_port), &[]);
    let mut data = Vec::new();
    rig.pump_until("the early bytes", |_| {
        data.extend(
            guest
                .receive()
                .into_iter()
                .filter(|(h, _)| h.op == op::RW)
                .flat_map(|(_, d)| d),
        );
        data.len() == 2
    });
    assert_eq!(data, b"hi");
    assert_eq!(
        read_exact_blocking(&mut host, 14),
        format!("OK {FIRST_HOST_PORT}\n").as_bytes()
    );
    guest.send(hdr(op::RW, 52, req.src_port), b"pong");
    rig.pump_until("the host bytes", |r| {
        r.metrics.tx_bytes.load(Ordering::Relaxed) == 4
    });
    assert_eq!(read_exact_blocking(&mut host, 4), b"pong");
    // The host hangs up: the guest is told with SHUTDOWN.
    drop(host);
    let mut shutdown = false;
    rig.pump_until("SHUTDOWN", |_| {
        shutdown |= guest.receive().iter().any(|(h, _)| h.op == op::SHUTDOWN);
        shutdown
    });
}

#[test]
fn protocol_errors_get_rst_and_counters() {
    let m = mem();
    let (mut rig, mut guest) = rig(&m);
    // Data for a connection that does not exist.
    guest.send(hdr(op::RW, 1, 2), b"x");
    // A spoofed source CID.
    guest.send(
        PacketHeader {
            src_cid: 99,
            ..hdr(op::REQUEST, 3, 4)
        },
        &[],
    );
    // An unknown operation.
    guest.send(hdr(42, 5, 6), &[]);
    // A control packet with a payload.
    guest.send(hdr(op::CREDIT_REQUEST, 7, 8), b"junk");
    // A connection to a host port nobody listens on.
    guest.send(hdr(op::REQUEST, 9, 10), &[]);
    let mut rsts = Vec::new();
    rig.pump_until("five RSTs", |_| {
        rsts.extend(
            guest
                .receive()
                .into_iter()
                .filter(|(h, _)| h.op == op::RST)
                .map(|(h, _)| h.dst_port),
        );
        rsts.len() == 5
    });
    rsts.sort();
    assert_eq!(rsts, vec![1, 3, 5, 7, 9]);
    assert_eq!(rig.metrics.bad_packets.load(Ordering::Relaxed), 3);
    assert_eq!(rig.metrics.connect_failures.load(Ordering::Relaxed), 1);
    assert!(!rig.irq.needs_reset());
}

#[test]
fn credit_overrun_resets_the_connection() {
    let m = mem();
    let (mut rig, mut guest) = rig(&m);
    // The host service never reads, so the device's buffer fills up.
    let service = UnixListener::bind(format!("{}_7", rig.uds.display())).unwrap();
    guest.send(hdr(op::REQUEST, 100, 7), &[]);
    rig.pump_until("the connection", |r| {
        r.metrics.connections.load(Ordering::Relaxed) == 1
    });
    let (_host, _) = service.accept().unwrap();
    let chunk = vec![0x5au8; 0x1_0000];
    let mut sent = 0;
    while rig.metrics.credit_overruns.load(Ordering::Relaxed) == 0 {
        assert!(sent < 64, "no overrun after {sent} chunks");
        guest.send(hdr(op::RW, 100, 7), &chunk);
        rig.manager.run_with_timeout(5).unwrap();
        sent += 1;
    }
    rig.pump_until("the close", |r| {
        r.handler.lock().unwrap().connection_count() == 0
    });
    let mut rst = false;
    rig.pump_until("RST", |_| {
        rst |= guest
            .receive()
            .iter()
            .any(|(h, _)| h.op == op::RST && h.dst_port == 100);
        rst
    });
}

#[test]
fn protocol_error_on_a_live_connection_closes_it() {
    let m = mem();
    let (mut rig, mut guest) = rig(&m);
    let service = UnixListener::bind(format!("{}_8", rig.uds.display())).unwrap();
    guest.send(hdr(op::REQUEST, 200, 8), &[]);
    rig.pump_until("the connection", |r| {
        r.metrics.connections.load(Ordering::Relaxed) == 1
    });
    let (mut host, _) = service.accept().unwrap();
    // A data packet whose length claims more than the chain holds (patched after
    // `send`, before the loop runs).
    let slot = guest.tx_slot;
    guest.send(hdr(op::RW, 200, 8), b"");
    let bad = PacketHeader {
        len: 1000,
        ..hdr(op::RW, 200, 8)
    };
    let addr = TX_BUFS + u64::from(slot) * BUF_SPAN;
    m.write_slice(&bad.encode(), GuestAddress(addr)).unwrap();
    rig.pump_until("the close", |r| {
        r.handler.lock().unwrap().connection_count() == 0
    });
    host.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    assert_eq!(host.read(&mut [0u8; 4]).unwrap(), 0);
}

#[test]
fn malformed_chains_and_handshakes_are_counted() {
    let m = mem();
    let (mut rig, mut guest) = rig(&m);
    // A TX chain shorter than a header, and one with a device-writable buffer.
    guest
        .tx
        .add_desc_chains(
            &[RawDescriptor::from(SplitDescriptor::new(TX_BUFS, 10, 0, 0))],
            60,
        )
        .unwrap();
    guest
        .tx
        .add_desc_chains(
            &[RawDescriptor::from(SplitDescriptor::new(
                TX_BUFS, 64, F_WRITE, 0,
            ))],
            61,
        )
        .unwrap();
    // A TX buffer outside guest memory.
    guest
        .tx
        .add_desc_chains(
            &[RawDescriptor::from(SplitDescriptor::new(1 << 40, 64, 0, 0))],
            62,
        )
        .unwrap();
    guest.tx_evt.write(1).unwrap();
    rig.pump_until("three bad packets", |r| {
        r.metrics.bad_packets.load(Ordering::Relaxed) == 3
    });
    // Garbage instead of CONNECT, and a line that never ends.
    let mut bad = UnixStream::connect(&rig.uds).unwrap();
    bad.write_all(b"HELLO\n").unwrap();
    let mut long = UnixStream::connect(&rig.uds).unwrap();
    long.write_all(&[b'9'; 100]).unwrap();
    rig.pump_until("two bad handshakes", |r| {
        r.metrics.bad_handshakes.load(Ordering::Relaxed) == 2
    });
    bad.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    assert_eq!(bad.read(&mut [0u8; 4]).unwrap(), 0);
    // A device-readable RX buffer is returned unused when the device needs a buffer.
    guest
        .rx
        .desc_table()
        .store(
            0,
            RawDescriptor::from(SplitDescriptor::new(RX_BUFS, 64, 0, 0)),
        )
        .unwrap();
    guest.send(hdr(op::RW, 1, 2), b"x");
    rig.pump_until("a bad RX buffer", |r| {
        r.metrics.bad_rx_buffers.load(Ordering::Relaxed) >= 1
    });
    let _ = guest.receive();
}

#[test]
fn corrupt_avail_index_needs_reset() {
    let m = mem();
    let (mut rig, guest) = rig(&m);
    guest.tx.avail().idx().store(QSIZE * 3);
    guest.tx_evt.write(1).unwrap();
    rig.pump_until("the reset request", |r| r.irq.needs_reset());
    assert_eq!(rig.metrics.queue_errors.load(Ordering::Relaxed), 1);
}
