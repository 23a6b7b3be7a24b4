//! The virtio-blk queue worker, run by the device event loop.
//!
//! Per notification it takes at most one queue's worth of chains, refuses a head offered
//! twice in that batch, parses each chain with [`request::parse`],
//! asks the rate limiter, does the I/O, writes the status byte and returns the chain.
//! A corrupt queue marks the device as needing reset and stops the worker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use event_manager::{EventOps, Events, MutEventSubscriber};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use super::disk::DiskFile;
use super::request::{self, DiskGeometry, Rejected, Request, RequestKind};
use super::{status, BlockMetrics, SECTOR_SHIFT};
use crate::inc;
use crate::virtio::features::RING_EVENT_IDX;
use crate::virtio::{GuestMemoryMmap, VirtioInterrupt, VirtioInterruptType};

use super::rate_limiter::RateLimiter;

/// Available-ring flag: the driver does not want interrupts (without EVENT_IDX).
const AVAIL_F_NO_INTERRUPT: u16 = 1;

const QUEUE_EVENT: u32 = 0;
const TIMER_EVENT: u32 = 1;

/// The worker of one disk's request queue.
pub struct BlockHandler {
    mem: GuestMemoryMmap,
    queue: Queue,
    queue_evt: EventFd,
    interrupt: Arc<dyn VirtioInterrupt>,
    disk: Arc<DiskFile>,
    geometry: DiskGeometry,
    limiter: RateLimiter,
    timer: TimerFd,
    /// See [`COALESCE`]; tests change it.
    coalesce: Duration,
    throttled: bool,
    broken: bool,
    metrics: Arc<BlockMetrics>,
}

/// How long returned chains may wait before the driver is interrupted while the worker
/// still has requests to do. At the end of its work the worker always interrupts.
/// 1 MiB requests (hundreds of microseconds each) are signalled one by one; 4 KiB
/// requests a few at a time.
pub const COALESCE: Duration = Duration::from_micros(50);

/// Interrupt state of one round of work.
struct Signal {
    /// Chains returned since the last interrupt.
    pending: bool,
    /// When the driver was last interrupted (or the round began).
    last: Instant,
}

impl Signal {
    fn new() -> Self {
        Self {
            pending: false,
            last: Instant::now(),
        }
    }
}

/// What one batch of chains came to.
enum Batch {
    /// All taken chains were handled (this many, returned or refused).
    Done(usize),
    /// The worker stopped early (throttled or broken).
    Stopped,
}

/// What one chain came to.
enum Outcome {
    /// Return the chain with this used length.
    Used(u32),
    /// The rate limiter said wait; put the chain back.
    Throttled(std::time::Duration),
}

