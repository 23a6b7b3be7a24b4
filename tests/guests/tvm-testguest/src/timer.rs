//! Time: the TSC, calibrated once against PIT channel 2.

use crate::io::{inb, outb, rdtsc};
use core::sync::atomic::{AtomicU64, Ordering};

/// TSC ticks per millisecond, set by [`calibrate`].
static TSC_PER_MS: AtomicU64 = AtomicU64::new(2_000_000);

const PIT_HZ: u64 = 1_193_182;
/// 10 ms worth of PIT ticks.
const PIT_COUNT: u16 = 11_932;

/// Measures the TSC against 10 ms of PIT channel 2. Without a PIT (the count never ends) it
/// keeps the 2 GHz guess, which only stretches or shrinks the guest's timeouts.
pub fn calibrate() -> bool {
    let gate = inb(0x61);
    outb(0x61, (gate & !0x02) | 0x01); // gate on, speaker off
    outb(0x43, 0xb0); // channel 2, lobyte/hibyte, mode 0, binary
    outb(0x42, (PIT_COUNT & 0xff) as u8);
    let start = rdtsc();
    outb(0x42, (PIT_COUNT >> 8) as u8);
    // Mode 0 drives OUT2 low until the count ends; high right away means no PIT answers.
    if inb(0x61) & 0x20 != 0 {
        outb(0x61, gate);
        return false;
    }
    let mut done = false;
    for _ in 0..50_000_000u32 {
        if inb(0x61) & 0x20 != 0 {
            done = true;
            break;
        }
    }
    let elapsed = rdtsc().wrapping_sub(start);
    outb(0x61, gate);
    if done && elapsed > 0 {
        let per_ms = elapsed * PIT_HZ / (u64::from(PIT_COUNT) * 1000);
        if per_ms > 0 {
            TSC_PER_MS.store(per_ms, Ordering::Relaxed);
        }
    }
    done
}

/// TSC ticks per millisecond.
pub fn tsc_per_ms() -> u64 {
    TSC_PER_MS.load(Ordering::Relaxed)
}

/// A point in time `ms` milliseconds from now.
pub fn deadline_ms(ms: u64) -> u64 {
    rdtsc().saturating_add(ms.saturating_mul(tsc_per_ms()))
}

/// Whether `deadline` has passed.
pub fn expired(deadline: u64) -> bool {
    rdtsc() >= deadline
}

/// Busy-waits `us` microseconds.
pub fn delay_us(us: u64) {
    let end = rdtsc().saturating_add(us.saturating_mul(tsc_per_ms()) / 1000);
    while rdtsc() < end {
        core::hint::spin_loop();
    }
}
