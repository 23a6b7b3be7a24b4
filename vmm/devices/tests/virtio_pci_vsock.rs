//! virtio-vsock end to end through PCI: a guest connection to a host Unix socket, data
//! both ways, interrupts.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;

use common::{Driver, GuestQueue, Platform};
use tenantvm_devices::virtio::vsock::packet::{PacketHeader, HEADER_SIZE};
use tenantvm_devices::virtio::vsock::{op, Vsock, VsockConfig, HOST_CID, TYPE_STREAM};
use vm_memory::{Bytes, GuestAddress};

const RX_BUF: u64 = 0x40_0000;
const TX_BUF: u64 = 0x50_0000;

fn hdr(op: u16, len: u32) -> PacketHeader {
    PacketHeader {
        src_cid: 3,
        dst_cid: HOST_CID,
        src_port: 4000,
        dst_port: 9000,
        len,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 65536,
        fwd_cnt: 0,
    }
}

#[test]
fn guest_connects_to_host_socket_and_data_flows_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("vm.sock");
    let service = UnixListener::bind(dir.path().join("vm.sock_9000")).unwrap();
    let p = Platform::new();
    let slot = p.add_virtio(Box::new(
        Vsock::new(&VsockConfig {
            guest_cid: 3,
            uds_path: uds,
        })
        .unwrap(),
    ));
    let d = Driver::probe(&p, slot);
    d.negotiate(0);
    let mut rx = GuestQueue::new(0x1_0000, 16);
    let mut tx = GuestQueue::new(0x2_0000, 16);
    let evq = GuestQueue::new(0x3_0000, 16);
    d.setup_queue(0, &rx);
    d.setup_queue(1, &tx);
    d.setup_queue(2, &evq);
    d.driver_ok();
    assert_eq!(d.status(), 0xf);
    for i in 0..8u64 {
        rx.add(&p.mem, &[(RX_BUF + i * 0x1000, 0x1000, true)]);
    }
    d.notify(0);

    let mut send = |h: PacketHeader, payload: &[u8]| {
        p.mem
            .write_slice(&h.encode(), GuestAddress(TX_BUF))
            .unwrap();
        p.mem
            .write_slice(payload, GuestAddress(TX_BUF + HEADER_SIZE as u64))
            .unwrap();
        tx.add(
            &p.mem,
            &[
                (TX_BUF, HEADER_SIZE as u32, false),
                (TX_BUF + HEADER_SIZE as u64, payload.len() as u32, false),
            ],
        );
        d.notify(1);
        d.wait_used(&mut tx);
    };
    send(hdr(op::REQUEST, 0), &[]);
    let (id, _) = d.wait_used(&mut rx);
    let mut raw = [0u8; HEADER_SIZE];
    p.mem
        .read_slice(&mut raw, GuestAddress(RX_BUF + u64::from(id) * 0x1000))
        .unwrap();
    assert_eq!(PacketHeader::decode(&raw).unwrap().op, op::RESPONSE);

    let (mut host, _) = service.accept().unwrap();
    host.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    send(hdr(op::RW, 4), b"ping");
    let mut buf = [0u8; 4];
    host.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ping");

    host.write_all(b"pong").unwrap();
    let (id, len) = d.wait_used(&mut rx);
    assert_eq!(len as usize, HEADER_SIZE + 4);
    let base = RX_BUF + u64::from(id) * 0x1000;
    p.mem.read_slice(&mut raw, GuestAddress(base)).unwrap();
    let h = PacketHeader::decode(&raw).unwrap();
    assert_eq!(
        (h.op, h.len, h.dst_port, h.src_port),
        (op::RW, 4, 4000, 9000)
    );
    p.mem
        .read_slice(&mut buf, GuestAddress(base + HEADER_SIZE as u64))
        .unwrap();
    assert_eq!(&buf, b"pong");
    common::wait_for(|| p.fired().iter().any(|(v, _)| *v == 0));
}
