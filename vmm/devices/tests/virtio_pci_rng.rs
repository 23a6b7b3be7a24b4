//! virtio-rng end to end through PCI and the device event loop.

mod common;

use common::{Driver, GuestQueue, Platform};
use tenantvm_devices::virtio::rng::Rng;
use vm_memory::{Bytes, GuestAddress};

#[test]
fn rng_returns_random_bytes_through_pci() {
    let p = Platform::new();
    let slot = p.add_virtio(Box::new(Rng::new()));
    let d = Driver::probe(&p, slot);
    d.negotiate(0);
    let mut q = GuestQueue::new(0x1_0000, 16);
    d.setup_queue(0, &q);
    d.driver_ok();
    let mut seen = Vec::new();
    for _ in 0..2 {
        q.add(&p.mem, &[(0x20_0000, 64, true)]);
        d.notify(0);
        let (_, len) = d.wait_used(&mut q);
        assert_eq!(len, 64);
        let mut buf = [0u8; 64];
        p.mem.read_slice(&mut buf, GuestAddress(0x20_0000)).unwrap();
        seen.push(buf);
    }
    // Two 64-byte draws from a CSPRNG are equal with probability 2^-512.
    assert_ne!(seen[0], seen[1]);
    common::wait_for(|| !p.fired().is_empty());
}

#[test]
fn driver_without_version_1_cannot_start_the_device() {
    let p = Platform::new();
    let slot = p.add_virtio(Box::new(Rng::new()));
    let d = Driver::probe(&p, slot);
    d.w8(0x14, 1);
    d.w8(0x14, 3);
    d.w32(0x08, 0);
    d.w32(0x0c, 0);
    d.w8(0x14, 0xb);
    assert_eq!(d.status() & 0x8, 0);
    d.w8(0x14, 0xf);
    assert_eq!(d.status() & 0x4, 0);
}
