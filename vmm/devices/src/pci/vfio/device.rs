//! [`VfioPciDevice`]: a passed-through function on the PCI root. Configuration accesses
//! go through the [`ConfigShadow`]; trapped BAR accesses go to the emulated MSI-X table
//! and PBA or to the device's region; the rest of each BAR is mmapped by the VMM (see
//! [`VfioPciDevice::mmap_plan`]) and never exits.
//!
//! Interrupts: the VMM hands in one KVM irqfd per vector; enabling MSI-X or MSI passes
//! those eventfds to the device (VFIO_DEVICE_SET_IRQS), so a device interrupt reaches the
//! guest without waking the VMM. Table writes and masking update the KVM routes through
//! the [`MsiInterruptSink`].

use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use super::areas::{mmap_areas, AreaError};
use super::backend::{IrqIndex, VfioBackend, VfioBackendError};
use super::shadow::{ConfigShadow, DeviceProbe, IrqChange, MsixLayout, ShadowError};
use crate::pci::{BarMove, MsiInterruptSink, MsixConfig, MsixMetrics, PciDevice};

counters! {
    /// Counters of a passed-through function.
    pub struct VfioMetrics {
        /// BAR accesses that went through the VMM (not the mmapped parts).
        trapped_accesses,
        /// Region reads or writes the device refused.
        region_errors,
        /// Interrupt (re)configurations the device refused.
        irq_errors,
        /// Interrupt reconfigurations done (MSI/MSI-X enable and disable).
        irq_changes,
    }
}

/// Why a passed-through function could not be built.
#[derive(Debug, thiserror::Error)]
pub enum VfioDeviceError {
    /// The configuration space could not be shadowed.
    #[error(transparent)]
    Shadow(#[from] ShadowError),
    /// Fewer irqfds than the device has vectors.
    #[error("The device needs {needed} interrupt vectors but {given} irqfds were given")]
    Irqfds {
        /// Vectors the device has.
        needed: usize,
        /// Irqfds given.
        given: usize,
    },
}

/// One mmappable part of a BAR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedArea {
    /// BAR index.
    pub bar: usize,
    /// Offset in the BAR.
    pub offset: u64,
    /// Length in bytes.
    pub size: u64,
}

/// The interrupt vectors `probe` needs irqfds for: MSI-X's count, else 1 for MSI, else 0.
pub fn irq_vectors(probe: &DeviceProbe) -> u16 {
    match (probe.msix, probe.msi) {
        (Some(m), _) => m.vectors,
        (None, Some(_)) => 1,
        (None, None) => 0,
    }
}

/// A passed-through PCI function.
pub struct VfioPciDevice {
    backend: Arc<dyn VfioBackend>,
    shadow: ConfigShadow,
    msix: Option<(MsixLayout, MsixConfig)>,
    sink: Arc<dyn MsiInterruptSink>,
    irqfds: Vec<EventFd>,
    msi_enabled: bool,
    /// INTx: the trigger and resample eventfds (KVM irqfd with resample), and whether the
    /// device signals them now (not while MSI or MSI-X is on).
    intx: Option<(EventFd, EventFd)>,
    intx_on: bool,
    metrics: Arc<VfioMetrics>,
}

impl VfioPciDevice {
    /// Builds the function from a probe of `backend`, with its BARs at `addresses` (BAR
    /// index, guest physical address), MSI routes through `sink` and one irqfd per vector
    /// of [`irq_vectors`] (the eventfds KVM injects from).
    pub fn new(
        backend: Arc<dyn VfioBackend>,
        probe: DeviceProbe,
        addresses: &[(usize, u64)],
        sink: Arc<dyn MsiInterruptSink>,
        irqfds: Vec<EventFd>,
    ) -> Result<Self, VfioDeviceError> {
        let needed = usize::from(irq_vectors(&probe));
        if irqfds.len() < needed {
            return Err(VfioDeviceError::Irqfds {
                needed,
                given: irqfds.len(),
            });
        }
        let msix = probe
            .msix
            .map(|layout| (layout, MsixConfig::new(layout.vectors, sink.clone())));
        let shadow = ConfigShadow::new(backend.as_ref(), probe, addresses)?;
        Ok(Self {
            backend,
            shadow,
            msix,
            sink,
            irqfds,
            msi_enabled: false,
            intx: None,
            intx_on: false,
            metrics: Arc::default(),
        })
    }