impl BlockHandler {
    /// A worker for `queue`, woken by `queue_evt`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        mem: GuestMemoryMmap,
        queue: Queue,
        queue_evt: EventFd,
        interrupt: Arc<dyn VirtioInterrupt>,
        disk: Arc<DiskFile>,
        geometry: DiskGeometry,
        limiter: RateLimiter,
        metrics: Arc<BlockMetrics>,
    ) -> std::io::Result<Self> {
        Ok(Self {
            mem,
            queue,
            queue_evt,
            interrupt,
            disk,
            geometry,
            limiter,
            timer: TimerFd::new()?,
            coalesce: COALESCE,
            throttled: false,
            broken: false,
            metrics,
        })
    }

    fn mark_broken(&mut self, what: &str) {
        inc(&self.metrics.queue_errors);
        warn_limited!("virtio-blk: {what}; the device needs a reset");
        self.broken = true;
        self.interrupt.signal_needs_reset();
    }

    /// Handles the available chains, at most one queue's worth per call, and interrupts
    /// the driver as it goes. Returns whether any chain was completed.
    ///
    /// While it works the device tells the driver not to notify it (used-ring flag, or
    /// `avail_event` with EVENT_IDX): the driver keeps adding requests, and the worker
    /// picks them up when it looks at the ring again before re-enabling notifications.
    /// Completed requests are signalled as soon as [`COALESCE`] has passed since the
    /// last interrupt, not only at the end, so that the driver refills the ring while
    /// the device still has work: device and driver overlap instead of taking turns.
    pub fn process_queue(&mut self) -> bool {
        if self.broken || self.throttled {
            return false;
        }
        let size = usize::from(self.queue.size());
        let mem = self.mem.clone();
        let used_before = self.queue.next_used();
        let mut signal = Signal::new();
        let mut handled = 0usize;
        let mut more = false;
        loop {
            if let Err(e) = self.queue.disable_notification(&mem) {
                self.mark_broken(&format!("cannot write the used ring flags: {e}"));
                break;
            }
            match self.process_batch(size - handled, &mut signal) {
                Batch::Done(0) if more => {
                    // The index says there is more, yet no chain could be read.
                    self.mark_broken("available ring entries unreadable");
                    break;
                }
                Batch::Done(n) => handled += n,
                Batch::Stopped => break,
            }
            if handled >= size {
                // More may be waiting: come back on the next loop round, after other
                // devices, with notifications still off (the re-armed event brings the
                // worker back).
                inc(&self.metrics.batches_cut);
                let _ = self.queue_evt.write(1);
                break;
            }
            match self.queue.enable_notification(&mem) {
                // The driver added chains while notifications were off: take them too.
                Ok(true) => more = true,
                Ok(false) => break,
                Err(e) => {
                    self.mark_broken(&format!("cannot re-enable notifications: {e}"));
                    break;
                }
            }
        }
        self.flush_signal(&mut signal);
        self.queue.next_used() != used_before
    }

    /// Handles at most `limit` of the chains available now (a snapshot: a head offered
    /// twice in it is refused).
    fn process_batch(&mut self, limit: usize, signal: &mut Signal) -> Batch {
        let size = self.queue.size();
        let mem = self.mem.clone();
        let chains: Vec<_> = match self.queue.iter(&mem) {
            Ok(iter) => iter.take(limit).collect(),
            Err(e) => {
                self.mark_broken(&format!("bad available ring: {e}"));
                return Batch::Stopped;
            }
        };
        let mut seen = vec![false; usize::from(size)];
        let mut done = 0usize;
        for (i, chain) in chains.iter().enumerate() {
            let head = chain.head_index();
            match seen.get_mut(usize::from(head)) {
                Some(true) => {
                    // The driver offered a chain the device already holds: refuse it
                    // rather than return the head twice.
                    inc(&self.metrics.head_reuse);
                    done += 1;
                    continue;
                }
                Some(slot) => *slot = true,
                None => {
                    inc(&self.metrics.invalid_requests);
                    inc(&self.metrics.no_status);
                    done += 1;
                    continue;
                }
            }
            match self.handle_chain(chain.clone(), size) {
                Outcome::Used(len) => {
                    if let Err(e) = self.queue.add_used(&mem, head, len) {
                        self.mark_broken(&format!("cannot return a chain: {e}"));
                        return Batch::Stopped;
                    }
                    done += 1;
                    signal.pending = true;
                    if signal.last.elapsed() >= self.coalesce {
                        self.flush_signal(signal);
                    }
                }
                Outcome::Throttled(wait) => {
                    inc(&self.metrics.throttled);
                    for _ in i..chains.len() {
                        self.queue.go_to_previous_position();
                    }
                    self.throttled = true;
                    if let Err(e) = self.timer.reset(wait, None) {
                        tracing::error!("virtio-blk: rate limiter timer: {e}");
                        self.throttled = false;
                    }
                    return Batch::Stopped;
                }
            }
        }
        Batch::Done(done)
    }

    /// Interrupts the driver if chains were returned since the last interrupt and the
    /// driver asked to hear about them: EVENT_IDX's `used_event`, or without it the
    /// available ring's NO_INTERRUPT flag (a driver that polls sets it).
    fn flush_signal(&mut self, signal: &mut Signal) {
        if !signal.pending || self.broken {
            return;
        }
        signal.pending = false;
        signal.last = Instant::now();
        let wanted = if self.geometry.acked_features & RING_EVENT_IDX != 0 {
            self.queue.needs_notification(&self.mem)
        } else {
            Ok(!self.driver_polls())
        };
        match wanted {
            Ok(false) => inc(&self.metrics.interrupts_suppressed),
            Ok(true) | Err(_) => {
                inc(&self.metrics.interrupts);
                if let Err(e) = self.interrupt.trigger(VirtioInterruptType::Queue(0)) {
                    tracing::error!("virtio-blk: {e}");
                }
            }
        }
    }

    /// Whether the driver set VIRTQ_AVAIL_F_NO_INTERRUPT (an unreadable flag counts as
    /// not set: the interrupt goes out).
    fn driver_polls(&self) -> bool {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.mem
            .load::<u16>(
                GuestAddress(self.queue.avail_ring()),
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok_and(|flags| u16::from_le(flags) & AVAIL_F_NO_INTERRUPT != 0)
    }

    fn handle_chain(
        &mut self,
        chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
        size: u16,
    ) -> Outcome {
        let parsed = request::collect_chain(chain, size)
            .map_err(|error| Rejected {
                error,
                status_addr: None,
            })
            .and_then(|descs| request::parse(&descs, &self.mem, &self.geometry));
        let req = match parsed {
            Ok(req) => req,
            Err(rejected) => {
                if rejected.error.status() == status::UNSUPP {
                    inc(&self.metrics.unsupported_requests);
                } else {
                    inc(&self.metrics.invalid_requests);
                }
                return Outcome::Used(self.finish(
                    rejected.status_addr,
                    rejected.error.status(),
                    0,
                ));
            }
        };
        let cost = match req.kind {
            RequestKind::Read | RequestKind::Write => req.data_len,
            _ => 0,
        };
        if let Err(wait) = self.limiter.try_consume(cost, Instant::now()) {
            return Outcome::Throttled(wait);
        }
        let (status, written) = self.execute(&req);
        Outcome::Used(self.finish(Some(req.status_addr), status, written))
    }

    /// Writes the status byte; returns the used length (bytes written to the guest).
    fn finish(&self, status_addr: Option<GuestAddress>, status: u8, written: u32) -> u32 {
        match status_addr.map(|addr| self.mem.write_obj(status, addr)) {
            Some(Ok(())) => written.saturating_add(1),
            _ => {
                inc(&self.metrics.no_status);
                0
            }
        }
    }

    fn execute(&self, req: &Request) -> (u8, u32) {
        let m = &self.metrics;
        let offset = req.sector << SECTOR_SHIFT;
        let result = match &req.kind {
            RequestKind::Read => self
                .disk
                .transfer(&self.mem, &req.data, offset, false)
                .and_then(|n| {
                    inc(&m.read_ops);
                    m.read_bytes
                        .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                    // A request moves at most MAX_REQUEST_BYTES.
                    u32::try_from(n)
                        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidData))
                }),
            RequestKind::Write => self
                .disk
                .transfer(&self.mem, &req.data, offset, true)
                .map(|n| {
                    inc(&m.write_ops);
                    m.write_bytes
                        .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                    0
                }),
            RequestKind::Flush => self.disk.flush().map(|()| {
                inc(&m.flush_ops);
                0
            }),
            RequestKind::GetId => self.write_id(req).inspect(|_| inc(&m.get_id_ops)),
            RequestKind::Discard(ranges) => ranges
                .iter()
                .try_for_each(|r| self.disk.discard(r.sector, r.count))
                .map(|()| {
                    inc(&m.discard_ops);
                    0
                }),
            RequestKind::WriteZeroes(ranges) => ranges
                .iter()
                .try_for_each(|r| self.disk.write_zeroes(r.sector, r.count, r.unmap))
                .map(|()| {
                    inc(&m.write_zeroes_ops);
                    0
                }),
        };
        match result {
            Ok(written) => (status::OK, written),
            Err(e) => {
                inc(&m.io_errors);
                warn_limited!("virtio-blk: I/O error: {e}");
                (status::IOERR, 0)
            }
        }
    }

    fn write_id(&self, req: &Request) -> std::io::Result<u32> {
        let mut left: &[u8] = self.disk.id();
        for d in &req.data {
            if left.is_empty() {
                break;
            }
            let n = left.len().min(d.len as usize);
            self.mem
                .write_slice(&left[..n], d.addr)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            left = &left[n..];
        }
        Ok(const { crate::narrow::const_u32(super::ID_BYTES as u64) })
    }
}

