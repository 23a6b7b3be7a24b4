//! virtio-vsock with a host Unix-socket backend in the hybrid model (as Firecracker's):
//!
//! - host to guest: a host process connects to the VM's socket `uds_path`, writes
//!   `CONNECT <port>\n` and, once the guest accepts, reads `OK <hostport>\n`; then the
//!   stream carries the connection's bytes;
//! - guest to host: a guest connection to host port P is connected to the Unix socket
//!   `<uds_path>_P`.
//!
//! Flow control is credit based in both directions; every per-connection buffer is
//! bounded; a protocol error gets an RST. Modules: [`packet`] parses and validates guest
//! packets, [`connection`] holds one connection's state, [`event_handler`] runs the
//! queues and sockets on the device event loop, [`device`] is the virtio device.

pub mod connection;
pub mod device;
pub mod event_handler;
pub mod metrics;
pub mod packet;
#[cfg(test)]
mod tests;

pub use device::{Vsock, VsockConfig, VsockError};
pub use metrics::VsockMetrics;

/// The host's CID.
pub const HOST_CID: u64 = 2;
/// Stream sockets, the only type supported.
pub const TYPE_STREAM: u16 = 1;
/// Largest payload of one packet.
pub const MAX_PKT_PAYLOAD: usize = 64 << 10;
/// Receive buffer the device advertises per connection (and the most it buffers).
pub const CONN_BUF_SIZE: u32 = 256 << 10;
/// Most connections at once per VM.
pub const MAX_CONNECTIONS: usize = 1024;
/// Most host connections still sending their `CONNECT` line.
pub const MAX_PENDING_HANDSHAKES: usize = 64;
/// Longest `CONNECT <port>\n` line.
pub const MAX_HANDSHAKE_LINE: usize = 32;
/// Most control packets (RST, RESPONSE, credit updates) waiting for RX buffers.
pub const MAX_PENDING_CONTROL: usize = 1024;
/// First port the device picks for host-initiated connections.
pub const FIRST_HOST_PORT: u32 = 1 << 30;
/// Queue size of each of the three queues.
pub const QUEUE_SIZE: u16 = 256;

/// Operations.
pub mod op {
    /// Connection request.
    pub const REQUEST: u16 = 1;
    /// Connection accepted.
    pub const RESPONSE: u16 = 2;
    /// Reset.
    pub const RST: u16 = 3;
    /// Shutdown (flags: 1 receive, 2 send).
    pub const SHUTDOWN: u16 = 4;
    /// Data.
    pub const RW: u16 = 5;
    /// Credit update.
    pub const CREDIT_UPDATE: u16 = 6;
    /// Credit request.
    pub const CREDIT_REQUEST: u16 = 7;
}

/// Shutdown flag: the sender will receive no more.
pub const SHUTDOWN_RCV: u32 = 1;
/// Shutdown flag: the sender will send no more.
pub const SHUTDOWN_SEND: u32 = 2;
