//! MSI-X emulation: the capability's message control, the vector table and the pending
//! bit array (PBA), producing `(address, data)` messages for an [`MsiInterruptSink`].
//!
//! The VMM implements the sink with KVM GSI routing (on [`MsiInterruptSink::update`]) and
//! an irqfd per vector (on [`MsiInterruptSink::trigger`]). A vector that fires while
//! masked (per entry or by the function mask) sets its pending bit and is delivered when
//! unmasked, as the PCI specification requires.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::Serialize;

use super::cap_id;

/// Size of one MSI-X table entry.
pub const MSIX_ENTRY_SIZE: u64 = 16;
/// Message control: MSI-X enable.
const MSG_CTL_ENABLE: u16 = 1 << 15;
/// Message control: function mask.
const MSG_CTL_FUNCTION_MASK: u16 = 1 << 14;
/// Vector control: entry masked.
const VECTOR_CTL_MASK: u32 = 1;
/// Most vectors a function may have.
pub const MSIX_MAX_VECTORS: u16 = 2048;

/// One MSI message: what the device writes, and where, to raise an interrupt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MsiMessage {
    /// Message address (the LAPIC doorbell range on x86).
    pub address: u64,
    /// Message data (vector, delivery mode).
    pub data: u32,
}

/// Why an interrupt sink failed. The VMM's implementation reports KVM errors here.
#[derive(Debug, thiserror::Error)]
pub enum MsiSinkError {
    /// Updating the interrupt route failed.
    #[error("Could not update the route of MSI-X vector {vector}: {reason}")]
    Route {
        /// The vector.
        vector: u16,
        /// What failed.
        reason: String,
    },
    /// Raising the interrupt failed.
    #[error("Could not raise MSI-X vector {vector}: {reason}")]
    Trigger {
        /// The vector.
        vector: u16,
        /// What failed.
        reason: String,
    },
}

/// Where MSI-X messages go. Implemented by the VMM (KVM GSI routing + irqfd); tests use
/// `FakeMsiSink` from `test_utils`.
pub trait MsiInterruptSink: Send + Sync {
    /// The message of `vector` changed, or its masked state did. A VMM points the vector's
    /// GSI route at `message` (and may disable the route while `masked`).
    fn update(&self, vector: u16, message: MsiMessage, masked: bool) -> Result<(), MsiSinkError>;
    /// Raises `vector`, whose current message is `message`.
    fn trigger(&self, vector: u16, message: MsiMessage) -> Result<(), MsiSinkError>;
}

/// Counters of guest misbehaviour and delivery on an MSI-X function.
#[derive(Debug, Default)]
pub struct MsixMetrics {
    /// Table or PBA accesses of a width or alignment the specification does not allow.
    pub bad_access: AtomicU64,
    /// Triggers of a vector the table does not have.
    pub bad_vector: AtomicU64,
    /// Interrupts delivered.
    pub delivered: AtomicU64,
    /// Interrupts held pending because they were masked.
    pub pended: AtomicU64,
    /// Sink failures.
    pub sink_errors: AtomicU64,
}

#[derive(Debug, Clone, Copy, Default)]
struct MsixEntry {
    addr_lo: u32,
    addr_hi: u32,
    data: u32,
    vector_ctl: u32,
}

impl MsixEntry {
    fn message(&self) -> MsiMessage {
        MsiMessage {
            address: u64::from(self.addr_lo) | (u64::from(self.addr_hi) << 32),
            data: self.data,
        }
    }

    fn masked(&self) -> bool {
        self.vector_ctl & VECTOR_CTL_MASK != 0
    }
}

/// The MSI-X state of one function.
pub struct MsixConfig {
    table: Vec<MsixEntry>,
    pba: Vec<u64>,
    enabled: bool,
    function_masked: bool,
    sink: Arc<dyn MsiInterruptSink>,
    metrics: Arc<MsixMetrics>,
}

