//! Counters of one virtio-vsock device.

counters! {
    /// What the vsock device did and what its guest got wrong.
    pub struct VsockMetrics {
        /// Packets taken from the TX queue.
        tx_packets,
        /// Payload bytes from the guest forwarded to host sockets.
        tx_bytes,
        /// Packets put on the RX queue.
        rx_packets,
        /// Payload bytes from host sockets delivered to the guest.
        rx_bytes,
        /// Malformed TX chains or headers (answered with RST where addressable).
        bad_packets,
        /// Malformed RX chains (returned unused).
        bad_rx_buffers,
        /// RSTs sent to the guest.
        rst_sent,
        /// Guest packets that overran the credit the device gave.
        credit_overruns,
        /// Connections established (both directions).
        connections,
        /// Guest connections to host ports whose socket refused.
        connect_failures,
        /// Host connections with a malformed CONNECT line, or over a limit.
        bad_handshakes,
        /// Control packets dropped because too many were waiting.
        control_dropped,
        /// Corrupt queues: device needs reset.
        queue_errors,
    }
}
