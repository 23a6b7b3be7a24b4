//! Counters of the virtio-rng device.

counters! {
    /// What the entropy device did and what its guest got wrong.
    pub struct RngMetrics {
        /// Queue notifications handled.
        notifications,
        /// Requests filled.
        requests,
        /// Random bytes given to the guest.
        bytes,
        /// Malformed chains (device-readable buffers, outside memory, loops).
        bad_requests,
        /// getrandom failures.
        entropy_errors,
        /// Corrupt queues: device needs reset.
        queue_errors,
    }
}
