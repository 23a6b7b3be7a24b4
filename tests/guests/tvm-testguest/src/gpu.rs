//! `vfio-model`: the model GPU that a test build of tenantvm-vmm passes through
//! (`--device model-gpu`): the guest enumerates it, checks the configuration space the
//! VMM shows (no multi-function bit, SR-IOV/ReBAR/ARI hidden, ROM empty), sizes its BARs,
//! reads and writes BAR0 registers (trapped), BAR1 and BAR3 memory (mapped), moves BAR3,
//! takes MSI-X interrupts the model raises (a masked one pends until unmasked), and has the
//! model DMA a pattern into guest RAM it chose. Then it holds, so the host can read the
//! VMM's counters (trapped accesses, VMM-delivered interrupts) before stopping it.

use crate::bootinfo::BootInfo;
use crate::idt::IRQ_BASE;
use crate::pci::{self, ConfigAccess, CMD_MASTER, CMD_MEMORY};
use crate::report::Detail;
use crate::virtio::{dma_alloc, enable_interrupts, fill, irqs, r, w};
use crate::vtests::{check_dma, wait_irq};
use crate::{paging, timer};

const VENDOR: u16 = 0x10de;
const DEVICE: u16 = 0x2330;
const BOOT_0: u32 = 0x1800_00a1;
const GIB: u64 = 1 << 30;
/// Model registers in BAR0 (tenantvm-devices `pci::vfio::model`).
const SCRATCH: u64 = 0x04;
const IRQ_RAISE: u64 = 0x08;
const DMA_ADDR_LO: u64 = 0x10;
const DMA_ADDR_HI: u64 = 0x14;
const DMA_LEN: u64 = 0x18;
const DMA_PATTERN: u64 = 0x1c;
const DMA_GO: u64 = 0x20;
const DMA_STATUS: u64 = 0x24;
/// Interrupts raised per vector.
const RAISES: u32 = 10;
/// Writes to mapped BAR memory (the host checks they did not exit).
pub const MAPPED_WRITES: u64 = 1024;

fn err(args: core::fmt::Arguments<'_>) -> Detail {
    Detail::fmt(args)
}

fn bar64(cfg: ConfigAccess, slot: u8, off: u16) -> u64 {
    u64::from(cfg.read32(slot, off) & !0xf) | (u64::from(cfg.read32(slot, off + 4)) << 32)
}

/// Sizes a 64-bit BAR at `off` and puts `addr` back.
fn size64(cfg: ConfigAccess, slot: u8, off: u16, addr: u64) -> u64 {
    cfg.write32(slot, off, u32::MAX);
    cfg.write32(slot, off + 4, u32::MAX);
    let size = (!bar64(cfg, slot, off)).wrapping_add(1);
    cfg.write32(slot, off, addr as u32);
    cfg.write32(slot, off + 4, (addr >> 32) as u32);
    size
}

fn ext_cap_ids(cfg: ConfigAccess, slot: u8) -> [u16; 8] {
    let mut ids = [0xffff; 8];
    let mut off = 0x100u16;
    for id in ids.iter_mut() {
        let head = cfg.read32(slot, off);
        if head == 0 || head == u32::MAX {
            break;
        }
        *id = head as u16;
        let next = ((head >> 20) & 0xffc) as u16;
        if next < 0x100 {
            break;
        }
        off = next;
    }
    ids
}