    /// Wires INTx: the device signals `trigger` (a KVM irqfd on the slot's GSI) and is
    /// unmasked when KVM signals `resample` at the guest's EOI. Active until the guest
    /// enables MSI or MSI-X, and again when it turns them off.
    pub fn enable_intx(
        &mut self,
        trigger: EventFd,
        resample: EventFd,
    ) -> Result<(), VfioBackendError> {
        self.backend.irq_enable(IrqIndex::Intx, &[&trigger])?;
        self.backend.irq_unmask_on(IrqIndex::Intx, &resample)?;
        self.intx = Some((trigger, resample));
        self.intx_on = true;
        Ok(())
    }

    /// Whether INTx is signalled now.
    pub fn intx_active(&self) -> bool {
        self.intx_on
    }

    /// INTx off before MSI or MSI-X goes on (VFIO allows one kind at a time), back on when
    /// neither is on.
    fn switch_intx(&mut self, on: bool) {
        let Some((trigger, resample)) = &self.intx else {
            return;
        };
        if on == self.intx_on {
            return;
        }
        let result = if on {
            self.backend
                .irq_enable(IrqIndex::Intx, &[trigger])
                .and_then(|()| self.backend.irq_unmask_on(IrqIndex::Intx, resample))
        } else {
            self.backend.irq_disable(IrqIndex::Intx)
        };
        crate::inc(&self.metrics.irq_changes);
        match result {
            Ok(()) => self.intx_on = on,
            Err(e) => {
                crate::inc(&self.metrics.irq_errors);
                warn_limited!("VFIO INTx {}: {e}", if on { "enable" } else { "disable" });
            }
        }
    }

    fn msix_enabled(&self) -> bool {
        self.msix.as_ref().is_some_and(|(_, m)| m.enabled())
    }

    /// The counters.
    pub fn metrics(&self) -> Arc<VfioMetrics> {
        self.metrics.clone()
    }

    /// The MSI-X counters, when the function has MSI-X.
    pub fn msix_metrics(&self) -> Option<Arc<MsixMetrics>> {
        self.msix.as_ref().map(|(_, m)| m.metrics())
    }

    /// The backend.
    pub fn backend(&self) -> Arc<dyn VfioBackend> {
        self.backend.clone()
    }

    /// The address BAR `index` is mapped at now.
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        self.shadow.bar_address(index)
    }

    /// The shadow's probe (BAR list, MSI-X layout).
    pub fn probe(&self) -> &DeviceProbe {
        self.shadow.probe()
    }

    /// The parts of every BAR to mmap into the guest: what the device allows, minus the
    /// pages of the MSI-X table and PBA.
    pub fn mmap_plan(&self) -> Result<Vec<PlannedArea>, AreaError> {
        let mut plan = Vec::new();
        for bar in &self.shadow.probe().bars {
            let Ok(index) = u32::try_from(bar.index) else {
                continue;
            };
            let Some(info) = self.backend.region_info(index) else {
                continue;
            };
            let mut trapped = Vec::new();
            if let Some((m, _)) = &self.msix {
                if m.table_bar == bar.index {
                    trapped.push((m.table_offset, m.table_size()));
                }
                if m.pba_bar == bar.index {
                    trapped.push((m.pba_offset, m.pba_size()));
                }
            }
            for area in mmap_areas(&info, &trapped)? {
                plan.push(PlannedArea {
                    bar: bar.index,
                    offset: area.offset,
                    size: area.size,
                });
            }
        }
        Ok(plan)
    }

    fn set_irq(&self, index: IrqIndex, count: usize, on: bool) {
        let result = if on {
            let fds: Vec<&EventFd> = self.irqfds.iter().take(count).collect();
            self.backend.irq_enable(index, &fds)
        } else {
            self.backend.irq_disable(index)
        };
        crate::inc(&self.metrics.irq_changes);
        if let Err(e) = result {
            crate::inc(&self.metrics.irq_errors);
            warn_limited!(
                "VFIO {index:?} {}: {e}",
                if on { "enable" } else { "disable" }
            );
        }
    }

    fn apply(&mut self, change: IrqChange) {
        match change {
            IrqChange::Msix { control } => {
                let Some((layout, msix)) = self.msix.as_mut() else {
                    return;
                };
                let was = msix.enabled();
                let vectors = usize::from(layout.vectors);
                if control & 0x8000 != 0 && !was {
                    self.switch_intx(false);
                }
                let Some((_, msix)) = self.msix.as_mut() else {
                    return;
                };
                msix.set_message_control(control);
                let now = msix.enabled();
                if now != was {
                    self.set_irq(IrqIndex::Msix, vectors, now);
                }
                if !now && !self.msi_enabled {
                    self.switch_intx(true);
                }
            }
            IrqChange::Msi {
                enabled,
                message,
                masked,
            } => {
                if let Err(e) = self.sink.update(0, message, masked || !enabled) {
                    crate::inc(&self.metrics.irq_errors);
                    warn_limited!("{e}");
                }
                if enabled != self.msi_enabled {
                    if enabled {
                        self.switch_intx(false);
                    }
                    self.msi_enabled = enabled;
                    self.set_irq(IrqIndex::Msi, 1, enabled);
                    if !enabled && !self.msix_enabled() {
                        self.switch_intx(true);
                    }
                }
            }
        }
    }

    /// Where `offset` of BAR `bar` falls: the MSI-X table, the PBA, or the device.
    fn msix_part(&self, bar: usize, offset: u64, len: usize) -> Option<(bool, u64)> {
        let (m, _) = self.msix.as_ref()?;
        let within = |start: u64, size: u64| {
            offset >= start
                && offset
                    .checked_add(len as u64)
                    .is_some_and(|e| e <= start + size)
        };
        if bar == m.table_bar && within(m.table_offset, m.table_size()) {
            return Some((true, offset - m.table_offset));
        }
        if bar == m.pba_bar && within(m.pba_offset, m.pba_size()) {
            return Some((false, offset - m.pba_offset));
        }
        None
    }

    /// Turns interrupts off at the device (detach).
    pub fn disable_interrupts(&mut self) {
        if self.intx_on {
            self.switch_intx(false);
        }
        if self.msix.as_ref().is_some_and(|(_, m)| m.enabled()) {
            self.set_irq(IrqIndex::Msix, 0, false);
        }
        if self.msi_enabled {
            self.set_irq(IrqIndex::Msi, 0, false);
            self.msi_enabled = false;
        }
    }
}