impl std::fmt::Debug for MsixConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsixConfig")
            .field("vectors", &self.table.len())
            .field("enabled", &self.enabled)
            .field("function_masked", &self.function_masked)
            .finish()
    }
}

impl MsixConfig {
    /// Creates MSI-X state for `vectors` vectors (clamped to 1..=2048), all masked, as
    /// after reset.
    pub fn new(vectors: u16, sink: Arc<dyn MsiInterruptSink>) -> Self {
        let vectors = vectors.clamp(1, MSIX_MAX_VECTORS);
        let table = vec![
            MsixEntry {
                vector_ctl: VECTOR_CTL_MASK,
                ..Default::default()
            };
            usize::from(vectors)
        ];
        Self {
            pba: vec![0; usize::from(vectors).div_ceil(64)],
            table,
            enabled: false,
            function_masked: false,
            sink,
            metrics: Arc::default(),
        }
    }

    /// Number of vectors.
    pub fn vectors(&self) -> u16 {
        // `new` clamps the table to `MSIX_MAX_VECTORS` entries.
        u16::try_from(self.table.len()).unwrap_or(MSIX_MAX_VECTORS)
    }

    /// Size of the table in bytes.
    pub fn table_size(&self) -> u64 {
        self.table.len() as u64 * MSIX_ENTRY_SIZE
    }

    /// Size of the PBA in bytes.
    pub fn pba_size(&self) -> u64 {
        self.pba.len() as u64 * 8
    }

    /// The counters.
    pub fn metrics(&self) -> Arc<MsixMetrics> {
        self.metrics.clone()
    }

    /// Whether MSI-X is enabled.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The capability bytes to add to configuration space and its writable mask: the
    /// table and PBA live in BAR `bar` at the given offsets (8-byte aligned).
    pub fn capability(&self, bar: u8, table_offset: u32, pba_offset: u32) -> ([u8; 12], [u8; 12]) {
        let mut cap = [0u8; 12];
        cap[0] = cap_id::MSIX;
        let control = self.vectors() - 1;
        cap[2..4].copy_from_slice(&control.to_le_bytes());
        cap[4..8].copy_from_slice(&(table_offset | u32::from(bar & 7)).to_le_bytes());
        cap[8..12].copy_from_slice(&(pba_offset | u32::from(bar & 7)).to_le_bytes());
        let mut writable = [0u8; 12];
        // Enable and function mask, the top two bits of message control.
        writable[3] = 0xc0;
        (cap, writable)
    }

    /// Handles the new value of the capability's message control word (after the config
    /// space masks applied).
    pub fn set_message_control(&mut self, control: u16) {
        let enabled = control & MSG_CTL_ENABLE != 0;
        let function_masked = control & MSG_CTL_FUNCTION_MASK != 0;
        if enabled == self.enabled && function_masked == self.function_masked {
            return;
        }
        self.enabled = enabled;
        self.function_masked = function_masked;
        for vector in 0..self.vectors() {
            self.push_route(vector);
        }
        self.deliver_unmasked_pending();
    }

    /// Whether a trigger of `vector` now would be held pending.
    fn is_masked(&self, vector: u16) -> bool {
        self.function_masked || self.table[usize::from(vector)].masked()
    }

    fn push_route(&self, vector: u16) {
        if !self.enabled {
            return;
        }
        let entry = self.table[usize::from(vector)];
        if let Err(e) = self
            .sink
            .update(vector, entry.message(), self.is_masked(vector))
        {
            self.metrics.sink_errors.fetch_add(1, Ordering::Relaxed);
            warn_limited!("{e}");
        }
    }

    fn deliver_unmasked_pending(&mut self) {
        if !self.enabled || self.function_masked {
            return;
        }
        for vector in 0..self.vectors() {
            let (word, bit) = (usize::from(vector / 64), vector % 64);
            if self.pba[word] & (1 << bit) != 0 && !self.is_masked(vector) {
                self.pba[word] &= !(1 << bit);
                self.deliver(vector);
            }
        }
    }

