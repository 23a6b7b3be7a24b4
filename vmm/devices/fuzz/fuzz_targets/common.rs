//! Builds a one-queue guest from fuzz input: a 16-entry descriptor table, an available
//! ring with one head, and buffer contents, all taken from the input bytes.

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

pub const QUEUE_SIZE: u16 = 16;
pub const MEM_SIZE: usize = 0x10_0000;
const DESC_TABLE: u64 = 0x0;
const AVAIL: u64 = 0x800;
const USED: u64 = 0xc00;
const BUFFERS: u64 = 0x1000;

/// Guest memory and a ready queue whose first available chain is built from `data`.
/// Descriptor addresses are folded into (and a bit beyond) guest memory, so both valid
/// and invalid buffers occur.
pub fn guest_from(data: &[u8]) -> Option<(GuestMemoryMmap, Queue)> {
    let mem: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).ok()?;
    let table_len = usize::from(QUEUE_SIZE) * 16;
    let (table, rest) = data.split_at(data.len().min(table_len));
    let mut table = table.to_vec();
    table.resize(table_len, 0);
    for entry in table.chunks_mut(16) {
        let addr = u64::from_le_bytes(entry[0..8].try_into().ok()?);
        // Mostly inside memory, sometimes past its end.
        let folded = addr % (MEM_SIZE as u64 + 0x1000);
        entry[0..8].copy_from_slice(&folded.to_le_bytes());
    }
    mem.write_slice(&table, GuestAddress(DESC_TABLE)).ok()?;
    let head = u16::from(*rest.first().unwrap_or(&0)) % (QUEUE_SIZE + 2);
    mem.write_obj(0u16, GuestAddress(AVAIL)).ok()?;
    mem.write_obj(1u16, GuestAddress(AVAIL + 2)).ok()?;
    mem.write_obj(head, GuestAddress(AVAIL + 4)).ok()?;
    let payload = rest.get(1..).unwrap_or_default();
    let n = payload.len().min(MEM_SIZE - BUFFERS as usize);
    mem.write_slice(&payload[..n], GuestAddress(BUFFERS)).ok()?;

    let mut q = Queue::new(QUEUE_SIZE).ok()?;
    q.set_size(QUEUE_SIZE);
    q.set_desc_table_address(Some(DESC_TABLE as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    q.set_used_ring_address(Some(USED as u32), Some(0));
    q.set_ready(true);
    Some((mem, q))
}
