//! `vfio-edu`: QEMU's edu device (1234:11e8) passed through by tenantvm-vmm with real
//! kernel VFIO (the nested host's `vfio-passthrough` scenario): the guest reads its ID
//! register, checks liveness, computes a factorial, receives its MSI, and has its DMA
//! engine copy a buffer from guest RAM into the device and back out into another buffer
//! (IOVA = guest physical address through the host IOMMU).

use crate::bootinfo::BootInfo;
use crate::idt::IRQ_BASE;
use crate::pci::{self, ConfigAccess, CMD_MASTER, CMD_MEMORY};
use crate::report::Detail;
use crate::timer;
use crate::virtio::{dma_alloc, enable_interrupts, irqs, r, w};
use crate::vtests::{check_dma, wait_irq};

const VENDOR: u16 = 0x1234;
const DEVICE: u16 = 0x11e8;
/// Registers (QEMU docs/specs/edu.rst).
const ID: u64 = 0x00;
const LIVENESS: u64 = 0x04;
const FACTORIAL: u64 = 0x08;
const STATUS: u64 = 0x20;
const IRQ_STATUS: u64 = 0x24;
const IRQ_RAISE: u64 = 0x60;
const IRQ_ACK: u64 = 0x64;
const DMA_SRC: u64 = 0x80;
const DMA_DST: u64 = 0x88;
const DMA_COUNT: u64 = 0x90;
const DMA_CMD: u64 = 0x98;
/// Where edu's own DMA buffer is, in its address space.
const EDU_BUFFER: u64 = 0x40000;
const DMA_BYTES: u64 = 256;

fn err(args: core::fmt::Arguments<'_>) -> Detail {
    Detail::fmt(args)
}

fn wait_clear(addr: u64, bit: u32, what: &str) -> Result<(), Detail> {
    let deadline = timer::deadline_ms(5_000);
    while r::<u32>(addr) & bit != 0 {
        if timer::expired(deadline) {
            return Err(err(format_args!("edu: {what} did not finish in 5 s")));
        }
        core::hint::spin_loop();
    }
    Ok(())
}

fn dma(bar: u64, src: u64, dst: u64, to_ram: bool) -> Result<(), Detail> {
    w(bar + DMA_SRC, src);
    w(bar + DMA_DST, dst);
    w(bar + DMA_COUNT, DMA_BYTES);
    w(bar + DMA_CMD, 1u64 | if to_ram { 2 } else { 0 });
    wait_clear(bar + DMA_CMD, 1, "DMA")
}

/// Points edu's MSI at this CPU (IDT vector `IRQ_BASE`) and enables it.
fn enable_msi(cfg: ConfigAccess, slot: u8) -> Result<(), Detail> {
    let mut msi = 0u16;
    pci::capabilities(cfg, slot, |ptr, id| {
        if id == 0x05 {
            msi = ptr;
        }
    });
    if msi == 0 {
        return Err(err(format_args!("edu shows no MSI capability")));
    }
    let control = (cfg.read32(slot, msi) >> 16) as u16;
    let data_at = if control & 0x80 != 0 { 12 } else { 8 };
    cfg.write32(slot, msi + 4, 0xfee0_0000);
    if data_at == 12 {
        cfg.write32(slot, msi + 8, 0);
    }
    cfg.write16(slot, msi + data_at, u16::from(IRQ_BASE));
    cfg.write16(slot, msi + 2, control | 1);
    // Firmware (SeaBIOS under QEMU) leaves the 8259s mapped at vectors 8-15 with the PIT
    // ticking: mask them, or the first tick lands on the double-fault gate.
    crate::io::outb(0x21, 0xff);
    crate::io::outb(0xa1, 0xff);
    enable_interrupts();
    Ok(())
}

/// Finds edu, turns on memory decoding and bus mastering, returns its slot and BAR0.
fn open_edu(cfg: ConfigAccess) -> Result<(u8, u64), Detail> {
    let f = pci::find(cfg, VENDOR, DEVICE)
        .ok_or_else(|| err(format_args!("No edu {VENDOR:04x}:{DEVICE:04x} on bus 0")))?;
    let bar = u64::from(cfg.read32(f.slot, 0x10) & !0xf);
    if bar == 0 {
        return Err(err(format_args!("edu's BAR0 is not placed")));
    }
    cfg.write16(f.slot, 0x04, CMD_MEMORY | CMD_MASTER);
    Ok((f.slot, bar))
}

