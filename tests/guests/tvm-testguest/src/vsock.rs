//! `virtio-vsock`: a stream echo in both directions, started from either side, through
//! the VMM's hybrid Unix-socket backend.
//!
//! 1. Guest-initiated: the guest connects to host port 5000 (the host test listens on
//!    `<socket>_5000`), sends `hello-from-guest\n` and expects it back upper-cased.
//! 2. Host-initiated: the guest prints `TVMTEST virtio-vsock READY`, the host connects with
//!    `CONNECT 1234\n` and sends a line; the guest accepts and echoes it upper-cased.

use crate::bootinfo::BootInfo;
use crate::report::Detail;
use crate::timer;
use crate::virtio::{self, dma_alloc, r, w, VirtioPci, Virtq};
use crate::vtests::{check_dma, wait_irq};

const HOST_CID: u64 = 2;
/// Host port the guest connects to.
pub const HOST_PORT: u32 = 5000;
/// Guest port the host connects to.
pub const GUEST_PORT: u32 = 1234;
const GUEST_LOCAL_PORT: u32 = 40000;
const HDR: u64 = 44;
const RX_BUF: u64 = 4096;
const RX_BUFS: u16 = 8;
const BUF_ALLOC: u32 = 64 * 1024;
const WAIT_MS: u64 = 30_000;

mod op {
    pub const REQUEST: u16 = 1;
    pub const RESPONSE: u16 = 2;
    pub const RST: u16 = 3;
    pub const SHUTDOWN: u16 = 4;
    pub const RW: u16 = 5;
    pub const CREDIT_UPDATE: u16 = 6;
    pub const CREDIT_REQUEST: u16 = 7;
}

/// Most payload a received packet carries here (an RX buffer less the header).
const MAX_PAYLOAD: usize = (RX_BUF - HDR) as usize;

/// A received packet: header fields and its payload.
struct Packet {
    src_port: u32,
    dst_port: u32,
    op: u16,
    len: usize,
    data: [u8; MAX_PAYLOAD],
}

struct Vsock {
    cid: u64,
    rx: Virtq,
    tx: Virtq,
    rx_addr: [u64; 16],
    tx_buf: u64,
    /// Payload bytes consumed on the current connection (one at a time).
    fwd_cnt: u32,
    /// Payload bytes sent on the current connection.
    tx_cnt: u32,
    /// The host side's buffer and consumption, from its last header.
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Wait by halting until an interrupt instead of spinning (no timeouts: benchmarks).
    halt: bool,
}

impl Vsock {
    fn open() -> Result<(VirtioPci, Self), Detail> {
        let dev = VirtioPci::open(virtio::DEV_VSOCK)?;
        dev.negotiate(0)?;
        let mut rx = dev.queue(0, 16)?;
        let tx = dev.queue(1, 16)?;
        let mut ev = dev.queue(2, 16)?;
        let cid: u64 = r(dev.device_cfg);
        let mut rx_addr = [0u64; 16];
        for _ in 0..RX_BUFS {
            let buf = dma_alloc(RX_BUF, 4096)?;
            let head = rx.add(&[(buf, RX_BUF as u32, true)]);
            rx_addr[usize::from(head)] = buf;
        }
        let evbuf = dma_alloc(64, 64)?;
        ev.add(&[(evbuf, 8, true)]);
        dev.driver_ok()?;
        rx.kick();
        ev.kick();
        let tx_buf = dma_alloc(4096, 4096)?;
        Ok((
            dev,
            Vsock {
                cid,
                rx,
                tx,
                rx_addr,
                tx_buf,
                fwd_cnt: 0,
                tx_cnt: 0,
                peer_buf_alloc: 0,
                peer_fwd_cnt: 0,
                halt: false,
            },
        ))
    }

