//! Address buses that route guest port I/O and MMIO exits to device models.
//!
//! A [`Bus`] maps non-overlapping address ranges to devices. The vCPU loop asks the bus
//! for the device covering an exit address and calls it with the offset into its range.
//! The guest controls every address and every byte here, so lookups never panic: an
//! access to an unmapped address (or one that straddles the end of a range) is reported
//! to the caller, which ignores writes and reads back all-ones, as real hardware does.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device that answers reads and writes on a bus.
///
/// `base` is the start of the device's range as registered; `offset` is the distance of
/// the access from `base`. `data.len()` is the access width (1, 2, 4 or 8 bytes for port
/// I/O and MMIO exits; devices must not assume it).
pub trait BusDevice: Send {
    /// Fills `data` with the value read at `base + offset`.
    fn read(&mut self, base: u64, offset: u64, data: &mut [u8]);
    /// Handles a write of `data` at `base + offset`.
    fn write(&mut self, base: u64, offset: u64, data: &[u8]);
}

/// A device shared between the bus and whoever else needs to reach it.
pub type SharedBusDevice = Arc<Mutex<dyn BusDevice>>;

/// Why a range could not be inserted into a bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    /// The range has zero length.
    #[error("Bus range at {base:#x} has zero length")]
    ZeroLength {
        /// Start of the rejected range.
        base: u64,
    },
    /// `base + len` does not fit in 64 bits.
    #[error("Bus range at {base:#x} with length {len:#x} overflows the address space")]
    Overflow {
        /// Start of the rejected range.
        base: u64,
        /// Length of the rejected range.
        len: u64,
    },
    /// The range overlaps one that is already registered.
    #[error("Bus range {base:#x}+{len:#x} overlaps an existing range")]
    Overlap {
        /// Start of the rejected range.
        base: u64,
        /// Length of the rejected range.
        len: u64,
    },
}

#[derive(Clone)]
struct BusEntry {
    len: u64,
    device: SharedBusDevice,
}

/// A set of non-overlapping address ranges, each served by one device.
#[derive(Clone, Default)]
pub struct Bus {
    ranges: BTreeMap<u64, BusEntry>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = f.debug_list();
        for (base, entry) in &self.ranges {
            list.entry(&format_args!("{base:#x}+{:#x}", entry.len));
        }
        list.finish()
    }
}

impl Bus {
    /// Creates an empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `device` for `[base, base + len)`.
    pub fn insert(&mut self, device: SharedBusDevice, base: u64, len: u64) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::ZeroLength { base });
        }
        let end = base
            .checked_add(len)
            .ok_or(BusError::Overflow { base, len })?;
        // The nearest range starting at or below `end - 1` is the only one that can overlap.
        if let Some((other_base, other)) = self.ranges.range(..end).next_back() {
            if other_base + other.len > base {
                return Err(BusError::Overlap { base, len });
            }
        }
        self.ranges.insert(base, BusEntry { len, device });
        Ok(())
    }

    /// Removes the range that starts exactly at `base`, returning its device.
    pub fn remove(&mut self, base: u64) -> Option<SharedBusDevice> {
        self.ranges.remove(&base).map(|entry| entry.device)
    }

    /// Finds the device whose range holds the whole access `[addr, addr + width)`.
    /// Returns the device and its range base.
    pub fn resolve(&self, addr: u64, width: usize) -> Option<(u64, &SharedBusDevice)> {
        let (base, entry) = self.ranges.range(..=addr).next_back()?;
        let offset = addr - base;
        let end = offset.checked_add(width as u64)?;
        (end <= entry.len).then_some((*base, &entry.device))
    }

    /// Dispatches a read. Returns `false` (and fills `data` with all-ones) when no device
    /// covers the access.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.resolve(addr, data.len()) {
            Some((base, device)) => {
                lock_device(device).read(base, addr - base, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// Dispatches a write. Returns `false` (and drops the write) when no device covers it.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.resolve(addr, data.len()) {
            Some((base, device)) => {
                lock_device(device).write(base, addr - base, data);
                true
            }
            None => false,
        }
    }
}

/// Locks a device, recovering from a poisoned lock: a device whose handler panicked on
/// one access must not take the whole VMM down on the next.
fn lock_device(device: &SharedBusDevice) -> std::sync::MutexGuard<'_, dyn BusDevice + 'static> {
    device
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the last access and answers reads with the low byte of the offset.
    #[derive(Default)]
    struct Recorder {
        last_write: Option<(u64, u64, Vec<u8>)>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
            data.fill(crate::narrow::low_u8(offset));
        }
        fn write(&mut self, base: u64, offset: u64, data: &[u8]) {
            self.last_write = Some((base, offset, data.to_vec()));
        }
    }

    fn recorder() -> Arc<Mutex<Recorder>> {
        Arc::new(Mutex::new(Recorder::default()))
    }

    #[test]
    fn insert_rejects_overlap_zero_length_and_overflow() {
        let mut bus = Bus::new();
        bus.insert(recorder(), 0x100, 0x10).unwrap();
        assert_eq!(
            bus.insert(recorder(), 0x108, 0x10),
            Err(BusError::Overlap {
                base: 0x108,
                len: 0x10
            })
        );
        assert_eq!(
            bus.insert(recorder(), 0xf8, 0x10),
            Err(BusError::Overlap {
                base: 0xf8,
                len: 0x10
            })
        );
        assert_eq!(
            bus.insert(recorder(), 0x200, 0),
            Err(BusError::ZeroLength { base: 0x200 })
        );
        assert_eq!(
            bus.insert(recorder(), u64::MAX, 2),
            Err(BusError::Overflow {
                base: u64::MAX,
                len: 2
            })
        );
        // Adjacent ranges are fine.
        bus.insert(recorder(), 0x110, 0x10).unwrap();
        bus.insert(recorder(), 0xf0, 0x10).unwrap();
    }

    #[test]
    fn write_reaches_device_with_offset() {
        let mut bus = Bus::new();
        let dev = recorder();
        bus.insert(dev.clone(), 0x3f8, 8).unwrap();
        assert!(bus.write(0x3fb, &[0x80]));
        assert_eq!(dev.lock().unwrap().last_write, Some((0x3f8, 3, vec![0x80])));
    }

    #[test]
    fn unmapped_and_straddling_accesses_read_all_ones() {
        let mut bus = Bus::new();
        bus.insert(recorder(), 0x1000, 4).unwrap();
        let mut data = [0u8; 4];
        assert!(!bus.read(0x2000, &mut data));
        assert_eq!(data, [0xff; 4]);
        // Starts inside the range but runs past its end.
        assert!(!bus.read(0x1002, &mut data));
        assert_eq!(data, [0xff; 4]);
        assert!(bus.read(0x1000, &mut data));
        assert_eq!(data, [0; 4]);
        // An access at the very top of the address space does not overflow.
        assert!(!bus.read(u64::MAX, &mut data));
    }
}
