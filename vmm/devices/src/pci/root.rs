//! The PCI root: a host bridge at 00:00.0 and up to 31 devices on bus 0, reachable
//! through ECAM ([`PciConfigMmio`]) and the legacy 0xCF8/0xCFC ports ([`PciConfigIo`]).
//!
//! When a guest moves a BAR, the root asks the VMM's [`BarRelocation`] to move the bus
//! mapping (and ioeventfds); a refused move leaves the device where it was.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::config::{BarMove, PciConfiguration, PciHeader};
use super::PCI_SLOTS;
use crate::bus::BusDevice;

/// A PCI function as the root sees it.
pub trait PciDevice: Send {
    /// Reads configuration register `reg` (dword index into the 4 KiB space).
    fn config_read(&mut self, reg: usize) -> u32;
    /// Writes `data` (1, 2 or 4 bytes) at byte `offset` of register `reg`. Returns the
    /// BARs the write moved.
    fn config_write(&mut self, reg: usize, offset: usize, data: &[u8]) -> Vec<BarMove>;
    /// The VMM refused `mv`: the device stays mapped at `mv.old`.
    fn bar_move_refused(&mut self, mv: &BarMove);
    /// Reads BAR `bar` at `offset`.
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]);
    /// Writes BAR `bar` at `offset`.
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]);
}

/// A PCI device shared between the root and its BAR mappings on the MMIO bus.
pub type SharedPciDevice = Arc<Mutex<dyn PciDevice>>;

/// Why the VMM refused to move a BAR.
#[derive(Debug, thiserror::Error)]
pub enum BarRelocationError {
    /// The new range is outside the PCI windows or overlaps another mapping.
    #[error("BAR range {addr:#x}+{size:#x} is not free in the PCI windows")]
    Range {
        /// Requested address.
        addr: u64,
        /// BAR size.
        size: u64,
    },
    /// Moving the bus mapping or an ioeventfd failed.
    #[error("Could not move the BAR mapping: {0}")]
    Remap(String),
}

/// The VMM's side of BAR relocation: move the bus range of the BAR (and any ioeventfds
/// inside it). Called on the vCPU thread with the [`PciRoot`] locked but not the device,
/// so an implementation must not touch configuration space.
pub trait BarRelocation: Send + Sync {
    /// Moves BAR `mv.index` of the device in `slot` from `mv.old` to `mv.new`.
    fn move_bar(&self, slot: u8, mv: &BarMove) -> Result<(), BarRelocationError>;
}

/// Why a device could not be added to the root.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PciRootError {
    /// All 31 device slots are taken.
    #[error("No free PCI slot on bus 0 (31 devices at most)")]
    NoFreeSlot,
}

/// The host bridge at 00:00.0: identity only.
struct HostBridge {
    config: PciConfiguration,
}

impl PciDevice for HostBridge {
    fn config_read(&mut self, reg: usize) -> u32 {
        self.config.read_reg(reg)
    }
    fn config_write(&mut self, reg: usize, offset: usize, data: &[u8]) -> Vec<BarMove> {
        self.config.write(reg, offset, data)
    }
    fn bar_move_refused(&mut self, _mv: &BarMove) {}
    fn bar_read(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }
    fn bar_write(&mut self, _bar: usize, _offset: u64, _data: &[u8]) {}
}

/// Counters of the root.
#[derive(Debug, Default)]
pub struct PciRootMetrics {
    /// Configuration accesses of a width or alignment that is not allowed.
    pub bad_access: AtomicU64,
    /// BAR moves the VMM refused.
    pub bar_moves_refused: AtomicU64,
    /// BAR moves done.
    pub bar_moves: AtomicU64,
}

/// Bus 0: the host bridge and the devices, by slot.
pub struct PciRoot {
    devices: BTreeMap<u8, SharedPciDevice>,
    relocation: Option<Arc<dyn BarRelocation>>,
    metrics: Arc<PciRootMetrics>,
}

