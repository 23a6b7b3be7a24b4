//! virtio-blk end to end through PCI: enumeration over 0xCF8/0xCFC, BAR sizing, MSI-X,
//! feature negotiation, requests over the device event loop, and the host file.

mod common;

use std::io::{Read, Seek, SeekFrom, Write};

use common::{Driver, GuestQueue, Platform};
use tenantvm_devices::virtio::block::{request_type, status, Block, BlockConfig};
use vm_memory::{Bytes, GuestAddress};

const QUEUE_BASE: u64 = 0x1_0000;
const HDR: u64 = 0x10_0000;
const DATA: u64 = 0x20_0000;
const STATUS: u64 = 0x30_0000;

fn disk(len: usize, read_only: bool) -> (tempfile::NamedTempFile, BlockConfig) {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(&vec![0u8; len]).unwrap();
    let config = BlockConfig {
        path: file.path().into(),
        read_only,
        id: None,
        rate_limit: None,
    };
    (file, config)
}

fn request(
    d: &Driver,
    q: &mut GuestQueue,
    kind: u32,
    sector: u64,
    data: Option<(u32, bool)>,
) -> (u8, u32) {
    let mem = &d.p.mem;
    mem.write_obj(kind, GuestAddress(HDR)).unwrap();
    mem.write_obj(0u32, GuestAddress(HDR + 4)).unwrap();
    mem.write_obj(sector, GuestAddress(HDR + 8)).unwrap();
    mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    let mut bufs = vec![(HDR, 16, false)];
    if let Some((len, writable)) = data {
        bufs.push((DATA, len, writable));
    }
    bufs.push((STATUS, 1, true));
    q.add(mem, &bufs);
    d.notify(0);
    let (_, used_len) = d.wait_used(q);
    (mem.read_obj(GuestAddress(STATUS)).unwrap(), used_len)
}

fn bring_up(p: &Platform, slot: u8) -> (Driver<'_>, GuestQueue) {
    let d = Driver::probe(p, slot);
    d.negotiate(1 << 9);
    let q = GuestQueue::new(QUEUE_BASE, 64);
    d.setup_queue(0, &q);
    d.driver_ok();
    assert_eq!(d.status(), 0xf);
    (d, q)
}

#[test]
fn block_round_trip_flush_and_msix_through_pci() {
    let p = Platform::new();
    let (mut file, config) = disk(1 << 20, false);
    let slot = p.add_virtio(Box::new(Block::new(&config).unwrap()));
    let (d, mut q) = bring_up(&p, slot);
    // Capacity in the device configuration.
    let mut cap = [0u8; 8];
    p.mmio_read(d.bar + d.device_cfg, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), 2048);

    let pattern: Vec<u8> = (0..8192u32).map(|i| (i * 13 + 1) as u8).collect();
    p.mem.write_slice(&pattern, GuestAddress(DATA)).unwrap();
    assert_eq!(
        request(&d, &mut q, request_type::OUT, 16, Some((8192, false))),
        (status::OK, 1)
    );
    assert_eq!(
        request(&d, &mut q, request_type::FLUSH, 0, None),
        (status::OK, 1)
    );
    let mut on_disk = vec![0u8; 8192];
    file.seek(SeekFrom::Start(16 * 512)).unwrap();
    file.read_exact(&mut on_disk).unwrap();
    assert_eq!(on_disk, pattern);

    p.mem.write_slice(&[0u8; 8192], GuestAddress(DATA)).unwrap();
    assert_eq!(
        request(&d, &mut q, request_type::IN, 16, Some((8192, true))),
        (status::OK, 8193)
    );
    let mut back = vec![0u8; 8192];
    p.mem.read_slice(&mut back, GuestAddress(DATA)).unwrap();
    assert_eq!(back, pattern);
    // Every completion raised queue 0's MSI-X vector with the message the driver programmed.
    common::wait_for(|| p.fired().len() >= 3);
    assert!(p
        .fired()
        .iter()
        .all(|(v, m)| *v == 0 && m.address == 0xfee0_0000 && m.data == 0x30));
}