    fn deliver(&self, vector: u16) {
        let message = self.table[usize::from(vector)].message();
        match self.sink.trigger(vector, message) {
            Ok(()) => {
                self.metrics.delivered.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.metrics.sink_errors.fetch_add(1, Ordering::Relaxed);
                warn_limited!("{e}");
            }
        }
    }

    /// Raises `vector`: delivered now, or held pending while masked. Does nothing while
    /// MSI-X is disabled (this model has no INTx fallback).
    pub fn trigger(&mut self, vector: u16) {
        if vector >= self.vectors() {
            self.metrics.bad_vector.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if !self.enabled {
            return;
        }
        if self.is_masked(vector) {
            self.pba[usize::from(vector / 64)] |= 1 << (vector % 64);
            self.metrics.pended.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.deliver(vector);
    }

    /// Whether `vector`'s pending bit is set.
    pub fn is_pending(&self, vector: u16) -> bool {
        self.pba
            .get(usize::from(vector / 64))
            .is_some_and(|w| w & (1 << (vector % 64)) != 0)
    }

    fn access_ok(&self, offset: u64, len: usize, size: u64) -> bool {
        let ok = matches!(len, 4 | 8)
            && offset % len as u64 == 0
            && offset
                .checked_add(len as u64)
                .is_some_and(|end| end <= size);
        if !ok {
            self.metrics.bad_access.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// Reads the table at `offset`. Accesses must be 4 or 8 bytes, naturally aligned;
    /// others read zero.
    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if !self.access_ok(offset, data.len(), self.table_size()) {
            return;
        }
        for (i, chunk) in data.chunks_mut(4).enumerate() {
            let dword = offset / 4 + i as u64;
            let entry = &self.table[(dword / 4) as usize];
            let value = match dword % 4 {
                0 => entry.addr_lo,
                1 => entry.addr_hi,
                2 => entry.data,
                _ => entry.vector_ctl,
            };
            chunk.copy_from_slice(&value.to_le_bytes());
        }
    }

    /// Writes the table at `offset`. Accesses must be 4 or 8 bytes, naturally aligned;
    /// others are dropped.
    pub fn write_table(&mut self, offset: u64, data: &[u8]) {
        if !self.access_ok(offset, data.len(), self.table_size()) {
            return;
        }
        // `access_ok` kept `offset` inside the table: the entry index is below its u16 count.
        let Ok(first_vector) = u16::try_from(offset / MSIX_ENTRY_SIZE) else {
            return;
        };
        for (i, chunk) in data.chunks(4).enumerate() {
            let dword = offset / 4 + i as u64;
            let value = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            let entry = &mut self.table[(dword / 4) as usize];
            match dword % 4 {
                0 => entry.addr_lo = value & !0x3,
                1 => entry.addr_hi = value,
                2 => entry.data = value,
                _ => entry.vector_ctl = value & VECTOR_CTL_MASK,
            }
        }
        self.push_route(first_vector);
        self.deliver_unmasked_pending();
    }

    /// Reads the PBA at `offset` (4 or 8 bytes, naturally aligned; others read zero).
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if !self.access_ok(offset, data.len(), self.pba_size()) {
            return;
        }
        let word = self.pba[(offset / 8) as usize].to_le_bytes();
        let start = (offset % 8) as usize;
        data.copy_from_slice(&word[start..start + data.len()]);
    }

    /// The PBA is read-only; writes are counted and dropped.
    pub fn write_pba(&mut self, _offset: u64, _data: &[u8]) {
        self.metrics.bad_access.fetch_add(1, Ordering::Relaxed);
    }

    /// Returns to the reset state: disabled, all entries masked, nothing pending.
    pub fn reset(&mut self) {
        for entry in &mut self.table {
            *entry = MsixEntry {
                vector_ctl: VECTOR_CTL_MASK,
                ..Default::default()
            };
        }
        self.pba.fill(0);
        self.enabled = false;
        self.function_masked = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_utils::FakeMsiSink;

    fn write_entry(msix: &mut MsixConfig, vector: u64, address: u64, data: u32, masked: bool) {
        let base = vector * MSIX_ENTRY_SIZE;
        msix.write_table(base, &address.to_le_bytes());
        msix.write_table(base + 8, &data.to_le_bytes());
        msix.write_table(base + 12, &u32::from(masked).to_le_bytes());
    }

    #[test]
    fn trigger_delivers_programmed_message() {
        let sink = Arc::new(FakeMsiSink::new(4));
        let mut msix = MsixConfig::new(4, sink.clone());
        msix.set_message_control(MSG_CTL_ENABLE);
        write_entry(&mut msix, 2, 0xfee0_0000, 0x4041, false);
        msix.trigger(2);
        assert_eq!(
            sink.triggered(),
            vec![(
                2,
                MsiMessage {
                    address: 0xfee0_0000,
                    data: 0x4041
                }
            )]
        );
        assert_eq!(sink.eventfd_count(2), 1);
        assert_eq!(
            sink.route(2),
            Some((
                MsiMessage {
                    address: 0xfee0_0000,
                    data: 0x4041
                },
                false
            ))
        );
    }

    #[test]
    fn masked_vector_pends_and_fires_on_unmask() {
        let sink = Arc::new(FakeMsiSink::new(2));
        let mut msix = MsixConfig::new(2, sink.clone());
        msix.set_message_control(MSG_CTL_ENABLE);
        write_entry(&mut msix, 0, 0xfee0_0000, 0x30, true);
        msix.trigger(0);
        assert!(sink.triggered().is_empty());
        assert!(msix.is_pending(0));
        let mut pba = [0u8; 8];
        msix.read_pba(0, &mut pba);
        assert_eq!(u64::from_le_bytes(pba), 1);
        msix.write_table(12, &0u32.to_le_bytes());
        assert!(!msix.is_pending(0));
        assert_eq!(sink.triggered().len(), 1);
    }

    #[test]
    fn function_mask_holds_all_vectors() {
        let sink = Arc::new(FakeMsiSink::new(2));
        let mut msix = MsixConfig::new(2, sink.clone());
        msix.set_message_control(MSG_CTL_ENABLE | MSG_CTL_FUNCTION_MASK);
        write_entry(&mut msix, 1, 0xfee0_0000, 0x31, false);
        msix.trigger(1);
        assert!(sink.triggered().is_empty());
        msix.set_message_control(MSG_CTL_ENABLE);
        assert_eq!(sink.triggered().len(), 1);
    }

    #[test]
    fn bad_accesses_and_vectors_are_counted_not_fatal() {
        let sink = Arc::new(FakeMsiSink::new(1));
        let mut msix = MsixConfig::new(1, sink);
        let mut data = [0xaau8; 4];
        msix.read_table(2, &mut data);
        assert_eq!(data, [0; 4]);
        msix.write_table(16, &[1, 2, 3, 4]);
        msix.write_table(0, &[1, 2]);
        msix.read_pba(u64::MAX - 3, &mut data);
        msix.write_pba(0, &[1; 8]);
        msix.trigger(7);
        let m = msix.metrics();
        assert_eq!(m.bad_access.load(Ordering::Relaxed), 5);
        assert_eq!(m.bad_vector.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn reset_masks_everything() {
        let sink = Arc::new(FakeMsiSink::new(1));
        let mut msix = MsixConfig::new(1, sink.clone());
        msix.set_message_control(MSG_CTL_ENABLE);
        write_entry(&mut msix, 0, 0xfee0_0000, 0x30, false);
        msix.reset();
        msix.trigger(0);
        assert!(sink.triggered().is_empty());
        let mut ctl = [0u8; 4];
        msix.read_table(12, &mut ctl);
        assert_eq!(u32::from_le_bytes(ctl), 1);
    }
}
