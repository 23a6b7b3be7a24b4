//! Counters of one virtio-blk device.

counters! {
    /// What a disk did and what its guest got wrong.
    pub struct BlockMetrics {
        /// Queue notifications handled.
        notifications,
        /// Read requests completed.
        read_ops,
        /// Bytes read.
        read_bytes,
        /// Write requests completed.
        write_ops,
        /// Bytes written.
        write_bytes,
        /// Flushes completed.
        flush_ops,
        /// GET_ID requests completed.
        get_id_ops,
        /// Discard requests completed.
        discard_ops,
        /// Write-zeroes requests completed.
        write_zeroes_ops,
        /// Requests refused by the parser (malformed, out of range, read-only).
        invalid_requests,
        /// Requests of an unknown or unnegotiated type.
        unsupported_requests,
        /// Requests whose chain had no usable status byte (completed with length 0).
        no_status,
        /// Host I/O errors.
        io_errors,
        /// Chain heads offered twice in one batch (refused).
        head_reuse,
        /// Corrupt queues (bad avail index, unwritable used ring): device needs reset.
        queue_errors,
        /// Times the rate limiter deferred work.
        throttled,
        /// Interrupts sent to the driver.
        interrupts,
        /// Interrupts the driver said it did not need (EVENT_IDX's `used_event`, or the
        /// available ring's NO_INTERRUPT flag).
        interrupts_suppressed,
        /// Batches cut at the queue size (the rest is handled next round).
        batches_cut,
    }
}
