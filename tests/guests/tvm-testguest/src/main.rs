//! tvm-testguest: a no_std x86-64 guest that runs the test named by `tvm.test=<name>` on the
//! kernel command line and reports on COM1 (`TVMTEST <name> PASS|FAIL ...`), then powers off
//! or performs the action under test. See docs/test-guests.md for the tests and the
//! platform they expect.
#![cfg_attr(target_os = "none", no_std)]
#![cfg_attr(target_os = "none", no_main)]
// Host builds (unit tests of the parsers) compile the hardware paths out.
#![cfg_attr(not(target_os = "none"), allow(dead_code, unused_imports))]
// No heap: report details are fixed-size buffers, passed by value in both Ok and Err.
#![allow(clippy::result_large_err)]

#[cfg(test)]
extern crate std;

mod boot;
mod bootinfo;
mod edu;
mod gpu;
mod hostile;
mod idt;
#[macro_use]
mod io;
mod memtest;
mod mptable;
mod nvme;
mod paging;
mod pci;
mod phys;
mod report;
mod smp;
mod timer;
mod virtio;
mod vsock;
mod vtests;

use boot::EntryKind;
use bootinfo::BootInfo;
use core::fmt::Write;
use core::sync::atomic::{AtomicUsize, Ordering};
use io::outb;
use report::Detail;

/// I/O port of the ACPI hardware-reduced sleep control register (tenantvm-vmm).
const SLEEP_CONTROL_PORT: u16 = 0x600;
/// SLP_TYP = 5 (S5), SLP_EN.
const SLEEP_S5: u8 = (5 << 2) | (1 << 5);
/// QEMU's isa-debug-exit, only present when the command line asks for it (benchmarks, and
/// development under QEMU); a VMM without it ignores the write or never sees it.
const QEMU_DEBUG_EXIT_PORT: u16 = 0xf4;
/// pvpanic's I/O port.
const PVPANIC_PORT: u16 = 0x505;
/// i8042 command port.
const I8042_COMMAND_PORT: u16 = 0x64;
/// i8042 command: pulse the reset line.
const I8042_RESET: u8 = 0xfe;

/// The longest line `serial-echo` reads.
const ECHO_LINE_MAX: usize = 256;
/// How long `serial-echo` waits for its line.
const ECHO_TIMEOUT_MS: u64 = 60_000;

/// Every test the guest knows, for the unknown-test message and docs.
const TESTS: &[&str] = &[
    "boot",
    "smp",
    "memory",
    "memory-sparse",
    "serial-echo",
    "poweroff",
    "reset",
    "panic",
    "triple-fault",
    "page-fault",
    "idle",
    "virtio-blk",
    "virtio-rng",
    "msix",
    "blk-bench",
    "virtio-vsock",
    "hostile-blk",
    "hostile-config",
    "vsock-bench",
    "vfio-model",
    "vfio-irq-bench",
    "vfio-edu",
    "pci-list",
    "vfio-edu-bench",
    "vfio-nvme",
    "vfio-edu-intx",
    "vfio-edu-intx-storm",
    "vfio-edu-hold",
    "vfio-nvme-hold",
];

/// Index into TESTS of the running test, for the panic handler (none yet: `boot`).
static CURRENT_TEST: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Powers the VM off: the sleep control register, then QEMU's debug exit, then halts.
fn power_off() -> ! {
    outb(SLEEP_CONTROL_PORT, SLEEP_S5);
    outb(QEMU_DEBUG_EXIT_PORT, 0);
    io::halt_forever()
}

/// Reports a crash through pvpanic, then triple-faults in case nobody listens.
fn crash() -> ! {
    outb(PVPANIC_PORT, 1);
    triple_fault()
}

/// Loads an empty IDT and divides by zero: no #DE handler, no #GP or double-fault handler,
/// so the CPU shuts down (KVM_EXIT_SHUTDOWN). #DE rather than int3 or ud2 because KVM
/// intercepts #BP and #UD and may try to emulate around them.
fn triple_fault() -> ! {
    let idtr = [0u16; 5];
    // SAFETY: deliberately unrecoverable: with the empty IDT the divide error becomes a
    // triple fault, which ends this VM; nothing runs after it.
    unsafe {
        core::arch::asm!(
            "lidt [{idtr}]",
            "xor edx, edx",
            "xor eax, eax",
            "xor ecx, ecx",
            "div ecx",
            idtr = in(reg) idtr.as_ptr(),
            out("eax") _, out("ecx") _, out("edx") _,
            options(nostack)
        );
    }
    io::halt_forever()
}

