//! Port I/O, MSRs, the TSC and the COM1 console.

use core::arch::asm;
use core::fmt;
use core::sync::atomic::{AtomicBool, Ordering};

/// COM1's base I/O port.
pub const COM1: u16 = 0x3f8;

/// Writes a byte to an I/O port.
pub fn outb(port: u16, value: u8) {
    // SAFETY: port writes have no memory effects the compiler must know about; which ports
    // the guest touches is the test's business and the VMM's job to police.
    unsafe {
        asm!("out dx, al", in("dx") port, in("al") value, options(nomem, nostack, preserves_flags))
    }
}

/// Reads a byte from an I/O port.
pub fn inb(port: u16) -> u8 {
    let value: u8;
    // SAFETY: as for `outb`: a port read has no memory effects.
    unsafe {
        asm!("in al, dx", in("dx") port, out("al") value, options(nomem, nostack, preserves_flags))
    }
    value
}

/// Reads a model-specific register.
pub fn rdmsr(msr: u32) -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: the callers read architectural MSRs (APIC base, EFER) that exist on every
    // x86-64 CPU; rdmsr has no memory effects.
    unsafe {
        asm!("rdmsr", in("ecx") msr, out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags))
    }
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Writes a model-specific register.
pub fn wrmsr(msr: u32, value: u64) {
    // SAFETY: the callers write only the x2APIC interrupt command register, whose effect
    // (an IPI) touches no memory of ours.
    unsafe {
        asm!("wrmsr", in("ecx") msr, in("eax") value as u32, in("edx") (value >> 32) as u32,
             options(nomem, nostack, preserves_flags))
    }
}

/// Reads the time-stamp counter.
pub fn rdtsc() -> u64 {
    // SAFETY: rdtsc only reads the counter.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// Stops this CPU for good (interrupts stay off).
pub fn halt_forever() -> ! {
    loop {
        // SAFETY: with interrupts disabled hlt only parks the CPU.
        unsafe { asm!("cli", "hlt", options(nomem, nostack)) }
    }
}

static CONSOLE_LOCK: AtomicBool = AtomicBool::new(false);

/// Programs COM1 for 115200 8N1 with FIFOs on, polled (no interrupts).
pub fn serial_init() {
    outb(COM1 + 1, 0x00); // no interrupts
    outb(COM1 + 3, 0x80); // DLAB
    outb(COM1, 0x01); // divisor 1: 115200 baud
    outb(COM1 + 1, 0x00);
    outb(COM1 + 3, 0x03); // 8N1
    outb(COM1 + 2, 0xc7); // FIFO on, cleared
    outb(COM1 + 4, 0x03); // DTR | RTS
}

fn serial_put(byte: u8) {
    // Wait for the transmit holding register, bounded so a broken UART cannot hang us.
    for _ in 0..100_000 {
        if inb(COM1 + 5) & 0x20 != 0 {
            break;
        }
        core::hint::spin_loop();
    }
    outb(COM1, byte);
}

/// Returns a received byte if COM1 has one.
pub fn serial_try_read() -> Option<u8> {
    if inb(COM1 + 5) & 0x01 != 0 {
        Some(inb(COM1))
    } else {
        None
    }
}

/// A `fmt::Write` sink for COM1; hold [`console`]'s guard while writing a whole line.
pub struct Console {
    _private: (),
}

impl fmt::Write for Console {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for b in s.bytes() {
            if b == b'\n' {
                serial_put(b'\r');
            }
            serial_put(b);
        }
        Ok(())
    }
}

/// Exclusive access to the console for one message, shared between CPUs.
pub struct ConsoleGuard {
    console: Console,
}

impl core::ops::Deref for ConsoleGuard {
    type Target = Console;
    fn deref(&self) -> &Console {
        &self.console
    }
}

impl core::ops::DerefMut for ConsoleGuard {
    fn deref_mut(&mut self) -> &mut Console {
        &mut self.console
    }
}

impl Drop for ConsoleGuard {
    fn drop(&mut self) {
        CONSOLE_LOCK.store(false, Ordering::Release);
    }
}

/// Takes the console lock.
pub fn console() -> ConsoleGuard {
    while CONSOLE_LOCK
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        core::hint::spin_loop();
    }
    ConsoleGuard {
        console: Console { _private: () },
    }
}

/// Takes the console without waiting for the lock (panic path: the holder may be us).
pub fn console_force() -> Console {
    Console { _private: () }
}

/// Prints a line on COM1.
#[macro_export]
macro_rules! println {
    ($($arg:tt)*) => {{
        use core::fmt::Write as _;
        let mut c = $crate::io::console();
        let _ = writeln!(c, $($arg)*);
    }};
}
