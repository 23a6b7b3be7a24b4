//! The common configuration structure (virtio 1.x, 4.1.4.3): feature windows, MSI-X
//! vector assignment and queue configuration. Status is decoded here and applied by the
//! device (it activates and resets).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};

use super::interrupt::VectorTable;
use super::{TransportMetrics, NO_VECTOR};
use crate::inc;
use crate::narrow::{low_u16, low_u32, low_u8};
use crate::virtio::status;

/// Register offsets in the common configuration.
mod reg {
    pub const DEVICE_FEATURE_SELECT: u64 = 0x00;
    pub const DEVICE_FEATURE: u64 = 0x04;
    pub const DRIVER_FEATURE_SELECT: u64 = 0x08;
    pub const DRIVER_FEATURE: u64 = 0x0c;
    pub const MSIX_CONFIG: u64 = 0x10;
    pub const NUM_QUEUES: u64 = 0x12;
    pub const DEVICE_STATUS: u64 = 0x14;
    pub const CONFIG_GENERATION: u64 = 0x15;
    pub const QUEUE_SELECT: u64 = 0x16;
    pub const QUEUE_SIZE: u64 = 0x18;
    pub const QUEUE_MSIX_VECTOR: u64 = 0x1a;
    pub const QUEUE_ENABLE: u64 = 0x1c;
    pub const QUEUE_NOTIFY_OFF: u64 = 0x1e;
    pub const QUEUE_DESC: u64 = 0x20;
    pub const QUEUE_DRIVER: u64 = 0x28;
    pub const QUEUE_DEVICE: u64 = 0x30;
}

/// What a common configuration write asks the device to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CommonCfgAction {
    /// Nothing beyond the register change.
    None,
    /// The driver wrote this value to device_status.
    Status(u8),
}

/// State of the common configuration.
pub(super) struct CommonConfig {
    pub(super) device_feature_select: u32,
    pub(super) driver_feature_select: u32,
    pub(super) driver_features: u64,
    pub(super) status: u8,
    pub(super) queue_select: u16,
    pub(super) queues: Vec<Queue>,
    pub(super) vectors: Arc<VectorTable>,
    metrics: Arc<TransportMetrics>,
}

impl CommonConfig {
    pub(super) fn new(queues: Vec<Queue>, metrics: Arc<TransportMetrics>) -> Self {
        let vectors = Arc::new(VectorTable::new(queues.len()));
        Self {
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            status: 0,
            queue_select: 0,
            queues,
            vectors,
            metrics,
        }
    }

    /// Back to the state after power-on: features, status and queues cleared.
    pub(super) fn reset(&mut self) {
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.driver_features = 0;
        self.status = 0;
        self.queue_select = 0;
        for q in &mut self.queues {
            q.reset();
        }
        self.vectors.reset();
    }

    fn selected(&self) -> Option<&Queue> {
        self.queues.get(usize::from(self.queue_select))
    }

    fn feature_window(features: u64, select: u32) -> u32 {
        match select {
            0 => low_u32(features),
            1 => low_u32(features >> 32),
            _ => 0,
        }
    }

    /// Reads a register. `data.len()` must match the field (8-byte reads of the queue
    /// addresses are allowed too); anything else reads zero and is counted.
    pub(super) fn read(&self, offset: u64, data: &mut [u8], device_features: u64, generation: u8) {
        data.fill(0);
        let queue = self.selected();
        let value: u64 = match (offset, data.len()) {
            (reg::DEVICE_FEATURE_SELECT, 4) => u64::from(self.device_feature_select),
            (reg::DEVICE_FEATURE, 4) => u64::from(Self::feature_window(
                device_features,
                self.device_feature_select,
            )),
            (reg::DRIVER_FEATURE_SELECT, 4) => u64::from(self.driver_feature_select),
            (reg::DRIVER_FEATURE, 4) => u64::from(Self::feature_window(
                self.driver_features,
                self.driver_feature_select,
            )),
            (reg::MSIX_CONFIG, 2) => u64::from(self.vectors.config.load(Ordering::Acquire)),
            (reg::NUM_QUEUES, 2) => self.queues.len() as u64,
            (reg::DEVICE_STATUS, 1) => u64::from(self.status),
            (reg::CONFIG_GENERATION, 1) => u64::from(generation),
            (reg::QUEUE_SELECT, 2) => u64::from(self.queue_select),
            (reg::QUEUE_SIZE, 2) => queue.map_or(0, |q| u64::from(q.size())),
            (reg::QUEUE_MSIX_VECTOR, 2) => self
                .vectors
                .queues
                .get(usize::from(self.queue_select))
                .map_or(u64::from(NO_VECTOR), |v| {
                    u64::from(v.load(Ordering::Acquire))
                }),
            (reg::QUEUE_ENABLE, 2) => queue.map_or(0, |q| u64::from(q.ready())),
            (reg::QUEUE_NOTIFY_OFF, 2) => u64::from(self.queue_select),
            (reg::QUEUE_DESC, 4 | 8) => queue.map_or(0, |q| q.desc_table()),
            (reg::QUEUE_DRIVER, 4 | 8) => queue.map_or(0, |q| q.avail_ring()),
            (reg::QUEUE_DEVICE, 4 | 8) => queue.map_or(0, |q| q.used_ring()),
            (0x24, 4) => queue.map_or(0, |q| q.desc_table() >> 32),
            (0x2c, 4) => queue.map_or(0, |q| q.avail_ring() >> 32),
            (0x34, 4) => queue.map_or(0, |q| q.used_ring() >> 32),
            _ => {
                inc(&self.metrics.bad_access);
                return;
            }
        };
        let bytes = value.to_le_bytes();
        data.copy_from_slice(&bytes[..data.len()]);
    }