/// Tests that wait for something and so need the TSC calibrated (10 ms of PIT time, more
/// under nested KVM: the others skip it so that power-off timings stay about the VMM).
const TIMED_TESTS: &[&str] = &[
    "smp",
    "serial-echo",
    "reset",
    "idle",
    "virtio-blk",
    "virtio-rng",
    "msix",
    "blk-bench",
    "virtio-vsock",
    "hostile-blk",
    "hostile-config",
    "vsock-bench",
    "vfio-model",
    "vfio-irq-bench",
    "vfio-edu",
    "vfio-edu-bench",
    "vfio-nvme",
    "vfio-edu-intx",
    "vfio-edu-intx-storm",
    "vfio-edu-hold",
    "vfio-nvme-hold",
];

fn run_test(name: &'static str, bi: &BootInfo) -> ! {
    if TIMED_TESTS.contains(&name) {
        let calibrated = timer::calibrate();
        println!(
            "tvm-testguest: tsc_khz={}{}",
            timer::tsc_per_ms(),
            if calibrated {
                ""
            } else {
                " (no PIT answered: guessed)"
            }
        );
    }
    let result = match name {
        "boot" => Ok(Detail::fmt(format_args!(
            "entry={} ram={} regions={} cmdline=\"{}\"",
            bi.entry.name(),
            bi.ram_bytes(),
            bi.regions().len(),
            bi.cmdline()
        ))),
        "smp" => smp::run(bi),
        "memory" => {
            let (start, end) = image_range();
            memtest::run(bi, memtest::Span { start, end })
        }
        "memory-sparse" => {
            let (start, end) = image_range();
            memtest::run_sparse(bi, memtest::Span { start, end })
        }
        "serial-echo" => serial_echo(),
        "poweroff" => Ok(Detail::fmt(format_args!(
            "powering off through port {SLEEP_CONTROL_PORT:#x}"
        ))),
        "reset" => {
            report::pass(
                name,
                &Detail::fmt(format_args!("requesting reset through the i8042")),
            );
            outb(I8042_COMMAND_PORT, I8042_RESET);
            timer::delay_us(1_000_000);
            Err(Detail::fmt(format_args!(
                "Still running 1 s after the i8042 reset request"
            )))
        }
        "panic" => panic!("deliberate panic requested by tvm.test=panic"),
        "triple-fault" => {
            report::pass(
                name,
                &Detail::fmt(format_args!("triple-faulting with an empty IDT")),
            );
            triple_fault()
        }
        "page-fault" => {
            let unmapped = paging::MAP_LIMIT;
            println!("TVMTEST page-fault READY reading unmapped address {unmapped:#x}");
            // SAFETY: deliberately faulting: nothing maps this address, so the read raises
            // #PF, whose handler reports and ends the VM; the value is never used.
            let _ = unsafe { core::ptr::read_volatile(unmapped as *const u64) };
            Err(Detail::fmt(format_args!(
                "Reading unmapped address {unmapped:#x} did not fault"
            )))
        }
        "idle" => idle(),
        "virtio-blk" => vtests::block(bi),
        "virtio-rng" => vtests::rng(bi),
        "msix" => vtests::msix(bi),
        "blk-bench" => vtests::bench(bi),
        "virtio-vsock" => vsock::run(bi),
        "vfio-irq-bench" => gpu::irq_bench(bi),
        "vfio-edu" => edu::run(bi),
        "pci-list" => gpu::list(bi),
        "vfio-edu-bench" => edu::bench(bi),
        "vfio-nvme" => nvme::run(bi),
        "vfio-edu-intx" => edu::intx(bi),
        "vfio-edu-intx-storm" => edu::intx_storm(bi),
        "vsock-bench" => vsock::bench(bi),
        "hostile-blk" | "hostile-config" | "vfio-model" | "vfio-edu-hold" | "vfio-nvme-hold" => {
            let result = match name {
                "hostile-blk" => hostile::block(bi),
                "hostile-config" => hostile::config(bi),
                "vfio-edu-hold" => edu::run(bi),
                "vfio-nvme-hold" => nvme::run(bi),
                _ => gpu::run(bi),
            };
            match result {
                Ok(detail) => report::pass(name, &detail),
                Err(reason) => report::fail(name, &reason),
            }
            // Stay up: the host reads the VMM's counters, then stops the VM.
            println!("TVMTEST {name} HOLD waiting for the host to stop the VM");
            io::halt_forever()
        }
        _ => unreachable!("dispatch only sees names from TESTS"),
    };
    match result {
        Ok(detail) => report::pass(name, &detail),
        Err(reason) => report::fail(name, &reason),
    }
    power_off()
}