/// Runs the test (see the module documentation).
pub fn run(bi: &BootInfo) -> Result<Detail, Detail> {
    check_dma(bi)?;
    let cfg = ConfigAccess::Ecam(pci::find_ecam()?);
    let f = pci::find(cfg, VENDOR, DEVICE).ok_or_else(|| {
        err(format_args!(
            "No model GPU {VENDOR:04x}:{DEVICE:04x} on bus 0"
        ))
    })?;
    let slot = f.slot;
    if cfg.read32(slot, 0x0c) & (1 << 23) != 0 {
        return Err(err(format_args!(
            "Header type shows the multi-function bit"
        )));
    }
    let ids = ext_cap_ids(cfg, slot);
    if ids.iter().any(|id| [0x000e, 0x0010, 0x0015].contains(id)) || !ids.contains(&0x0003) {
        return Err(err(format_args!(
            "Extended capabilities {ids:x?}: ARI/SR-IOV/ReBAR visible or DSN lost"
        )));
    }
    // BARs where the VMM placed them, then sized with decoding off as Linux does.
    let bar0 = u64::from(cfg.read32(slot, 0x10) & !0xf);
    let bar1 = bar64(cfg, slot, 0x14);
    let bar3 = bar64(cfg, slot, 0x1c);
    cfg.write16(slot, 0x04, 0);
    cfg.write32(slot, 0x10, u32::MAX);
    let size0 = u64::from(!(cfg.read32(slot, 0x10) & !0xf)) + 1;
    cfg.write32(slot, 0x10, bar0 as u32);
    let size1 = size64(cfg, slot, 0x14, bar1);
    let size3 = size64(cfg, slot, 0x1c, bar3);
    if (size0, size1, size3) != (16 << 20, 128 * GIB, 32 << 20) {
        return Err(err(format_args!(
            "BAR sizes {size0:#x} {size1:#x} {size3:#x}"
        )));
    }
    if !bar1.is_multiple_of(size1) || !bar3.is_multiple_of(size3) || !bar0.is_multiple_of(size0) {
        return Err(err(format_args!(
            "BARs not naturally aligned: {bar0:#x} {bar1:#x} {bar3:#x}"
        )));
    }
    cfg.write32(slot, 0x30, 0xffff_f801);
    if cfg.read32(slot, 0x30) != 0 {
        return Err(err(format_args!("The ROM BAR is not empty")));
    }
    cfg.write16(slot, 0x04, CMD_MEMORY | CMD_MASTER);

    // BAR0: the register page is trapped.
    let boot0: u32 = r(bar0);
    w(bar0 + SCRATCH, 0x5a5a_1234u32);
    let scratch: u32 = r(bar0 + SCRATCH);
    if boot0 != BOOT_0 || scratch != 0x5a5a_1234 {
        return Err(err(format_args!(
            "BAR0 boot0={boot0:#x} scratch={scratch:#x}"
        )));
    }

    // BAR1 and BAR3: mapped memory.
    paging::map_window(bar1, 0).ok_or_else(|| err(format_args!("Cannot map BAR1 at {bar1:#x}")))?;
    paging::map_window(bar3, 1).ok_or_else(|| err(format_args!("Cannot map BAR3 at {bar3:#x}")))?;
    for i in 0..MAPPED_WRITES {
        w(bar1 + i * 8, i ^ 0xb1b1_0000);
    }
    w(bar1 + GIB - 8, 0x1111_2222_3333_4444u64);
    w(bar3 + 0x100, 0xb3b3_b3b3u32);
    let sum = (0..MAPPED_WRITES)
        .filter(|&i| r::<u64>(bar1 + i * 8) == i ^ 0xb1b1_0000)
        .count() as u64;
    if sum != MAPPED_WRITES || r::<u64>(bar1 + GIB - 8) != 0x1111_2222_3333_4444 {
        return Err(err(format_args!(
            "BAR1 read back {sum} of {MAPPED_WRITES} words"
        )));
    }

    // Move BAR3 (a mapped one) 128 GiB up; its memory follows.
    let moved = bar1 + 128 * GIB;
    cfg.write16(slot, 0x04, 0);
    cfg.write32(slot, 0x1c, moved as u32 | 0xc);
    cfg.write32(slot, 0x20, (moved >> 32) as u32);
    cfg.write16(slot, 0x04, CMD_MEMORY | CMD_MASTER);
    paging::map_window(moved, 2).ok_or_else(|| err(format_args!("Cannot map {moved:#x}")))?;
    let after: u32 = r(moved + 0x100);
    if after != 0xb3b3_b3b3 {
        return Err(err(format_args!(
            "BAR3 moved to {moved:#x} reads {after:#x}"
        )));
    }

    // MSI-X: vectors 0-3 to this CPU, vector 3 masked; enable.
    let mut cap = 0u16;
    pci::capabilities(cfg, slot, |ptr, id| {
        if id == 0x11 {
            cap = ptr;
        }
    });
    if cap == 0 {
        return Err(err(format_args!("No MSI-X capability")));
    }
    let table = cfg.read32(slot, cap + 4);
    if table & 7 != 0 {
        return Err(err(format_args!("MSI-X table not in BAR0 ({table:#x})")));
    }
    let table = bar0 + u64::from(table & !7);
    for v in 0..4u64 {
        w(table + 16 * v, 0xfee0_0000u32);
        w(table + 16 * v + 4, 0u32);
        w(table + 16 * v + 8, u32::from(IRQ_BASE) + v as u32);
        w(table + 16 * v + 12, u32::from(v == 3));
    }
    let control = cfg.read32(slot, cap);
    cfg.write32(slot, cap, control | (1 << 31));
    enable_interrupts();
    for v in 0..3u16 {
        let before = irqs(v);
        for _ in 0..RAISES {
            w(bar0 + IRQ_RAISE, u32::from(v));
        }
        let deadline = timer::deadline_ms(5_000);
        while irqs(v) < before + 1 && !timer::expired(deadline) {
            core::hint::spin_loop();
        }
        if irqs(v) == before {
            return Err(err(format_args!("No interrupt on vector {v}")));
        }
    }
    let before = irqs(3);
    w(bar0 + IRQ_RAISE, 3u32);
    timer::delay_us(50_000);
    if irqs(3) != before {
        return Err(err(format_args!("Masked vector 3 interrupted")));
    }
    w(table + 16 * 3 + 12, 0u32);
    if !wait_irq(3, before) {
        return Err(err(format_args!(
            "Vector 3's interrupt was lost while masked"
        )));
    }

    // DMA into guest RAM at an address the guest chose; not without bus mastering.
    let buf = dma_alloc(4096, 4096)?;
    fill(buf, 4096, 0);
    let start_dma = |len: u32| {
        w(bar0 + DMA_ADDR_LO, buf as u32);
        w(bar0 + DMA_ADDR_HI, (buf >> 32) as u32);
        w(bar0 + DMA_LEN, len);
        w(bar0 + DMA_PATTERN, 0xc0ff_ee11u32);
        w(bar0 + DMA_GO, 1u32);
        r::<u32>(bar0 + DMA_STATUS)
    };
    cfg.write16(slot, 0x04, CMD_MEMORY);
    let refused = start_dma(256);
    cfg.write16(slot, 0x04, CMD_MEMORY | CMD_MASTER);
    let status = start_dma(256);
    let good = (0..64).all(|i| r::<u32>(buf + 4 * i) == 0xc0ff_ee11);
    let untouched = r::<u32>(buf + 256) == 0;
    if refused != 3 || status != 1 || !good || !untouched {
        return Err(err(format_args!(
            "DMA: without bus mastering {refused}, with {status}, pattern {good}, beyond {untouched}"
        )));
    }
    let total: u32 = (0..4).map(irqs).sum();
    Ok(Detail::fmt(format_args!(
        "slot={slot} bar0={bar0:#x} bar1={bar1:#x} bar3={bar3:#x} size1={size1:#x} boot0={boot0:#x} moved=1 irqs={total} masked_pending=1 dma=256 mapped_writes={MAPPED_WRITES}"
    )))
}

