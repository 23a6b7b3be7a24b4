//! Block device throughput on the host: requests through the virtio-blk worker (queue,
//! parser, preadv/pwritev into guest memory) against the same file read and written
//! directly with pread/pwrite, as a ratio. Both run against the page cache, so the ratio
//! is the device path's overhead. `cargo bench -p tenantvm-devices --bench block_throughput`.

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Instant;

use tenantvm_devices::virtio::block::disk::DiskFile;
use tenantvm_devices::virtio::block::event_handler::BlockHandler;
use tenantvm_devices::virtio::block::request::DiskGeometry;
use tenantvm_devices::virtio::block::{request_type, BlockMetrics, RateLimiter};
use tenantvm_devices::virtio::{
    GuestMemoryMmap, VirtioInterrupt, VirtioInterruptError, VirtioInterruptType,
};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

const DISK: u64 = 256 << 20;
const QSIZE: u16 = 256;
const HDRS: u64 = 0x10_0000;
const DATA: u64 = 0x100_0000;

struct NoInterrupt;
impl VirtioInterrupt for NoInterrupt {
    fn trigger(&self, _kind: VirtioInterruptType) -> Result<(), VirtioInterruptError> {
        Ok(())
    }
    fn signal_needs_reset(&self) {}
}

fn rng(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// MB/s of `total` bytes in `reqs` requests of `size` through the device.
fn device(path: &std::path::Path, size: u64, write: bool, random: bool) -> f64 {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x900_0000)]).unwrap();
    let vq = MockSplitQueue::new(&mem, QSIZE);
    let disk = Arc::new(DiskFile::open(path, false, None).unwrap());
    let geometry = DiskGeometry {
        sectors: disk.sectors(),
        read_only: false,
        acked_features: 0,
    };
    let mut handler = BlockHandler::new(
        mem.clone(),
        vq.create_queue().unwrap(),
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        Arc::new(NoInterrupt),
        disk,
        geometry,
        RateLimiter::unlimited(),
        Arc::new(BlockMetrics::default()),
    )
    .unwrap();
    let per_batch = (QSIZE / 3).min(((128u64 << 20) / size) as u16).max(1);
    let total = if size >= (1 << 20) {
        2u64 << 30
    } else {
        256 << 20
    };
    let mut done = 0u64;
    let mut x = 0x1234_5678u64;
    let mut sector = 0u64;
    let start = Instant::now();
    while done < total {
        let mut descs = Vec::new();
        for i in 0..u64::from(per_batch) {
            let s = if random {
                (rng(&mut x) % ((DISK - size) / 4096)) * 8
            } else {
                sector
            };
            sector = (sector + size / 512) % ((DISK - size) / 512);
            let hdr = HDRS + i * 0x200;
            mem.write_obj(
                if write {
                    request_type::OUT
                } else {
                    request_type::IN
                },
                GuestAddress(hdr),
            )
            .unwrap();
            mem.write_obj(s, GuestAddress(hdr + 8)).unwrap();
            let flags = if write { 0 } else { 2 };
            let base = descs.len() as u16;
            descs.push(RawDescriptor::from(SplitDescriptor::new(
                hdr,
                16,
                1,
                base + 1,
            )));
            descs.push(RawDescriptor::from(SplitDescriptor::new(
                DATA + (i * size) % (128 << 20),
                size as u32,
                flags | 1,
                base + 2,
            )));
            descs.push(RawDescriptor::from(SplitDescriptor::new(
                hdr + 0x100,
                1,
                2,
                0,
            )));
        }
        for (i, d) in descs.iter().enumerate() {
            vq.desc_table().store(i as u16, *d).unwrap();
        }
        for i in 0..per_batch {
            let idx = vq.avail().idx().load();
            vq.avail()
                .ring()
                .ref_at(usize::from(idx % QSIZE))
                .unwrap()
                .store(i * 3);
            vq.avail().idx().store(idx.wrapping_add(1));
        }
        handler.process_queue();
        done += size * u64::from(per_batch);
    }
    done as f64 / start.elapsed().as_secs_f64() / 1e6
}

fn direct(file: &std::fs::File, size: u64, write: bool, random: bool) -> f64 {
    let mut buf = vec![0x5au8; size as usize];
    let total = if size >= (1 << 20) {
        2u64 << 30
    } else {
        256 << 20
    };
    let mut done = 0u64;
    let mut x = 0x1234_5678u64;
    let mut off = 0u64;
    let start = Instant::now();
    while done < total {
        let o = if random {
            (rng(&mut x) % ((DISK - size) / 4096)) * 4096
        } else {
            off
        };
        off = (off + size) % (DISK - size);
        if write {
            file.write_all_at(&buf, o).unwrap();
        } else {
            file.read_exact_at(&mut buf, o).unwrap();
        }
        done += size;
    }
    done as f64 / start.elapsed().as_secs_f64() / 1e6
}

fn main() {
    let tmp = tempfile::NamedTempFile::new().unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(tmp.path())
        .unwrap();
    file.write_all_at(&vec![1u8; DISK as usize], 0).unwrap();
    println!(
        "{:<22} {:>12} {:>12} {:>7}",
        "workload", "device MB/s", "direct MB/s", "ratio"
    );
    for (name, size, write, random) in [
        ("seq read 1 MiB", 1 << 20, false, false),
        ("seq write 1 MiB", 1 << 20, true, false),
        ("rand read 4 KiB", 4096, false, true),
        ("rand write 4 KiB", 4096, true, true),
    ] {
        let dev = device(tmp.path(), size, write, random);
        let host = direct(&file, size, write, random);
        let iops = if size == 4096 {
            format!("  ({:.0}k IOPS device)", dev * 1e6 / 4096.0 / 1e3)
        } else {
            String::new()
        };
        println!(
            "{name:<22} {dev:>12.0} {host:>12.0} {:>6.0}%{iops}",
            100.0 * dev / host
        );
    }
}
