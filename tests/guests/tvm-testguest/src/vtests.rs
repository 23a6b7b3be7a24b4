//! The virtio tests: `virtio-blk`, `virtio-rng`, `msix` (and the block benchmark
//! `blk-bench`). vsock lives in vsock.rs, the hostile modes in hostile.rs.

use crate::bootinfo::{cmdline_param, BootInfo};
use crate::report::Detail;
use crate::timer;
use crate::virtio::{self, dma_alloc, irqs, r, w, VirtioPci, Virtq};

/// Block request types and statuses (virtio 1.2 5.2.6).
pub mod blk {
    /// Read.
    pub const IN: u32 = 0;
    /// Write.
    pub const OUT: u32 = 1;
    /// Flush.
    pub const FLUSH: u32 = 4;
    /// Device id.
    pub const GET_ID: u32 = 8;
    /// Success.
    pub const OK: u8 = 0;
    /// I/O error.
    pub const IOERR: u8 = 1;
    /// VIRTIO_BLK_F_RO.
    pub const F_RO: u64 = 1 << 5;
    /// VIRTIO_BLK_F_FLUSH.
    pub const F_FLUSH: u64 = 1 << 9;
}

/// How long a request may take (generous: the host is a noisy nested hypervisor).
pub const REQUEST_MS: u64 = 10_000;

/// The byte the `virtio-blk` test writes at disk offset `off` (the host test recomputes it).
pub fn pattern(off: u64) -> u8 {
    (off.wrapping_mul(31) ^ (off >> 9) ^ 0xa5) as u8
}

/// Checks the guest RAM the driver uses for DMA is usable RAM.
pub fn check_dma(bi: &BootInfo) -> Result<(), Detail> {
    if !bi.is_ram(virtio::DMA_BASE, virtio::DMA_BASE + virtio::DMA_SIZE) {
        return Err(Detail::fmt(format_args!(
            "The DMA area {:#x}+{:#x} is not RAM; give the guest at least 64 MiB",
            virtio::DMA_BASE,
            virtio::DMA_SIZE
        )));
    }
    Ok(())
}

/// A block device ready for requests.
pub struct BlockDev {
    /// The transport.
    pub dev: VirtioPci,
    /// Request queue.
    pub q: Virtq,
    /// Capacity in sectors.
    pub capacity: u64,
    /// Negotiated features.
    pub features: u64,
    hdr: u64,
    status: u64,
}

impl BlockDev {
    /// Opens and starts the first virtio-blk device (16-entry queue).
    pub fn open() -> Result<Self, Detail> {
        Self::open_sized(16)
    }

    /// Opens and starts the first virtio-blk device with a `size`-entry queue.
    pub fn open_sized(size: u16) -> Result<Self, Detail> {
        Self::open_with(size, 0)
    }

    /// Opens and starts the first virtio-blk device with a `size`-entry queue, also
    /// asking for `extra` features (the ring's EVENT_IDX, say).
    pub fn open_with(size: u16, extra: u64) -> Result<Self, Detail> {
        let dev = VirtioPci::open(virtio::DEV_BLOCK)?;
        let features = dev.negotiate(blk::F_RO | blk::F_FLUSH | extra)?;
        let mut q = dev.queue(0, size)?;
        q.event_idx = features & virtio::F_EVENT_IDX != 0;
        dev.driver_ok()?;
        let capacity: u64 = r(dev.device_cfg);
        Ok(Self {
            dev,
            q,
            capacity,
            features,
            hdr: dma_alloc(16, 16)?,
            status: dma_alloc(16, 16)?,
        })
    }

    /// Submits one request and waits for it; returns the status byte and used length.
    pub fn request(
        &mut self,
        kind: u32,
        sector: u64,
        data: Option<(u64, u32)>,
    ) -> Result<(u8, u32), Detail> {
        w(self.hdr, kind);
        w(self.hdr + 4, 0u32);
        w(self.hdr + 8, sector);
        w(self.status, 0xffu8);
        let writable = matches!(kind, blk::IN | blk::GET_ID);
        match data {
            Some((addr, len)) => self.q.add(&[
                (self.hdr, 16, false),
                (addr, len, writable),
                (self.status, 1, true),
            ]),
            None => self.q.add(&[(self.hdr, 16, false), (self.status, 1, true)]),
        };
        self.q.kick();
        let (_, len) = self.q.wait(REQUEST_MS).ok_or_else(|| {
            Detail::fmt(format_args!(
                "Request type {kind} sector {sector}: no completion"
            ))
        })?;
        Ok((r(self.status), len))
    }
}

fn expect(what: &str, got: u8, want: u8) -> Result<(), Detail> {
    if got != want {
        return Err(Detail::fmt(format_args!(
            "{what}: status {got}, expected {want}"
        )));
    }
    Ok(())
}

