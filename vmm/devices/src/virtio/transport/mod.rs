//! The virtio-pci modern transport (virtio 1.x, section 4.1): vendor capabilities for
//! the common configuration, notifications, ISR and device configuration, all in one
//! 64-bit memory BAR together with the MSI-X table and PBA.
//!
//! BAR 0 layout (offsets from the BAR base):
//!
//! | region | offset | size |
//! |---|---|---|
//! | common configuration | 0x0000 | 0x38 |
//! | ISR status | 0x1000 | 1 |
//! | device configuration | 0x2000 | 0x1000 |
//! | notifications (4 bytes per queue) | 0x3000 | 0x1000 |
//! | MSI-X table | 0x4000 | 16 per vector |
//! | MSI-X PBA | 0x6000 | 8 per 64 vectors |

mod common_cfg;
mod device;
mod interrupt;

pub use device::{VirtioPciDevice, VirtioPciError};

/// The BAR holding every region.
pub const BAR_INDEX: usize = 0;
/// Size of BAR 0.
pub const BAR_SIZE: u64 = 0x8000;
/// Common configuration region.
pub const COMMON_CFG_OFFSET: u64 = 0x0000;
/// Size of the common configuration structure.
pub const COMMON_CFG_SIZE: u64 = 0x38;
/// ISR status region.
pub const ISR_OFFSET: u64 = 0x1000;
/// Device configuration region.
pub const DEVICE_CFG_OFFSET: u64 = 0x2000;
/// Size of the device configuration region.
pub const DEVICE_CFG_SIZE: u64 = 0x1000;
/// Notification region.
pub const NOTIFY_OFFSET: u64 = 0x3000;
/// Size of the notification region.
pub const NOTIFY_SIZE: u64 = 0x1000;
/// Bytes between two queues' notification addresses.
pub const NOTIFY_OFF_MULTIPLIER: u32 = 4;
/// MSI-X table.
pub const MSIX_TABLE_OFFSET: u64 = 0x4000;
/// MSI-X pending bit array.
pub const MSIX_PBA_OFFSET: u64 = 0x6000;
/// "No MSI-X vector" in msix_config and queue_msix_vector.
pub const NO_VECTOR: u16 = 0xffff;

counters! {
    /// Counters of a virtio-pci function: mostly driver misbehaviour.
    pub struct TransportMetrics {
        /// Status writes that skip or clear bits out of order.
        bad_status,
        /// Feature sets refused at FEATURES_OK (missing VERSION_1, or bits not offered).
        bad_features,
        /// Queue configuration writes refused (bad size, queue already live, no such queue).
        bad_queue_config,
        /// MSI-X vector numbers past the table.
        bad_vector,
        /// BAR accesses of a width, offset or direction the layout does not allow.
        bad_access,
        /// DRIVER_OK refused (invalid queue memory, missing queues, device error).
        activate_failures,
        /// Successful activations.
        activations,
        /// Device resets.
        resets,
        /// Notifications written through MMIO (not through an ioeventfd).
        mmio_notifies,
    }
}
