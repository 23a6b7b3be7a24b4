//! A minimal virtio-pci modern driver: capabilities, feature negotiation, split queues in a
//! fixed DMA area of guest RAM, MSI-X vectors delivered to the local APIC.

use core::sync::atomic::{compiler_fence, fence, AtomicU64, Ordering};

use crate::idt::{IRQS, IRQ_BASE, IRQ_COUNT};
use crate::pci::{self, ConfigAccess, Function};
use crate::report::Detail;
use crate::timer;

/// Where the driver's rings and buffers live: guest RAM the test checks is usable.
pub const DMA_BASE: u64 = 0x200_0000;
/// Size of the DMA area.
pub const DMA_SIZE: u64 = 0x200_0000;
/// Where the virtio functions' BAR 0 go: the 32-bit PCI window (identity-mapped), one
/// 32 KiB BAR per slot.
pub const BAR_AREA: u64 = 0xc000_0000;

/// Virtio PCI vendor ID.
pub const VENDOR: u16 = 0x1af4;
/// Device IDs (modern: 0x1040 + type).
pub const DEV_BLOCK: u16 = 0x1042;
/// Entropy device.
pub const DEV_RNG: u16 = 0x1044;
/// Socket device.
pub const DEV_VSOCK: u16 = 0x1053;

/// VIRTIO_F_VERSION_1.
pub const F_VERSION_1: u64 = 1 << 32;

/// Device status bits.
pub mod status {
    /// ACKNOWLEDGE.
    pub const ACK: u8 = 1;
    /// DRIVER.
    pub const DRIVER: u8 = 2;
    /// DRIVER_OK.
    pub const DRIVER_OK: u8 = 4;
    /// FEATURES_OK.
    pub const FEATURES_OK: u8 = 8;
    /// DEVICE_NEEDS_RESET.
    pub const NEEDS_RESET: u8 = 64;
}

/// Common configuration offsets.
pub mod common {
    /// device_feature_select.
    pub const DFSELECT: u64 = 0x00;
    /// device_feature.
    pub const DF: u64 = 0x04;
    /// driver_feature_select.
    pub const GFSELECT: u64 = 0x08;
    /// driver_feature.
    pub const GF: u64 = 0x0c;
    /// config_msix_vector.
    pub const MSIX: u64 = 0x10;
    /// num_queues.
    pub const NUMQ: u64 = 0x12;
    /// device_status.
    pub const STATUS: u64 = 0x14;
    /// queue_select.
    pub const Q_SELECT: u64 = 0x16;
    /// queue_size.
    pub const Q_SIZE: u64 = 0x18;
    /// queue_msix_vector.
    pub const Q_MSIX: u64 = 0x1a;
    /// queue_enable.
    pub const Q_ENABLE: u64 = 0x1c;
    /// queue_notify_off.
    pub const Q_NOFF: u64 = 0x1e;
    /// queue_desc.
    pub const Q_DESC: u64 = 0x20;
    /// queue_driver (avail).
    pub const Q_AVAIL: u64 = 0x28;
    /// queue_device (used).
    pub const Q_USED: u64 = 0x30;
}

static DMA_NEXT: AtomicU64 = AtomicU64::new(DMA_BASE);

/// Allocates `size` bytes of DMA memory aligned to `align` (not zeroed).
pub fn dma_alloc(size: u64, align: u64) -> Result<u64, Detail> {
    let cur = DMA_NEXT.load(Ordering::Relaxed).next_multiple_of(align);
    if cur + size > DMA_BASE + DMA_SIZE {
        return Err(Detail::fmt(format_args!(
            "DMA area exhausted ({size} bytes asked)"
        )));
    }
    DMA_NEXT.store(cur + size, Ordering::Relaxed);
    Ok(cur)
}

/// Writes `v` at physical `addr`.
pub fn w<T: Copy>(addr: u64, v: T) {
    // SAFETY: callers write the driver's own DMA area or device registers in the
    // identity-mapped first 4 GiB.
    unsafe { core::ptr::write_volatile(addr as *mut T, v) }
}

/// Reads a `T` at physical `addr`.
pub fn r<T: Copy>(addr: u64) -> T {
    // SAFETY: as for `w`.
    unsafe { core::ptr::read_volatile(addr as *const T) }
}