/// Waits (bounded) until vector `v` has counted more than `before` interrupts.
pub fn wait_irq(v: u16, before: u32) -> bool {
    let deadline = timer::deadline_ms(REQUEST_MS);
    while irqs(v) <= before {
        if timer::expired(deadline) {
            return false;
        }
        core::hint::spin_loop();
    }
    true
}

/// `virtio-blk`: writes the pattern to sectors 0-7 and the last sector, flushes, reads
/// them back; a read past the end fails; a read-only disk refuses the write.
pub fn block(bi: &BootInfo) -> Result<Detail, Detail> {
    check_dma(bi)?;
    virtio::enable_interrupts();
    let mut b = BlockDev::open()?;
    if b.capacity < 16 {
        return Err(Detail::fmt(format_args!(
            "Disk has {} sectors; need 16",
            b.capacity
        )));
    }
    let buf = dma_alloc(4096, 4096)?;
    let back = dma_alloc(4096, 4096)?;
    let id = dma_alloc(20, 16)?;
    let irq_before = irqs(0);
    let readonly = b.features & blk::F_RO != 0;
    for (i, byte) in virtio::bytes_mut(buf, 4096).iter_mut().enumerate() {
        *byte = pattern(i as u64);
    }
    let (st, _) = b.request(blk::OUT, 0, Some((buf, 4096)))?;
    if readonly {
        expect("write to a read-only disk", st, blk::IOERR)?;
    } else {
        expect("write sectors 0-7", st, blk::OK)?;
        let last = b.capacity - 1;
        for (i, byte) in virtio::bytes_mut(buf, 512).iter_mut().enumerate() {
            *byte = pattern(last * 512 + i as u64);
        }
        expect(
            "write the last sector",
            b.request(blk::OUT, last, Some((buf, 512)))?.0,
            blk::OK,
        )?;
        if b.features & blk::F_FLUSH != 0 {
            expect("flush", b.request(blk::FLUSH, 0, None)?.0, blk::OK)?;
        }
    }
    virtio::fill(back, 4096, 0);
    expect(
        "read sectors 0-7",
        b.request(blk::IN, 0, Some((back, 4096)))?.0,
        blk::OK,
    )?;
    if !readonly {
        if let Some(i) = (0..4096u64).find(|&i| virtio::bytes(back, 4096)[i as usize] != pattern(i))
        {
            return Err(Detail::fmt(format_args!("Read-back differs at byte {i}")));
        }
    }
    let past = b.request(blk::IN, b.capacity, Some((back, 512)))?.0;
    expect("read past the end", past, blk::IOERR)?;
    virtio::fill(id, 20, 0);
    expect(
        "get id",
        b.request(blk::GET_ID, 0, Some((id, 20)))?.0,
        blk::OK,
    )?;
    let id_bytes = virtio::bytes(id, 20);
    let id_len = id_bytes.iter().position(|&c| c == 0).unwrap_or(20);
    let id_text = core::str::from_utf8(&id_bytes[..id_len]).unwrap_or("?");
    if !wait_irq(0, irq_before) {
        return Err(Detail::fmt(format_args!(
            "No MSI-X interrupt on the request queue"
        )));
    }
    Ok(Detail::fmt(format_args!(
        "sectors={} readonly={} id={} irqs={} slot={}",
        b.capacity,
        u8::from(readonly),
        id_text,
        irqs(0) - irq_before,
        b.dev.f.slot
    )))
}

/// An rng device with one queue.
fn rng_open(masked: bool) -> Result<(VirtioPci, Virtq), Detail> {
    let dev = VirtioPci::open(virtio::DEV_RNG)?;
    dev.negotiate(0)?;
    let q = dev.queue(0, 16)?;
    if masked {
        dev.program_vector(0, true);
    }
    dev.driver_ok()?;
    Ok((dev, q))
}

/// `virtio-rng`: 64 bytes arrive, not all equal, with an interrupt.
pub fn rng(bi: &BootInfo) -> Result<Detail, Detail> {
    check_dma(bi)?;
    virtio::enable_interrupts();
    let (_dev, mut q) = rng_open(false)?;
    let buf = dma_alloc(64, 64)?;
    virtio::fill(buf, 64, 0);
    let before = irqs(0);
    q.add(&[(buf, 64, true)]);
    q.kick();
    let (_, len) = q
        .wait(REQUEST_MS)
        .ok_or_else(|| Detail::fmt(format_args!("No rng completion")))?;
    let data = virtio::bytes(buf, u64::from(len.min(64)));
    if len != 64 || data.iter().all(|&b| b == data[0]) {
        return Err(Detail::fmt(format_args!("{len} bytes, all equal or short")));
    }
    if !wait_irq(0, before) {
        return Err(Detail::fmt(format_args!(
            "No MSI-X interrupt on the rng queue"
        )));
    }
    Ok(Detail::fmt(format_args!(
        "bytes={len} first={:02x}{:02x}{:02x}{:02x}",
        data[0], data[1], data[2], data[3]
    )))
}