/// `vfio-irq-bench`: `tvm.n=N` (default 20000) MSI-X round trips with the model GPU: ring
/// its doorbell (a trapped BAR0 write), wait for the interrupt (device eventfd -> KVM irqfd
/// -> this CPU). Prints `GO` and `END` around the loop (the host reads the VMM threads'
/// context switches in between) and reports the rate by the TSC.
pub fn irq_bench(bi: &BootInfo) -> Result<Detail, Detail> {
    let n: u32 = crate::bootinfo::cmdline_param(bi.cmdline(), "tvm.n")
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let cfg = ConfigAccess::Ecam(pci::find_ecam()?);
    let f = pci::find(cfg, VENDOR, DEVICE).ok_or_else(|| {
        err(format_args!(
            "No model GPU {VENDOR:04x}:{DEVICE:04x} on bus 0"
        ))
    })?;
    let slot = f.slot;
    let bar0 = u64::from(cfg.read32(slot, 0x10) & !0xf);
    cfg.write16(slot, 0x04, CMD_MEMORY | CMD_MASTER);
    let mut cap = 0u16;
    pci::capabilities(cfg, slot, |ptr, id| {
        if id == 0x11 {
            cap = ptr;
        }
    });
    if cap == 0 {
        return Err(err(format_args!("No MSI-X capability")));
    }
    let table = bar0 + u64::from(cfg.read32(slot, cap + 4) & !7);
    w(table, 0xfee0_0000u32);
    w(table + 4, 0u32);
    w(table + 8, u32::from(IRQ_BASE));
    w(table + 12, 0u32);
    let control = cfg.read32(slot, cap);
    cfg.write32(slot, cap, control | (1 << 31));
    enable_interrupts();
    crate::println!("TVMTEST vfio-irq-bench GO");
    let start = crate::io::rdtsc();
    for i in 0..n {
        let before = irqs(0);
        w(bar0 + IRQ_RAISE, 0u32);
        let deadline = timer::deadline_ms(5_000);
        while irqs(0) == before {
            if timer::expired(deadline) {
                return Err(err(format_args!("Interrupt {i} of {n} never came")));
            }
            core::hint::spin_loop();
        }
    }
    let ticks = crate::io::rdtsc() - start;
    crate::println!("TVMTEST vfio-irq-bench END");
    let us = ticks * 1000 / timer::tsc_per_ms().max(1);
    Ok(Detail::fmt(format_args!(
        "n={n} us={us} per_second={}",
        u64::from(n) * 1_000_000 / us.max(1)
    )))
}

/// `pci-list`: every function on bus 0 as `ids=vvvv:dddd,...` (slot order), for the gated
/// real-device test to find the device it passed through.
pub fn list(_bi: &BootInfo) -> Result<Detail, Detail> {
    use core::fmt::Write;
    let cfg = ConfigAccess::Ecam(pci::find_ecam()?);
    let mut d = Detail::new();
    let _ = write!(d, "ids=");
    let mut n = 0;
    for slot in 0..32u8 {
        let id = cfg.read32(slot, 0);
        if id == u32::MAX {
            continue;
        }
        let _ = write!(
            d,
            "{}{:04x}:{:04x}",
            if n == 0 { "" } else { "," },
            id as u16,
            id >> 16
        );
        n += 1;
    }
    let _ = write!(d, " functions={n}");
    Ok(d)
}