/// Fills `len` bytes at `addr` with `byte`.
pub fn fill(addr: u64, len: u64, byte: u8) {
    // SAFETY: callers pass ranges of the DMA area they allocated.
    unsafe { core::ptr::write_bytes(addr as *mut u8, byte, len as usize) }
}

/// The DMA bytes at `addr` as a slice.
pub fn bytes<'a>(addr: u64, len: u64) -> &'a [u8] {
    // SAFETY: callers pass ranges of the DMA area they allocated; the device wrote them
    // before the used entry was published (read after the fence in `Virtq::poll`).
    unsafe { core::slice::from_raw_parts(addr as *const u8, len as usize) }
}

/// The DMA bytes at `addr` as a mutable slice.
pub fn bytes_mut<'a>(addr: u64, len: u64) -> &'a mut [u8] {
    // SAFETY: as for `bytes`; the device does not own these buffers while we write them.
    unsafe { core::slice::from_raw_parts_mut(addr as *mut u8, len as usize) }
}

const XAPIC_BASE: u64 = 0xfee0_0000;
const IA32_APIC_BASE: u32 = 0x1b;

fn x2apic() -> bool {
    crate::io::rdmsr(IA32_APIC_BASE) & (1 << 10) != 0
}

/// Enables the local APIC (SVR) and interrupts.
pub fn enable_interrupts() {
    if x2apic() {
        let svr = crate::io::rdmsr(0x80f);
        crate::io::wrmsr(0x80f, svr | 0x1ff);
    } else {
        let svr: u32 = r(XAPIC_BASE + 0xf0);
        w(XAPIC_BASE + 0xf0, svr | 0x1ff);
    }
    // SAFETY: the IDT has gates for every vector a device can send (idt.rs).
    unsafe { core::arch::asm!("sti", options(nomem, nostack)) }
}

/// End of interrupt.
pub fn lapic_eoi() {
    if x2apic() {
        crate::io::wrmsr(0x80b, 0);
    } else {
        w(XAPIC_BASE + 0xb0, 0u32);
    }
}

/// Interrupts counted on device vector `v` (IDT vector `IRQ_BASE + v`).
pub fn irqs(v: u16) -> u32 {
    IRQS.get(usize::from(v))
        .map_or(0, |n| n.load(Ordering::SeqCst))
}

/// A split virtqueue.
pub struct Virtq {
    /// Queue index.
    pub index: u16,
    /// Number of descriptors.
    pub size: u16,
    /// Descriptor table address.
    pub desc: u64,
    /// Available ring address.
    pub avail: u64,
    /// Used ring address.
    pub used: u64,
    /// Notify register address.
    pub notify: u64,
    /// VIRTIO_F_RING_EVENT_IDX was negotiated: notifications both ways go by the
    /// `used_event` / `avail_event` fields instead of the ring flags.
    pub event_idx: bool,
    next_desc: u16,
    avail_idx: u16,
    last_used: u16,
    /// The available index when the driver last decided whether to kick.
    notified_idx: u16,
}

/// Descriptor flags.
pub const DESC_NEXT: u16 = 1;
/// Device-writable.
pub const DESC_WRITE: u16 = 2;
/// Used-ring flag: the device does not need notifications now.
pub const USED_F_NO_NOTIFY: u16 = 1;
/// Available-ring flag: the driver does not want interrupts.
pub const AVAIL_F_NO_INTERRUPT: u16 = 1;
/// VIRTIO_F_RING_EVENT_IDX.
pub const F_EVENT_IDX: u64 = 1 << 29;

