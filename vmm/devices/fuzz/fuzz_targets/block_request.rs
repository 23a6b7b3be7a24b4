//! Fuzzes virtio-blk request parsing: descriptor chain collection (loops, indirect
//! tables, broken chains) and the request parser (directions, lengths, sectors).
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use tenantvm_devices::virtio::block::request::{collect_chain, parse, DiskGeometry};
use virtio_queue::QueueOwnedT;

fuzz_target!(|data: &[u8]| {
    let Some((mem, mut queue)) = common::guest_from(data) else {
        return;
    };
    let flags = data.last().copied().unwrap_or(0);
    let geometry = DiskGeometry {
        sectors: 2048,
        read_only: flags & 1 != 0,
        acked_features: u64::from(flags) << 8,
    };
    let Ok(mut iter) = queue.iter(&mem) else {
        return;
    };
    if let Some(chain) = iter.next() {
        if let Ok(descs) = collect_chain(chain, common::QUEUE_SIZE) {
            let _ = parse(&descs, &mem, &geometry);
        }
    }
});