    fn send(
        &mut self,
        src_port: u32,
        dst_port: u32,
        op: u16,
        flags: u32,
        payload: &[u8],
    ) -> Result<(), Detail> {
        let b = self.tx_buf;
        w(b, self.cid);
        w(b + 8, HOST_CID);
        w(b + 16, src_port);
        w(b + 20, dst_port);
        w(b + 24, payload.len() as u32);
        w(b + 28, 1u16);
        w(b + 30, op);
        w(b + 32, flags);
        w(b + 36, BUF_ALLOC);
        w(b + 40, self.fwd_cnt);
        virtio::bytes_mut(b + HDR, payload.len() as u64).copy_from_slice(payload);
        self.tx_cnt = self.tx_cnt.wrapping_add(payload.len() as u32);
        self.tx
            .add(&[(b, (HDR as usize + payload.len()) as u32, false)]);
        self.tx.kick();
        if self.halt {
            self.tx.wait_halt();
            return Ok(());
        }
        self.tx
            .wait(WAIT_MS)
            .map(drop)
            .ok_or_else(|| Detail::fmt(format_args!("TX op {op} not completed")))
    }

    /// The next packet for us; answers credit requests on the way.
    fn recv(&mut self, ms: u64) -> Result<Packet, Detail> {
        let deadline = timer::deadline_ms(ms);
        loop {
            if let Some((head, len)) = self.rx.poll() {
                let buf = self.rx_addr[(head % 16) as usize];
                let plen = (r::<u32>(buf + 24) as usize).min(MAX_PAYLOAD);
                let mut p = Packet {
                    src_port: r(buf + 16),
                    dst_port: r(buf + 20),
                    op: r(buf + 30),
                    len: plen,
                    data: [0; MAX_PAYLOAD],
                };
                self.peer_buf_alloc = r(buf + 36);
                self.peer_fwd_cnt = r(buf + 40);
                if u64::from(len) < HDR {
                    return Err(Detail::fmt(format_args!("RX used length {len} < header")));
                }
                p.data[..plen].copy_from_slice(virtio::bytes(buf + HDR, plen as u64));
                let again = self.rx.add(&[(buf, RX_BUF as u32, true)]);
                self.rx_addr[usize::from(again)] = buf;
                self.rx.kick();
                if p.op == op::RW {
                    self.fwd_cnt = self.fwd_cnt.wrapping_add(r::<u32>(buf + 24));
                }
                if p.op == op::CREDIT_REQUEST {
                    self.send(p.dst_port, p.src_port, op::CREDIT_UPDATE, 0, &[])?;
                    continue;
                }
                if p.op == op::CREDIT_UPDATE {
                    continue;
                }
                return Ok(p);
            }
            if timer::expired(deadline) {
                return Err(Detail::fmt(format_args!(
                    "No vsock packet within {} s",
                    ms / 1000
                )));
            }
            if self.halt {
                self.rx.halt_unless_used();
            } else {
                core::hint::spin_loop();
            }
        }
    }
}

/// `vsock-bench`: accepts one host connection on port 1234 and echoes every byte back
/// until the host closes; the host measures round trips and throughput, keeping at most
/// 64 KiB in flight.
pub fn bench(bi: &BootInfo) -> Result<Detail, Detail> {
    check_dma(bi)?;
    virtio::enable_interrupts();
    let (_dev, mut v) = Vsock::open()?;
    v.halt = true;
    crate::println!("TVMTEST vsock-bench READY listening on port {GUEST_PORT}");
    let req = v.recv(120_000)?;
    if req.op != op::REQUEST || req.dst_port != GUEST_PORT {
        return Err(Detail::fmt(format_args!(
            "Expected a connection, got op {}",
            req.op
        )));
    }
    let host_port = req.src_port;
    v.send(GUEST_PORT, host_port, op::RESPONSE, 0, &[])?;
    let mut echoed: u64 = 0;
    loop {
        let p = v.recv(120_000)?;
        match p.op {
            op::RW => {
                // The host keeps less than the VMM's per-connection buffer in flight, so
                // the echo always has credit; running out means the host broke that rule.
                let credit = v
                    .peer_buf_alloc
                    .saturating_sub(v.tx_cnt.wrapping_sub(v.peer_fwd_cnt));
                if credit < p.len as u32 {
                    return Err(Detail::fmt(format_args!(
                        "No credit to echo {} bytes (credit {credit}: host buffer {} consumed {} sent {})",
                        p.len, v.peer_buf_alloc, v.peer_fwd_cnt, v.tx_cnt
                    )));
                }
                v.send(GUEST_PORT, host_port, op::RW, 0, &p.data[..p.len])?;
                echoed += p.len as u64;
            }
            op::SHUTDOWN | op::RST => break,
            _ => {}
        }
    }
    Ok(Detail::fmt(format_args!("echoed={echoed}")))
}

