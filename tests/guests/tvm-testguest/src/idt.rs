//! CPU exceptions: an IDT whose 32 gates all lead to one handler that prints
//! `TVMTEST <test> PANIC CPU exception ...` with the vector, error code, RIP and CR2, then
//! reports a crash through pvpanic. Without it a fault in the guest (say, because the VMM
//! mapped memory wrongly) would be a silent triple fault.

#[cfg(target_os = "none")]
use core::arch::global_asm;

/// Number of architectural exception vectors.
const VECTORS: usize = 32;
/// Gates in the IDT: the exceptions, then room for the device interrupt vectors.
const IDT_GATES: usize = 0x50;
/// First device interrupt vector (MSI-X vectors of the virtio tests).
pub const IRQ_BASE: u8 = 0x40;
/// Number of device interrupt vectors.
pub const IRQ_COUNT: usize = 16;

/// Interrupts received per device vector (`IRQ_BASE + i`).
pub static IRQS: [core::sync::atomic::AtomicU32; IRQ_COUNT] =
    [const { core::sync::atomic::AtomicU32::new(0) }; IRQ_COUNT];
/// Bytes between two stubs in `isr_stubs`.
const STUB_SIZE: u64 = 16;

/// The conventional mnemonic of an exception vector.
pub fn vector_name(vector: u64) -> &'static str {
    const NAMES: [&str; 22] = [
        "#DE", "#DB", "NMI", "#BP", "#OF", "#BR", "#UD", "#NM", "#DF", "CSO", "#TS", "#NP", "#SS",
        "#GP", "#PF", "reserved", "#MF", "#AC", "#MC", "#XM", "#VE", "#CP",
    ];
    NAMES.get(vector as usize).copied().unwrap_or("reserved")
}

/// One interrupt gate: present, DPL 0, 64-bit interrupt gate, code selector 0x08.
pub fn gate(handler: u64) -> [u64; 2] {
    let low =
        (handler & 0xffff) | (0x08 << 16) | (0x8e00u64 << 32) | ((handler >> 16) & 0xffff) << 48;
    [low, handler >> 32]
}

#[cfg(target_os = "none")]
global_asm!(
    r#"
    .section .text.isr, "ax"
    .p2align 4
    .global isr_stubs
isr_stubs:
    .set vec, 0
    .rept 32
    .p2align 4
    .if (vec == 8) || ((vec >= 10) && (vec <= 14)) || (vec == 17) || (vec == 21) || (vec == 29) || (vec == 30)
    .else
    pushq $0
    .endif
    pushq $vec
    jmp isr_common
    .set vec, vec + 1
    .endr

isr_common:
    movq %rsp, %rdi              /* [vector, error, rip, cs, rflags, rsp, ss] */
    andq $-16, %rsp
    call {handler}
1:  cli
    hlt
    jmp 1b

    .p2align 4
    .global irq_stubs
irq_stubs:
    .set vec, 0x40
    .rept 16
    .p2align 4
    pushq $vec
    jmp irq_common
    .set vec, vec + 1
    .endr

irq_common:
    pushq %rax
    pushq %rcx
    pushq %rdx
    pushq %rsi
    pushq %rdi
    pushq %r8
    pushq %r9
    pushq %r10
    pushq %r11
    pushq %rbp
    movq 80(%rsp), %rdi          /* the vector the stub pushed */
    movq %rsp, %rbp
    andq $-16, %rsp
    call {irq}
    movq %rbp, %rsp
    popq %rbp
    popq %r11
    popq %r10
    popq %r9
    popq %r8
    popq %rdi
    popq %rsi
    popq %rdx
    popq %rcx
    popq %rax
    addq $8, %rsp
    iretq
"#,
    handler = sym exception_handler,
    irq = sym irq_handler,
    options(att_syntax)
);

#[repr(C, align(16))]
struct Idt([[u64; 2]; IDT_GATES]);

static mut IDT: Idt = Idt([[0; 2]; IDT_GATES]);

#[cfg(target_os = "none")]
extern "C" {
    static isr_stubs: u8;
    static irq_stubs: u8;
}

/// A level-triggered source's acknowledgement, done by the handler of vector `IRQ_BASE + 1`
/// before its EOI (as a driver of a level-triggered line must): a 32-bit register address
/// (0: none) and the value written there.
pub static LEVEL_ACK_ADDR: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(0);
/// The value written to [`LEVEL_ACK_ADDR`].
pub static LEVEL_ACK_VALUE: core::sync::atomic::AtomicU32 = core::sync::atomic::AtomicU32::new(0);

