//! The three ways into the guest, its page tables, GDT and stacks.
//!
//! * `_start64`: the ELF entry, Linux 64-bit boot protocol: long mode, paging on (the
//!   loader's identity map), `rsi` = zero page.
//! * `_start_pvh`: the PVH entry named by the `XEN_ELFNOTE_PHYS32_ENTRY` note: 32-bit
//!   protected mode, paging off, `ebx` = `hvm_start_info`. A trampoline here enables PAE,
//!   long mode and paging with the guest's own page tables.
//! * `_bzimage_entry`: at load address + 0x200, where the bzImage packaging puts the
//!   protected-mode kernel's 64-bit entry (`tests/guests/pack.py`).
//!
//! All three load the guest's own GDT and page tables (the first 4 GiB identity-mapped with
//! 2 MiB pages, static data below; `paging.rs` extends the map above 4 GiB), zero `.bss`,
//! switch to the boot stack and call `rust_main(entry_kind, boot_info_address)`.

use core::arch::global_asm;

/// How the guest was entered (the first argument of `rust_main`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum EntryKind {
    /// PVH: 32-bit protected mode, `hvm_start_info` in `ebx`.
    Pvh,
    /// ELF entry, Linux 64-bit boot protocol, zero page in `rsi`.
    Linux64,
    /// bzImage 64-bit entry (load address + 0x200), zero page in `rsi`.
    BzImage,
}

impl EntryKind {
    /// Decodes the value the assembly entry code passes in `edi`.
    pub fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            0 => Some(Self::Pvh),
            1 => Some(Self::Linux64),
            2 => Some(Self::BzImage),
            _ => None,
        }
    }

    /// The name used in report lines (`entry=...`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Pvh => "pvh",
            Self::Linux64 => "linux64",
            Self::BzImage => "bzimage",
        }
    }
}

/// Size of the bootstrap processor's stack.
pub const BOOT_STACK_SIZE: usize = 64 * 1024;

#[cfg(target_os = "none")]
global_asm!(
    r#"
    .set BOOT_STACK_SIZE, {stack_size}

    /* The PVH note: name "Xen", type XEN_ELFNOTE_PHYS32_ENTRY (18), desc = 32-bit entry. */
    .section .note.Xen, "a"
    .p2align 2
    .long 4
    .long 4
    .long 18
    .asciz "Xen"
    .long _start_pvh

    .section .text.head, "ax"
    .code64
    .global _start64
_start64:
    cli
    cld
    movl $1, %edi
    jmp common64

    /* Entered in 32-bit protected mode, paging off, ebx = hvm_start_info. */
    .code32
    .global _start_pvh
_start_pvh:
    cli
    cld
    movl %ebx, %esi
    lgdt gdtr
    movw $0x10, %ax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    movl %cr4, %eax
    orl $0x20, %eax              /* PAE */
    movl %eax, %cr4
    movl $pml4, %eax
    movl %eax, %cr3
    movl $0xC0000080, %ecx       /* EFER.LME */
    rdmsr
    orl $0x100, %eax
    wrmsr
    movl %cr0, %eax
    andl $0x9fffffff, %eax       /* caches on: clear CD and NW (reset leaves them set) */
    orl $0x80000001, %eax        /* PG | PE */
    movl %eax, %cr0
    ljmp $0x08, $pvh64
    .code64
pvh64:
    movl %esi, %esi              /* zero-extend the start_info address */
    xorl %edi, %edi
    jmp common64

    /* The bzImage 64-bit entry: load address + 0x200 (checked by linker.ld). */
    .org 0x200
    .global _bzimage_entry
_bzimage_entry:
    cli
    cld
    leaq _bzimage_entry(%rip), %rax
    movq $_bzimage_entry, %rcx
    cmpq %rax, %rcx
    jne 2f
    movl $2, %edi
    movq $common64, %rax
    jmp *%rax
    /* Loaded somewhere other than code32_start: say so on COM1 and report a crash. */
2:  leaq wrong_address_msg(%rip), %r8
    movw $0x3f8, %dx
3:  movb (%r8), %al
    testb %al, %al
    jz 4f
    outb %al, %dx
    incq %r8
    jmp 3b
4:  movw $0x505, %dx
    movb $1, %al
    outb %al, %dx
5:  hlt
    jmp 5b
wrong_address_msg:
    .asciz "TVMTEST boot FAIL bzImage loaded away from code32_start (0x100000); load it there\n"

    /* rdi = entry kind, rsi = boot info address (zero page or hvm_start_info). */
common64:
    movq %rdi, %r12
    movq %rsi, %r13
    movq $__bss_start, %rdi
    movq $__bss_end, %rcx
    subq %rdi, %rcx
    shrq $3, %rcx                /* .bss is 16-byte aligned at both ends */
    xorl %eax, %eax
    rep stosq
    movq %cr0, %rax
    andq $0xffffffff9fffffff, %rax   /* caches on: clear CD and NW */
    movq %rax, %cr0
    lgdt gdtr
    movw $0x10, %ax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    movw %ax, %fs
    movw %ax, %gs
    movq $pml4, %rax
    movq %rax, %cr3
    movq $boot_stack, %rsp
    addq $BOOT_STACK_SIZE, %rsp
    pushq $0x08
    leaq 6f(%rip), %rax
    pushq %rax
    lretq
6:  movq %r12, %rdi
    movq %r13, %rsi
    call rust_main
7:  cli
    hlt
    jmp 7b

    .section .rodata.gdt, "a"
    .p2align 4
    .global gdt
gdt:
    .quad 0
    .quad 0x00af9a000000ffff     /* 0x08: 64-bit code */
    .quad 0x00cf92000000ffff     /* 0x10: flat data */
    .quad 0x00cf9a000000ffff     /* 0x18: 32-bit code */
gdt_end:
    .p2align 3
gdtr:
    .word gdt_end - gdt - 1
    .quad gdt

    /* Identity map of the first 4 GiB with 2 MiB pages; pdpt entries 4.. are filled
       at run time by paging.rs when RAM reaches above 4 GiB. */
    .section .data.pagetables, "aw"
    .p2align 12
    .global pml4
pml4:
    .quad pdpt + 3
    .fill 511, 8, 0
    .global pdpt
pdpt:
    .quad pd_low + 0x0003
    .quad pd_low + 0x1003
    .quad pd_low + 0x2003
    .quad pd_low + 0x3003
    .fill 508, 8, 0
pd_low:
    .set i, 0
    .rept 2048
    .quad (i << 21) | 0x83
    .set i, i + 1
    .endr

    .section .noinit.boot_stack, "aw", @nobits
    .p2align 4
boot_stack:
    .skip BOOT_STACK_SIZE
"#,
    stack_size = const BOOT_STACK_SIZE,
    options(att_syntax)
);

#[cfg(target_os = "none")]
extern "C" {
    static __image_start: u8;
    static __image_end: u8;
}

/// The physical range the guest image occupies, `.bss` and stacks included.
#[cfg(target_os = "none")]
pub fn image_range() -> (u64, u64) {
    (
        core::ptr::addr_of!(__image_start) as u64,
        core::ptr::addr_of!(__image_end) as u64,
    )
}
