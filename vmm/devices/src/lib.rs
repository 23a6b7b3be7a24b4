//! Device models of tenantvm-vmm.
//!
//! Everything here faces the guest: every register write, descriptor and packet is
//! hostile input. Devices validate what they read, answer malformed requests with an
//! error status and a counter, and never panic on guest input.
//!
//! For the same reason an integer cast that may drop bits is denied here: a narrowing says
//! what it means through `narrow.rs` or `try_from` (docs/devices.md, docs/testing.md "Lints").

#![deny(clippy::cast_possible_truncation)]

/// Declares a struct of `AtomicU64` counters with a `snapshot()` that lists them by name,
/// so the VMM can report them without knowing each device.
macro_rules! counters {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* $field:ident,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Default)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: std::sync::atomic::AtomicU64,)*
        }

        impl $name {
            /// Every counter by name, in declaration order.
            pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($field), self.$field.load(std::sync::atomic::Ordering::Relaxed)),)*]
            }
        }
    };
}

/// Adds one to a counter.
pub(crate) fn inc(counter: &std::sync::atomic::AtomicU64) {
    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a rate-limited log site may log now: at most once per second per site, so a
/// guest that repeats a mistake cannot flood the host's logs.
pub(crate) fn log_allowed(last: &std::sync::atomic::AtomicU64) -> bool {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let now = START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs()
        + 1;
    let prev = last.load(std::sync::atomic::Ordering::Relaxed);
    now > prev
        && last
            .compare_exchange(
                prev,
                now,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
}

/// `tracing::warn!` for events a guest can cause: at most one line per second per site.
macro_rules! warn_limited {
    ($($arg:tt)*) => {{
        static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        if $crate::log_allowed(&LAST) {
            tracing::warn!($($arg)*);
        }
    }};
}

/// `tracing::debug!` for events a guest can cause: at most one line per second per site.
macro_rules! debug_limited {
    ($($arg:tt)*) => {{
        static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        if $crate::log_allowed(&LAST) {
            tracing::debug!($($arg)*);
        }
    }};
}

pub mod bus;
pub mod legacy;
mod narrow;
pub mod pci;
#[cfg(any(test, feature = "test-utils"))]
pub mod test_utils;
pub mod virtio;

#[cfg(test)]
mod tests {
    #[test]
    fn rate_limited_site_logs_about_once_per_second() {
        let last = std::sync::atomic::AtomicU64::new(0);
        let allowed = (0..1000).filter(|_| super::log_allowed(&last)).count();
        // One, or two if a second boundary fell inside the loop.
        assert!((1..=2).contains(&allowed), "{allowed}");
    }
}
