//! Fuzzes vsock TX packet handling: chain collection, header decoding and validation,
//! and payload gathering across descriptors.
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;
use tenantvm_devices::virtio::vsock::packet::{self, PacketHeader, HEADER_SIZE};
use virtio_queue::QueueOwnedT;

fuzz_target!(|data: &[u8]| {
    // The raw header path, on the input bytes directly.
    if let Some(h) = PacketHeader::decode(data) {
        let _ = packet::validate_tx(&h, 3, data.len().saturating_sub(HEADER_SIZE));
    }
    // The chain path, as the device reads the TX queue.
    let Some((mem, mut queue)) = common::guest_from(data) else {
        return;
    };
    let Ok(mut iter) = queue.iter(&mem) else {
        return;
    };
    let Some(chain) = iter.next() else {
        return;
    };
    let Ok(bufs) = packet::collect(chain, &mem, common::QUEUE_SIZE, false) else {
        return;
    };
    let total = packet::total_len(&bufs);
    let mut raw = [0u8; HEADER_SIZE];
    if total < HEADER_SIZE || !packet::gather(&mem, &bufs, 0, &mut raw) {
        return;
    }
    let Some(h) = PacketHeader::decode(&raw) else {
        return;
    };
    if packet::validate_tx(&h, 3, total - HEADER_SIZE).is_ok() {
        let mut payload = vec![0u8; h.len as usize];
        let _ = packet::gather(&mem, &bufs, HEADER_SIZE, &mut payload);
    }
});