/// Counts a device interrupt, acknowledges a level-triggered source at the device when one
/// is registered ([`LEVEL_ACK_ADDR`]), and signals end-of-interrupt to the local APIC.
extern "C" fn irq_handler(vector: u64) {
    use core::sync::atomic::Ordering;
    if let Some(n) = IRQS.get((vector as usize).wrapping_sub(usize::from(IRQ_BASE))) {
        n.fetch_add(1, Ordering::SeqCst);
    }
    if vector == u64::from(IRQ_BASE) + 1 {
        let addr = LEVEL_ACK_ADDR.load(Ordering::SeqCst);
        if addr != 0 {
            crate::virtio::w(addr, LEVEL_ACK_VALUE.load(Ordering::SeqCst));
        }
    }
    crate::virtio::lapic_eoi();
}

/// Fills the IDT and loads it on the bootstrap processor (before any AP runs).
#[cfg(target_os = "none")]
pub fn init() {
    let stubs = core::ptr::addr_of!(isr_stubs) as u64;
    let idt = core::ptr::addr_of_mut!(IDT);
    // SAFETY: called once on the BSP before any AP starts, so nothing else touches the
    // table; writes go through a raw pointer to the guest's own static.
    unsafe {
        for v in 0..VECTORS {
            (*idt).0[v] = gate(stubs + v as u64 * STUB_SIZE);
        }
        let irqs = core::ptr::addr_of!(irq_stubs) as u64;
        for i in 0..IRQ_COUNT {
            (*idt).0[usize::from(IRQ_BASE) + i] = gate(irqs + i as u64 * STUB_SIZE);
        }
    }
    load();
}

/// Loads the IDT filled by [`init`] on this CPU (APs call it first thing).
#[cfg(target_os = "none")]
pub fn load() {
    let base = core::ptr::addr_of!(IDT) as u64;
    let mut idtr = [0u16; 5];
    idtr[0] = (core::mem::size_of::<Idt>() - 1) as u16;
    idtr[1] = base as u16;
    idtr[2] = (base >> 16) as u16;
    idtr[3] = (base >> 32) as u16;
    idtr[4] = (base >> 48) as u16;
    // SAFETY: the IDTR points at a static table of valid gates to `isr_stubs`.
    unsafe { core::arch::asm!("lidt [{0}]", in(reg) idtr.as_ptr(), options(nostack, readonly)) };
}

/// Host builds have no IDT.
#[cfg(not(target_os = "none"))]
pub fn init() {}

/// Host builds have no IDT.
#[cfg(not(target_os = "none"))]
pub fn load() {}

/// Reached from `isr_common` with the exception frame; never returns.
extern "C" fn exception_handler(frame: *const u64) -> ! {
    // SAFETY: `isr_common` passes the stack pointer after the stub's two pushes, so seven
    // words of frame (vector, error code, and the CPU's five) are readable there.
    let [vector, error, rip] = unsafe { [*frame, *frame.add(1), *frame.add(2)] };
    let cr2: u64;
    // SAFETY: reading CR2 has no side effects.
    unsafe { core::arch::asm!("mov {}, cr2", out(reg) cr2, options(nomem, nostack)) };
    let mut c = crate::io::console_force();
    let _ = core::fmt::Write::write_fmt(
        &mut c,
        format_args!(
            "TVMTEST {} PANIC CPU exception {} ({}) error={:#x} rip={:#x} cr2={:#x}\n",
            crate::current_test(),
            vector,
            vector_name(vector),
            error,
            rip,
            cr2
        ),
    );
    crate::crash()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_splits_the_handler_address() {
        let [low, high] = gate(0x1234_5678_9abc_def0);
        assert_eq!(low & 0xffff, 0xdef0);
        assert_eq!((low >> 16) & 0xffff, 0x08);
        assert_eq!((low >> 40) & 0xff, 0x8e);
        assert_eq!(low >> 48, 0x9abc);
        assert_eq!(high, 0x1234_5678);
    }

    #[test]
    fn vectors_have_their_names() {
        assert_eq!(vector_name(14), "#PF");
        assert_eq!(vector_name(13), "#GP");
        assert_eq!(vector_name(31), "reserved");
    }
}