impl Virtq {
    /// Writes descriptor `i` raw (hostile tests write what they like).
    pub fn write_desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = self.desc + 16 * u64::from(i % self.size);
        w(at, addr);
        w(at + 8, len);
        w(at + 12, flags);
        w(at + 14, next);
    }

    /// Publishes `head` in the available ring.
    pub fn publish(&mut self, head: u16) {
        self.stage(head);
        self.commit();
        fence(Ordering::SeqCst);
    }

    /// Sets the available index directly (hostile tests).
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.avail_idx = idx;
        fence(Ordering::SeqCst);
        w(self.avail + 2, idx);
    }

    /// Adds a chain of `(addr, len, device_writable)` buffers; returns its head.
    pub fn add(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, writable)) in bufs.iter().enumerate() {
            let idx = (head + i as u16) % self.size;
            let next = (idx + 1) % self.size;
            let mut flags = if writable { DESC_WRITE } else { 0 };
            if i + 1 < bufs.len() {
                flags |= DESC_NEXT;
            }
            self.write_desc(idx, addr, len, flags, next);
        }
        self.next_desc = (head + bufs.len() as u16) % self.size;
        self.publish(head);
        head
    }

    /// Kicks the device.
    pub fn kick(&self) {
        w(self.notify, self.index);
    }

    /// Kicks the device only if it asked for it, as Linux's virtqueue_kick_prepare
    /// decides: with EVENT_IDX when the chains published since the last decision pass
    /// its `avail_event`; without, unless it set VIRTQ_USED_F_NO_NOTIFY (it is working
    /// through the ring and looks again before it re-enables notifications). Returns
    /// whether it kicked.
    pub fn kick_if_needed(&mut self) -> bool {
        // The avail index written by `publish` must be visible before the device's
        // answer is read.
        fence(Ordering::SeqCst);
        let (new, old) = (self.avail_idx, self.notified_idx);
        self.notified_idx = new;
        let needed = if self.event_idx {
            let avail_event: u16 = r(self.used + 4 + 8 * u64::from(self.size));
            new.wrapping_sub(avail_event).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            r::<u16>(self.used) & USED_F_NO_NOTIFY == 0
        };
        if needed {
            self.kick();
        }
        needed
    }

    /// EVENT_IDX: asks for the next interrupt only once `n` more chains are used (what
    /// Linux's virtqueue_enable_cb_delayed does), by writing `used_event`.
    pub fn interrupt_after(&self, n: u16) {
        let at = self.avail + 4 + 2 * u64::from(self.size);
        w(at, self.last_used.wrapping_add(n.max(1) - 1));
        fence(Ordering::SeqCst);
    }

    /// Asks the device not to interrupt (a driver that polls): with EVENT_IDX by moving
    /// `used_event` half the index space ahead of what it has taken (call again after
    /// taking entries), without it by the available ring's NO_INTERRUPT flag.
    pub fn suppress_interrupts(&self) {
        if self.event_idx {
            let at = self.avail + 4 + 2 * u64::from(self.size);
            w(at, self.last_used.wrapping_add(0x8000));
        } else {
            w(self.avail, AVAIL_F_NO_INTERRUPT);
        }
        fence(Ordering::SeqCst);
    }

    /// Used entries not yet taken.
    pub fn used_pending(&self) -> u16 {
        // Loads are not reordered with loads on x86: keep the compiler from doing it.
        compiler_fence(Ordering::Acquire);
        r::<u16>(self.used + 2).wrapping_sub(self.last_used)
    }

    /// Puts `head` (a chain already in the descriptor table) in the available ring
    /// without publishing it; [`Virtq::commit`] publishes every staged head at once.
    pub fn stage(&mut self, head: u16) {
        // Split queue sizes are powers of two (checked in `VirtioPci::queue`): a mask,
        // not a division.
        w(
            self.avail + 4 + 2 * u64::from(self.avail_idx & (self.size - 1)),
            head,
        );
        self.avail_idx = self.avail_idx.wrapping_add(1);
    }

    /// Publishes the staged heads with one index update.
    pub fn commit(&self) {
        fence(Ordering::SeqCst);
        w(self.avail + 2, self.avail_idx);
    }

    /// Takes every used entry there now, handing each chain id to `f`; returns how many.
    pub fn drain(&mut self, mut f: impl FnMut(u32)) -> u16 {
        let n = self.used_pending();
        compiler_fence(Ordering::Acquire);
        for _ in 0..n {
            let at = self.used + 4 + 8 * u64::from(self.last_used & (self.size - 1));
            f(r(at));
            self.last_used = self.last_used.wrapping_add(1);
        }
        n
    }

    /// Halts until at least `n` used entries are waiting (checked again with interrupts
    /// off before each halt, as in [`Virtq::wait_halt`]). For requests that always
    /// complete and interrupt, with `used_event` set by [`Virtq::interrupt_after`].
    pub fn halt_until(&self, n: u16) {
        while self.used_pending() < n {
            self.halt_unless_pending(n);
        }
    }

    /// The next used entry `(id, len)`, if any.
    pub fn poll(&mut self) -> Option<(u32, u32)> {
        fence(Ordering::SeqCst);
        let idx: u16 = r(self.used + 2);
        if idx == self.last_used {
            return None;
        }
        fence(Ordering::SeqCst);
        let at = self.used + 4 + 8 * u64::from(self.last_used % self.size);
        self.last_used = self.last_used.wrapping_add(1);
        Some((r(at), r(at + 4)))
    }

    /// Halts until the next interrupt unless this queue already has a used entry (checked
    /// with interrupts off, so a completion cannot slip in between).
    pub fn halt_unless_used(&self) {
        self.halt_unless_pending(1);
    }

    /// Halts until the next interrupt unless at least `n` used entries are waiting
    /// (checked with interrupts off, so a completion cannot slip in between).
    fn halt_unless_pending(&self, n: u16) {
        // SAFETY: cli only masks interrupts on this CPU until the sti below.
        unsafe { core::arch::asm!("cli", options(nomem, nostack)) };
        fence(Ordering::SeqCst);
        let waiting = r::<u16>(self.used + 2).wrapping_sub(self.last_used);
        if waiting >= n {
            // SAFETY: re-enables interrupts (the IDT handles every device vector).
            unsafe { core::arch::asm!("sti", options(nomem, nostack)) };
        } else {
            // SAFETY: as above; hlt returns on the next interrupt.
            unsafe { core::arch::asm!("sti", "hlt", options(nomem, nostack)) };
        }
    }

    /// Waits for a used entry halting between interrupts (frees the host CPU for the
    /// device thread). Only for requests that always complete and interrupt: there is no
    /// timeout. `sti; hlt` has no lost-wakeup window: interrupts are taken only once the
    /// CPU halts, after the check made with them off.
    pub fn wait_halt(&mut self) -> (u32, u32) {
        loop {
            // SAFETY: cli only masks interrupts on this CPU until the sti below.
            unsafe { core::arch::asm!("cli", options(nomem, nostack)) };
            if let Some(e) = self.poll() {
                // SAFETY: re-enables interrupts (the IDT handles every device vector).
                unsafe { core::arch::asm!("sti", options(nomem, nostack)) };
                return e;
            }
            // SAFETY: as above; hlt returns on the next interrupt.
            unsafe { core::arch::asm!("sti", "hlt", options(nomem, nostack)) };
        }
    }

    /// Waits up to `ms` for a used entry.
    pub fn wait(&mut self, ms: u64) -> Option<(u32, u32)> {
        let deadline = timer::deadline_ms(ms);
        loop {
            if let Some(e) = self.poll() {
                return Some(e);
            }
            if timer::expired(deadline) {
                return None;
            }
            core::hint::spin_loop();
        }
    }
}