/// `msix`: with its vector masked, a completion sets the pending bit and raises nothing;
/// unmasking delivers it; a second request with the vector unmasked interrupts at once.
pub fn msix(bi: &BootInfo) -> Result<Detail, Detail> {
    check_dma(bi)?;
    virtio::enable_interrupts();
    let (dev, mut q) = rng_open(true)?;
    let buf = dma_alloc(64, 64)?;
    let before = irqs(0);
    q.add(&[(buf, 16, true)]);
    q.kick();
    q.wait(REQUEST_MS)
        .ok_or_else(|| Detail::fmt(format_args!("No completion while masked")))?;
    timer::delay_us(50_000);
    if irqs(0) != before {
        return Err(Detail::fmt(format_args!(
            "Interrupt delivered while the vector was masked"
        )));
    }
    if !dev.pending(0) {
        return Err(Detail::fmt(format_args!(
            "PBA bit not set for the masked vector"
        )));
    }
    dev.program_vector(0, false);
    if !wait_irq(0, before) {
        return Err(Detail::fmt(format_args!(
            "Pending interrupt not delivered on unmask"
        )));
    }
    if dev.pending(0) {
        return Err(Detail::fmt(format_args!(
            "PBA bit still set after delivery"
        )));
    }
    let after_unmask = irqs(0);
    q.add(&[(buf, 16, true)]);
    q.kick();
    q.wait(REQUEST_MS)
        .ok_or_else(|| Detail::fmt(format_args!("No completion while unmasked")))?;
    if !wait_irq(0, after_unmask) {
        return Err(Detail::fmt(format_args!(
            "No interrupt with the vector unmasked"
        )));
    }
    Ok(Detail::fmt(format_args!(
        "vectors={} masked_pending=1 delivered_on_unmask=1 irqs={}",
        dev.vectors,
        irqs(0) - before
    )))
}

/// Most requests `blk-bench` keeps in flight (3 descriptors each in a 64-entry queue).
const MAX_QD: u64 = 16;
/// Index mask for `blk-bench`'s per-slot arrays (MAX_QD is a power of two).
const SLOT_MASK: usize = MAX_QD as usize - 1;

