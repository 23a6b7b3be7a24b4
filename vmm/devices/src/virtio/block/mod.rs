//! virtio-blk over a raw image file.
//!
//! - [`request`]: the one parser of guest descriptors into typed requests;
//! - [`disk`]: the image file (positional I/O straight into guest memory, fdatasync,
//!   fallocate for discard and write-zeroes);
//! - [`rate_limiter`]: token buckets for bytes/s and ops/s;
//! - [`device`]: the [`VirtioDevice`](crate::virtio::VirtioDevice) and its config;
//! - [`event_handler`]: the queue worker on the device event loop;
//! - [`metrics`]: the counters.

pub mod device;
pub mod disk;
pub mod event_handler;
pub mod metrics;
pub mod rate_limiter;
pub mod request;

pub use device::{Block, BlockConfig, BlockError};
pub use metrics::BlockMetrics;
pub use rate_limiter::{RateLimitConfig, RateLimiter};

/// Bytes per sector.
pub const SECTOR_SIZE: u64 = 512;
/// log2 of [`SECTOR_SIZE`].
pub const SECTOR_SHIFT: u32 = 9;
/// Size of the queue the device offers.
pub const QUEUE_SIZE: u16 = 256;
/// Length of the GET_ID answer (VIRTIO_BLK_ID_BYTES): the longest disk id the config
/// accepts.
pub const ID_BYTES: usize = tenantvm_vmm_api::config::MAX_DISK_ID_BYTES;
/// Largest data transfer of one request (the guest's block layer uses far less).
pub const MAX_REQUEST_BYTES: u64 = 32 << 20;
/// Largest single discard or write-zeroes range, in sectors.
pub const MAX_DISCARD_SECTORS: u32 = crate::narrow::const_u32((1 << 30) / SECTOR_SIZE);

/// Feature bits of virtio-blk.
pub mod features {
    /// Maximum number of segments in a request is in `seg_max`.
    pub const SEG_MAX: u64 = 1 << 2;
    /// The device is read-only.
    pub const RO: u64 = 1 << 5;
    /// Flush is supported.
    pub const FLUSH: u64 = 1 << 9;
    /// Discard is supported.
    pub const DISCARD: u64 = 1 << 13;
    /// Write-zeroes is supported.
    pub const WRITE_ZEROES: u64 = 1 << 14;
}

/// Request types.
pub mod request_type {
    /// Read.
    pub const IN: u32 = 0;
    /// Write.
    pub const OUT: u32 = 1;
    /// Flush.
    pub const FLUSH: u32 = 4;
    /// Device ID.
    pub const GET_ID: u32 = 8;
    /// Discard.
    pub const DISCARD: u32 = 11;
    /// Write zeroes.
    pub const WRITE_ZEROES: u32 = 13;
}

/// Status bytes.
pub mod status {
    /// Success.
    pub const OK: u8 = 0;
    /// I/O error, or a request the device refuses (including writes to a read-only disk).
    pub const IOERR: u8 = 1;
    /// Unsupported request type.
    pub const UNSUPP: u8 = 2;
}