/// `vfio-edu-bench`: `tvm.n=N` (default 2000) MSI round trips with edu: write its raise
/// register, wait for the interrupt, acknowledge it. `GO`/`END` around the loop; the rate by
/// the TSC. The same guest runs under tenantvm-vmm and under QEMU's vfio-pci.
pub fn bench(bi: &BootInfo) -> Result<Detail, Detail> {
    let n: u32 = crate::bootinfo::cmdline_param(bi.cmdline(), "tvm.n")
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let cfg = ConfigAccess::Ecam(pci::find_ecam()?);
    let (slot, bar) = open_edu(cfg)?;
    enable_msi(cfg, slot)?;
    crate::println!("TVMTEST vfio-edu-bench GO");
    let start = crate::io::rdtsc();
    for i in 0..n {
        let before = irqs(0);
        w(bar + IRQ_RAISE, 1u32);
        if !wait_irq(0, before) {
            return Err(err(format_args!("MSI {i} of {n} never came")));
        }
        w(bar + IRQ_ACK, 1u32);
    }
    let ticks = crate::io::rdtsc() - start;
    crate::println!("TVMTEST vfio-edu-bench END");
    let us = ticks * 1000 / timer::tsc_per_ms().max(1);
    Ok(Detail::fmt(format_args!(
        "n={n} us={us} per_second={}",
        u64::from(n) * 1_000_000 / us.max(1)
    )))
}

/// Runs the test (see the module documentation).
pub fn run(bi: &BootInfo) -> Result<Detail, Detail> {
    check_dma(bi)?;
    let cfg = ConfigAccess::Ecam(pci::find_ecam()?);
    let (slot, bar) = open_edu(cfg)?;
    // Vendor and device ids as config space gives them (what the host's sysfs shows).
    let ids = cfg.read32(slot, 0);
    let id: u32 = r(bar + ID);
    if id & 0xffff != 0x00ed {
        return Err(err(format_args!("edu ID register reads {id:#x}")));
    }
    w(bar + LIVENESS, 0x1234_5678u32);
    let live: u32 = r(bar + LIVENESS);
    if live != !0x1234_5678u32 {
        return Err(err(format_args!("edu liveness reads {live:#x}")));
    }
    w(bar + FACTORIAL, 10u32);
    wait_clear(bar + STATUS, 1, "factorial")?;
    let fact: u32 = r(bar + FACTORIAL);
    if fact != 3_628_800 {
        return Err(err(format_args!("edu 10! = {fact}")));
    }

    // MSI to this CPU (the VMM emulates the capability and wires the device's eventfd to
    // a KVM irqfd).
    enable_msi(cfg, slot)?;
    let before = irqs(0);
    w(bar + IRQ_RAISE, 0x5u32);
    if !wait_irq(0, before) {
        return Err(err(format_args!(
            "No MSI after the raise register (irq status {:#x})",
            r::<u32>(bar + IRQ_STATUS)
        )));
    }
    w(bar + IRQ_ACK, 0x5u32);

    // DMA: guest RAM -> edu -> other guest RAM.
    let src = dma_alloc(4096, 4096)?;
    let dst = dma_alloc(4096, 4096)?;
    for i in 0..DMA_BYTES / 4 {
        w(src + 4 * i, 0xed00_0000u32 | i as u32);
        w(dst + 4 * i, 0u32);
    }
    dma(bar, src, EDU_BUFFER, false)?;
    dma(bar, EDU_BUFFER, dst, true)?;
    let copied = (0..DMA_BYTES / 4)
        .filter(|&i| r::<u32>(dst + 4 * i) == 0xed00_0000 | i as u32)
        .count();
    if copied as u64 != DMA_BYTES / 4 {
        return Err(err(format_args!(
            "edu DMA copied {copied} of {} words",
            DMA_BYTES / 4
        )));
    }
    Ok(Detail::fmt(format_args!(
        "slot={slot} pci={:04x}:{:04x} bar0={bar:#x} id={id:#x} factorial=3628800 msi=1 dma={DMA_BYTES}",
        ids & 0xffff,
        ids >> 16
    )))
}

/// The I/O APIC's register window.
const IOAPIC: u64 = 0xfec0_0000;

fn ioapic_write(reg: u32, value: u32) {
    w(IOAPIC, reg);
    w(IOAPIC + 0x10, value);
}

/// Finds edu with MSI left off, masks the 8259s and programs the I/O APIC pin the VMM routes
/// its INTx to (16 + (slot + pin) % 8, what its DSDT `_PRT` says) level-triggered to IDT
/// vector `IRQ_BASE + 1`; edu's stale interrupt status is cleared first. Returns (slot, pin,
/// GSI, BAR0).
fn open_intx(bi: &BootInfo) -> Result<(u8, u8, u32, u64), Detail> {
    check_dma(bi)?;
    let cfg = ConfigAccess::Ecam(pci::find_ecam()?);
    let (slot, bar) = open_edu(cfg)?;
    let pin = ((cfg.read32(slot, 0x3c) >> 8) & 0xff) as u8;
    if !(1..=4).contains(&pin) {
        return Err(err(format_args!("edu's interrupt pin is {pin}")));
    }
    let gsi = 16 + (u32::from(slot) + u32::from(pin) - 1) % 8;
    w(bar + IRQ_ACK, u32::MAX);
    crate::io::outb(0x21, 0xff);
    crate::io::outb(0xa1, 0xff);
    // Vector IRQ_BASE + 1, fixed delivery, physical destination APIC 0, level-triggered.
    ioapic_write(0x11 + 2 * gsi, 0);
    ioapic_write(0x10 + 2 * gsi, (u32::from(IRQ_BASE) + 1) | (1 << 15));
    Ok((slot, pin, gsi, bar))
}