impl PciDevice for VfioPciDevice {
    fn config_read(&mut self, reg: usize) -> u32 {
        self.shadow.read(self.backend.as_ref(), reg)
    }

    fn config_write(&mut self, reg: usize, offset: usize, data: &[u8]) -> Vec<BarMove> {
        let write = self.shadow.write(self.backend.as_ref(), reg, offset, data);
        if let Some(change) = write.irq {
            self.apply(change);
        }
        write.moves
    }

    fn bar_move_refused(&mut self, mv: &BarMove) {
        self.shadow.bar_move_refused(mv);
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        crate::inc(&self.metrics.trapped_accesses);
        match self.msix_part(bar, offset, data.len()) {
            Some((true, at)) => self
                .msix
                .as_ref()
                .map_or((), |(_, m)| m.read_table(at, data)),
            Some((false, at)) => self.msix.as_ref().map_or((), |(_, m)| m.read_pba(at, data)),
            None => {
                let read = u32::try_from(bar)
                    .ok()
                    .and_then(|bar| self.backend.region_read(bar, offset, data).ok());
                if read.is_none() {
                    crate::inc(&self.metrics.region_errors);
                    data.fill(0xff);
                }
            }
        }
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        crate::inc(&self.metrics.trapped_accesses);
        match self.msix_part(bar, offset, data.len()) {
            Some((true, at)) => {
                if let Some((_, m)) = self.msix.as_mut() {
                    m.write_table(at, data);
                }
            }
            Some((false, at)) => {
                if let Some((_, m)) = self.msix.as_mut() {
                    m.write_pba(at, data);
                }
            }
            None => {
                let written = u32::try_from(bar)
                    .ok()
                    .and_then(|bar| self.backend.region_write(bar, offset, data).ok());
                if written.is_none() {
                    crate::inc(&self.metrics.region_errors);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::model::{self, reg, ModelGpu, ModelReset};
    use super::super::shadow::probe;
    use super::*;
    use crate::test_utils::FakeMsiSink;

    fn attach() -> (Arc<ModelGpu>, Arc<FakeMsiSink>, VfioPciDevice) {
        let gpu = Arc::new(ModelGpu::new(ModelReset::Flr).unwrap());
        let p = probe(gpu.as_ref()).unwrap();
        let vectors = irq_vectors(&p);
        let sink = Arc::new(FakeMsiSink::new(vectors));
        let dev = VfioPciDevice::new(
            gpu.clone(),
            p,
            &[(0, 0xc000_0000), (1, 128 << 30), (3, 0x2_0000_0000)],
            sink.clone(),
            sink.clone_eventfds(),
        )
        .unwrap();
        (gpu, sink, dev)
    }

    #[test]
    fn mmap_plan_leaves_register_and_msix_pages_trapped() {
        let (_, _, dev) = attach();
        let plan = dev.mmap_plan().unwrap();
        let table_page = u64::from(model::MSIX_TABLE_OFFSET) & !0xfff;
        let pba_page = u64::from(model::MSIX_PBA_OFFSET) & !0xfff;
        for a in plan.iter().filter(|a| a.bar == 0) {
            for page in [0, table_page, pba_page] {
                assert!(
                    page + 0x1000 <= a.offset || page >= a.offset + a.size,
                    "{a:?}"
                );
            }
        }
        assert!(plan.contains(&PlannedArea {
            bar: 1,
            offset: 0,
            size: model::BAR1_SIZE
        }));
        assert!(plan.contains(&PlannedArea {
            bar: 3,
            offset: 0,
            size: model::BAR3_SIZE
        }));
    }

    #[test]
    fn msix_enable_hands_irqfds_to_the_device_and_table_writes_route() {
        let (gpu, sink, mut dev) = attach();
        let cap = model::cap_offset::MSIX;
        let table = u64::from(model::MSIX_TABLE_OFFSET);
        // Program vector 5, unmasked, then enable MSI-X.
        dev.bar_write(0, table + 5 * 16, &0xfee0_0000u32.to_le_bytes());
        dev.bar_write(0, table + 5 * 16 + 8, &0x45u32.to_le_bytes());
        dev.bar_write(0, table + 5 * 16 + 12, &0u32.to_le_bytes());
        dev.config_write(cap / 4, 2, &0x8000u16.to_le_bytes());
        let route = sink.route(5).unwrap();
        assert_eq!((route.0.data, route.1), (0x45, false));
        // The device raises vector 5: it lands on the irqfd, no VMM code involved.
        dev.bar_write(0, reg::IRQ_RAISE, &5u32.to_le_bytes());
        assert_eq!(sink.eventfd_count(5), 1);
        // Table reads come from the emulation, not the device.
        let mut data = [0u8; 4];
        dev.bar_read(0, table + 5 * 16 + 8, &mut data);
        assert_eq!(u32::from_le_bytes(data), 0x45);
        // Masking a vector updates its route.
        dev.bar_write(0, table + 5 * 16 + 12, &1u32.to_le_bytes());
        assert!(sink.route(5).unwrap().1);
        // Disabling MSI-X takes the eventfds back from the device.
        dev.config_write(cap / 4, 2, &0u16.to_le_bytes());
        assert!(!gpu.raise(5));
        assert_eq!(
            dev.metrics()
                .irq_changes
                .load(std::sync::atomic::Ordering::Relaxed),
            2
        );
    }

    #[test]
    fn trapped_bar0_registers_reach_the_device() {
        let (_, _, mut dev) = attach();
        let mut data = [0u8; 4];
        dev.bar_read(0, reg::BOOT_0, &mut data);
        assert_eq!(u32::from_le_bytes(data), model::MODEL_BOOT_0);
        dev.bar_write(0, reg::SCRATCH, &0xfeed_beefu32.to_le_bytes());
        dev.bar_read(0, reg::SCRATCH, &mut data);
        assert_eq!(u32::from_le_bytes(data), 0xfeed_beef);
        // Past the end of the BAR: the device refuses, the guest reads all-ones.
        dev.bar_read(0, model::BAR0_SIZE, &mut data);
        assert_eq!(data, [0xff; 4]);
        assert_eq!(
            dev.metrics()
                .region_errors
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
    }

    #[test]
    fn intx_gives_way_to_msix_and_msi_and_comes_back() {
        let (gpu, _, mut dev) = attach();
        let trigger = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let resample = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        dev.enable_intx(trigger.try_clone().unwrap(), resample)
            .unwrap();
        assert!(gpu.raise(0));
        assert_eq!(trigger.read().unwrap(), 1);
        let msix = model::cap_offset::MSIX;
        dev.config_write(msix / 4, 2, &0x8000u16.to_le_bytes());
        assert!(!dev.intx_active());
        dev.config_write(msix / 4, 2, &0u16.to_le_bytes());
        assert!(dev.intx_active());
        let msi = model::cap_offset::MSI;
        dev.config_write(msi / 4, 2, &[1]);
        assert!(!dev.intx_active());
        dev.config_write(msi / 4, 2, &[0]);
        assert!(dev.intx_active());
        assert!(gpu.raise(0));
        assert_eq!(trigger.read().unwrap(), 1);
        dev.disable_interrupts();
        assert!(!dev.intx_active());
        assert!(!gpu.raise(0));
    }

    #[test]
    fn too_few_irqfds_is_an_error() {
        let gpu = Arc::new(ModelGpu::new(ModelReset::Flr).unwrap());
        let p = probe(gpu.as_ref()).unwrap();
        let sink = Arc::new(FakeMsiSink::new(1));
        let err = VfioPciDevice::new(gpu, p, &[], sink.clone(), sink.clone_eventfds());
        assert!(matches!(
            err,
            Err(VfioDeviceError::Irqfds {
                needed: 16,
                given: 1
            })
        ));
    }
}

#[cfg(test)]
mod proptests {
    use proptest::prelude::*;

    use super::super::model::{self, ModelGpu, ModelReset};
    use super::super::shadow::probe;
    use super::*;
    use crate::test_utils::FakeMsiSink;

    /// One guest access: a config write, or a trapped BAR0 read or write.
    #[derive(Debug, Clone)]
    enum Access {
        Config {
            reg: usize,
            offset: usize,
            len: usize,
            value: u32,
        },
        BarWrite {
            offset: u64,
            len: usize,
            value: u64,
        },
        BarRead {
            offset: u64,
            len: usize,
        },
    }

    fn access() -> impl Strategy<Value = Access> {
        let len = prop_oneof![Just(1usize), Just(2), Just(4), Just(8), Just(3)];
        // BAR0 offsets near what matters: the register page, the MSI-X table and PBA, the end.
        let table = u64::from(model::MSIX_TABLE_OFFSET);
        let pba = u64::from(model::MSIX_PBA_OFFSET);
        let offset = prop_oneof![
            0u64..0x40,
            (table - 8)..(table + 0x110),
            (pba - 8)..(pba + 16),
            (model::BAR0_SIZE - 16)..(model::BAR0_SIZE + 8),
        ];
        prop_oneof![
            (0usize..1030, 0usize..4, len.clone(), any::<u32>()).prop_map(
                |(reg, offset, len, value)| Access::Config {
                    reg: if reg % 3 == 0 { reg % 64 } else { reg },
                    offset,
                    len,
                    value
                }
            ),
            (offset.clone(), len.clone(), any::<u64>())
                .prop_map(|(offset, len, value)| Access::BarWrite { offset, len, value }),
            (offset, len).prop_map(|(offset, len)| Access::BarRead { offset, len }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        #[test]
        fn hostile_guest_accesses_never_panic_or_reach_bar_registers(
            accesses in proptest::collection::vec(access(), 1..96)
        ) {
            let gpu = Arc::new(ModelGpu::new(ModelReset::Flr).unwrap());
            let p = probe(gpu.as_ref()).unwrap();
            let sink = Arc::new(FakeMsiSink::new(irq_vectors(&p)));
            let mut dev = VfioPciDevice::new(
                gpu.clone(),
                p,
                &[(0, 0xc000_0000), (1, 128 << 30), (3, 0x2_0000_0000)],
                sink.clone(),
                sink.clone_eventfds(),
            )
            .unwrap();
            gpu.take_config_writes();
            for a in accesses {
                match a {
                    Access::Config { reg, offset, len, value } => {
                        let bytes = value.to_le_bytes();
                        dev.config_write(reg, offset, &bytes[..len.min(4)]);
                        dev.config_read(reg);
                    }
                    Access::BarWrite { offset, len, value } => {
                        dev.bar_write(0, offset, &value.to_le_bytes()[..len]);
                    }
                    Access::BarRead { offset, len } => {
                        let mut data = [0u8; 8];
                        dev.bar_read(0, offset, &mut data[..len]);
                    }
                }
            }
            for (offset, len) in gpu.take_config_writes() {
                let end = offset + len as u64;
                prop_assert!(
                    !(offset < 0x28 && end > 0x10 || offset < 0x34 && end > 0x30),
                    "device got a config write at {offset:#x}+{len}"
                );
            }
            dev.disable_interrupts();
        }
    }
}
