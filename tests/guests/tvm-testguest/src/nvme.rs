//! `vfio-nvme`: an NVMe controller passed through by tenantvm-vmm with real kernel VFIO
//! (the nested host's `vfio-passthrough` scenario: QEMU's nvme, 1b36:0010; its
//! `gpu-vgpu-sriov` scenario: a virtual function of QEMU's SR-IOV nvme, `vfio-nvme-hold`):
//! the first function of the NVMe class on bus 0; the guest brings the controller up with an
//! admin queue pair in its RAM, points MSI-X vector 0 at itself, submits Identify Controller
//! and waits for the completion interrupt. That exercises the MSI-X table (in a trapped page
//! of BAR0) on a real device, the mapped doorbells, and DMA both ways. The report names the
//! function's ids (`pci=`) and the controller id Identify gives (`cntlid=`: a secondary
//! controller's, on a VF).

use crate::bootinfo::BootInfo;
use crate::idt::IRQ_BASE;
use crate::pci::{self, ConfigAccess, CMD_MASTER, CMD_MEMORY};
use crate::report::Detail;
use crate::virtio::{dma_alloc, enable_interrupts, fill, irqs, r, w};
use crate::vtests::{check_dma, wait_irq};
use crate::{paging, timer};

/// Class code of an NVMe controller (mass storage, non-volatile memory, NVM Express).
const NVME_CLASS: u32 = 0x01_08_02;
/// Controller registers.
const CAP: u64 = 0x00;
const CC: u64 = 0x14;
const CSTS: u64 = 0x1c;
const AQA: u64 = 0x24;
const ASQ: u64 = 0x28;
const ACQ: u64 = 0x30;
const DOORBELLS: u64 = 0x1000;
const QUEUE_ENTRIES: u64 = 8;

fn err(args: core::fmt::Arguments<'_>) -> Detail {
    Detail::fmt(args)
}

fn wait_ready(bar: u64, ready: bool) -> Result<(), Detail> {
    let deadline = timer::deadline_ms(10_000);
    while (r::<u32>(bar + CSTS) & 1 != 0) != ready {
        if timer::expired(deadline) {
            return Err(err(format_args!(
                "nvme CSTS.RDY did not become {} (CSTS {:#x})",
                u8::from(ready),
                r::<u32>(bar + CSTS)
            )));
        }
        core::hint::spin_loop();
    }
    Ok(())
}

/// Runs the test (see the module documentation).
pub fn run(bi: &BootInfo) -> Result<Detail, Detail> {
    check_dma(bi)?;
    let cfg = ConfigAccess::Ecam(pci::find_ecam()?);
    let f = pci::find_class(cfg, NVME_CLASS).ok_or_else(|| {
        err(format_args!(
            "No NVMe controller (class {NVME_CLASS:06x}) on bus 0"
        ))
    })?;
    let slot = f.slot;
    let ids = cfg.read32(slot, 0);
    let (vendor, device) = (ids as u16, (ids >> 16) as u16);
    let lo = cfg.read32(slot, 0x10);
    let mut bar = u64::from(lo & !0xf);
    if lo & 0x6 == 0x4 {
        bar |= u64::from(cfg.read32(slot, 0x14)) << 32;
    }
    if bar >= 4 << 30 {
        paging::map_window(bar, 0).ok_or_else(|| err(format_args!("Cannot map BAR0 {bar:#x}")))?;
    }
    cfg.write16(slot, 0x04, CMD_MEMORY | CMD_MASTER);

    // MSI-X vector 0 to this CPU, MSI-X on.
    let mut cap = 0u16;
    pci::capabilities(cfg, slot, |ptr, id| {
        if id == 0x11 {
            cap = ptr;
        }
    });
    if cap == 0 {
        return Err(err(format_args!("nvme shows no MSI-X capability")));
    }
    let table_reg = cfg.read32(slot, cap + 4);
    if table_reg & 7 != 0 {
        return Err(err(format_args!("nvme's MSI-X table is not in BAR0")));
    }
    let table = bar + u64::from(table_reg & !7);
    w(table, 0xfee0_0000u32);
    w(table + 4, 0u32);
    w(table + 8, u32::from(IRQ_BASE));
    w(table + 12, 0u32);
    let control = cfg.read32(slot, cap);
    cfg.write32(slot, cap, control | (1 << 31));
    crate::io::outb(0x21, 0xff);
    crate::io::outb(0xa1, 0xff);
    enable_interrupts();

    // Controller reset, admin queues in guest RAM, enable.
    let capreg: u64 = r(bar + CAP);
    let stride = 4u64 << ((capreg >> 32) & 0xf);
    w(bar + CC, 0u32);
    wait_ready(bar, false)?;
    let sq = dma_alloc(4096, 4096)?;
    let cq = dma_alloc(4096, 4096)?;
    let data = dma_alloc(4096, 4096)?;
    fill(sq, 4096, 0);
    fill(cq, 4096, 0);
    fill(data, 4096, 0);
    w(
        bar + AQA,
        ((QUEUE_ENTRIES as u32 - 1) << 16) | (QUEUE_ENTRIES as u32 - 1),
    );
    w(bar + ASQ, sq);
    w(bar + ACQ, cq);
    // EN, 4 KiB pages, 64-byte SQ entries, 16-byte CQ entries.
    w(bar + CC, 1u32 | (6 << 16) | (4 << 20));
    wait_ready(bar, true)?;

    // Identify Controller (opcode 6, CNS 1), command id 0x42, into `data`.
    w(sq, 0x06u32 | (0x42 << 16));
    w(sq + 24, data);
    w(sq + 40, 1u32);
    let before = irqs(0);
    w(bar + DOORBELLS, 1u32);
    if !wait_irq(0, before) {
        return Err(err(format_args!(
            "No MSI-X interrupt for the Identify completion (CSTS {:#x})",
            r::<u32>(bar + CSTS)
        )));
    }
    let dw3: u32 = r(cq + 12);
    let status = dw3 >> 17;
    let cid = dw3 & 0xffff;
    if dw3 & (1 << 16) == 0 || status != 0 || cid != 0x42 {
        return Err(err(format_args!("Identify completion dw3={dw3:#x}")));
    }
    w(bar + DOORBELLS + stride, 1u32);
    let vid: u16 = r(data);
    let mut model = [0u8; 16];
    for (i, b) in model.iter_mut().enumerate() {
        *b = r(data + 24 + i as u64);
    }
    let model = core::str::from_utf8(&model).unwrap_or("?").trim_end();
    let cntlid: u16 = r(data + 78);
    if vid != vendor {
        return Err(err(format_args!(
            "Identify says vendor {vid:#x}, config space {vendor:#x}"
        )));
    }
    w(bar + CC, 0u32);
    Ok(Detail::fmt(format_args!(
        "slot={slot} pci={vendor:04x}:{device:04x} bar0={bar:#x} msix=1 identify_vid={vid:04x} cntlid={cntlid} model=\"{model}\""
    )))
}
