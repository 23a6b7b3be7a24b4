//! Initial architectural state of the boot vCPU: GDT, identity page tables, segment and
//! control registers for the 64-bit Linux entry or PVH's 32-bit entry, MSRs, FPU, LAPIC.

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::boot::layout::{
    BOOT_STACK_POINTER, GDT_START, IDENTITY_MAP_SIZE, IDT_START, PDE_START, PDPTE_START,
    PML4_START, PVH_INFO_START, ZERO_PAGE_START,
};
use crate::boot::EntryPoint;

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_IA32_MISC_ENABLE_FAST_STRING: u64 = 0x1;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// MTRRs enabled, default type write-back.
const MTRR_ENABLE_DEFAULT_WB: u64 = (1 << 11) | 6;

/// LAPIC register offsets and LVT delivery modes.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// Builds a GDT entry from flags, base and limit (Intel SDM vol. 3, 3.4.5).
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((flags as u64 & 0xf0ff) << 40)
}

fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let bit = |shift: u64| ((entry >> shift) & 1) as u8;
    kvm_segment {
        base: ((entry >> 16) & 0xff_ffff) | (((entry >> 56) & 0xff) << 24),
        limit: {
            let raw = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
            if bit(55) == 1 {
                (raw << 12) | 0xfff
            } else {
                raw
            }
        },
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: bit(47),
        dpl: ((entry >> 45) & 0x3) as u8,
        db: bit(54),
        s: bit(44),
        l: bit(53),
        g: bit(55),
        avl: bit(52),
        unusable: if bit(47) == 1 { 0 } else { 1 },
        padding: 0,
    }
}

/// The GDT for an entry point: null, code, data, TSS.
fn gdt_for(entry: EntryPoint) -> [u64; 4] {
    match entry {
        EntryPoint::Linux64 { .. } => [
            gdt_entry(0, 0, 0),
            gdt_entry(0xa09b, 0, 0xfffff), // 64-bit code
            gdt_entry(0xc093, 0, 0xfffff), // data
            gdt_entry(0x808b, 0, 0xfffff), // TSS
        ],
        EntryPoint::Pvh { .. } => [
            gdt_entry(0, 0, 0),
            gdt_entry(0xc09b, 0, 0xfffff), // 32-bit code, 4 GiB
            gdt_entry(0xc093, 0, 0xfffff), // data, 4 GiB
            gdt_entry(0x008b, 0, 0x67),    // TSS
        ],
    }
}

/// Writes the GDT, an empty IDT and (for the 64-bit entry) the identity map, and returns
/// the special registers to enter `entry` with.
pub fn setup_sregs(
    mem: &GuestMemoryMmap,
    entry: EntryPoint,
    mut sregs: kvm_sregs,
) -> Result<kvm_sregs, vm_memory::GuestMemoryError> {
    let gdt = gdt_for(entry);
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(GDT_START + 8 * i as u64))?;
    }
    mem.write_obj(0u64, GuestAddress(IDT_START))?;
    sregs.gdt.base = GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&gdt) - 1) as u16;
    sregs.idt.base = IDT_START;
    sregs.idt.limit = 7;
    let code = segment_from_gdt(gdt[1], 1);
    let data = segment_from_gdt(gdt[2], 2);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment_from_gdt(gdt[3], 3);
    match entry {
        EntryPoint::Linux64 { .. } => {
            write_identity_map(mem)?;
            sregs.cr3 = PML4_START;
            sregs.cr4 |= X86_CR4_PAE;
            sregs.cr0 |= X86_CR0_PE | X86_CR0_PG | X86_CR0_ET;
            sregs.efer |= EFER_LME | EFER_LMA;
        }
        EntryPoint::Pvh { .. } => {
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
            sregs.cr3 = 0;
            sregs.cr4 = 0;
            sregs.efer = 0;
        }
    }
    Ok(sregs)
}

/// Identity-maps [`IDENTITY_MAP_SIZE`] bytes with 2 MiB pages: PML4 -> PDPT -> 4 PDs.
fn write_identity_map(mem: &GuestMemoryMmap) -> Result<(), vm_memory::GuestMemoryError> {
    const PRESENT_RW: u64 = 0x3;
    const HUGE: u64 = 0x80;
    mem.write_obj(PDPTE_START | PRESENT_RW, GuestAddress(PML4_START))?;
    let tables = IDENTITY_MAP_SIZE >> 30;
    for pd in 0..tables {
        let pd_addr = PDE_START + pd * 0x1000;
        mem.write_obj(pd_addr | PRESENT_RW, GuestAddress(PDPTE_START + pd * 8))?;
        for i in 0..512u64 {
            let phys = (pd << 30) | (i << 21);
            mem.write_obj(phys | PRESENT_RW | HUGE, GuestAddress(pd_addr + i * 8))?;
        }
    }
    Ok(())
}