/// `blk-bench`: `tvm.bench=seq-read|seq-write|rand-read|rand-write`, `tvm.bs=4096|1048576`,
/// `tvm.mib=N`, `tvm.qd=N` (requests in flight, default 8), `tvm.event_idx=0|1` (default
/// 1), `tvm.poll=0|1` (default 0), `tvm.verify=0|1` (default 0: writes put the block
/// number in each block's first 8 bytes, reads check it there): prints `GO`, runs, prints
/// `END`, reports; the host times from `GO` to `END` and computes throughput.
pub fn bench(bi: &BootInfo) -> Result<Detail, Detail> {
    check_dma(bi)?;
    let param = |key: &str, default: u64| {
        cmdline_param(bi.cmdline(), key)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let kind = cmdline_param(bi.cmdline(), "tvm.bench").unwrap_or("seq-read");
    let bs = param("tvm.bs", 4096);
    let mib = param("tvm.mib", 16);
    let qd = param("tvm.qd", 8);
    if bs < 512 || !bs.is_multiple_of(512) || bs > (1 << 20) {
        return Err(Detail::fmt(format_args!(
            "tvm.bs={bs}: use a multiple of 512 up to 1 MiB"
        )));
    }
    if qd == 0 || qd > MAX_QD || qd * bs > virtio::DMA_SIZE / 2 {
        return Err(Detail::fmt(format_args!(
            "tvm.qd={qd}: use 1 to {MAX_QD} (and qd * bs <= 16 MiB)"
        )));
    }
    let event_idx = param("tvm.event_idx", 1) != 0;
    let poll = param("tvm.poll", 0) != 0;
    let verify = param("tvm.verify", 0) != 0;
    let mut blocks_of = [0u64; MAX_QD as usize];
    if !poll {
        virtio::enable_interrupts();
    }
    let mut b = BlockDev::open_with(64, if event_idx { virtio::F_EVENT_IDX } else { 0 })?;
    if event_idx && !b.q.event_idx {
        return Err(Detail::fmt(format_args!(
            "The device does not offer EVENT_IDX (tvm.event_idx=0 runs without it)"
        )));
    }
    let total = mib << 20;
    if total / 512 > b.capacity {
        return Err(Detail::fmt(format_args!("Disk too small for {mib} MiB")));
    }
    let write = kind.ends_with("write");
    let random = kind.starts_with("rand");
    // One fixed chain per slot, written once: descriptors 3s, 3s+1, 3s+2 hold the
    // header, the data buffer and the status byte of slot s, so a request only
    // rewrites its sector and status and stages head 3s. Under a hypervisor that
    // emulates this guest's instructions, every store in this loop costs about a
    // microsecond: the loop is kept to the few a driver cannot avoid.
    let mut slots = [(0u64, 0u64, 0u64); MAX_QD as usize];
    for (i, slot) in slots.iter_mut().enumerate().take(qd as usize) {
        let (hdr, st, data) = (dma_alloc(16, 16)?, dma_alloc(16, 16)?, dma_alloc(bs, 4096)?);
        w(hdr, if write { blk::OUT } else { blk::IN });
        w(hdr + 4, 0u32);
        let d = 3 * i as u16;
        b.q.write_desc(d, hdr, 16, virtio::DESC_NEXT, d + 1);
        let data_flags = if write { 0 } else { virtio::DESC_WRITE };
        b.q.write_desc(
            d + 1,
            data,
            bs as u32,
            data_flags | virtio::DESC_NEXT,
            d + 2,
        );
        b.q.write_desc(d + 2, st, 1, virtio::DESC_WRITE, 0);
        *slot = (hdr, st, data);
    }
    let ops = total / bs;
    let blocks = b.capacity * 512 / bs;
    let sectors_per_block = bs / 512;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut free: [usize; MAX_QD as usize] = core::array::from_fn(|i| i);
    let mut nfree = qd as usize;
    let (mut issued, mut done, mut kicks_skipped, mut bad) = (0u64, 0u64, 0u64, 0u64);
    // The host times from this line to the report line.
    crate::println!("TVMTEST blk-bench GO");
    let start = crate::io::rdtsc();
    while done < ops {
        let mut added = false;
        while nfree > 0 && issued < ops {
            let block = if random {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % blocks
            } else {
                issued
            };
            nfree -= 1;
            // Masks let the compiler drop bounds checks (slots and free hold MAX_QD).
            let slot = free[nfree & SLOT_MASK] & SLOT_MASK;
            let (hdr, st, data) = slots[slot];
            w(hdr + 8, block * sectors_per_block);
            w(st, 0xffu8);
            if verify {
                // Writes carry their block number; reads expect the host's.
                w(data, if write { block } else { u64::MAX });
                blocks_of[slot] = block;
            }
            b.q.stage(3 * slot as u16);
            issued += 1;
            added = true;
        }
        if added {
            b.q.commit();
            if !b.q.kick_if_needed() {
                kicks_skipped += 1;
            }
        }
        // Wait for completions, then take every one there, so that the next refill
        // goes out with a single index update (and at most one notification). With
        // EVENT_IDX the driver asks to be woken only once half of its requests are back
        // (as Linux's virtqueue_enable_cb_delayed does): the device keeps working on the
        // other half meanwhile. `tvm.poll=1` spins on the used ring instead, interrupts
        // suppressed, as a polled queue does.
        if poll {
            b.q.suppress_interrupts();
            while b.q.used_pending() == 0 {
                core::hint::spin_loop();
            }
        } else if b.q.event_idx {
            let want = ((issued - done) / 2).max(1) as u16;
            b.q.interrupt_after(want);
            b.q.halt_until(want);
        } else {
            b.q.halt_until(1);
        }
        let n = b.q.drain(|head| {
            let slot = (head / 3) as usize & SLOT_MASK;
            if r::<u8>(slots[slot].1) != blk::OK
                || (verify && !write && r::<u64>(slots[slot].2) != blocks_of[slot])
            {
                bad += 1;
            }
            free[nfree & SLOT_MASK] = slot;
            nfree += 1;
        });
        done += u64::from(n);
        if bad != 0 {
            return Err(Detail::fmt(format_args!(
                "{bad} bench request(s) did not complete with status OK (or, with tvm.verify=1, read the wrong block)"
            )));
        }
    }
    let ticks = crate::io::rdtsc() - start;
    // The host stops its clock here, before the report is formatted and printed.
    crate::println!("TVMTEST blk-bench END");
    let us = ticks * 1000 / timer::tsc_per_ms().max(1);
    Ok(Detail::fmt(format_args!(
        "kind={kind} bs={bs} qd={qd} event_idx={event_idx} poll={poll} ops={ops} bytes={total} us={us} kicks_skipped={kicks_skipped}"
    )))
}