fn lock(device: &SharedPciDevice) -> MutexGuard<'_, dyn PciDevice + 'static> {
    device
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl PciRoot {
    /// Creates bus 0 with the host bridge (Red Hat QEMU PCIe host bridge IDs, which every
    /// OS accepts) in slot 0.
    pub fn new(relocation: Option<Arc<dyn BarRelocation>>) -> Self {
        let bridge = HostBridge {
            config: PciConfiguration::new(PciHeader {
                vendor_id: 0x1b36,
                device_id: 0x0008,
                class: 0x06,
                subclass: 0x00,
                subsystem_vendor_id: 0x1b36,
                subsystem_id: 0x0008,
                ..Default::default()
            }),
        };
        let mut devices: BTreeMap<u8, SharedPciDevice> = BTreeMap::new();
        devices.insert(0, Arc::new(Mutex::new(bridge)));
        Self {
            devices,
            relocation,
            metrics: Arc::default(),
        }
    }

    /// Sets the VMM's relocation handler.
    pub fn set_relocation(&mut self, relocation: Arc<dyn BarRelocation>) {
        self.relocation = Some(relocation);
    }

    /// Adds a device in the first free slot and returns the slot.
    pub fn add_device(&mut self, device: SharedPciDevice) -> Result<u8, PciRootError> {
        let slot = (1..PCI_SLOTS)
            .find(|s| !self.devices.contains_key(s))
            .ok_or(PciRootError::NoFreeSlot)?;
        self.devices.insert(slot, device);
        Ok(slot)
    }

    /// The counters.
    pub fn metrics(&self) -> Arc<PciRootMetrics> {
        self.metrics.clone()
    }

    /// Reads a dword of configuration space. Absent functions read all-ones.
    pub fn config_read(&self, bus: u8, slot: u8, function: u8, reg: usize) -> u32 {
        if bus != 0 || function != 0 {
            return u32::MAX;
        }
        match self.devices.get(&slot) {
            Some(device) => lock(device).config_read(reg),
            None => u32::MAX,
        }
    }

    /// Writes configuration space and carries out any BAR moves it causes.
    pub fn config_write(
        &self,
        bus: u8,
        slot: u8,
        function: u8,
        reg: usize,
        offset: usize,
        data: &[u8],
    ) {
        if bus != 0 || function != 0 {
            return;
        }
        let Some(device) = self.devices.get(&slot) else {
            return;
        };
        let moves = lock(device).config_write(reg, offset, data);
        for mv in moves {
            let result = match &self.relocation {
                Some(relocation) => relocation.move_bar(slot, &mv),
                None => Err(BarRelocationError::Remap("no relocation handler".into())),
            };
            match result {
                Ok(()) => {
                    self.metrics.bar_moves.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    self.metrics
                        .bar_moves_refused
                        .fetch_add(1, Ordering::Relaxed);
                    warn_limited!("PCI slot {slot} BAR {}: {e}", mv.index);
                    lock(device).bar_move_refused(&mv);
                }
            }
        }
    }

    /// Reads `data.len()` bytes (1, 2 or 4, naturally aligned) at byte `offset` of a
    /// function's configuration space.
    fn read_bytes(&self, bus: u8, slot: u8, function: u8, offset: u64, data: &mut [u8]) {
        if !self.access_ok(offset, data.len()) {
            data.fill(0xff);
            return;
        }
        let value = self.config_read(bus, slot, function, (offset / 4) as usize);
        let shift = (offset % 4) * 8;
        let bytes = (value >> shift).to_le_bytes();
        data.copy_from_slice(&bytes[..data.len()]);
    }

    fn write_bytes(&self, bus: u8, slot: u8, function: u8, offset: u64, data: &[u8]) {
        if !self.access_ok(offset, data.len()) {
            return;
        }
        self.config_write(
            bus,
            slot,
            function,
            (offset / 4) as usize,
            (offset % 4) as usize,
            data,
        );
    }

    fn access_ok(&self, offset: u64, len: usize) -> bool {
        let ok = matches!(len, 1 | 2 | 4) && offset % len as u64 == 0;
        if !ok {
            self.metrics.bad_access.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }
}

/// One BAR of a PCI device as a bus device: the VMM inserts it on the MMIO (or port I/O)
/// bus at the BAR's address and moves it when the guest moves the BAR.
pub struct PciBarWindow {
    device: SharedPciDevice,
    bar: usize,
}

impl PciBarWindow {
    /// Routes accesses to BAR `bar` of `device`.
    pub fn new(device: SharedPciDevice, bar: usize) -> Self {
        Self { device, bar }
    }
}

impl BusDevice for PciBarWindow {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        lock(&self.device).bar_read(self.bar, offset, data);
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        lock(&self.device).bar_write(self.bar, offset, data);
    }
}

fn lock_root(root: &Mutex<PciRoot>) -> MutexGuard<'_, PciRoot> {
    root.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The ECAM window of bus 0 as an MMIO bus device: offset = slot << 15 | function << 12 | register.
pub struct PciConfigMmio {
    root: Arc<Mutex<PciRoot>>,
}

impl PciConfigMmio {
    /// Serves `root` through ECAM.
    pub fn new(root: Arc<Mutex<PciRoot>>) -> Self {
        Self { root }
    }

    fn decode(offset: u64) -> (u8, u8, u8, u64) {
        let bus = ((offset >> 20) & 0xff) as u8;
        let slot = ((offset >> 15) & 0x1f) as u8;
        let function = ((offset >> 12) & 0x7) as u8;
        (bus, slot, function, offset & 0xfff)
    }
}

impl BusDevice for PciConfigMmio {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        let (bus, slot, function, reg) = Self::decode(offset);
        lock_root(&self.root).read_bytes(bus, slot, function, reg, data);
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        let (bus, slot, function, reg) = Self::decode(offset);
        lock_root(&self.root).write_bytes(bus, slot, function, reg, data);
    }
}