/// General registers to enter `entry` with.
pub fn boot_regs(entry: EntryPoint) -> kvm_regs {
    match entry {
        EntryPoint::Linux64 { entry } => kvm_regs {
            rflags: 0x2,
            rip: entry,
            rsp: BOOT_STACK_POINTER,
            rbp: BOOT_STACK_POINTER,
            rsi: ZERO_PAGE_START,
            ..Default::default()
        },
        EntryPoint::Pvh { entry } => kvm_regs {
            rflags: 0x2,
            rip: entry,
            rbx: PVH_INFO_START,
            ..Default::default()
        },
    }
}

/// The FPU state after reset, as Linux expects it.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

/// MSRs every vCPU starts with.
pub fn boot_msrs() -> Result<Msrs, vmm_sys_util::fam::Error> {
    let entry = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    let entries = [
        entry(MSR_IA32_SYSENTER_CS, 0),
        entry(MSR_IA32_SYSENTER_ESP, 0),
        entry(MSR_IA32_SYSENTER_EIP, 0),
        entry(MSR_STAR, 0),
        entry(MSR_CSTAR, 0),
        entry(MSR_KERNEL_GS_BASE, 0),
        entry(MSR_SYSCALL_MASK, 0),
        entry(MSR_LSTAR, 0),
        entry(MSR_IA32_TSC, 0),
        entry(MSR_IA32_MISC_ENABLE, MSR_IA32_MISC_ENABLE_FAST_STRING),
        entry(MSR_MTRR_DEF_TYPE, MTRR_ENABLE_DEFAULT_WB),
    ];
    Msrs::from_entries(&entries)
}

/// Sets LINT0 to ExtINT (the 8259's output) and LINT1 to NMI, as on a PC.
pub fn set_lint(lapic: &mut kvm_bindings::kvm_lapic_state) {
    for (offset, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let reg = &mut lapic.regs[offset..offset + 4];
        let bytes: Vec<u8> = reg.iter().map(|b| *b as u8).collect();
        let value = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let value = (value & !0x700) | (mode << 8);
        for (dst, src) in reg.iter_mut().zip(value.to_le_bytes()) {
            *dst = src as _;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap()
    }

    #[test]
    fn linux64_entry_uses_long_mode_and_identity_map() {
        let m = mem();
        let sregs = setup_sregs(
            &m,
            EntryPoint::Linux64 { entry: 0x100_0000 },
            kvm_sregs::default(),
        )
        .unwrap();
        assert_eq!(sregs.cs.l, 1);
        assert_eq!(sregs.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!(sregs.cr3, PML4_START);
        let pml4: u64 = m.read_obj(GuestAddress(PML4_START)).unwrap();
        assert_eq!(pml4, PDPTE_START | 3);
        // The last 2 MiB page of the 4th GiB maps to itself.
        let last: u64 = m
            .read_obj(GuestAddress(PDE_START + 3 * 0x1000 + 511 * 8))
            .unwrap();
        assert_eq!(last & !0xfff, 0xffe0_0000);
        let regs = boot_regs(EntryPoint::Linux64 { entry: 0x100_0000 });
        assert_eq!((regs.rip, regs.rsi), (0x100_0000, ZERO_PAGE_START));
    }

    #[test]
    fn pvh_entry_is_flat_32bit_protected_mode() {
        let m = mem();
        let sregs = setup_sregs(
            &m,
            EntryPoint::Pvh { entry: 0x100_0000 },
            kvm_sregs::default(),
        )
        .unwrap();
        assert_eq!(
            (sregs.cs.l, sregs.cs.db, sregs.cs.limit),
            (0, 1, 0xffff_ffff)
        );
        assert_eq!(sregs.cr0, X86_CR0_PE | X86_CR0_ET);
        assert_eq!(sregs.efer, 0);
        assert_eq!(
            boot_regs(EntryPoint::Pvh { entry: 0x100_0000 }).rbx,
            PVH_INFO_START
        );
    }

    #[test]
    fn lint0_is_extint_and_lint1_is_nmi() {
        let mut lapic = kvm_bindings::kvm_lapic_state::default();
        set_lint(&mut lapic);
        assert_eq!((lapic.regs[APIC_LVT0 + 1] as u8) & 0x7, 7);
        assert_eq!((lapic.regs[APIC_LVT1 + 1] as u8) & 0x7, 4);
    }
}