#[test]
fn hostile_requests_through_pci_get_error_statuses() {
    let p = Platform::new();
    let (_file, config) = disk(1 << 20, true);
    let slot = p.add_virtio(Box::new(Block::new(&config).unwrap()));
    let (d, mut q) = bring_up(&p, slot);
    assert_eq!(
        request(&d, &mut q, request_type::OUT, 0, Some((512, false))).0,
        status::IOERR
    );
    assert_eq!(
        request(&d, &mut q, request_type::IN, 2048, Some((512, true))).0,
        status::IOERR
    );
    assert_eq!(
        request(&d, &mut q, request_type::IN, 0, Some((511, true))).0,
        status::IOERR
    );
    assert_eq!(
        request(&d, &mut q, request_type::IN, 0, Some((512, false))).0,
        status::IOERR
    );
    assert_eq!(request(&d, &mut q, 0x1234, 0, None).0, status::UNSUPP);
    // The device still works afterwards.
    assert_eq!(
        request(&d, &mut q, request_type::IN, 0, Some((512, true))).0,
        status::OK
    );
}

#[test]
fn guest_moves_the_bar_and_the_device_follows() {
    let p = Platform::new();
    let (_file, config) = disk(1 << 20, false);
    let slot = p.add_virtio(Box::new(Block::new(&config).unwrap()));
    let d = Driver::probe(&p, slot);
    let old = d.bar;
    // Into the 32-bit window, decoding off while both halves change.
    p.cfg_write(slot, 0x04, 0);
    p.cfg_write(slot, 0x10, 0xc800_0000);
    p.cfg_write(slot, 0x14, 0);
    p.cfg_write(slot, 0x04, 0x6);
    let moved = Driver::probe(&p, slot);
    assert_eq!(moved.bar, 0xc800_0000);
    let mut probe = [0u8; 4];
    assert!(!p.mmio_read(old, &mut probe), "old range still mapped");
    moved.negotiate(0);
    // Onto guest RAM: refused, the device stays where it was.
    p.cfg_write(slot, 0x04, 0);
    p.cfg_write(slot, 0x10, 0x10_0000);
    p.cfg_write(slot, 0x04, 0x6);
    assert!(p.mmio_read(0xc800_0000 + 0x14, &mut probe[..1]));
    assert_eq!(probe[0] & 0x8, 0x8);
}

#[test]
fn bar_move_through_ecam_remaps_the_mmio_bus() {
    let p = Platform::new();
    let (_file, config) = disk(1 << 20, false);
    let slot = p.add_virtio(Box::new(Block::new(&config).unwrap()));
    Driver::probe(&p, slot);
    p.ecam_write(slot, 0x04, 0);
    p.ecam_write(slot, 0x10, 0xd000_0000);
    p.ecam_write(slot, 0x14, 0);
    p.ecam_write(slot, 0x04, 0x6);
    let moved = Driver::probe(&p, slot);
    assert_eq!(moved.bar, 0xd000_0000);
    moved.negotiate(0);
}

#[test]
fn garbage_on_every_bus_never_panics() {
    let p = Platform::new();
    let (_file, config) = disk(1 << 20, false);
    let slot = p.add_virtio(Box::new(Block::new(&config).unwrap()));
    let d = Driver::probe(&p, slot);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..200_000 {
        let r = next();
        let len = [1usize, 2, 3, 4, 8][(r % 5) as usize];
        let data = next().to_le_bytes();
        match (r >> 8) % 3 {
            0 => {
                let off = (r >> 16) % 0x100;
                p.pio.write(0xcf8 + off % 8, &data[..len]);
                let mut out = [0u8; 8];
                p.pio.read(0xcf8 + off % 8, &mut out[..len]);
            }
            1 => {
                let off = (r >> 16) % tenantvm_devices::pci::ECAM_BUS_SIZE;
                p.mmio_write(tenantvm_devices::pci::ECAM_BASE + off, &data[..len]);
            }
            _ => {
                let off = (r >> 16) % tenantvm_devices::virtio::transport::BAR_SIZE;
                p.mmio_write(d.bar + off, &data[..len]);
                let mut out = [0u8; 8];
                p.mmio_read(d.bar + off, &mut out[..len]);
            }
        }
    }
    // The host bridge is intact.
    assert_eq!(p.cfg_read(0, 0), 0x0008_1b36);
}
