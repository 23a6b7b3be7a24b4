//! Device models of tenantvm-vmm.
//!
//! Everything here faces the guest: every register write, descriptor and packet is
//! hostile input. Devices validate what they read, answer malformed requests with an
//! error status and a counter, and never panic on guest input.

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

pub mod bus;
pub mod legacy;
pub mod pci;
#[cfg(any(test, feature = "test-utils"))]
pub mod test_utils;
pub mod virtio;
