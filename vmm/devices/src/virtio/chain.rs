//! Descriptor chains as lists of checked guest buffers, and gather/scatter over them,
//! for devices whose packets may be framed across descriptors in any way.

use std::ops::Deref;

use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

/// Why a chain was refused.
#[derive(Debug, Clone, Copy, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    /// The chain is empty, longer than the queue (a loop) or broken.
    #[error("Descriptor chain is empty, broken or longer than the queue")]
    BadChain,
    /// A buffer has the wrong direction for the queue.
    #[error("Descriptor direction is wrong for this queue")]
    WrongDirection,
    /// A buffer lies outside guest memory.
    #[error("Buffer {addr:#x}+{len:#x} is outside guest memory")]
    OutsideMemory {
        /// Address.
        addr: u64,
        /// Length.
        len: u32,
    },
}

/// One buffer of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    /// Guest address.
    pub addr: GuestAddress,
    /// Length.
    pub len: u32,
}

/// Reads the buffers of `chain`, which must all have direction `writable` and lie in
/// guest memory, and number at most `queue_size`.
pub fn collect<M, G>(
    chain: DescriptorChain<M>,
    mem: &G,
    queue_size: u16,
    writable: bool,
) -> Result<Vec<Buffer>, ChainError>
where
    M: Deref,
    M::Target: GuestMemory,
    G: GuestMemory + ?Sized,
{
    let mut out = Vec::new();
    let mut last_has_next = false;
    for desc in chain {
        if out.len() >= usize::from(queue_size) {
            return Err(ChainError::BadChain);
        }
        if desc.is_write_only() != writable {
            return Err(ChainError::WrongDirection);
        }
        if !mem.check_range(desc.addr(), desc.len() as usize, Permissions::ReadWrite) {
            return Err(ChainError::OutsideMemory {
                addr: desc.addr().0,
                len: desc.len(),
            });
        }
        last_has_next = desc.has_next();
        out.push(Buffer {
            addr: desc.addr(),
            len: desc.len(),
        });
    }
    if out.is_empty() || last_has_next {
        return Err(ChainError::BadChain);
    }
    Ok(out)
}

/// Total bytes of `bufs`.
pub fn total_len(bufs: &[Buffer]) -> usize {
    bufs.iter().map(|b| b.len as usize).sum()
}

/// Copies `out.len()` bytes starting at logical `offset` of `bufs` into `out`.
pub fn gather<M: GuestMemory + ?Sized>(
    mem: &M,
    bufs: &[Buffer],
    mut offset: usize,
    out: &mut [u8],
) -> bool {
    let mut done = 0;
    for b in bufs {
        if done == out.len() {
            break;
        }
        let len = b.len as usize;
        if offset >= len {
            offset -= len;
            continue;
        }
        let n = (len - offset).min(out.len() - done);
        if mem
            .read_slice(
                &mut out[done..done + n],
                GuestAddress(b.addr.0 + offset as u64),
            )
            .is_err()
        {
            return false;
        }
        done += n;
        offset = 0;
    }
    done == out.len()
}

/// Copies `data` into `bufs` at logical `offset`.
pub fn scatter<M: GuestMemory + ?Sized>(
    mem: &M,
    bufs: &[Buffer],
    mut offset: usize,
    data: &[u8],
) -> bool {
    let mut done = 0;
    for b in bufs {
        if done == data.len() {
            break;
        }
        let len = b.len as usize;
        if offset >= len {
            offset -= len;
            continue;
        }
        let n = (len - offset).min(data.len() - done);
        if mem
            .write_slice(
                &data[done..done + n],
                GuestAddress(b.addr.0 + offset as u64),
            )
            .is_err()
        {
            return false;
        }
        done += n;
        offset = 0;
    }
    done == data.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::GuestMemoryMmap;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::{Queue, QueueOwnedT};

    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;

    fn first_chain(
        m: &GuestMemoryMmap,
        descs: &[RawDescriptor],
    ) -> Result<Vec<Buffer>, ChainError> {
        let vq = MockSplitQueue::new(m, 16);
        vq.add_desc_chains(descs, 0).unwrap();
        let mut q: Queue = vq.create_queue().unwrap();
        let chain = q.iter(m).unwrap().next().unwrap();
        collect(chain, m, 16, true)
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    #[test]
    fn collect_refuses_loops_direction_and_outside_buffers() {
        let m = mem();
        let looped = [
            RawDescriptor::from(SplitDescriptor::new(0x8000, 16, F_NEXT | F_WRITE, 1)),
            RawDescriptor::from(SplitDescriptor::new(0x9000, 16, F_NEXT | F_WRITE, 0)),
        ];
        assert_eq!(first_chain(&m, &looped), Err(ChainError::BadChain));
        let readable = [RawDescriptor::from(SplitDescriptor::new(0x8000, 16, 0, 0))];
        assert_eq!(first_chain(&m, &readable), Err(ChainError::WrongDirection));
        let outside = [RawDescriptor::from(SplitDescriptor::new(
            0xf_fff0, 32, F_WRITE, 0,
        ))];
        assert!(matches!(
            first_chain(&m, &outside),
            Err(ChainError::OutsideMemory { .. })
        ));
        let good = [RawDescriptor::from(SplitDescriptor::new(
            0x8000, 16, F_WRITE, 0,
        ))];
        assert_eq!(first_chain(&m, &good).unwrap().len(), 1);
    }

    #[test]
    fn gather_and_scatter_cross_buffer_boundaries() {
        let m = mem();
        let bufs = [
            Buffer {
                addr: GuestAddress(0x8000),
                len: 3,
            },
            Buffer {
                addr: GuestAddress(0x9000),
                len: 5,
            },
        ];
        assert!(scatter(&m, &bufs, 1, b"abcdef"));
        let mut out = [0u8; 6];
        assert!(gather(&m, &bufs, 1, &mut out));
        assert_eq!(&out, b"abcdef");
        // Past the end of the buffers: refused.
        assert!(!scatter(&m, &bufs, 4, b"abcdef"));
        assert!(!gather(&m, &bufs, 0, &mut [0u8; 9]));
    }
}
