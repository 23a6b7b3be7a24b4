//! The virtio-rng worker: fills each device-writable chain with up to
//! [`MAX_BYTES_PER_REQUEST`] bytes from getrandom(2), at most one queue's worth of
//! chains per notification.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use event_manager::{EventOps, Events, MutEventSubscriber};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::{RngMetrics, MAX_BYTES_PER_REQUEST};
use crate::inc;
use crate::virtio::chain;
use crate::virtio::{GuestMemoryMmap, VirtioInterrupt, VirtioInterruptType};

/// Fills `buf` from the kernel's CSPRNG.
fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: the kernel writes at most `rest.len()` bytes into `rest`, which we own.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        done += n as usize;
    }
    Ok(())
}

/// The entropy queue's worker.
pub struct RngHandler {
    mem: GuestMemoryMmap,
    queue: Queue,
    queue_evt: EventFd,
    interrupt: Arc<dyn VirtioInterrupt>,
    broken: bool,
    metrics: Arc<RngMetrics>,
}

impl RngHandler {
    /// A worker for `queue`, woken by `queue_evt`.
    pub fn new(
        mem: GuestMemoryMmap,
        queue: Queue,
        queue_evt: EventFd,
        interrupt: Arc<dyn VirtioInterrupt>,
        metrics: Arc<RngMetrics>,
    ) -> Self {
        Self {
            mem,
            queue,
            queue_evt,
            interrupt,
            broken: false,
            metrics,
        }
    }

    fn mark_broken(&mut self, what: &str) {
        inc(&self.metrics.queue_errors);
        warn_limited!("virtio-rng: {what}; the device needs a reset");
        self.broken = true;
        self.interrupt.signal_needs_reset();
    }

    /// Handles available chains; returns whether any was completed.
    pub fn process_queue(&mut self) -> bool {
        if self.broken {
            return false;
        }
        let mem = self.mem.clone();
        let size = self.queue.size();
        let chains: Vec<_> = match self.queue.iter(&mem) {
            Ok(iter) => iter.take(usize::from(size)).collect(),
            Err(e) => {
                self.mark_broken(&format!("bad available ring: {e}"));
                return false;
            }
        };
        let mut seen = vec![false; usize::from(size)];
        let mut completed = false;
        for c in &chains {
            let head = c.head_index();
            match seen.get_mut(usize::from(head)) {
                Some(false) => seen[usize::from(head)] = true,
                _ => {
                    inc(&self.metrics.bad_requests);
                    continue;
                }
            }
            let len = match chain::collect(c.clone(), &mem, size, true) {
                Ok(bufs) => self.fill(&bufs),
                Err(_) => {
                    inc(&self.metrics.bad_requests);
                    0
                }
            };
            if let Err(e) = self.queue.add_used(&mem, head, len) {
                self.mark_broken(&format!("cannot return a chain: {e}"));
                return completed;
            }
            completed = true;
        }
        if chains.len() == usize::from(size) {
            let _ = self.queue_evt.write(1);
        }
        completed
    }

    fn fill(&self, bufs: &[chain::Buffer]) -> u32 {
        let n = chain::total_len(bufs).min(MAX_BYTES_PER_REQUEST);
        // MAX_BYTES_PER_REQUEST is far below 4 GiB.
        let Ok(used) = u32::try_from(n) else {
            inc(&self.metrics.bad_requests);
            return 0;
        };
        let mut data = vec![0u8; n];
        if let Err(e) = getrandom(&mut data) {
            inc(&self.metrics.entropy_errors);
            tracing::error!("virtio-rng: getrandom: {e}");
            return 0;
        }
        if !chain::scatter(&self.mem, bufs, 0, &data) {
            inc(&self.metrics.bad_requests);
            return 0;
        }
        inc(&self.metrics.requests);
        self.metrics.bytes.fetch_add(n as u64, Ordering::Relaxed);
        used
    }
}

impl MutEventSubscriber for RngHandler {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.queue_evt.read();
        inc(&self.metrics.notifications);
        if self.process_queue() {
            if let Err(e) = self.interrupt.trigger(VirtioInterruptType::Queue(0)) {
                tracing::error!("virtio-rng: {e}");
            }
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.queue_evt, EventSet::IN)) {
            tracing::error!("virtio-rng: cannot watch the queue: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_utils::FakeInterrupt;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};

    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;

    fn setup(
        m: &GuestMemoryMmap,
        vq: &MockSplitQueue<GuestMemoryMmap>,
    ) -> (RngHandler, Arc<FakeInterrupt>, Arc<RngMetrics>) {
        let irq = Arc::new(FakeInterrupt::default());
        let metrics = Arc::new(RngMetrics::default());
        let h = RngHandler::new(
            m.clone(),
            vq.create_queue().unwrap(),
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            irq.clone(),
            metrics.clone(),
        );
        (h, irq, metrics)
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap()
    }

    #[test]
    fn fills_writable_buffers_with_random_bytes() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, 16);
        let (mut h, _, metrics) = setup(&m, &vq);
        let descs = [
            RawDescriptor::from(SplitDescriptor::new(0x10_0000, 32, F_WRITE | F_NEXT, 1)),
            RawDescriptor::from(SplitDescriptor::new(0x20_0000, 32, F_WRITE, 0)),
        ];
        vq.add_desc_chains(&descs, 0).unwrap();
        assert!(h.process_queue());
        let e = vq.used().ring().ref_at(0).unwrap().load();
        assert_eq!((e.id(), e.len()), (0, 64));
        let mut a = [0u8; 32];
        let mut b = [0u8; 32];
        m.read_slice(&mut a, GuestAddress(0x10_0000)).unwrap();
        m.read_slice(&mut b, GuestAddress(0x20_0000)).unwrap();
        // 64 zero bytes from a CSPRNG has probability 2^-512.
        assert!(a.iter().chain(b.iter()).any(|&x| x != 0));
        assert_eq!(metrics.bytes.load(Ordering::Relaxed), 64);
    }

    #[test]
    fn large_request_is_capped() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, 16);
        let (mut h, _, metrics) = setup(&m, &vq);
        let d = RawDescriptor::from(SplitDescriptor::new(0x10_0000, 1 << 20, F_WRITE, 0));
        vq.add_desc_chains(&[d], 0).unwrap();
        h.process_queue();
        let e = vq.used().ring().ref_at(0).unwrap().load();
        assert_eq!(e.len() as usize, MAX_BYTES_PER_REQUEST);
        assert_eq!(metrics.requests.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn readable_or_outside_buffers_get_nothing() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, 16);
        let (mut h, irq, metrics) = setup(&m, &vq);
        vq.add_desc_chains(
            &[RawDescriptor::from(SplitDescriptor::new(
                0x10_0000, 32, 0, 0,
            ))],
            0,
        )
        .unwrap();
        vq.add_desc_chains(
            &[RawDescriptor::from(SplitDescriptor::new(
                1 << 40,
                32,
                F_WRITE,
                0,
            ))],
            1,
        )
        .unwrap();
        h.process_queue();
        for i in 0..2 {
            assert_eq!(vq.used().ring().ref_at(i).unwrap().load().len(), 0);
        }
        assert_eq!(metrics.bad_requests.load(Ordering::Relaxed), 2);
        assert!(!irq.needs_reset());
    }

    #[test]
    fn corrupt_avail_index_needs_reset() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, 16);
        let (mut h, irq, _) = setup(&m, &vq);
        vq.avail().idx().store(100);
        assert!(!h.process_queue());
        assert!(irq.needs_reset());
    }
}