/// Makes the handler of vector `IRQ_BASE + 1` acknowledge edu's INTx status bit `bit`
/// before its EOI (0: the handler acknowledges nothing).
fn ack_in_handler(bar: u64, bit: u32) {
    use core::sync::atomic::Ordering;
    crate::idt::LEVEL_ACK_VALUE.store(bit, Ordering::SeqCst);
    let addr = if bit == 0 { 0 } else { bar + IRQ_ACK };
    crate::idt::LEVEL_ACK_ADDR.store(addr, Ordering::SeqCst);
}

/// The bit the INTx tests raise in edu's interrupt status.
const INTX_BIT: u32 = 0x10;

/// `vfio-edu-intx`: edu's legacy interrupt (MSI left off), as a driver of a level-triggered
/// line takes it: the handler acknowledges edu before its EOI. Three interrupts one after
/// the other; the second and third only arrive if the line was unmasked after the EOI before
/// (VFIO's INTx unmask through KVM's resample eventfd), and each raise gives exactly one
/// interrupt (acknowledged before the EOI, the line does not fire again).
pub fn intx(bi: &BootInfo) -> Result<Detail, Detail> {
    let (slot, pin, gsi, bar) = open_intx(bi)?;
    ack_in_handler(bar, INTX_BIT);
    enable_interrupts();
    let start = irqs(1);
    for round in 0..3 {
        let before = irqs(1);
        w(bar + IRQ_RAISE, INTX_BIT);
        if !wait_irq(1, before) {
            return Err(err(format_args!(
                "No INTx interrupt in round {round} on GSI {gsi} (edu irq status {:#x})",
                r::<u32>(bar + IRQ_STATUS)
            )));
        }
        timer::delay_us(10_000);
        let status: u32 = r(bar + IRQ_STATUS);
        if status != 0 {
            return Err(err(format_args!(
                "edu irq status {status:#x} after the handler's acknowledgement in round {round}"
            )));
        }
    }
    let got = irqs(1) - start;
    if got != 3 {
        return Err(err(format_args!(
            "{got} INTx interrupts for 3 raises (each acknowledged before its EOI)"
        )));
    }
    Ok(Detail::fmt(format_args!(
        "slot={slot} pin={pin} gsi={gsi} rounds=3 irqs={got}"
    )))
}

/// `vfio-edu-intx-storm`: a guest that never acknowledges its level-triggered interrupt.
/// edu's INTx is raised and left pending for `tvm.ms=N` ms (default 500) while the handler
/// only EOIs, so the line fires again after every EOI (each time through VFIO's unmask at
/// KVM's resample and its re-sent trigger); the count is the storm's size. Then the guest
/// acknowledges: the storm must stop (at most one interrupt already on its way), and one
/// more raise, acknowledged by the handler, must arrive exactly once.
pub fn intx_storm(bi: &BootInfo) -> Result<Detail, Detail> {
    let ms: u64 = crate::bootinfo::cmdline_param(bi.cmdline(), "tvm.ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let (slot, _pin, gsi, bar) = open_intx(bi)?;
    ack_in_handler(bar, 0);
    enable_interrupts();
    let before = irqs(1);
    let t0 = crate::io::rdtsc();
    w(bar + IRQ_RAISE, INTX_BIT);
    timer::delay_us(ms * 1000);
    let storm = irqs(1) - before;
    let elapsed_us = (crate::io::rdtsc() - t0) * 1000 / timer::tsc_per_ms().max(1);
    w(bar + IRQ_ACK, INTX_BIT);
    timer::delay_us(50_000);
    let settled = irqs(1);
    timer::delay_us(100_000);
    let after = irqs(1) - settled;
    let tail = settled - before - storm;
    if storm == 0 {
        return Err(err(format_args!(
            "No INTx interrupt on GSI {gsi} in {ms} ms"
        )));
    }
    if after != 0 || tail > 1 {
        return Err(err(format_args!(
            "the line kept firing after the acknowledgement: {tail} within 50 ms, {after} in the next 100 ms"
        )));
    }
    ack_in_handler(bar, INTX_BIT);
    let b = irqs(1);
    w(bar + IRQ_RAISE, INTX_BIT);
    if !wait_irq(1, b) {
        return Err(err(format_args!("No INTx interrupt after the storm")));
    }
    timer::delay_us(10_000);
    let last = irqs(1) - b;
    if last != 1 {
        return Err(err(format_args!(
            "{last} interrupts for the raise after the storm"
        )));
    }
    Ok(Detail::fmt(format_args!(
        "slot={slot} gsi={gsi} storm={storm} storm_ms={} per_second={} tail={tail}",
        elapsed_us / 1000,
        u64::from(storm) * 1_000_000 / elapsed_us.max(1)
    )))
}
