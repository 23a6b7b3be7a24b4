//! [`VirtioInterrupt`] over MSI-X: each queue and the configuration have a vector the
//! driver chose through the common configuration.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use super::NO_VECTOR;
use crate::pci::MsixConfig;
use crate::virtio::{VirtioInterrupt, VirtioInterruptError, VirtioInterruptType};

/// ISR bit: a queue interrupt.
const ISR_QUEUE: u8 = 1;
/// ISR bit: a configuration change.
const ISR_CONFIG: u8 = 2;

/// The vectors the driver assigned; shared between the transport (writer, vCPU thread)
/// and the interrupt (reader, device thread).
#[derive(Debug)]
pub(super) struct VectorTable {
    pub(super) config: AtomicU16,
    pub(super) queues: Vec<AtomicU16>,
}

impl VectorTable {
    pub(super) fn new(queues: usize) -> Self {
        Self {
            config: AtomicU16::new(NO_VECTOR),
            queues: (0..queues).map(|_| AtomicU16::new(NO_VECTOR)).collect(),
        }
    }

    pub(super) fn reset(&self) {
        self.config.store(NO_VECTOR, Ordering::Release);
        for q in &self.queues {
            q.store(NO_VECTOR, Ordering::Release);
        }
    }
}

/// Raises a virtio device's interrupts through its function's MSI-X state.
pub(super) struct VirtioPciInterrupt {
    pub(super) msix: Arc<Mutex<MsixConfig>>,
    pub(super) vectors: Arc<VectorTable>,
    pub(super) isr: AtomicU8,
    pub(super) needs_reset: AtomicBool,
}

impl VirtioPciInterrupt {
    fn raise(&self, vector: u16) {
        if vector != NO_VECTOR {
            self.msix
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .trigger(vector);
        }
    }
}

impl VirtioInterrupt for VirtioPciInterrupt {
    fn trigger(&self, kind: VirtioInterruptType) -> Result<(), VirtioInterruptError> {
        let vector = match kind {
            VirtioInterruptType::Config => {
                self.isr.fetch_or(ISR_CONFIG, Ordering::AcqRel);
                self.vectors.config.load(Ordering::Acquire)
            }
            VirtioInterruptType::Queue(q) => {
                let vector = self
                    .vectors
                    .queues
                    .get(usize::from(q))
                    .ok_or(VirtioInterruptError::NoSuchQueue(q))?;
                self.isr.fetch_or(ISR_QUEUE, Ordering::AcqRel);
                vector.load(Ordering::Acquire)
            }
        };
        self.raise(vector);
        Ok(())
    }

    fn signal_needs_reset(&self) {
        self.needs_reset.store(true, Ordering::Release);
        let _ = self.trigger(VirtioInterruptType::Config);
    }
}