impl MutEventSubscriber for BlockHandler {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        match events.data() {
            QUEUE_EVENT => {
                let _ = self.queue_evt.read();
                inc(&self.metrics.notifications);
            }
            TIMER_EVENT => {
                let _ = self.timer.wait();
                self.throttled = false;
            }
            _ => return,
        }
        self.process_queue();
    }

    fn init(&mut self, ops: &mut EventOps) {
        for (fd, data) in [
            (
                std::os::fd::AsRawFd::as_raw_fd(&self.queue_evt),
                QUEUE_EVENT,
            ),
            (std::os::fd::AsRawFd::as_raw_fd(&self.timer), TIMER_EVENT),
        ] {
            if let Err(e) = ops.add(Events::with_data_raw(fd, data, EventSet::IN)) {
                tracing::error!("virtio-blk: cannot watch an fd: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_utils::FakeInterrupt;
    use crate::virtio::block::{features, request_type, RateLimitConfig};
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::sync::atomic::Ordering;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;

    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    const QSIZE: u16 = 16;
    const DISK_SECTORS: u64 = 64;

    struct Rig {
        handler: BlockHandler,
        irq: Arc<FakeInterrupt>,
        metrics: Arc<BlockMetrics>,
        file: tempfile::NamedTempFile,
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap()
    }

    fn rig(
        m: &GuestMemoryMmap,
        vq: &MockSplitQueue<GuestMemoryMmap>,
        read_only: bool,
        limit: Option<RateLimitConfig>,
    ) -> Rig {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        let pattern: Vec<u8> = (0..DISK_SECTORS * 512).map(|i| (i % 251) as u8).collect();
        file.write_all(&pattern).unwrap();
        let disk = Arc::new(DiskFile::open(file.path(), read_only, Some("disk-0")).unwrap());
        let irq = Arc::new(FakeInterrupt::default());
        let metrics = Arc::new(BlockMetrics::default());
        let limiter = match limit {
            Some(l) => RateLimiter::new(&l, Instant::now()).unwrap(),
            None => RateLimiter::unlimited(),
        };
        let geometry = DiskGeometry {
            sectors: disk.sectors(),
            read_only,
            acked_features: features::FLUSH | features::DISCARD | features::WRITE_ZEROES,
        };
        let handler = BlockHandler::new(
            m.clone(),
            vq.create_queue().unwrap(),
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            irq.clone(),
            disk,
            geometry,
            limiter,
            metrics.clone(),
        )
        .unwrap();
        Rig {
            handler,
            irq,
            metrics,
            file,
        }
    }

    /// Where [`full_ring_rig`] puts the used ring.
    const OWN_USED_RING: u64 = 0x8000;

    /// A rig whose used ring lies apart from the available ring. virtio-queue 0.18's
    /// MockSplitQueue places its used ring `len` bytes (not `2 * len`) after the start
    /// of the available ring's entries, so the used flags overlap entry `len / 2`: a
    /// test that offers more than half a ring of chains needs its own used ring.
    fn full_ring_rig(m: &GuestMemoryMmap, vq: &MockSplitQueue<GuestMemoryMmap>) -> Rig {
        let mut r = rig(m, vq, false, None);
        r.handler.queue.set_ready(false);
        r.handler
            .queue
            .set_used_ring_address(Some(u32::try_from(OWN_USED_RING).unwrap()), Some(0));
        r.handler.queue.set_ready(true);
        r
    }

    /// The used index of a [`full_ring_rig`].
    fn own_used_idx(m: &GuestMemoryMmap) -> u16 {
        m.read_obj(GuestAddress(OWN_USED_RING + 2)).unwrap()
    }

    fn desc(addr: u64, len: u32, flags: u16) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, 0))
    }

    /// Adds a request chain at descriptor index `first`: header at `hdr`, data buffers,
    /// status byte at `hdr + 0x100`.
    fn add_request(
        m: &GuestMemoryMmap,
        vq: &MockSplitQueue<GuestMemoryMmap>,
        first: u16,
        hdr: u64,
        kind: u32,
        sector: u64,
        data: &[(u64, u32, u16)],
    ) {
        m.write_obj(kind.to_le(), GuestAddress(hdr)).unwrap();
        m.write_obj(0u32, GuestAddress(hdr + 4)).unwrap();
        m.write_obj(sector.to_le(), GuestAddress(hdr + 8)).unwrap();
        m.write_obj(0xffu8, GuestAddress(hdr + 0x100)).unwrap();
        let mut descs = vec![desc(hdr, 16, F_NEXT)];
        for &(addr, len, flags) in data {
            descs.push(desc(addr, len, flags | F_NEXT));
        }
        descs.push(desc(hdr + 0x100, 1, F_WRITE));
        let n = descs.len();
        for (i, d) in descs.iter_mut().enumerate() {
            let sd = SplitDescriptor::from(*d);
            *d = RawDescriptor::from(SplitDescriptor::new(
                sd.addr().0,
                sd.len(),
                sd.flags(),
                first + u16::try_from(i).unwrap() + 1,
            ));
            if i == n - 1 {
                *d =
                    RawDescriptor::from(SplitDescriptor::new(sd.addr().0, sd.len(), sd.flags(), 0));
            }
        }
        vq.add_desc_chains(&descs, first).unwrap();
    }

    fn status_at(m: &GuestMemoryMmap, hdr: u64) -> u8 {
        m.read_obj(GuestAddress(hdr + 0x100)).unwrap()
    }

    fn used(vq: &MockSplitQueue<GuestMemoryMmap>, i: u16) -> (u32, u32) {
        let e = vq.used().ring().ref_at(usize::from(i)).unwrap().load();
        (e.id(), e.len())
    }

    #[test]
    fn write_then_read_round_trips_through_the_file() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let mut r = rig(&m, &vq, false, None);
        let payload: Vec<u8> = (0..8192u32)
            .map(|i| crate::narrow::low_u8(u64::from(i * 7)))
            .collect();
        m.write_slice(&payload, GuestAddress(0x20_0000)).unwrap();
        add_request(
            &m,
            &vq,
            0,
            0x10_0000,
            request_type::OUT,
            4,
            &[(0x20_0000, 4096, 0), (0x20_1000, 4096, 0)],
        );
        assert!(r.handler.process_queue());
        assert_eq!(status_at(&m, 0x10_0000), status::OK);
        // The host file has the bytes.
        let mut on_disk = vec![0u8; 8192];
        r.file.seek(SeekFrom::Start(4 * 512)).unwrap();
        r.file.read_exact(&mut on_disk).unwrap();
        assert_eq!(on_disk, payload);
        // Read back into other guest buffers.
        add_request(
            &m,
            &vq,
            8,
            0x11_0000,
            request_type::IN,
            4,
            &[(0x30_0000, 8192, F_WRITE)],
        );
        assert!(r.handler.process_queue());
        assert_eq!(status_at(&m, 0x11_0000), status::OK);
        let mut back = vec![0u8; 8192];
        m.read_slice(&mut back, GuestAddress(0x30_0000)).unwrap();
        assert_eq!(back, payload);
        assert_eq!(used(&vq, 1), (8, 8193));
        assert_eq!(r.metrics.write_bytes.load(Ordering::Relaxed), 8192);
        assert_eq!(r.metrics.read_ops.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn flush_get_id_and_discard_complete() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let mut r = rig(&m, &vq, false, None);
        add_request(&m, &vq, 0, 0x10_0000, request_type::FLUSH, 0, &[]);
        add_request(
            &m,
            &vq,
            2,
            0x11_0000,
            request_type::GET_ID,
            0,
            &[(0x20_0000, 20, F_WRITE)],
        );
        m.write_obj(2u64, GuestAddress(0x21_0000)).unwrap();
        m.write_obj(8u32, GuestAddress(0x21_0008)).unwrap();
        m.write_obj(0u32, GuestAddress(0x21_000c)).unwrap();
        add_request(
            &m,
            &vq,
            5,
            0x12_0000,
            request_type::DISCARD,
            0,
            &[(0x21_0000, 16, 0)],
        );
        add_request(
            &m,
            &vq,
            8,
            0x13_0000,
            request_type::WRITE_ZEROES,
            0,
            &[(0x21_0000, 16, 0)],
        );
        assert!(r.handler.process_queue());
        for hdr in [0x10_0000, 0x11_0000, 0x12_0000, 0x13_0000] {
            assert_eq!(status_at(&m, hdr), status::OK, "request at {hdr:#x}");
        }
        let mut id = [0u8; 20];
        m.read_slice(&mut id, GuestAddress(0x20_0000)).unwrap();
        assert_eq!(&id[..6], b"disk-0");
        // Write-zeroes reached the file: sectors 2..10 read as zeroes.
        let mut zeroed = vec![0xffu8; 8 * 512];
        r.file.seek(SeekFrom::Start(2 * 512)).unwrap();
        r.file.read_exact(&mut zeroed).unwrap();
        assert!(zeroed.iter().all(|&b| b == 0));
        assert_eq!(r.metrics.flush_ops.load(Ordering::Relaxed), 1);
        // The worker interrupted the driver itself (at least once, at the end).
        assert!(!r.irq.raised().is_empty());
    }

    #[test]
    fn write_to_read_only_disk_gets_ioerr_and_file_is_untouched() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let mut r = rig(&m, &vq, true, None);
        m.write_slice(&[0xaa; 512], GuestAddress(0x20_0000))
            .unwrap();
        add_request(
            &m,
            &vq,
            0,
            0x10_0000,
            request_type::OUT,
            0,
            &[(0x20_0000, 512, 0)],
        );
        r.handler.process_queue();
        assert_eq!(status_at(&m, 0x10_0000), status::IOERR);
        assert_eq!(used(&vq, 0), (0, 1));
        let mut first = [0u8; 4];
        r.file.seek(SeekFrom::Start(0)).unwrap();
        r.file.read_exact(&mut first).unwrap();
        assert_eq!(first, [0, 1, 2, 3]);
        assert_eq!(r.metrics.invalid_requests.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn hostile_chains_get_error_status_or_empty_used_entry() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let mut r = rig(&m, &vq, false, None);
        // Past the end of the disk.
        add_request(
            &m,
            &vq,
            0,
            0x10_0000,
            request_type::IN,
            DISK_SECTORS,
            &[(0x20_0000, 512, F_WRITE)],
        );
        // Wrong direction: a read into a device-readable buffer.
        add_request(
            &m,
            &vq,
            3,
            0x11_0000,
            request_type::IN,
            0,
            &[(0x20_0000, 512, 0)],
        );
        // A buffer outside guest memory.
        add_request(
            &m,
            &vq,
            6,
            0x12_0000,
            request_type::OUT,
            0,
            &[(0x1_0000_0000, 512, 0)],
        );
        // Unknown request type.
        add_request(&m, &vq, 9, 0x13_0000, 99, 0, &[]);
        r.handler.process_queue();
        assert_eq!(status_at(&m, 0x10_0000), status::IOERR);
        assert_eq!(status_at(&m, 0x11_0000), status::IOERR);
        // No status written: the chain is returned with length 0.
        assert_eq!(status_at(&m, 0x12_0000), 0xff);
        assert_eq!(used(&vq, 2), (6, 0));
        assert_eq!(status_at(&m, 0x13_0000), status::UNSUPP);
        assert_eq!(r.metrics.invalid_requests.load(Ordering::Relaxed), 3);
        assert_eq!(r.metrics.no_status.load(Ordering::Relaxed), 1);
        assert_eq!(r.metrics.unsupported_requests.load(Ordering::Relaxed), 1);
        assert!(!r.irq.needs_reset());
    }

    #[test]
    fn descriptor_loop_and_reused_head_are_refused() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let mut r = rig(&m, &vq, false, None);
        // Chain 0 -> 1 -> 0: a loop.
        let descs = [
            RawDescriptor::from(SplitDescriptor::new(0x10_0000, 16, F_NEXT, 1)),
            RawDescriptor::from(SplitDescriptor::new(0x20_0000, 512, F_NEXT | F_WRITE, 0)),
        ];
        vq.desc_table().store(0, descs[0]).unwrap();
        vq.desc_table().store(1, descs[1]).unwrap();
        // The avail ring offers head 0 twice.
        vq.avail().ring().ref_at(0).unwrap().store(0);
        vq.avail().ring().ref_at(1).unwrap().store(0);
        vq.avail().idx().store(2);
        r.handler.process_queue();
        assert_eq!(r.metrics.head_reuse.load(Ordering::Relaxed), 1);
        assert_eq!(r.metrics.invalid_requests.load(Ordering::Relaxed), 1);
        assert_eq!(vq.used().idx().load(), 1);
        assert_eq!(used(&vq, 0), (0, 0));
    }

    #[test]
    fn avail_index_beyond_queue_size_needs_reset() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let mut r = rig(&m, &vq, false, None);
        vq.avail().idx().store(QSIZE + 5);
        assert!(!r.handler.process_queue());
        assert!(r.irq.needs_reset());
        assert_eq!(r.metrics.queue_errors.load(Ordering::Relaxed), 1);
        // A broken device does no more work.
        assert!(!r.handler.process_queue());
    }

    #[test]
    fn work_per_notification_is_bounded_by_queue_size() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let mut r = full_ring_rig(&m, &vq);
        // A full ring of one-descriptor chains (malformed: no status byte).
        for i in 0..QSIZE {
            vq.desc_table().store(i, desc(0x10_0000, 16, 0)).unwrap();
            vq.avail().ring().ref_at(usize::from(i)).unwrap().store(i);
        }
        vq.avail().idx().store(QSIZE);
        r.handler.process_queue();
        assert_eq!(own_used_idx(&m), QSIZE);
        assert_eq!(
            r.metrics.no_status.load(Ordering::Relaxed),
            u64::from(QSIZE)
        );
        // The handler stopped at the queue size and re-armed its own notification.
        assert_eq!(r.metrics.batches_cut.load(Ordering::Relaxed), 1);
        assert_eq!(r.handler.queue_evt.read().unwrap(), 1);
    }

    #[test]
    fn rate_limiter_defers_and_puts_the_chain_back() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let limit = RateLimitConfig {
            bytes_per_sec: None,
            bytes_burst: None,
            ops_per_sec: Some(1),
            ops_burst: Some(1),
        };
        let mut r = rig(&m, &vq, false, Some(limit));
        add_request(
            &m,
            &vq,
            0,
            0x10_0000,
            request_type::IN,
            0,
            &[(0x20_0000, 512, F_WRITE)],
        );
        add_request(
            &m,
            &vq,
            3,
            0x11_0000,
            request_type::IN,
            0,
            &[(0x20_0000, 512, F_WRITE)],
        );
        assert!(r.handler.process_queue());
        assert_eq!(vq.used().idx().load(), 1);
        assert_eq!(r.metrics.throttled.load(Ordering::Relaxed), 1);
        // While throttled, notifications do nothing.
        assert!(!r.handler.process_queue());
        // The deferred chain went back to the ring, armed on the timer (the event-loop
        // test below checks it completes when the timer fires).
        assert!(r.handler.timer.is_armed().unwrap());
        assert_eq!(r.handler.queue.next_avail(), 1);
    }

    #[test]
    fn throttled_requests_complete_when_the_timer_fires_on_the_event_loop() {
        use event_manager::{EventManager, SubscriberOps};
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let limit = RateLimitConfig {
            bytes_per_sec: None,
            bytes_burst: None,
            ops_per_sec: Some(20),
            ops_burst: Some(1),
        };
        let r = rig(&m, &vq, false, Some(limit));
        let kick = r.handler.queue_evt.try_clone().unwrap();
        let metrics = r.metrics.clone();
        let handler = Arc::new(std::sync::Mutex::new(r.handler));
        let mut manager = EventManager::<Arc<std::sync::Mutex<BlockHandler>>>::new().unwrap();
        manager.add_subscriber(handler);
        add_flushes(&m, &vq, 0..3);
        kick.write(1).unwrap();
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while vq.used().idx().load() < 3 {
            assert!(
                Instant::now() < deadline,
                "throttled requests never completed"
            );
            manager.run_with_timeout(50).unwrap();
        }
        assert!(metrics.throttled.load(Ordering::Relaxed) >= 2);
        assert_eq!(metrics.flush_ops.load(Ordering::Relaxed), 3);
    }

    /// Queues flush request number `i` of `range` at descriptor `3 * i`.
    fn add_flushes(
        m: &GuestMemoryMmap,
        vq: &MockSplitQueue<GuestMemoryMmap>,
        range: std::ops::Range<u16>,
    ) {
        for i in range {
            add_request(
                m,
                vq,
                i * 3,
                0x10_0000 + u64::from(i) * 0x1000,
                request_type::FLUSH,
                0,
                &[],
            );
        }
    }

    /// Queues `n` flush requests and returns the rig.
    fn flushes(m: &GuestMemoryMmap, vq: &MockSplitQueue<GuestMemoryMmap>, n: u16) -> Rig {
        let r = rig(m, vq, false, None);
        add_flushes(m, vq, 0..n);
        r
    }

    #[test]
    fn fast_requests_get_one_interrupt_per_round() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let mut r = flushes(&m, &vq, 3);
        r.handler.coalesce = Duration::from_secs(3600);
        assert!(r.handler.process_queue());
        assert_eq!(vq.used().idx().load(), 3);
        assert_eq!(r.irq.raised().len(), 1);
        assert_eq!(r.metrics.interrupts.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn slow_requests_are_signalled_while_the_worker_goes_on() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let mut r = flushes(&m, &vq, 3);
        // Every request outlasts the coalescing window.
        r.handler.coalesce = Duration::ZERO;
        assert!(r.handler.process_queue());
        assert_eq!(r.irq.raised().len(), 3);
    }

    #[test]
    fn device_asks_for_no_kicks_while_it_works_and_for_kicks_after() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        drop(flushes(&m, &vq, 2));
        let mut r = full_ring_rig(&m, &vq);
        let used_flags = GuestAddress(OWN_USED_RING);
        // After a round the device asks for kicks again.
        assert!(r.handler.process_queue());
        assert_eq!(own_used_idx(&m), 2);
        assert_eq!(m.read_obj::<u16>(used_flags).unwrap() & 1, 0);
        // A round cut at the queue size leaves it set: the worker comes back by itself.
        for i in 0..QSIZE {
            vq.desc_table().store(i, desc(0x10_0000, 16, 0)).unwrap();
            vq.avail()
                .ring()
                .ref_at(usize::from((2 + i) % QSIZE))
                .unwrap()
                .store(i);
        }
        vq.avail().idx().store(2 + QSIZE);
        r.handler.process_queue();
        assert_eq!(m.read_obj::<u16>(used_flags).unwrap() & 1, 1);
        assert_eq!(r.handler.queue_evt.read().unwrap(), 1);
    }

    #[test]
    fn no_interrupt_flag_is_honoured_without_event_idx() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        let mut r = flushes(&m, &vq, 2);
        r.handler.coalesce = Duration::from_secs(3600);
        m.write_obj(1u16, vq.avail_addr()).unwrap();
        assert!(r.handler.process_queue());
        assert_eq!(vq.used().idx().load(), 2);
        assert!(r.irq.raised().is_empty());
        assert_eq!(r.metrics.interrupts_suppressed.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn event_idx_interrupts_only_past_used_event_and_publishes_avail_event() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, QSIZE);
        drop(flushes(&m, &vq, 2));
        let mut r = full_ring_rig(&m, &vq);
        r.handler.queue.set_event_idx(true);
        r.handler.geometry.acked_features |= RING_EVENT_IDX;
        r.handler.coalesce = Duration::from_secs(3600);
        let used_event = GuestAddress(vq.avail_addr().0 + 4 + 2 * u64::from(QSIZE));
        let avail_event = GuestAddress(OWN_USED_RING + 4 + 8 * u64::from(QSIZE));
        // The driver wants to hear only after its 5th chain: no interrupt for two.
        m.write_obj(4u16, used_event).unwrap();
        assert!(r.handler.process_queue());
        assert!(r.irq.raised().is_empty());
        assert_eq!(r.metrics.interrupts_suppressed.load(Ordering::Relaxed), 1);
        // The device asks for a kick at the next chain it has not seen.
        assert_eq!(m.read_obj::<u16>(avail_event).unwrap(), 2);
        // Three more: the 5th passes used_event, one interrupt.
        add_flushes(&m, &vq, 2..5);
        assert!(r.handler.process_queue());
        assert_eq!(own_used_idx(&m), 5);
        assert_eq!(r.irq.raised().len(), 1);
        assert_eq!(m.read_obj::<u16>(avail_event).unwrap(), 5);
    }
}
