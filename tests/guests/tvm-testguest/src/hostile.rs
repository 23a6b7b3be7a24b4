//! The hostile guest (`tvm.test=hostile-blk`, `tvm.test=hostile-config`): the guest is the
//! adversary. It sends malformed requests and garbage, checks that the device answers
//! with error statuses or DEVICE_NEEDS_RESET, that it recovers after a reset, and then
//! holds (no power-off) so the host test can read the VMM's counters through the control
//! socket while the VM is still up.

use crate::bootinfo::BootInfo;
use crate::pci::ConfigAccess;
use crate::report::Detail;
use crate::timer;
use crate::virtio::{self, dma_alloc, r, status, w, VirtioPci, DESC_NEXT, DESC_WRITE};
use crate::vtests::{blk, check_dma, BlockDev};

/// How long a refused request may take to come back (it may never: a refused chain can
/// be dropped with nothing returned).
const REFUSED_MS: u64 = 2_000;
const UNSUPP: u8 = 2;

/// A small xorshift generator, seeded from the TSC.
struct Rng(u64);

impl Rng {
    fn new() -> Self {
        Rng(crate::io::rdtsc() | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Publishes a hand-written chain at head 0 and waits briefly; returns the status byte if
/// a used entry came back.
fn raw(b: &mut BlockDev, status_addr: u64) -> Option<u8> {
    w(status_addr, 0xffu8);
    b.q.publish(0);
    b.q.kick();
    b.q.wait(REFUSED_MS).map(|_| r(status_addr))
}

/// `hostile-blk`: descriptor loops, buffers outside guest memory, wrong direction flags,
/// length overflow, sectors past the end, an unknown type, a reused head, a chain longer
/// than the queue; then an avail index far ahead (DEVICE_NEEDS_RESET), and recovery.
pub fn block(bi: &BootInfo) -> Result<Detail, Detail> {
    check_dma(bi)?;
    virtio::enable_interrupts();
    let mut b = BlockDev::open()?;
    let hdr = dma_alloc(16, 16)?;
    let data = dma_alloc(4096, 4096)?;
    let st = dma_alloc(16, 16)?;
    let outside = 0x7f00_0000_0000u64;
    let header = |kind: u32, sector: u64| {
        w(hdr, kind);
        w(hdr + 4, 0u32);
        w(hdr + 8, sector);
    };
    let mut refused = 0u32;
    let mut answers = [0xffu8; 8];

    // 1. A descriptor loop: header -> data -> header ...
    header(blk::IN, 0);
    b.q.write_desc(0, hdr, 16, DESC_NEXT, 1);
    b.q.write_desc(1, data, 512, DESC_NEXT | DESC_WRITE, 0);
    answers[0] = raw(&mut b, st).unwrap_or(0xfe);
    // 2. A header outside guest memory.
    b.q.write_desc(0, outside, 16, DESC_NEXT, 1);
    b.q.write_desc(1, st, 1, DESC_WRITE, 0);
    answers[1] = raw(&mut b, st).unwrap_or(0xfe);
    // 3. Wrong direction: a device-writable header, a read-only status.
    header(blk::IN, 0);
    b.q.write_desc(0, hdr, 16, DESC_NEXT | DESC_WRITE, 1);
    b.q.write_desc(1, data, 512, DESC_NEXT, 2);
    b.q.write_desc(2, st, 1, 0, 0);
    answers[2] = raw(&mut b, st).unwrap_or(0xfe);
    // 4. Length overflow: a data buffer of nearly 4 GiB.
    header(blk::IN, 0);
    b.q.write_desc(0, hdr, 16, DESC_NEXT, 1);
    b.q.write_desc(1, data, 0xffff_fe00, DESC_NEXT | DESC_WRITE, 2);
    b.q.write_desc(2, st, 1, DESC_WRITE, 0);
    answers[3] = raw(&mut b, st).unwrap_or(0xfe);
    // 5. Sectors past the end, with a sector number that overflows when added to.
    header(blk::IN, u64::MAX - 1);
    b.q.write_desc(1, data, 4096, DESC_NEXT | DESC_WRITE, 2);
    answers[4] = raw(&mut b, st).unwrap_or(0xfe);
    if answers[4] != blk::IOERR {
        return Err(Detail::fmt(format_args!(
            "Sector past the end answered {}",
            answers[4]
        )));
    }
    // 6. An unknown request type.
    header(0xdead, 0);
    b.q.write_desc(1, data, 512, DESC_NEXT | DESC_WRITE, 2);
    answers[5] = raw(&mut b, st).unwrap_or(0xfe);
    if answers[5] != UNSUPP {
        return Err(Detail::fmt(format_args!(
            "Unknown request type answered {}",
            answers[5]
        )));
    }
    // 7. The same head offered twice in one batch.
    header(blk::IN, 0);
    b.q.write_desc(1, data, 512, DESC_NEXT | DESC_WRITE, 2);
    w(st, 0xffu8);
    b.q.publish(0);
    b.q.publish(0);
    b.q.kick();
    let first = b.q.wait(REFUSED_MS);
    let second = b.q.wait(REFUSED_MS);
    answers[6] = u8::from(first.is_some()) + u8::from(second.is_some());
    // 8. A chain longer than the queue: all 16 descriptors chained, the last back to 0.
    header(blk::IN, 0);
    b.q.write_desc(0, hdr, 16, DESC_NEXT, 1);
    for i in 1..16u16 {
        b.q.write_desc(i, data, 512, DESC_NEXT | DESC_WRITE, (i + 1) % 16);
    }
    answers[7] = raw(&mut b, st).unwrap_or(0xfe);
    for a in [answers[0], answers[1], answers[2], answers[3], answers[7]] {
        if a != blk::OK {
            refused += 1;
        }
    }
    if refused != 5 {
        return Err(Detail::fmt(format_args!(
            "A malformed chain completed with OK (answers {answers:?})"
        )));
    }
    // The device still serves a good request.
    let ok = b.request(blk::IN, 0, Some((data, 512)))?.0;
    if ok != blk::OK {
        return Err(Detail::fmt(format_args!(
            "Good request after the bad ones answered {ok}"
        )));
    }
    // 9. The available index far ahead: the device must give up on the queue.
    let config_irqs = virtio::irqs(1);
    let idx: u16 = r(b.q.avail + 2);
    b.q.set_avail_idx(idx.wrapping_add(1000));
    b.q.kick();
    let deadline = timer::deadline_ms(5_000);
    while b.dev.status() & status::NEEDS_RESET == 0 {
        if timer::expired(deadline) {
            return Err(Detail::fmt(format_args!(
                "No DEVICE_NEEDS_RESET after an avail index 1000 ahead (status {:#x})",
                b.dev.status()
            )));
        }
        core::hint::spin_loop();
    }
    let config_irq = crate::vtests::wait_irq(1, config_irqs);
    // Recovery: reset and start again.
    let mut b = BlockDev::open()?;
    let ok = b.request(blk::IN, 0, Some((data, 512)))?.0;
    if ok != blk::OK {
        return Err(Detail::fmt(format_args!(
            "Request after reset answered {ok}"
        )));
    }
    Ok(Detail::fmt(format_args!(
        "refused={refused} past_end=ioerr unknown=unsupp reused_completions={} needs_reset=1 config_irq={} recovered=1",
        answers[6],
        u8::from(config_irq)
    )))
}

/// Random widths and offsets of writes inside `[base, base + len)`.
fn garbage_mmio(rng: &mut Rng, base: u64, len: u64, count: u32) -> u32 {
    for _ in 0..count {
        let v = rng.next();
        let off = rng.next() % len;
        match rng.next() % 4 {
            0 => w(base + off, v as u8),
            1 => w(base + (off & !1).min(len - 2), v as u16),
            2 => w(base + (off & !3).min(len - 4), v as u32),
            _ => w(base + (off & !7).min(len - 8), v),
        }
        // Reads of everything too (ISR reads clear it).
        let _: u8 = r(base + off);
    }
    count
}

/// `hostile-config`: garbage to the rng function's common configuration, notify, ISR,
/// device configuration, PBA and MSI-X table (entries kept masked), then to the
/// configuration space of every slot (ECAM and ports, odd widths and offsets); then
/// resets the function, places its BAR again and checks it still serves a request.
pub fn config(bi: &BootInfo) -> Result<Detail, Detail> {
    check_dma(bi)?;
    let dev = VirtioPci::open(virtio::DEV_RNG)?;
    let mut rng = Rng::new();
    let mut writes = 0;
    // Keep every MSI-X entry masked so that garbage messages cannot reach this CPU.
    for v in 0..dev.vectors {
        dev.program_vector(v, true);
    }
    writes += garbage_mmio(&mut rng, dev.bar, 0x1000, 3000); // common configuration
    writes += garbage_mmio(&mut rng, dev.bar + 0x1000, 0x1000, 200); // ISR
    writes += garbage_mmio(&mut rng, dev.bar + 0x2000, 0x1000, 500); // device configuration
    writes += garbage_mmio(&mut rng, dev.bar + 0x3000, 0x1000, 500); // notifications
    writes += garbage_mmio(&mut rng, dev.msix_pba, 0x1000, 200);
    for _ in 0..500 {
        let v = rng.next() % u64::from(dev.vectors);
        let entry = dev.msix_table + 16 * v;
        w(entry + 4 * (rng.next() % 3), rng.next() as u32);
        w(entry + 12, 1u32 | (rng.next() as u32 & !1));
        writes += 2;
    }
    // Configuration space of every slot, through both mechanisms. BAR and command writes
    // may move or disable BARs: the VMM must refuse what is outside its windows.
    let ecam = dev.cfg;
    for slot in 0..32u8 {
        for _ in 0..64 {
            let off = (rng.next() % 0x100) as u16;
            let v = rng.next() as u32;
            let access = if rng.next() & 1 == 0 {
                ecam
            } else {
                ConfigAccess::Ports
            };
            // Keep MSI-X disabled and the vector table out of reach of random messages.
            if off & !3 == dev.msix_cap_offset() {
                continue;
            }
            match rng.next() % 3 {
                0 => access.write32(slot, off & !3, v),
                1 => access.write16(slot, off & !1, v as u16),
                _ => access.write8(slot, off, v as u8),
            }
            writes += 1;
        }
        // Misaligned ECAM accesses.
        if let ConfigAccess::Ecam(base) = ecam {
            let at = base + (u64::from(slot) << 15) + 0x41;
            w(at, rng.next() as u32);
            let _: u32 = r(at);
            writes += 1;
        }
    }
    // Recovery: find the device again, re-place its BAR, run one request.
    virtio::enable_interrupts();
    let dev = VirtioPci::open(virtio::DEV_RNG)?;
    dev.negotiate(0)?;
    let mut q = dev.queue(0, 16)?;
    dev.driver_ok()?;
    let buf = dma_alloc(64, 64)?;
    q.add(&[(buf, 32, true)]);
    q.kick();
    let (_, len) = q
        .wait(crate::vtests::REQUEST_MS)
        .ok_or_else(|| Detail::fmt(format_args!("No rng completion after the garbage")))?;
    Ok(Detail::fmt(format_args!(
        "writes={writes} recovered=1 bytes={len}"
    )))
}