/// Configuration mechanism #1: the address register at 0xCF8 and data at 0xCFC-0xCFF,
/// as a port I/O bus device covering 8 ports from 0xCF8.
pub struct PciConfigIo {
    root: Arc<Mutex<PciRoot>>,
    address: u32,
}

impl PciConfigIo {
    /// Serves `root` through ports 0xCF8/0xCFC.
    pub fn new(root: Arc<Mutex<PciRoot>>) -> Self {
        Self { root, address: 0 }
    }

    /// The addressed function and byte offset, if the enable bit is set.
    fn target(&self, data_offset: u64) -> Option<(u8, u8, u8, u64)> {
        if self.address & 0x8000_0000 == 0 {
            return None;
        }
        let bus = ((self.address >> 16) & 0xff) as u8;
        let slot = ((self.address >> 11) & 0x1f) as u8;
        let function = ((self.address >> 8) & 0x7) as u8;
        let reg = u64::from(self.address & 0xfc) + data_offset;
        Some((bus, slot, function, reg))
    }
}

impl BusDevice for PciConfigIo {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        match offset {
            0 if data.len() == 4 => data.copy_from_slice(&self.address.to_le_bytes()),
            4..=7 => match self.target(offset - 4) {
                Some((bus, slot, function, reg)) => {
                    lock_root(&self.root).read_bytes(bus, slot, function, reg, data);
                }
                None => data.fill(0xff),
            },
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        match offset {
            0 if data.len() == 4 => {
                self.address =
                    u32::from_le_bytes([data[0], data[1], data[2], data[3]]) & 0x80ff_fffc;
            }
            4..=7 => {
                if let Some((bus, slot, function, reg)) = self.target(offset - 4) {
                    lock_root(&self.root).write_bytes(bus, slot, function, reg, data);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci::{BarKind, COMMAND_MEMORY};

    /// A device with one 32-bit BAR, for root tests.
    struct OneBar {
        config: PciConfiguration,
        refused: Vec<BarMove>,
    }

    impl PciDevice for OneBar {
        fn config_read(&mut self, reg: usize) -> u32 {
            self.config.read_reg(reg)
        }
        fn config_write(&mut self, reg: usize, offset: usize, data: &[u8]) -> Vec<BarMove> {
            self.config.write(reg, offset, data)
        }
        fn bar_move_refused(&mut self, mv: &BarMove) {
            self.config.bar_move_refused(mv);
            self.refused.push(*mv);
        }
        fn bar_read(&mut self, _bar: usize, _offset: u64, _data: &mut [u8]) {}
        fn bar_write(&mut self, _bar: usize, _offset: u64, _data: &[u8]) {}
    }

    /// Accepts moves into [0xc000_0000, 0xe000_0000) and records them.
    #[derive(Default)]
    struct RecordingRelocation {
        moves: Mutex<Vec<(u8, BarMove)>>,
    }

    impl BarRelocation for RecordingRelocation {
        fn move_bar(&self, slot: u8, mv: &BarMove) -> Result<(), BarRelocationError> {
            if !(0xc000_0000..0xe000_0000).contains(&mv.new) {
                return Err(BarRelocationError::Range {
                    addr: mv.new,
                    size: mv.size,
                });
            }
            self.moves.lock().unwrap().push((slot, *mv));
            Ok(())
        }
    }

    fn setup() -> (
        Arc<Mutex<PciRoot>>,
        Arc<Mutex<OneBar>>,
        Arc<RecordingRelocation>,
    ) {
        let relocation = Arc::new(RecordingRelocation::default());
        let root = Arc::new(Mutex::new(PciRoot::new(Some(relocation.clone()))));
        let mut config = PciConfiguration::new(PciHeader {
            vendor_id: 0x1af4,
            device_id: 0x1044,
            ..Default::default()
        });
        config
            .add_bar(
                0,
                BarKind::Memory32 {
                    prefetchable: false,
                },
                0xc000_0000,
                0x1000,
            )
            .unwrap();
        let dev = Arc::new(Mutex::new(OneBar {
            config,
            refused: vec![],
        }));
        assert_eq!(root.lock().unwrap().add_device(dev.clone()), Ok(1));
        (root, dev, relocation)
    }

    fn io_read(io: &mut PciConfigIo, slot: u8, reg: u8) -> u32 {
        let addr = 0x8000_0000u32 | (u32::from(slot) << 11) | u32::from(reg);
        io.write(0xcf8, 0, &addr.to_le_bytes());
        let mut data = [0u8; 4];
        io.read(0xcf8, 4, &mut data);
        u32::from_le_bytes(data)
    }

    #[test]
    fn host_bridge_and_device_visible_through_both_mechanisms() {
        let (root, _, _) = setup();
        let mut io = PciConfigIo::new(root.clone());
        let mut ecam = PciConfigMmio::new(root);
        assert_eq!(io_read(&mut io, 0, 0), 0x0008_1b36);
        assert_eq!(io_read(&mut io, 1, 0), 0x1044_1af4);
        assert_eq!(io_read(&mut io, 2, 0), u32::MAX);
        let mut data = [0u8; 2];
        ecam.read(0xe000_0000, 1 << 15, &mut data);
        assert_eq!(u16::from_le_bytes(data), 0x1af4);
        // Sub-dword read of the device ID through the data port's upper half.
        let addr = 0x8000_0000u32 | (1 << 11);
        io.write(0xcf8, 0, &addr.to_le_bytes());
        io.read(0xcf8, 6, &mut data);
        assert_eq!(u16::from_le_bytes(data), 0x1044);
    }

    #[test]
    fn other_buses_and_functions_read_all_ones() {
        let (root, _, _) = setup();
        let mut ecam = PciConfigMmio::new(root);
        let mut data = [0u8; 4];
        ecam.read(0, (1 << 20) | (1 << 15), &mut data);
        assert_eq!(data, [0xff; 4]);
        ecam.read(0, (1 << 15) | (1 << 12), &mut data);
        assert_eq!(data, [0xff; 4]);
    }

    #[test]
    fn bar_move_goes_to_vmm_and_refusal_keeps_mapping() {
        let (root, dev, relocation) = setup();
        let mut ecam = PciConfigMmio::new(root.clone());
        let base = 1u64 << 15;
        ecam.write(0, base + 4, &u32::from(COMMAND_MEMORY).to_le_bytes());
        ecam.write(0, base + 0x10, &0xd000_0000u32.to_le_bytes());
        assert_eq!(relocation.moves.lock().unwrap().len(), 1);
        assert_eq!(dev.lock().unwrap().config.bar_mapped(0), Some(0xd000_0000));
        // Outside the window: refused, still mapped at the old place.
        ecam.write(0, base + 0x10, &0x1000u32.to_le_bytes());
        assert_eq!(dev.lock().unwrap().refused.len(), 1);
        assert_eq!(dev.lock().unwrap().config.bar_mapped(0), Some(0xd000_0000));
        let metrics = root.lock().unwrap().metrics();
        assert_eq!(metrics.bar_moves.load(Ordering::Relaxed), 1);
        assert_eq!(metrics.bar_moves_refused.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn misaligned_and_odd_width_accesses_are_refused() {
        let (root, _, _) = setup();
        let mut ecam = PciConfigMmio::new(root.clone());
        let mut data = [0u8; 4];
        ecam.read(0, 1, &mut data);
        assert_eq!(data, [0xff; 4]);
        let mut odd = [0u8; 3];
        ecam.read(0, 0, &mut odd);
        assert_eq!(odd, [0xff; 3]);
        ecam.write(0, 2, &[0u8; 4]);
        let mut io = PciConfigIo::new(root);
        io.write(0xcf8, 0, &[0xff]);
        io.read(0xcf8, 0, &mut odd);
        assert_eq!(odd, [0xff; 3]);
    }

    #[test]
    fn full_root_refuses_more_devices() {
        let mut root = PciRoot::new(None);
        for _ in 1..PCI_SLOTS {
            let dev = Arc::new(Mutex::new(OneBar {
                config: PciConfiguration::new(PciHeader::default()),
                refused: vec![],
            }));
            root.add_device(dev).unwrap();
        }
        let dev = Arc::new(Mutex::new(OneBar {
            config: PciConfiguration::new(PciHeader::default()),
            refused: vec![],
        }));
        assert_eq!(root.add_device(dev), Err(PciRootError::NoFreeSlot));
    }
}
