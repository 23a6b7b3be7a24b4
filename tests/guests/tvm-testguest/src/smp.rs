//! The `smp` test: read the MP table, start every listed application processor with
//! INIT-SIPI-SIPI through the local APIC and a real-mode trampoline, and collect the APIC id
//! each AP reads from its own local APIC.

use crate::bootinfo::{BootInfo, PhysRead};
use crate::io::{halt_forever, rdmsr, wrmsr};
use crate::mptable::{self, MpConfig, MAX_CPUS};
use crate::phys::Phys;
use crate::report::Detail;
use crate::timer::{deadline_ms, delay_us, expired};
use core::arch::global_asm;
use core::fmt::Write;
use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Where the real-mode trampoline is copied; the SIPI vector is this address >> 12.
const TRAMPOLINE_BASE: u64 = 0x8000;
const AP_STACK_SIZE: usize = 16 * 1024;
const NOT_REPORTED: u32 = u32::MAX;

const IA32_APIC_BASE: u32 = 0x1b;
const LAPIC_ID: u64 = 0x20;
const LAPIC_SVR: u64 = 0xf0;
const LAPIC_ICR_LOW: u64 = 0x300;
const LAPIC_ICR_HIGH: u64 = 0x310;
const ICR_INIT: u32 = 0x0000_4500;
const ICR_STARTUP: u32 = 0x0000_4600;
const ICR_PENDING: u32 = 1 << 12;

/// Stack top for the AP being started; read by the trampoline.
static AP_STACK_TOP: AtomicU64 = AtomicU64::new(0);
/// Slot (index into the MP table's CPU list) of the AP being started.
static AP_SLOT: AtomicUsize = AtomicUsize::new(0);
/// Set by the AP once it runs Rust code.
static AP_STARTED: AtomicBool = AtomicBool::new(false);
/// The APIC id each slot's AP read from its local APIC.
static REPORTED: [AtomicU32; MAX_CPUS] = [const { AtomicU32::new(NOT_REPORTED) }; MAX_CPUS];
/// Local APIC base (xAPIC) or 0 in x2APIC mode.
static LAPIC_BASE: AtomicU64 = AtomicU64::new(0);

#[repr(C, align(16))]
struct ApStacks([[u8; AP_STACK_SIZE]; MAX_CPUS]);
/// Not zeroed at boot (see linker.ld): a stack needs no initial contents.
#[link_section = ".noinit.ap_stacks"]
static mut AP_STACKS: ApStacks = ApStacks([[0; AP_STACK_SIZE]; MAX_CPUS]);

#[cfg(target_os = "none")]
global_asm!(
    r#"
    .set TRAMP_BASE, {base}
    .section .rodata.trampoline, "a"
    .p2align 4
    .global tvm_trampoline_start
    .global tvm_trampoline_end
    .code16
tvm_trampoline_start:
    cli
    cld
    xorw %ax, %ax
    movw %ax, %ds
    lgdtl (TRAMP_BASE + tramp_gdtr - tvm_trampoline_start)
    movl %cr4, %eax
    orl $0x20, %eax
    movl %eax, %cr4
    movl (TRAMP_BASE + tramp_cr3 - tvm_trampoline_start), %eax
    movl %eax, %cr3
    movl $0xC0000080, %ecx
    rdmsr
    orl $0x100, %eax
    wrmsr
    movl %cr0, %eax
    andl $0x9fffffff, %eax
    orl $0x80000001, %eax
    movl %eax, %cr0
    ljmpl $0x08, $(TRAMP_BASE + tramp64 - tvm_trampoline_start)
    .code64
tramp64:
    movw $0x10, %ax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    movw %ax, %fs
    movw %ax, %gs
    movabsq ${stack_top}, %rax
    movq (%rax), %rsp
    movabsq ${entry}, %rax
    call *%rax
1:  cli
    hlt
    jmp 1b
    .p2align 3
tramp_gdt:
    .quad 0
    .quad 0x00af9a000000ffff
    .quad 0x00cf92000000ffff
tramp_gdtr:
    .word 23
    .long TRAMP_BASE + tramp_gdt - tvm_trampoline_start
tramp_cr3:
    .long pml4
tvm_trampoline_end:
"#,
    base = const TRAMPOLINE_BASE,
    stack_top = sym AP_STACK_TOP,
    entry = sym ap_entry,
    options(att_syntax)
);

#[cfg(target_os = "none")]
extern "C" {
    static tvm_trampoline_start: u8;
    static tvm_trampoline_end: u8;
}

/// The local APIC, in whichever mode the VMM left it.
#[derive(Clone, Copy)]
enum Lapic {
    X(u64),
    X2,
}

