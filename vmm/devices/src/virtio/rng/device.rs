//! The virtio-rng device.

use std::sync::{Arc, Mutex};

use super::event_handler::RngHandler;
use super::{RngMetrics, QUEUE_SIZE};
use crate::virtio::{
    device_type, features, ActivateContext, ActivateError, DeviceSubscriber, VirtioDevice,
};

/// A virtio-rng device. It has no configuration.
#[derive(Default)]
pub struct Rng {
    metrics: Arc<RngMetrics>,
}

impl Rng {
    /// Creates the device.
    pub fn new() -> Self {
        Self::default()
    }

    /// The device's counters.
    pub fn metrics(&self) -> Arc<RngMetrics> {
        self.metrics.clone()
    }
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        device_type::RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        features::VERSION_1 | features::RING_INDIRECT_DESC
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(&mut self, mut ctx: ActivateContext) -> Result<DeviceSubscriber, ActivateError> {
        let got = ctx.queues.len().min(ctx.queue_events.len());
        if got < 1 {
            return Err(ActivateError::QueueCount { needed: 1, got });
        }
        Ok(Arc::new(Mutex::new(RngHandler::new(
            ctx.mem,
            ctx.queues.remove(0),
            ctx.queue_events.remove(0),
            ctx.interrupt,
            self.metrics.clone(),
        ))))
    }

    fn reset(&mut self) {}
}
