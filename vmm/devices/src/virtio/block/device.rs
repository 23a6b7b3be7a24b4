//! The virtio-blk device: configuration, features, activation.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use virtio_queue::QueueT;

use super::disk::{DiskError, DiskFile};
use super::event_handler::BlockHandler;
use super::rate_limiter::{RateLimitConfig, RateLimitError, RateLimiter};
use super::request::{DiskGeometry, MAX_DISCARD_SEGMENTS};
use super::{features, BlockMetrics, MAX_DISCARD_SECTORS, QUEUE_SIZE};
use crate::virtio::{
    device_type, features as common_features, read_config_bytes, ActivateContext, ActivateError,
    DeviceSubscriber, VirtioDevice,
};

/// One disk of a VM (config file and command line): part of the VMM's contract, defined in
/// tenantvm-vmm-api.
pub use tenantvm_vmm_api::BlockConfig;

/// Why a disk could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The image.
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// The limits.
    #[error(transparent)]
    RateLimit(#[from] RateLimitError),
    /// The serial is too long.
    #[error("Disk id {0:?} is longer than 20 bytes")]
    IdTooLong(String),
}

/// A virtio-blk device.
pub struct Block {
    disk: Arc<DiskFile>,
    rate_limit: Option<RateLimitConfig>,
    avail_features: u64,
    config: Vec<u8>,
    metrics: Arc<BlockMetrics>,
    queue_sizes: [u16; 1],
}

impl Block {
    /// Opens the image and builds the device.
    pub fn new(config: &BlockConfig) -> Result<Self, BlockError> {
        if let Some(id) = &config.id {
            if id.len() > super::ID_BYTES {
                return Err(BlockError::IdTooLong(id.clone()));
            }
        }
        let disk = DiskFile::open(&config.path, config.read_only, config.id.as_deref())?;
        if let Some(limits) = &config.rate_limit {
            RateLimiter::new(limits, Instant::now())?;
        }
        let mut avail_features = common_features::VERSION_1
            | common_features::RING_INDIRECT_DESC
            | common_features::RING_EVENT_IDX
            | features::SEG_MAX
            | features::FLUSH;
        if disk.read_only() {
            avail_features |= features::RO;
        } else if disk.supports_fallocate() {
            avail_features |= features::DISCARD | features::WRITE_ZEROES;
        }
        // struct virtio_blk_config, up to write_zeroes_may_unmap.
        let mut cfg = vec![0u8; 60];
        cfg[0..8].copy_from_slice(&disk.sectors().to_le_bytes());
        cfg[12..16].copy_from_slice(&(u32::from(QUEUE_SIZE) - 2).to_le_bytes());
        cfg[36..40].copy_from_slice(&MAX_DISCARD_SECTORS.to_le_bytes());
        cfg[40..44].copy_from_slice(&MAX_DISCARD_SEGMENTS.to_le_bytes());
        cfg[44..48].copy_from_slice(&1u32.to_le_bytes());
        cfg[48..52].copy_from_slice(&MAX_DISCARD_SECTORS.to_le_bytes());
        cfg[52..56].copy_from_slice(&MAX_DISCARD_SEGMENTS.to_le_bytes());
        cfg[56] = 1;
        Ok(Self {
            disk: Arc::new(disk),
            rate_limit: config.rate_limit,
            avail_features,
            config: cfg,
            metrics: Arc::default(),
            queue_sizes: [QUEUE_SIZE],
        })
    }

    /// The disk's counters.
    pub fn metrics(&self) -> Arc<BlockMetrics> {
        self.metrics.clone()
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        device_type::BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // Nothing in virtio_blk_config is writable without CONFIG_WCE, which is not offered.
    }

    fn activate(&mut self, mut ctx: ActivateContext) -> Result<DeviceSubscriber, ActivateError> {
        let got = ctx.queues.len().min(ctx.queue_events.len());
        if got < 1 {
            return Err(ActivateError::QueueCount { needed: 1, got });
        }
        let limiter = match &self.rate_limit {
            // Validated in `new`.
            Some(limits) => RateLimiter::new(limits, Instant::now())
                .unwrap_or_else(|_| RateLimiter::unlimited()),
            None => RateLimiter::unlimited(),
        };
        let geometry = DiskGeometry {
            sectors: self.disk.sectors(),
            read_only: self.disk.read_only(),
            acked_features: ctx.acked_features & self.avail_features,
        };
        let mut queue = ctx.queues.remove(0);
        queue.set_event_idx(geometry.acked_features & common_features::RING_EVENT_IDX != 0);
        let handler = BlockHandler::new(
            ctx.mem,
            queue,
            ctx.queue_events.remove(0),
            ctx.interrupt,
            self.disk.clone(),
            geometry,
            limiter,
            self.metrics.clone(),
        )?;
        Ok(Arc::new(Mutex::new(handler)))
    }

    fn reset(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn config(path: PathBuf, read_only: bool) -> BlockConfig {
        BlockConfig {
            path,
            read_only,
            id: None,
            rate_limit: None,
        }
    }

    #[test]
    fn missing_image_error_names_the_path() {
        let err = Block::new(&config("/nonexistent/disk.img".into(), false))
            .err()
            .unwrap();
        assert!(err.to_string().contains("/nonexistent/disk.img"), "{err}");
    }

    #[test]
    fn tiny_image_and_long_id_are_refused() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), [0u8; 100]).unwrap();
        assert!(matches!(
            Block::new(&config(file.path().into(), false)),
            Err(BlockError::Disk(DiskError::TooSmall(_)))
        ));
        std::fs::write(file.path(), [0u8; 4096]).unwrap();
        let long = BlockConfig {
            id: Some("x".repeat(21)),
            ..config(file.path().into(), false)
        };
        assert!(matches!(Block::new(&long), Err(BlockError::IdTooLong(_))));
    }

    #[test]
    fn read_only_disk_offers_ro_and_no_discard() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), [0u8; 8192]).unwrap();
        let ro = Block::new(&config(file.path().into(), true)).unwrap();
        assert_ne!(ro.avail_features() & features::RO, 0);
        assert_eq!(
            ro.avail_features() & (features::DISCARD | features::WRITE_ZEROES),
            0
        );
        let rw = Block::new(&config(file.path().into(), false)).unwrap();
        assert_eq!(rw.avail_features() & features::RO, 0);
        assert_ne!(rw.avail_features() & common_features::RING_EVENT_IDX, 0);
        let mut capacity = [0u8; 8];
        rw.read_config(0, &mut capacity);
        assert_eq!(u64::from_le_bytes(capacity), 16);
    }

    #[test]
    fn config_rejects_unknown_fields() {
        let err =
            serde_json::from_str::<BlockConfig>(r#"{"path":"/x","readonly":true}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }
}
