//! Virtio devices and the virtio-pci transport.
//!
//! The seams towards the VMM:
//! - a device implements [`VirtioDevice`]; the transport ([`transport::VirtioPciDevice`])
//!   presents it as a PCI function and, when the driver sets DRIVER_OK, calls
//!   [`VirtioDevice::activate`], which returns an event-manager subscriber;
//! - the subscriber runs on the device event-loop thread ([`DeviceEventLoop`], with a
//!   ready implementation in [`EventLoopThread`]), never on a vCPU thread;
//! - queue notifications arrive on one EventFd per queue, which the VMM registers as
//!   ioeventfds at the addresses [`transport::VirtioPciDevice::ioeventfds`] lists;
//! - interrupts leave through [`VirtioInterrupt`], which the transport implements with
//!   MSI-X and the VMM's [`crate::pci::MsiInterruptSink`].

pub mod block;
pub mod chain;
mod event_loop;
pub mod rng;
pub mod transport;
pub mod vsock;

use std::sync::{Arc, Mutex};

use event_manager::MutEventSubscriber;
use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

pub use event_loop::{DeviceEventLoop, EventLoopError, EventLoopThread, ThreadInit};

/// Guest memory as the devices see it.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<()>;

/// A device's work on the event-loop thread.
pub type DeviceSubscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;

/// Virtio device IDs.
pub mod device_type {
    /// Block device.
    pub const BLOCK: u32 = 2;
    /// Entropy source.
    pub const RNG: u32 = 4;
    /// Socket device.
    pub const VSOCK: u32 = 19;
}

/// Device status bits (virtio 1.x, 2.1).
pub mod status {
    /// The guest found the device.
    pub const ACKNOWLEDGE: u8 = 1;
    /// The guest has a driver for it.
    pub const DRIVER: u8 = 2;
    /// The driver is ready.
    pub const DRIVER_OK: u8 = 4;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u8 = 8;
    /// The device hit an error and needs a reset.
    pub const DEVICE_NEEDS_RESET: u8 = 0x40;
    /// The driver gave up on the device.
    pub const FAILED: u8 = 0x80;
}

/// Feature bits common to every device.
pub mod features {
    /// Virtio 1.x (modern) device: required by this transport.
    pub const VERSION_1: u64 = 1 << 32;
    /// The driver may use indirect descriptors.
    pub const RING_INDIRECT_DESC: u64 = 1 << 28;
    /// `used_event` / `avail_event` in the rings suppress notifications both ways.
    pub const RING_EVENT_IDX: u64 = 1 << 29;
}

/// The largest queue this crate's devices offer.
pub const MAX_QUEUE_SIZE: u16 = 256;

/// What the device wants to tell the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VirtioInterruptType {
    /// The device configuration changed (or the device needs a reset).
    Config,
    /// Queue `n` has new used buffers.
    Queue(u16),
}

/// Why an interrupt could not be raised.
#[derive(Debug, thiserror::Error)]
pub enum VirtioInterruptError {
    /// The queue index is not one of the device's queues.
    #[error("Queue {0} does not exist")]
    NoSuchQueue(u16),
}

/// How a device's event handler raises interrupts and reports a broken device.
pub trait VirtioInterrupt: Send + Sync {
    /// Raises `kind` (MSI-X vector of the queue, or the config vector).
    fn trigger(&self, kind: VirtioInterruptType) -> Result<(), VirtioInterruptError>;
    /// Marks the device as needing a reset (DEVICE_NEEDS_RESET) and tells the driver.
    fn signal_needs_reset(&self);
}

/// What a device gets when the driver sets DRIVER_OK.
pub struct ActivateContext {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// Interrupts towards the driver.
    pub interrupt: Arc<dyn VirtioInterrupt>,
    /// The queues, configured and validated by the transport, in queue order.
    pub queues: Vec<Queue>,
    /// One notification EventFd per queue (the VMM's ioeventfds write them).
    pub queue_events: Vec<EventFd>,
    /// The features the driver accepted.
    pub acked_features: u64,
}

/// Why a device could not be activated.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    /// The driver enabled fewer queues than the device needs.
    #[error("The device needs {needed} queues, the driver enabled {got}")]
    QueueCount {
        /// Queues needed.
        needed: usize,
        /// Queues enabled.
        got: usize,
    },
    /// A host resource (eventfd, timer, socket) could not be created.
    #[error("Could not create a host resource for the device: {0}")]
    Resource(#[from] std::io::Error),
}

/// A virtio device model, independent of the transport.
pub trait VirtioDevice: Send {
    /// Virtio device ID (see [`device_type`]).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Features offered (must include [`features::VERSION_1`]).
    fn avail_features(&self) -> u64;
    /// Reads device configuration space at `offset`. Out-of-range bytes read zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes device configuration space; devices ignore writes they do not allow.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// Starts the device: returns the handler to run on the event-loop thread.
    fn activate(&mut self, ctx: ActivateContext) -> Result<DeviceSubscriber, ActivateError>;
    /// Returns the device to its initial state after the transport removed its handler.
    fn reset(&mut self);
}

/// Copies `src` at `offset` of `config` into `data`, zero-filling what lies outside.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(start) = usize::try_from(offset) else {
        return;
    };
    if start >= config.len() {
        return;
    }
    let end = start.saturating_add(data.len()).min(config.len());
    data[..end - start].copy_from_slice(&config[start..end]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_config_bytes_clips_and_zero_fills() {
        let config = [1u8, 2, 3, 4];
        let mut data = [0xffu8; 4];
        read_config_bytes(&config, 2, &mut data);
        assert_eq!(data, [3, 4, 0, 0]);
        read_config_bytes(&config, u64::MAX, &mut data);
        assert_eq!(data, [0; 4]);
    }
}