/// One virtio-pci function, BAR 0 placed and capabilities found.
pub struct VirtioPci {
    /// Configuration access.
    pub cfg: ConfigAccess,
    /// The function.
    pub f: Function,
    /// BAR 0 address.
    pub bar: u64,
    common: u64,
    notify: u64,
    notify_mult: u32,
    /// ISR status register.
    pub isr: u64,
    /// Device configuration.
    pub device_cfg: u64,
    msix_cap: u16,
    /// MSI-X table address.
    pub msix_table: u64,
    /// MSI-X PBA address.
    pub msix_pba: u64,
    /// Vectors in the table.
    pub vectors: u16,
}

impl VirtioPci {
    /// Finds the device `device_id` on bus 0 (ECAM from the MCFG), moves its BAR 0 into
    /// the 32-bit window, finds its capabilities and enables MSI-X with vector `v` sent
    /// as IDT vector `IRQ_BASE + v` to APIC 0.
    pub fn open(device_id: u16) -> Result<Self, Detail> {
        let cfg = ConfigAccess::Ecam(pci::find_ecam()?);
        let f = pci::find(cfg, VENDOR, device_id).ok_or_else(|| {
            Detail::fmt(format_args!(
                "No virtio device {VENDOR:04x}:{device_id:04x} on bus 0"
            ))
        })?;
        // The legacy mechanism must see the same function.
        let via_ports = ConfigAccess::Ports.read32(f.slot, 0);
        if via_ports != cfg.read32(f.slot, 0) {
            return Err(Detail::fmt(format_args!(
                "Slot {} reads {via_ports:#x} through 0xCF8 but differently through ECAM",
                f.slot
            )));
        }
        let bar = BAR_AREA + u64::from(f.slot) * 0x8000;
        pci::place_bar0(cfg, f, bar)?;
        let mut d = VirtioPci {
            cfg,
            f,
            bar,
            common: 0,
            notify: 0,
            notify_mult: 0,
            isr: 0,
            device_cfg: 0,
            msix_cap: 0,
            msix_table: 0,
            msix_pba: 0,
            vectors: 0,
        };
        let mut found = 0u8;
        pci::capabilities(cfg, f.slot, |ptr, id| match id {
            0x09 => {
                let head = cfg.read32(f.slot, ptr);
                let offset = u64::from(cfg.read32(f.slot, ptr + 8));
                match (head >> 24) as u8 {
                    1 => d.common = bar + offset,
                    2 => {
                        d.notify = bar + offset;
                        d.notify_mult = cfg.read32(f.slot, ptr + 16);
                    }
                    3 => d.isr = bar + offset,
                    4 => d.device_cfg = bar + offset,
                    _ => return,
                }
                found |= 1 << (head >> 24);
            }
            0x11 => {
                d.msix_cap = ptr;
                let control = cfg.read32(f.slot, ptr) >> 16;
                d.vectors = (control & 0x7ff) as u16 + 1;
                d.msix_table = bar + u64::from(cfg.read32(f.slot, ptr + 4) & !7);
                d.msix_pba = bar + u64::from(cfg.read32(f.slot, ptr + 8) & !7);
            }
            _ => {}
        });
        if found & 0x1e != 0x1e || d.msix_cap == 0 {
            return Err(Detail::fmt(format_args!(
                "Slot {}: virtio capabilities incomplete (mask {found:#x}, msix at {:#x})",
                f.slot, d.msix_cap
            )));
        }
        if usize::from(d.vectors) > IRQ_COUNT {
            return Err(Detail::fmt(format_args!(
                "{} MSI-X vectors; at most {IRQ_COUNT} handled",
                d.vectors
            )));
        }
        for v in 0..d.vectors {
            d.program_vector(v, false);
        }
        let control = cfg.read32(f.slot, d.msix_cap);
        cfg.write32(f.slot, d.msix_cap, control | (1 << 31));
        Ok(d)
    }

