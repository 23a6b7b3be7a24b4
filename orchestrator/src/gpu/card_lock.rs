//! One lock per GPU card, so that the steps that change a card's host mode (MIG on, VFs
//! on: prepare-gpu-host and create-gpu-instance; VFs off, MIG off: the card's last tenant
//! leaving in release-gpu) never interleave. Without it, a create that found the card in
//! vGPU mode (so recorded that it turned nothing on) could prepare while the departure of
//! the card's last vGPU tenant, having seen no other tenant on the card, disabled the VFs
//! and turned MIG off under it: the new tenant's instance or vGPU would then fail, and no
//! record would say who turns the mode back off.
//!
//! The lock is the daemon's (one daemon per state directory); each hold is bounded by
//! [`CARD_LOCK_WAIT`], after which the step fails with a clear error and is retried with its
//! operation.

use std::collections::HashSet;
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The longest a step waits for another step's hold on the same card (host mode changes
/// take seconds: `sriov-manage`, a MIG mode switch).
pub const CARD_LOCK_WAIT: Duration = Duration::from_secs(300);

/// Why a card could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum CardLockError {
    /// Another step held the card for longer than the wait.
    #[error("GPU {gpu} is busy: another tenant's step has been changing its host mode for more than {waited:?}; the operation can be retried")]
    Busy {
        /// The card.
        gpu: String,
        /// How long this step waited.
        waited: Duration,
    },
}

/// The cards held now.
#[derive(Debug, Default)]
pub struct CardLocks {
    held: Mutex<HashSet<String>>,
    freed: Condvar,
}

/// A held card; dropping it lets the next step in.
#[derive(Debug)]
pub struct CardGuard<'a> {
    locks: &'a CardLocks,
    key: String,
}

/// The key of a card: its ledger id (a PCI address in any case, or an index).
fn key(gpu: &str) -> String {
    gpu.trim().to_ascii_lowercase()
}

impl CardLocks {
    /// Holds card `gpu`, waiting up to `wait` for another holder.
    pub fn hold(&self, gpu: &str, wait: Duration) -> Result<CardGuard<'_>, CardLockError> {
        let key = key(gpu);
        let start = Instant::now();
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        while held.contains(&key) {
            let Some(left) = wait.checked_sub(start.elapsed()) else {
                return Err(CardLockError::Busy {
                    gpu: gpu.to_string(),
                    waited: start.elapsed(),
                });
            };
            held = self
                .freed
                .wait_timeout(held, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        held.insert(key.clone());
        Ok(CardGuard { locks: self, key })
    }

    /// Whether card `gpu` is held now (for tests and diagnostics).
    pub fn is_held(&self, gpu: &str) -> bool {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&key(gpu))
    }
}

impl Drop for CardGuard<'_> {
    fn drop(&mut self) {
        self.locks
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.key);
        self.locks.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_card_is_held_by_one_step_at_a_time_and_others_are_not_blocked() {
        let locks = CardLocks::default();
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            let first = locks.hold("0000:41:00.0", CARD_LOCK_WAIT).unwrap();
            // Another card is free meanwhile.
            drop(locks.hold("0000:42:00.0", Duration::ZERO).unwrap());
            s.spawn(|| {
                // The same card, spelt in capitals: it waits for the first holder.
                let g = locks.hold("0000:41:00.0".to_uppercase().as_str(), CARD_LOCK_WAIT);
                tx.send(g.is_ok()).unwrap();
            });
            rx.recv_timeout(Duration::from_millis(200)).unwrap_err();
            drop(first);
            assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());
        });
        assert!(!locks.is_held("0000:41:00.0"));
    }

    #[test]
    fn a_card_held_too_long_is_a_clear_error() {
        let locks = CardLocks::default();
        let _g = locks.hold("3", CARD_LOCK_WAIT).unwrap();
        let err = locks
            .hold("3", Duration::from_millis(50))
            .unwrap_err()
            .to_string();
        assert!(err.contains("GPU 3 is busy"), "{err}");
    }
}