fn upper(data: &[u8], out: &mut [u8; 256]) -> usize {
    for (o, i) in out.iter_mut().zip(data) {
        *o = i.to_ascii_uppercase();
    }
    data.len()
}

/// Runs both directions.
pub fn run(bi: &BootInfo) -> Result<Detail, Detail> {
    check_dma(bi)?;
    virtio::enable_interrupts();
    let (_dev, mut v) = Vsock::open()?;
    let rx_irqs = virtio::irqs(0);

    // 1. Guest to host.
    v.send(GUEST_LOCAL_PORT, HOST_PORT, op::REQUEST, 0, &[])?;
    let p = v.recv(WAIT_MS)?;
    if p.op != op::RESPONSE || p.src_port != HOST_PORT || p.dst_port != GUEST_LOCAL_PORT {
        return Err(Detail::fmt(format_args!(
            "Connect to host port {HOST_PORT}: op {} ports {}->{} (is the host listening on <socket>_{HOST_PORT}?)",
            p.op, p.src_port, p.dst_port
        )));
    }
    let hello = b"hello-from-guest\n";
    v.send(GUEST_LOCAL_PORT, HOST_PORT, op::RW, 0, hello)?;
    let mut got = [0u8; 256];
    let mut n = 0;
    while n < hello.len() {
        let p = v.recv(WAIT_MS)?;
        if p.op != op::RW {
            return Err(Detail::fmt(format_args!(
                "Expected the host's echo, got op {}",
                p.op
            )));
        }
        let take = p.len.min(256 - n);
        got[n..n + take].copy_from_slice(&p.data[..take]);
        n += take;
    }
    let mut want = [0u8; 256];
    upper(hello, &mut want);
    if got[..hello.len()] != want[..hello.len()] {
        return Err(Detail::fmt(format_args!("Host echo differs")));
    }
    v.send(GUEST_LOCAL_PORT, HOST_PORT, op::SHUTDOWN, 3, &[])?;

    // 2. Host to guest.
    crate::println!("TVMTEST virtio-vsock READY listening on port {GUEST_PORT}");
    let req = loop {
        let p = v.recv(WAIT_MS)?;
        // The RST answering our shutdown may arrive first.
        if p.op == op::RST && p.dst_port == GUEST_LOCAL_PORT {
            continue;
        }
        break p;
    };
    if req.op != op::REQUEST || req.dst_port != GUEST_PORT {
        return Err(Detail::fmt(format_args!(
            "Expected a connection to port {GUEST_PORT}, got op {} to port {}",
            req.op, req.dst_port
        )));
    }
    let host_port = req.src_port;
    // Credit counts are per connection: this one starts from zero.
    v.fwd_cnt = 0;
    v.tx_cnt = 0;
    v.send(GUEST_PORT, host_port, op::RESPONSE, 0, &[])?;
    let mut line = [0u8; 256];
    let mut n = 0;
    while !line[..n].contains(&b'\n') {
        let p = v.recv(WAIT_MS)?;
        if p.op != op::RW || p.src_port != host_port {
            return Err(Detail::fmt(format_args!(
                "Expected the host's line, got op {}",
                p.op
            )));
        }
        let take = p.len.min(256 - n);
        line[n..n + take].copy_from_slice(&p.data[..take]);
        n += take;
        if n == 256 {
            return Err(Detail::fmt(format_args!("Host line longer than 256 bytes")));
        }
    }
    let mut echo = [0u8; 256];
    let len = upper(&line[..n], &mut echo);
    v.send(GUEST_PORT, host_port, op::RW, 0, &echo[..len])?;
    if !wait_irq(0, rx_irqs) {
        return Err(Detail::fmt(format_args!(
            "No MSI-X interrupt on the rx queue"
        )));
    }
    // Wait for the host to close (SHUTDOWN), so the echo is read before power-off.
    let closed = matches!(v.recv(WAIT_MS), Ok(p) if p.op == op::SHUTDOWN || p.op == op::RST);
    Ok(Detail::fmt(format_args!(
        "cid={} guest_to_host=ok host_to_guest=ok echoed={} host_port={host_port} closed={}",
        v.cid,
        n,
        u8::from(closed)
    )))
}