    /// Writes MSI-X table entry `v` (message to APIC 0, IDT vector `IRQ_BASE + v`).
    pub fn program_vector(&self, v: u16, masked: bool) {
        let entry = self.msix_table + 16 * u64::from(v);
        w(entry, 0xfee0_0000u32);
        w(entry + 4, 0u32);
        w(entry + 8, u32::from(IRQ_BASE) + u32::from(v));
        w(entry + 12, u32::from(masked));
    }

    /// Offset of the MSI-X capability in configuration space.
    pub fn msix_cap_offset(&self) -> u16 {
        self.msix_cap
    }

    /// Whether vector `v`'s pending bit is set.
    pub fn pending(&self, v: u16) -> bool {
        let word: u64 = r(self.msix_pba + 8 * u64::from(v / 64));
        word & (1 << (v % 64)) != 0
    }

    /// Common configuration register access.
    pub fn c8(&self, off: u64) -> u8 {
        r(self.common + off)
    }
    /// Writes an 8-bit common register.
    pub fn wc8(&self, off: u64, v: u8) {
        w(self.common + off, v)
    }
    /// Reads a 16-bit common register.
    pub fn c16(&self, off: u64) -> u16 {
        r(self.common + off)
    }
    /// Writes a 16-bit common register.
    pub fn wc16(&self, off: u64, v: u16) {
        w(self.common + off, v)
    }
    /// Reads a 32-bit common register.
    pub fn c32(&self, off: u64) -> u32 {
        r(self.common + off)
    }
    /// Writes a 32-bit common register.
    pub fn wc32(&self, off: u64, v: u32) {
        w(self.common + off, v)
    }