impl Lapic {
    fn current() -> Self {
        match LAPIC_BASE.load(Ordering::Relaxed) {
            0 => Lapic::X2,
            base => Lapic::X(base),
        }
    }

    fn read(self, reg: u64) -> u32 {
        match self {
            // SAFETY: the xAPIC page lies inside the identity-mapped first 4 GiB and reads of
            // its registers have no side effects we rely on.
            Lapic::X(base) => unsafe { core::ptr::read_volatile((base + reg) as *const u32) },
            Lapic::X2 => rdmsr(0x800 + (reg >> 4) as u32) as u32,
        }
    }

    fn write(self, reg: u64, value: u32) {
        match self {
            // SAFETY: as for `read`; the registers written (SVR, ICR) belong to this CPU.
            Lapic::X(base) => unsafe { core::ptr::write_volatile((base + reg) as *mut u32, value) },
            Lapic::X2 => wrmsr(0x800 + (reg >> 4) as u32, u64::from(value)),
        }
    }

    fn id(self) -> u32 {
        match self {
            Lapic::X(_) => self.read(LAPIC_ID) >> 24,
            Lapic::X2 => self.read(LAPIC_ID),
        }
    }

    fn send_ipi(self, dest: u8, command: u32) {
        match self {
            Lapic::X(_) => {
                self.write(LAPIC_ICR_HIGH, u32::from(dest) << 24);
                self.write(LAPIC_ICR_LOW, command);
                for _ in 0..1_000_000 {
                    if self.read(LAPIC_ICR_LOW) & ICR_PENDING == 0 {
                        break;
                    }
                    core::hint::spin_loop();
                }
            }
            Lapic::X2 => wrmsr(0x830, (u64::from(dest) << 32) | u64::from(command)),
        }
    }
}

/// Where the AP lands in long mode, on its own stack.
extern "C" fn ap_entry() -> ! {
    crate::idt::load();
    let id = Lapic::current().id();
    let slot = AP_SLOT.load(Ordering::Acquire);
    REPORTED[slot].store(id, Ordering::Release);
    AP_STARTED.store(true, Ordering::Release);
    halt_forever()
}

fn find_mp_config() -> Result<MpConfig, Detail> {
    let mem = Phys;
    let mut ebda_seg = [0u8; 2];
    let mut areas: [(u64, u64); 3] = [(0x9fc00, 0x400), (0xf0000, 0x10000), (0, 0)];
    if mem.read(0x40e, &mut ebda_seg).is_ok() {
        let ebda = u64::from(u16::from_le_bytes(ebda_seg)) << 4;
        if (0x1000..0xa0000).contains(&ebda) && ebda != 0x9fc00 {
            areas[2] = (ebda, 0x400);
        }
    }
    let mut chunk = [0u8; 1024];
    let mut config = None;
    'search: for (start, len) in areas {
        let mut off = 0;
        while off < len {
            if mem.read(start + off, &mut chunk).is_err() {
                break;
            }
            match mptable::find_floating_pointer(&chunk) {
                Ok(Some(ptr)) => {
                    config = Some(ptr);
                    break 'search;
                }
                Ok(None) => {}
                Err(e) => return Err(Detail::fmt(format_args!("{e}"))),
            }
            off += chunk.len() as u64;
        }
    }
    let ptr = u64::from(config.ok_or_else(|| {
        Detail::fmt(format_args!("{}", mptable::MpTableError::NoFloatingPointer))
    })?);
    let mut header = [0u8; 44];
    mem.read(ptr, &mut header)
        .map_err(|e| Detail::fmt(format_args!("MP configuration table at {ptr:#x}: {e}")))?;
    let len = mptable::config_length(&header).map_err(|e| Detail::fmt(format_args!("{e}")))?;
    let mut table = [0u8; 4096];
    let table = table.get_mut(..len).ok_or_else(|| {
        Detail::fmt(format_args!(
            "MP configuration table is {len} bytes, more than 4096"
        ))
    })?;
    mem.read(ptr, table)
        .map_err(|e| Detail::fmt(format_args!("MP configuration table at {ptr:#x}: {e}")))?;
    mptable::parse_config(table).map_err(|e| Detail::fmt(format_args!("{e}")))
}

#[cfg(target_os = "none")]
fn install_trampoline() -> usize {
    let (start, end) = (
        core::ptr::addr_of!(tvm_trampoline_start) as usize,
        core::ptr::addr_of!(tvm_trampoline_end) as usize,
    );
    let len = end - start;
    // SAFETY: the caller checked that the trampoline page is RAM; the boot information that
    // may have lived there was copied out at boot, and the guest image lies above 1 MiB.
    unsafe { core::ptr::copy_nonoverlapping(start as *const u8, TRAMPOLINE_BASE as *mut u8, len) };
    len
}

