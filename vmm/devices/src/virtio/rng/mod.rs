//! virtio-rng fed from the host's getrandom(2), with a bound on bytes per request.

pub mod device;
pub mod event_handler;
pub mod metrics;

pub use device::Rng;
pub use metrics::RngMetrics;

/// Most bytes one request gets (the rest of a larger buffer stays unused).
pub const MAX_BYTES_PER_REQUEST: usize = 64 << 10;
/// Queue size.
pub const QUEUE_SIZE: u16 = 256;