    /// The device status.
    pub fn status(&self) -> u8 {
        self.c8(common::STATUS)
    }

    /// Resets the device and negotiates `wanted` | VERSION_1; returns the accepted set.
    pub fn negotiate(&self, wanted: u64) -> Result<u64, Detail> {
        self.wc8(common::STATUS, 0);
        if self.status() != 0 {
            return Err(Detail::fmt(format_args!(
                "Device did not reset (status {:#x})",
                self.status()
            )));
        }
        self.wc8(common::STATUS, status::ACK);
        self.wc8(common::STATUS, status::ACK | status::DRIVER);
        self.wc32(common::DFSELECT, 0);
        let mut offered = u64::from(self.c32(common::DF));
        self.wc32(common::DFSELECT, 1);
        offered |= u64::from(self.c32(common::DF)) << 32;
        if offered & F_VERSION_1 == 0 {
            return Err(Detail::fmt(format_args!(
                "Device does not offer VERSION_1 ({offered:#x})"
            )));
        }
        let accepted = offered & (wanted | F_VERSION_1);
        self.wc32(common::GFSELECT, 0);
        self.wc32(common::GF, accepted as u32);
        self.wc32(common::GFSELECT, 1);
        self.wc32(common::GF, (accepted >> 32) as u32);
        self.wc8(
            common::STATUS,
            status::ACK | status::DRIVER | status::FEATURES_OK,
        );
        if self.status() & status::FEATURES_OK == 0 {
            return Err(Detail::fmt(format_args!(
                "FEATURES_OK refused for {accepted:#x}"
            )));
        }
        let nq = self.c16(common::NUMQ);
        self.wc16(common::MSIX, nq);
        if self.c16(common::MSIX) != nq {
            return Err(Detail::fmt(format_args!("Config vector {nq} refused")));
        }
        Ok(accepted)
    }

    /// Sets up queue `q` with `size` descriptors and MSI-X vector `q`.
    pub fn queue(&self, q: u16, size: u16) -> Result<Virtq, Detail> {
        self.wc16(common::Q_SELECT, q);
        let max = self.c16(common::Q_SIZE);
        if !size.is_power_of_two() {
            return Err(Detail::fmt(format_args!(
                "Queue size {size} is not a power of two"
            )));
        }
        if max < size {
            return Err(Detail::fmt(format_args!("Queue {q} holds {max} < {size}")));
        }
        self.wc16(common::Q_SIZE, size);
        let desc = dma_alloc(4096, 4096)?;
        fill(desc, 4096, 0);
        let avail = desc + 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size)).next_multiple_of(4);
        if used + 6 + 8 * u64::from(size) > desc + 4096 {
            return Err(Detail::fmt(format_args!(
                "Queue size {size} does not fit a page"
            )));
        }
        for (off, addr) in [
            (common::Q_DESC, desc),
            (common::Q_AVAIL, avail),
            (common::Q_USED, used),
        ] {
            self.wc32(off, addr as u32);
            self.wc32(off + 4, (addr >> 32) as u32);
        }
        self.wc16(common::Q_MSIX, q);
        if self.c16(common::Q_MSIX) != q {
            return Err(Detail::fmt(format_args!("Queue {q} vector refused")));
        }
        let noff = self.c16(common::Q_NOFF);
        self.wc16(common::Q_ENABLE, 1);
        Ok(Virtq {
            index: q,
            size,
            desc,
            avail,
            used,
            notify: self.notify + u64::from(noff) * u64::from(self.notify_mult),
            event_idx: false,
            next_desc: 0,
            avail_idx: 0,
            last_used: 0,
            notified_idx: 0,
        })
    }

    /// Sets DRIVER_OK and checks the device took it.
    pub fn driver_ok(&self) -> Result<(), Detail> {
        let s = self.status() | status::DRIVER_OK;
        self.wc8(common::STATUS, s);
        let now = self.status();
        if now & status::DRIVER_OK == 0 || now & status::NEEDS_RESET != 0 {
            return Err(Detail::fmt(format_args!(
                "DRIVER_OK not taken (status {now:#x})"
            )));
        }
        Ok(())
    }
}