    /// Whether the selected queue may still be configured.
    fn queue_writable(&self) -> bool {
        let live =
            self.status & status::DRIVER_OK != 0 || self.selected().is_none_or(|q| q.ready());
        if live {
            inc(&self.metrics.bad_queue_config);
        }
        !live
    }

    /// Applies a register write. `msix_vectors` is the MSI-X table size.
    pub(super) fn write(&mut self, offset: u64, data: &[u8], msix_vectors: u16) -> CommonCfgAction {
        let mut bytes = [0u8; 8];
        let Some(dst) = bytes.get_mut(..data.len()) else {
            inc(&self.metrics.bad_access);
            return CommonCfgAction::None;
        };
        dst.copy_from_slice(data);
        // `value` holds exactly the `data.len()` bytes written; each arm below matches
        // that width, so narrowing it to the register's width drops only zeroes.
        let value = u64::from_le_bytes(bytes);
        let idx = usize::from(self.queue_select);
        match (offset, data.len()) {
            (reg::DEVICE_FEATURE_SELECT, 4) => self.device_feature_select = low_u32(value),
            (reg::DRIVER_FEATURE_SELECT, 4) => self.driver_feature_select = low_u32(value),
            (reg::DRIVER_FEATURE, 4) => {
                if self.status & status::FEATURES_OK != 0 || self.status & status::DRIVER == 0 {
                    inc(&self.metrics.bad_features);
                } else {
                    match self.driver_feature_select {
                        0 => {
                            self.driver_features =
                                (self.driver_features & !0xffff_ffff) | (value & 0xffff_ffff);
                        }
                        1 => {
                            self.driver_features =
                                (self.driver_features & 0xffff_ffff) | (value << 32);
                        }
                        _ => inc(&self.metrics.bad_features),
                    }
                }
            }
            (reg::MSIX_CONFIG, 2) => {
                let vector = self.checked_vector(low_u16(value), msix_vectors);
                self.vectors.config.store(vector, Ordering::Release);
            }
            (reg::DEVICE_STATUS, 1) => return CommonCfgAction::Status(low_u8(value)),
            (reg::QUEUE_SELECT, 2) => self.queue_select = low_u16(value),
            (reg::QUEUE_SIZE, 2) => {
                if self.queue_writable() {
                    let q = &mut self.queues[idx];
                    let size = low_u16(value);
                    if size == 0 || !size.is_power_of_two() || size > q.max_size() {
                        inc(&self.metrics.bad_queue_config);
                    } else {
                        q.set_size(size);
                    }
                }
            }
            (reg::QUEUE_MSIX_VECTOR, 2) => {
                let vector = self.checked_vector(low_u16(value), msix_vectors);
                match self.vectors.queues.get(idx) {
                    Some(slot) => slot.store(vector, Ordering::Release),
                    None => inc(&self.metrics.bad_queue_config),
                }
            }
            (reg::QUEUE_ENABLE, 2) => {
                // Only 1 is valid; a queue is disabled only by a device reset.
                if value == 1 && self.queue_writable() {
                    self.queues[idx].set_ready(true);
                } else if value != 1 {
                    inc(&self.metrics.bad_queue_config);
                }
            }
            (o @ (reg::QUEUE_DESC | reg::QUEUE_DRIVER | reg::QUEUE_DEVICE), 4 | 8)
            | (o @ (0x24 | 0x2c | 0x34), 4) => {
                if self.queue_writable() {
                    let high_half = o % 8 == 4;
                    let (low, high) = match (high_half, data.len()) {
                        (true, _) => (None, Some(low_u32(value))),
                        (false, 8) => (Some(low_u32(value)), Some(low_u32(value >> 32))),
                        (false, _) => (Some(low_u32(value)), None),
                    };
                    let q = &mut self.queues[idx];
                    match o - o % 8 {
                        reg::QUEUE_DESC => q.set_desc_table_address(low, high),
                        reg::QUEUE_DRIVER => q.set_avail_ring_address(low, high),
                        _ => q.set_used_ring_address(low, high),
                    }
                }
            }
            _ => inc(&self.metrics.bad_access),
        }
        CommonCfgAction::None
    }

    fn checked_vector(&self, vector: u16, msix_vectors: u16) -> u16 {
        if vector != NO_VECTOR && vector >= msix_vectors {
            inc(&self.metrics.bad_vector);
            NO_VECTOR
        } else {
            vector
        }
    }
}
