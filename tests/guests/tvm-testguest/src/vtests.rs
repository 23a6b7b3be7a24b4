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
        let dev = VirtioPci::open(virtio::DEV_BLOCK)?;
        let features = dev.negotiate(blk::F_RO | blk::F_FLUSH)?;
        let q = dev.queue(0, size)?;
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

/// `blk-bench`: `tvm.bench=seq-read|seq-write|rand-read|rand-write`, `tvm.bs=4096|1048576`,
/// `tvm.mib=N`, `tvm.qd=N` (requests in flight, default 8): prints `GO`, runs, reports;
/// the host times from `GO` to the report and computes throughput.
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
    virtio::enable_interrupts();
    let mut b = BlockDev::open_sized(64)?;
    let total = mib << 20;
    if total / 512 > b.capacity {
        return Err(Detail::fmt(format_args!("Disk too small for {mib} MiB")));
    }
    let mut slots = [(0u64, 0u64, 0u64); MAX_QD as usize];
    for slot in slots.iter_mut().take(qd as usize) {
        *slot = (dma_alloc(16, 16)?, dma_alloc(16, 16)?, dma_alloc(bs, 4096)?);
    }
    let write = kind.ends_with("write");
    let random = kind.starts_with("rand");
    let ops = total / bs;
    let blocks = b.capacity * 512 / bs;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut free: [usize; MAX_QD as usize] = core::array::from_fn(|i| i);
    let mut nfree = qd as usize;
    let mut head_slot = [0usize; 64];
    let (mut issued, mut done) = (0u64, 0u64);
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
            let slot = free[nfree];
            let (hdr, st, data) = slots[slot];
            w(hdr, if write { blk::OUT } else { blk::IN });
            w(hdr + 4, 0u32);
            w(hdr + 8, block * bs / 512);
            w(st, 0xffu8);
            let head =
                b.q.add(&[(hdr, 16, false), (data, bs as u32, !write), (st, 1, true)]);
            head_slot[usize::from(head % 64)] = slot;
            issued += 1;
            added = true;
        }
        if added {
            b.q.kick();
        }
        // Wait for one completion, then take every other one already there, so that
        // the next refill goes out with a single notification.
        let mut next = Some(b.q.wait_halt());
        while let Some((head, _)) = next {
            let slot = head_slot[(head % 64) as usize];
            let status: u8 = r(slots[slot].1);
            expect("bench request", status, blk::OK)?;
            free[nfree] = slot;
            nfree += 1;
            done += 1;
            next = b.q.poll();
        }
    }
    let ticks = crate::io::rdtsc() - start;
    let us = ticks * 1000 / timer::tsc_per_ms().max(1);
    Ok(Detail::fmt(format_args!(
        "kind={kind} bs={bs} qd={qd} ops={ops} bytes={total} us={us}"
    )))
}