/// Reads one line from COM1 and echoes it back upper-cased on an `ECHO` line.
fn serial_echo() -> Result<Detail, Detail> {
    println!("TVMTEST serial-echo READY send one line");
    let mut line = [0u8; ECHO_LINE_MAX];
    let mut len = 0;
    let deadline = timer::deadline_ms(ECHO_TIMEOUT_MS);
    loop {
        if timer::expired(deadline) {
            return Err(Detail::fmt(format_args!(
                "No complete line on COM1 within {} s ({len} bytes so far)",
                ECHO_TIMEOUT_MS / 1000
            )));
        }
        let Some(b) = io::serial_try_read() else {
            core::hint::spin_loop();
            continue;
        };
        match b {
            b'\n' | b'\r' if len == 0 => continue,
            b'\n' | b'\r' => break,
            _ if len == ECHO_LINE_MAX => {
                return Err(Detail::fmt(format_args!(
                    "Line longer than {ECHO_LINE_MAX} bytes"
                )));
            }
            _ => {
                line[len] = b.to_ascii_uppercase();
                len += 1;
            }
        }
    }
    let text = core::str::from_utf8(&line[..len])
        .map_err(|_| Detail::fmt(format_args!("The line is not UTF-8")))?;
    println!("ECHO {text}");
    Ok(Detail::fmt(format_args!("echoed {len} bytes")))
}

/// Prints a numbered tick every 100 ms, forever (for pause/resume/shutdown tests).
fn idle() -> Result<Detail, Detail> {
    println!("TVMTEST idle READY ticking every 100 ms");
    let mut n: u64 = 0;
    loop {
        let deadline = timer::deadline_ms(100);
        while !timer::expired(deadline) {
            core::hint::spin_loop();
        }
        n += 1;
        println!("tick {n}");
    }
}

#[cfg(target_os = "none")]
fn image_range() -> (u64, u64) {
    boot::image_range()
}

#[cfg(not(target_os = "none"))]
fn image_range() -> (u64, u64) {
    (0x100000, 0x200000)
}

/// Entered from boot.rs with the entry kind and the boot information's address.
#[cfg(target_os = "none")]
#[no_mangle]
extern "C" fn rust_main(entry: u32, info: u64) -> ! {
    io::serial_init();
    idt::init();
    let Some(entry) = EntryKind::from_raw(entry) else {
        println!("TVMTEST boot FAIL unknown entry kind {entry}");
        crash()
    };
    // First output as early as possible: benchmarks time the first serial byte.
    println!("tvm-testguest: entry={}", entry.name());
    let bi = match BootInfo::read(entry, info, &phys::Phys) {
        Ok(bi) => bi,
        Err(e) => {
            println!("TVMTEST boot FAIL {e}");
            crash()
        }
    };
    let wanted = bootinfo::cmdline_param(bi.cmdline(), "tvm.test");
    println!("tvm-testguest: test={}", wanted.unwrap_or("(none)"));
    let name = match wanted.and_then(|w| TESTS.iter().find(|t| **t == w)) {
        Some(n) => *n,
        None => {
            let mut d = Detail::new();
            let _ = match wanted {
                Some(w) => write!(d, "Unknown test '{w}'; pass tvm.test= one of"),
                None => write!(d, "No tvm.test= on the command line; pass one of"),
            };
            for t in TESTS {
                let _ = write!(d, " {t}");
            }
            report::fail(wanted.unwrap_or("none"), &d);
            power_off()
        }
    };
    set_current_test(name);
    run_test(name, &bi)
}

fn set_current_test(name: &'static str) {
    let idx = TESTS.iter().position(|t| *t == name).unwrap_or(usize::MAX);
    CURRENT_TEST.store(idx, Ordering::Relaxed);
}

fn current_test() -> &'static str {
    TESTS
        .get(CURRENT_TEST.load(Ordering::Relaxed))
        .copied()
        .unwrap_or("boot")
}

/// Prints `TVMTEST <test> PANIC <message>`, reports through pvpanic and triple-faults.
#[cfg(target_os = "none")]
#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    let mut c = io::console_force();
    let _ = write!(c, "TVMTEST {} PANIC {}", current_test(), info.message());
    if let Some(loc) = info.location() {
        let _ = write!(c, " at {}:{}", loc.file(), loc.line());
    }
    let _ = c.write_str("\n");
    crash()
}

#[cfg(not(target_os = "none"))]
fn main() {}