#[cfg(not(target_os = "none"))]
fn install_trampoline() -> usize {
    0
}

fn stack_top(slot: usize) -> u64 {
    let base = core::ptr::addr_of!(AP_STACKS) as u64;
    base + ((slot + 1) * AP_STACK_SIZE) as u64
}

/// Starts one AP and waits for it to report.
fn start_ap(lapic: Lapic, slot: usize, apic_id: u8) -> bool {
    AP_SLOT.store(slot, Ordering::Release);
    AP_STACK_TOP.store(stack_top(slot), Ordering::Release);
    AP_STARTED.store(false, Ordering::Release);
    let vector = (TRAMPOLINE_BASE >> 12) as u32;
    lapic.send_ipi(apic_id, ICR_INIT);
    delay_us(10_000);
    lapic.send_ipi(apic_id, ICR_STARTUP | vector);
    let first = deadline_ms(5);
    while !expired(first) {
        if AP_STARTED.load(Ordering::Acquire) {
            return true;
        }
        core::hint::spin_loop();
    }
    lapic.send_ipi(apic_id, ICR_STARTUP | vector);
    let deadline = deadline_ms(5_000);
    while !expired(deadline) {
        if AP_STARTED.load(Ordering::Acquire) {
            return true;
        }
        core::hint::spin_loop();
    }
    false
}

/// Runs the `smp` test; `Ok` carries the PASS detail, `Err` the FAIL reason.
pub fn run(bi: &BootInfo) -> Result<Detail, Detail> {
    let cfg = find_mp_config()?;
    let apic_base = rdmsr(IA32_APIC_BASE);
    if apic_base & (1 << 11) == 0 {
        return Err(Detail::fmt(format_args!(
            "The local APIC is globally disabled (IA32_APIC_BASE={apic_base:#x})"
        )));
    }
    let x2apic = apic_base & (1 << 10) != 0;
    LAPIC_BASE.store(
        if x2apic { 0 } else { apic_base & 0xffff_f000 },
        Ordering::Relaxed,
    );
    let lapic = Lapic::current();
    lapic.write(LAPIC_SVR, lapic.read(LAPIC_SVR) | 0x100);
    let bsp_id = lapic.id();
    if !cfg.cpus().iter().any(|c| u32::from(c.apic_id) == bsp_id) {
        return Err(Detail::fmt(format_args!(
            "The BSP's APIC id {bsp_id} is not in the MP table"
        )));
    }
    if !bi.is_ram(TRAMPOLINE_BASE, TRAMPOLINE_BASE + 0x1000) {
        return Err(Detail::fmt(format_args!(
            "The AP trampoline page {TRAMPOLINE_BASE:#x} is not RAM in the memory map"
        )));
    }
    install_trampoline();
    let mut missing = Detail::new();
    let mut missing_count = 0;
    for (slot, cpu) in cfg.cpus().iter().enumerate() {
        if u32::from(cpu.apic_id) == bsp_id {
            REPORTED[slot].store(bsp_id, Ordering::Release);
            continue;
        }
        if !start_ap(lapic, slot, cpu.apic_id) {
            let _ = write!(
                missing,
                "{}{}",
                if missing_count == 0 { "" } else { "," },
                cpu.apic_id
            );
            missing_count += 1;
        }
    }
    if missing_count > 0 {
        return Err(Detail::fmt(format_args!(
            "{} of {} CPUs did not come up: apic ids {}",
            missing_count,
            cfg.cpus().len(),
            missing.as_str()
        )));
    }
    let mut detail = Detail::new();
    let _ = write!(detail, "cpus={} apic_ids=", cfg.cpus().len());
    for (slot, cpu) in cfg.cpus().iter().enumerate() {
        let got = REPORTED[slot].load(Ordering::Acquire);
        if got != u32::from(cpu.apic_id) {
            return Err(Detail::fmt(format_args!(
                "The CPU listed with APIC id {} reports APIC id {}",
                cpu.apic_id, got
            )));
        }
        let _ = write!(detail, "{}{}", if slot == 0 { "" } else { "," }, got);
    }
    let _ = write!(
        detail,
        " bsp={} lapic={} mp_lapic_address={:#x} ioapics={}",
        bsp_id,
        if x2apic { "x2apic" } else { "xapic" },
        cfg.lapic_address,
        cfg.ioapics
    );
    Ok(detail)
}
