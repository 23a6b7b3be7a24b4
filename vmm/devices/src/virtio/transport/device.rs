//! A virtio device presented as a PCI function: configuration space with the virtio
//! vendor capabilities and MSI-X, BAR 0 dispatch, the status machine, activation on the
//! device event loop, and reset.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use event_manager::SubscriberId;
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::common_cfg::{CommonCfgAction, CommonConfig};
use super::interrupt::VirtioPciInterrupt;
use super::*;
use crate::inc;
use crate::narrow::{const_u32, const_u8};
use crate::pci::{
    cap_id, BarKind, BarMove, MsiInterruptSink, MsixConfig, PciConfigError, PciConfiguration,
    PciDevice, PciHeader,
};
use crate::virtio::{
    features, status, ActivateContext, DeviceEventLoop, GuestMemoryMmap, VirtioDevice,
    VirtioInterrupt,
};

/// PCI vendor ID of virtio devices.
const VIRTIO_PCI_VENDOR: u16 = 0x1af4;
/// Modern virtio device IDs are 0x1040 + device type.
const VIRTIO_PCI_DEVICE_BASE: u16 = 0x1040;

/// Virtio PCI capability types.
mod cfg_type {
    pub const COMMON: u8 = 1;
    pub const NOTIFY: u8 = 2;
    pub const ISR: u8 = 3;
    pub const DEVICE: u8 = 4;
    pub const PCI_CFG: u8 = 5;
}

/// Why a virtio-pci function could not be built (VMM configuration errors).
#[derive(Debug, thiserror::Error)]
pub enum VirtioPciError {
    /// The device does not offer VIRTIO_F_VERSION_1, which this transport requires.
    #[error("Virtio device type {0} does not offer VIRTIO_F_VERSION_1")]
    NotModern(u32),
    /// The device has no queues, too many, or a queue size that is not a power of two.
    #[error("Virtio device type {0} has an invalid queue layout")]
    Queues(u32),
    /// The device type has no PCI device ID (0x1040 plus the type must fit 16 bits).
    #[error("Virtio device type {0} has no PCI device ID")]
    DeviceType(u32),
    /// The configuration space could not be built.
    #[error("Could not build the PCI configuration space: {0}")]
    Config(#[from] PciConfigError),
    /// An eventfd could not be created.
    #[error("Could not create a queue notification eventfd: {0}")]
    EventFd(std::io::Error),
}

/// A virtio device on PCI.
pub struct VirtioPciDevice {
    config: PciConfiguration,
    device: Box<dyn VirtioDevice>,
    common: CommonConfig,
    msix: Arc<Mutex<MsixConfig>>,
    msix_cap_reg: usize,
    /// Register index of the VIRTIO_PCI_CAP_PCI_CFG capability's first dword.
    pci_cfg_reg: usize,
    interrupt: Arc<VirtioPciInterrupt>,
    queue_events: Vec<EventFd>,
    mem: GuestMemoryMmap,
    event_loop: Arc<dyn DeviceEventLoop>,
    subscriber: Option<SubscriberId>,
    metrics: Arc<TransportMetrics>,
}

/// A `virtio_pci_cap` for the part of BAR 0 at `offset`, `length` bytes long: both come
/// from the BAR layout's constants, so [`const_u32`] holds (every device test builds them).
fn vendor_cap(kind: u8, offset: u64, length: u64, extra: Option<u32>) -> Vec<u8> {
    let mut cap = vec![cap_id::VENDOR, 0, 0, kind, BAR_INDEX_U8, 0, 0, 0];
    cap.extend_from_slice(&const_u32(offset).to_le_bytes());
    cap.extend_from_slice(&const_u32(length).to_le_bytes());
    if let Some(extra) = extra {
        cap.extend_from_slice(&extra.to_le_bytes());
    }
    // 16 or 20 bytes.
    cap[2] = const_u8(cap.len() as u64);
    cap
}

/// [`BAR_INDEX`] as the one byte capabilities carry it in.
const BAR_INDEX_U8: u8 = const_u8(BAR_INDEX as u64);

impl VirtioPciDevice {
    /// Wraps `device` as a PCI function whose BAR 0 (64-bit, [`BAR_SIZE`] bytes) the VMM
    /// mapped at `bar_addr`.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryMmap,
        msi_sink: Arc<dyn MsiInterruptSink>,
        event_loop: Arc<dyn DeviceEventLoop>,
        bar_addr: u64,
    ) -> Result<Self, VirtioPciError> {
        let kind = device.device_type();
        if device.avail_features() & features::VERSION_1 == 0 {
            return Err(VirtioPciError::NotModern(kind));
        }
        let sizes = device.queue_max_sizes();
        // The MSI-X table (queues + 1 vectors of 16 bytes) must fit below the PBA.
        let max_queues = ((MSIX_PBA_OFFSET - MSIX_TABLE_OFFSET) / 16 - 1)
            .min(NOTIFY_SIZE / u64::from(NOTIFY_OFF_MULTIPLIER));
        let max_queues = usize::try_from(max_queues).unwrap_or(0);
        if sizes.is_empty() || sizes.len() > max_queues {
            return Err(VirtioPciError::Queues(kind));
        }
        let queues = sizes
            .iter()
            .map(|&size| Queue::new(size).map_err(|_| VirtioPciError::Queues(kind)))
            .collect::<Result<Vec<_>, _>>()?;
        let queue_events = sizes
            .iter()
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).map_err(VirtioPciError::EventFd))
            .collect::<Result<Vec<_>, _>>()?;

        let (class, subclass) = match kind {
            crate::virtio::device_type::BLOCK => (0x01, 0x80),
            _ => (0xff, 0x00),
        };
        let device_id = u16::try_from(kind)
            .ok()
            .and_then(|kind| VIRTIO_PCI_DEVICE_BASE.checked_add(kind))
            .ok_or(VirtioPciError::DeviceType(kind))?;
        let mut config = PciConfiguration::new(PciHeader {
            vendor_id: VIRTIO_PCI_VENDOR,
            device_id,
            revision: 1,
            class,
            subclass,
            prog_if: 0,
            subsystem_vendor_id: VIRTIO_PCI_VENDOR,
            subsystem_id: 0x40,
        });
        config.add_bar(
            BAR_INDEX,
            BarKind::Memory64 {
                prefetchable: false,
            },
            bar_addr,
            BAR_SIZE,
        )?;
        config.add_capability(
            &vendor_cap(cfg_type::COMMON, COMMON_CFG_OFFSET, COMMON_CFG_SIZE, None),
            &[],
        )?;
        config.add_capability(
            &vendor_cap(
                cfg_type::NOTIFY,
                NOTIFY_OFFSET,
                NOTIFY_SIZE,
                Some(NOTIFY_OFF_MULTIPLIER),
            ),
            &[],
        )?;
        config.add_capability(&vendor_cap(cfg_type::ISR, ISR_OFFSET, 1, None), &[])?;
        config.add_capability(
            &vendor_cap(cfg_type::DEVICE, DEVICE_CFG_OFFSET, DEVICE_CFG_SIZE, None),
            &[],
        )?;
        // The configuration-space window into the BAR (virtio 4.1.4.9): the driver writes
        // bar, offset and length, then accesses pci_cfg_data.
        let mut pci_cfg = vendor_cap(cfg_type::PCI_CFG, 0, 0, Some(0));
        pci_cfg[4] = 0;
        let mut pci_cfg_writable = vec![0u8; pci_cfg.len()];
        pci_cfg_writable[4] = 0xff;
        pci_cfg_writable[8..20].fill(0xff);
        let pci_cfg_reg = config.add_capability(&pci_cfg, &pci_cfg_writable)? / 4;
        // One vector per queue plus one for configuration changes.
        // At most `max_queues` queues, checked above.
        let vectors = u16::try_from(sizes.len() + 1).map_err(|_| VirtioPciError::Queues(kind))?;
        let msix = MsixConfig::new(vectors, msi_sink);
        let (cap, writable) = msix.capability(
            BAR_INDEX_U8,
            const { const_u32(MSIX_TABLE_OFFSET) },
            const { const_u32(MSIX_PBA_OFFSET) },
        );
        let msix_cap_reg = config.add_capability(&cap, &writable)? / 4;
        let msix = Arc::new(Mutex::new(msix));

        let metrics = Arc::new(TransportMetrics::default());
        let common = CommonConfig::new(queues, metrics.clone());
        let interrupt = Arc::new(VirtioPciInterrupt {
            msix: msix.clone(),
            vectors: common.vectors.clone(),
            isr: AtomicU8::new(0),
            needs_reset: AtomicBool::new(false),
        });
        Ok(Self {
            config,
            device,
            common,
            msix,
            msix_cap_reg,
            pci_cfg_reg,
            interrupt,
            queue_events,
            mem,
            event_loop,
            subscriber: None,
            metrics,
        })
    }

    /// The transport's counters.
    pub fn metrics(&self) -> Arc<TransportMetrics> {
        self.metrics.clone()
    }

    /// The MSI-X counters.
    pub fn msix_metrics(&self) -> Arc<crate::pci::MsixMetrics> {
        self.lock_msix().metrics()
    }

    /// Where BAR 0 is mapped now.
    pub fn bar_address(&self) -> u64 {
        self.config.bar_mapped(BAR_INDEX).unwrap_or(0)
    }

    /// The queue notification EventFds with their offsets in BAR 0: the VMM registers
    /// each as an ioeventfd at `BAR 0 base + offset` (and moves them when the BAR moves).
    pub fn ioeventfds(&self) -> Vec<(u64, &EventFd)> {
        self.queue_events
            .iter()
            .enumerate()
            .map(|(q, evt)| {
                (
                    NOTIFY_OFFSET + q as u64 * u64::from(NOTIFY_OFF_MULTIPLIER),
                    evt,
                )
            })
            .collect()
    }

    /// The device status as the driver reads it.
    pub fn status(&self) -> u8 {
        let mut value = self.common.status;
        if self.interrupt.needs_reset.load(Ordering::Acquire) {
            value |= status::DEVICE_NEEDS_RESET;
        }
        value
    }

    fn lock_msix(&self) -> MutexGuard<'_, MsixConfig> {
        self.msix
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn needs_reset(&mut self) {
        inc(&self.metrics.activate_failures);
        self.interrupt.signal_needs_reset();
    }

    /// Applies a status write: bits may only be added, in the order of virtio 3.1.1;
    /// 0 resets the device.
    fn write_status(&mut self, value: u8) {
        if value == 0 {
            self.reset();
            return;
        }
        // DEVICE_NEEDS_RESET belongs to the device; drivers that write back what they
        // read (status | new bit) may carry it along.
        let value = value & !status::DEVICE_NEEDS_RESET;
        let current = self.common.status;
        let added = value & !current;
        let valid = value & current == current
            && (added & status::DRIVER == 0 || value & status::ACKNOWLEDGE != 0)
            && (added & status::FEATURES_OK == 0 || value & status::DRIVER != 0)
            && (added & status::DRIVER_OK == 0 || value & status::FEATURES_OK != 0);
        if !valid {
            inc(&self.metrics.bad_status);
            return;
        }
        let mut new = value;
        if added & status::FEATURES_OK != 0 {
            let offered = self.device.avail_features();
            let acked = self.common.driver_features;
            if acked & features::VERSION_1 == 0 || acked & !offered != 0 {
                inc(&self.metrics.bad_features);
                new &= !status::FEATURES_OK;
                // DRIVER_OK cannot follow a refused FEATURES_OK.
                new &= !status::DRIVER_OK;
            }
        }
        self.common.status = new;
        if added & status::DRIVER_OK != 0
            && new & status::DRIVER_OK != 0
            && new & status::FAILED == 0
        {
            self.activate();
        }
    }

    fn activate(&mut self) {
        let mut queues = Vec::with_capacity(self.common.queues.len());
        for q in &self.common.queues {
            if !q.is_valid(&self.mem) {
                warn_limited!("virtio-pci: a queue is not ready or outside guest memory");
                self.needs_reset();
                return;
            }
            match Queue::try_from(q.state()) {
                Ok(q) => queues.push(q),
                Err(_) => {
                    self.needs_reset();
                    return;
                }
            }
        }
        let queue_events = match self
            .queue_events
            .iter()
            .map(EventFd::try_clone)
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(events) => events,
            Err(e) => {
                tracing::error!("virtio-pci: cannot clone a queue eventfd: {e}");
                self.needs_reset();
                return;
            }
        };
        let ctx = ActivateContext {
            mem: self.mem.clone(),
            interrupt: self.interrupt.clone(),
            queues,
            queue_events,
            acked_features: self.common.driver_features,
        };
        let subscriber = match self.device.activate(ctx) {
            Ok(subscriber) => subscriber,
            Err(e) => {
                warn_limited!("virtio-pci: activation refused: {e}");
                self.needs_reset();
                return;
            }
        };
        match self.event_loop.add(subscriber) {
            Ok(id) => {
                self.subscriber = Some(id);
                inc(&self.metrics.activations);
            }
            Err(e) => {
                tracing::error!("virtio-pci: {e}");
                self.device.reset();
                self.needs_reset();
            }
        }
    }

    /// Device reset (status 0): stops the handler, returns queues, features, vectors and
    /// MSI-X to their initial state.
    pub fn reset(&mut self) {
        if let Some(id) = self.subscriber.take() {
            if let Err(e) = self.event_loop.remove(id) {
                tracing::error!("virtio-pci: removing the device handler: {e}");
            }
        }
        self.device.reset();
        self.common.reset();
        self.interrupt.isr.store(0, Ordering::Release);
        self.interrupt.needs_reset.store(false, Ordering::Release);
        // Drain stale notifications so they do not reach the next activation.
        for evt in &self.queue_events {
            let _ = evt.read();
        }
        inc(&self.metrics.resets);
    }

    /// The BAR access the VIRTIO_PCI_CAP_PCI_CFG capability selects: BAR 0 only, 1, 2 or
    /// 4 bytes, naturally aligned, inside the BAR.
    fn pci_cfg_window(&self) -> Option<(usize, u64, usize)> {
        let bar = (self.config.read_reg(self.pci_cfg_reg + 1) & 0xff) as usize;
        let offset = u64::from(self.config.read_reg(self.pci_cfg_reg + 2));
        let len = self.config.read_reg(self.pci_cfg_reg + 3) as usize;
        let ok = bar == BAR_INDEX
            && matches!(len, 1 | 2 | 4)
            && offset % len as u64 == 0
            && offset + len as u64 <= BAR_SIZE;
        if !ok {
            inc(&self.metrics.bad_access);
        }
        ok.then_some((bar, offset, len))
    }

    fn notify(&mut self, offset: u64, len: usize) {
        let queue = offset / u64::from(NOTIFY_OFF_MULTIPLIER);
        let aligned = offset % u64::from(NOTIFY_OFF_MULTIPLIER) == 0 && matches!(len, 2 | 4);
        let event = usize::try_from(queue)
            .ok()
            .and_then(|queue| self.queue_events.get(queue));
        match event {
            Some(evt) if aligned => {
                inc(&self.metrics.mmio_notifies);
                let _ = evt.write(1);
            }
            _ => inc(&self.metrics.bad_access),
        }
    }
}

impl PciDevice for VirtioPciDevice {
    fn config_read(&mut self, reg: usize) -> u32 {
        if reg == self.pci_cfg_reg + 4 {
            let mut value = [0u8; 4];
            if let Some((bar, offset, len)) = self.pci_cfg_window() {
                self.bar_read(bar, offset, &mut value[..len]);
            }
            return u32::from_le_bytes(value);
        }
        self.config.read_reg(reg)
    }

    fn config_write(&mut self, reg: usize, offset: usize, data: &[u8]) -> Vec<BarMove> {
        if reg == self.pci_cfg_reg + 4 {
            if let Some((bar, bar_offset, len)) = self.pci_cfg_window() {
                if offset == 0 && data.len() >= len {
                    self.bar_write(bar, bar_offset, &data[..len]);
                } else {
                    inc(&self.metrics.bad_access);
                }
            }
            return Vec::new();
        }
        let moves = self.config.write(reg, offset, data);
        if reg == self.msix_cap_reg {
            let control = (self.config.read_reg(reg) >> 16) as u16;
            self.lock_msix().set_message_control(control);
        }
        moves
    }

    fn bar_move_refused(&mut self, mv: &BarMove) {
        self.config.bar_move_refused(mv);
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        if bar != BAR_INDEX {
            data.fill(0xff);
            return;
        }
        match offset {
            o if o < COMMON_CFG_SIZE => {
                let features = self.device.avail_features();
                self.common.read(o, data, features, 0);
                if o == 0x14 && data.len() == 1 {
                    data[0] = self.status();
                }
            }
            ISR_OFFSET if data.len() == 1 => {
                data[0] = self.interrupt.isr.swap(0, Ordering::AcqRel);
            }
            o if (DEVICE_CFG_OFFSET..DEVICE_CFG_OFFSET + DEVICE_CFG_SIZE).contains(&o) => {
                self.device.read_config(o - DEVICE_CFG_OFFSET, data);
            }
            o if (MSIX_TABLE_OFFSET..MSIX_PBA_OFFSET).contains(&o) => {
                self.lock_msix().read_table(o - MSIX_TABLE_OFFSET, data);
            }
            o if (MSIX_PBA_OFFSET..BAR_SIZE).contains(&o) => {
                self.lock_msix().read_pba(o - MSIX_PBA_OFFSET, data);
            }
            _ => {
                inc(&self.metrics.bad_access);
                data.fill(0);
            }
        }
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if bar != BAR_INDEX {
            return;
        }
        match offset {
            o if o < COMMON_CFG_SIZE => {
                let vectors = self.lock_msix().vectors();
                if let CommonCfgAction::Status(value) = self.common.write(o, data, vectors) {
                    self.write_status(value);
                }
            }
            o if (DEVICE_CFG_OFFSET..DEVICE_CFG_OFFSET + DEVICE_CFG_SIZE).contains(&o) => {
                self.device.write_config(o - DEVICE_CFG_OFFSET, data);
            }
            o if (NOTIFY_OFFSET..NOTIFY_OFFSET + NOTIFY_SIZE).contains(&o) => {
                self.notify(o - NOTIFY_OFFSET, data.len());
            }
            o if (MSIX_TABLE_OFFSET..MSIX_PBA_OFFSET).contains(&o) => {
                self.lock_msix().write_table(o - MSIX_TABLE_OFFSET, data);
            }
            o if (MSIX_PBA_OFFSET..BAR_SIZE).contains(&o) => {
                self.lock_msix().write_pba(o - MSIX_PBA_OFFSET, data);
            }
            _ => inc(&self.metrics.bad_access),
        }
    }
}

impl Drop for VirtioPciDevice {
    fn drop(&mut self) {
        if let Some(id) = self.subscriber.take() {
            let _ = self.event_loop.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci::{MsiMessage, COMMAND_MEMORY};
    use crate::test_utils::{wait_until, FakeMsiSink};
    use crate::virtio::{ActivateError, DeviceSubscriber, EventLoopThread};
    use event_manager::{EventOps, Events, MutEventSubscriber};
    use std::sync::atomic::AtomicU64;
    use vm_memory::GuestAddress;
    use vmm_sys_util::epoll::EventSet;

    const BAR: u64 = 0x1_0000_0000;

    /// A two-queue device whose handler answers each queue-0 notification with a
    /// queue-0 interrupt.
    struct PingDevice {
        kind: u32,
        sizes: [u16; 2],
        notified: Arc<AtomicU64>,
        resets: Arc<AtomicU64>,
        config: [u8; 8],
    }

    struct PingHandler {
        evt: EventFd,
        interrupt: Arc<dyn VirtioInterrupt>,
        notified: Arc<AtomicU64>,
    }

    impl MutEventSubscriber for PingHandler {
        fn process(&mut self, _events: Events, _ops: &mut EventOps) {
            let _ = self.evt.read();
            self.notified.fetch_add(1, Ordering::SeqCst);
            self.interrupt
                .trigger(VirtioInterruptType::Queue(0))
                .unwrap();
        }
        fn init(&mut self, ops: &mut EventOps) {
            ops.add(Events::new(&self.evt, EventSet::IN)).unwrap();
        }
    }

    impl VirtioDevice for PingDevice {
        fn device_type(&self) -> u32 {
            self.kind
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &self.sizes
        }
        fn avail_features(&self) -> u64 {
            features::VERSION_1 | 1
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            crate::virtio::read_config_bytes(&self.config, offset, data);
        }
        fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
        fn activate(
            &mut self,
            mut ctx: ActivateContext,
        ) -> Result<DeviceSubscriber, ActivateError> {
            Ok(Arc::new(Mutex::new(PingHandler {
                evt: ctx.queue_events.remove(0),
                interrupt: ctx.interrupt,
                notified: self.notified.clone(),
            })))
        }
        fn reset(&mut self) {
            self.resets.fetch_add(1, Ordering::SeqCst);
        }
    }

    use crate::virtio::VirtioInterruptType;

    struct Rig {
        dev: VirtioPciDevice,
        sink: Arc<FakeMsiSink>,
        notified: Arc<AtomicU64>,
        resets: Arc<AtomicU64>,
        _lp: Arc<EventLoopThread>,
    }

    fn ping_device(kind: u32) -> PingDevice {
        PingDevice {
            kind,
            sizes: [16, 16],
            notified: Arc::default(),
            resets: Arc::default(),
            config: *b"tenantvm",
        }
    }

    fn rig() -> Rig {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let sink = Arc::new(FakeMsiSink::new(3));
        let lp = Arc::new(EventLoopThread::spawn("test-virtio").unwrap());
        let notified = Arc::new(AtomicU64::new(0));
        let resets = Arc::new(AtomicU64::new(0));
        let device = PingDevice {
            notified: notified.clone(),
            resets: resets.clone(),
            ..ping_device(crate::virtio::device_type::RNG)
        };
        let dev =
            VirtioPciDevice::new(Box::new(device), mem, sink.clone(), lp.clone(), BAR).unwrap();
        Rig {
            dev,
            sink,
            notified,
            resets,
            _lp: lp,
        }
    }

    fn w8(dev: &mut VirtioPciDevice, off: u64, v: u8) {
        dev.bar_write(0, off, &[v]);
    }
    fn w16(dev: &mut VirtioPciDevice, off: u64, v: u16) {
        dev.bar_write(0, off, &v.to_le_bytes());
    }
    fn w32(dev: &mut VirtioPciDevice, off: u64, v: u32) {
        dev.bar_write(0, off, &v.to_le_bytes());
    }
    fn r8(dev: &mut VirtioPciDevice, off: u64) -> u8 {
        let mut d = [0u8; 1];
        dev.bar_read(0, off, &mut d);
        d[0]
    }
    fn r16(dev: &mut VirtioPciDevice, off: u64) -> u16 {
        let mut d = [0u8; 2];
        dev.bar_read(0, off, &mut d);
        u16::from_le_bytes(d)
    }

    /// Negotiates features and sets up both queues, as a driver does.
    fn bring_up(dev: &mut VirtioPciDevice) {
        w8(dev, 0x14, status::ACKNOWLEDGE);
        w8(dev, 0x14, status::ACKNOWLEDGE | status::DRIVER);
        w32(dev, 0x08, 1);
        w32(dev, 0x0c, 1);
        w8(
            dev,
            0x14,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        assert_ne!(r8(dev, 0x14) & status::FEATURES_OK, 0);
        for q in 0..2u16 {
            w16(dev, 0x16, q);
            w16(dev, 0x18, 8);
            let base = 0x1000 * (u32::from(q) + 1);
            w32(dev, 0x20, base);
            w32(dev, 0x24, 0);
            w32(dev, 0x28, base + 0x100);
            w32(dev, 0x30, base + 0x200);
            w16(dev, 0x1a, q);
            w16(dev, 0x1c, 1);
        }
        w16(dev, 0x10, 2);
    }

    fn enable_msix(dev: &mut VirtioPciDevice) {
        let cap = dev.msix_cap_reg;
        dev.config_write(cap, 2, &0x8000u16.to_le_bytes());
        for v in 0..3u64 {
            dev.bar_write(0, MSIX_TABLE_OFFSET + v * 16, &0xfee0_0000u64.to_le_bytes());
            dev.bar_write(
                0,
                MSIX_TABLE_OFFSET + v * 16 + 8,
                &(0x40 + u32::try_from(v).unwrap()).to_le_bytes(),
            );
            dev.bar_write(0, MSIX_TABLE_OFFSET + v * 16 + 12, &0u32.to_le_bytes());
        }
    }

    const ALL: u8 = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;

    #[test]
    fn config_space_advertises_modern_virtio_and_capabilities() {
        let mut r = rig();
        assert_eq!(r.dev.config_read(0), 0x1044_1af4);
        // Walk the capability list: four vendor caps and MSI-X.
        let mut ptr = (r.dev.config_read(0x34 / 4) & 0xff) as usize;
        let mut kinds = Vec::new();
        while ptr != 0 {
            let dword = r.dev.config_read(ptr / 4);
            let [id, next, ..] = dword.to_le_bytes();
            kinds.push(if id == cap_id::VENDOR {
                (dword >> 24) as u8
            } else {
                id
            });
            ptr = usize::from(next);
        }
        assert_eq!(kinds, vec![1, 2, 3, 4, 5, cap_id::MSIX]);
        let mut cfg = [0u8; 8];
        r.dev.bar_read(0, DEVICE_CFG_OFFSET, &mut cfg);
        assert_eq!(&cfg, b"tenantvm");
    }

    #[test]
    fn a_device_type_without_a_pci_device_id_is_refused() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let sink = Arc::new(FakeMsiSink::new(3));
        let lp = Arc::new(EventLoopThread::spawn("test-virtio").unwrap());
        let new = |kind| {
            VirtioPciDevice::new(
                Box::new(ping_device(kind)),
                mem.clone(),
                sink.clone(),
                lp.clone(),
                BAR,
            )
        };
        // 0x1040 plus these passes 16 bits: cast to u16, 0x1_0001 read as 0x1041 (entropy).
        for kind in [0x1_0001, 0xffff, 0xffff - 0x103f] {
            let err = new(kind).err();
            assert!(
                matches!(err, Some(VirtioPciError::DeviceType(k)) if k == kind),
                "{kind:#x}: {err:?}"
            );
        }
        // Control: the largest type that fits gets device ID 0xffff.
        let mut dev = new(0xffff - 0x1040).unwrap();
        assert_eq!(dev.config_read(0), 0xffff_1af4);
    }

    #[test]
    fn driver_ok_activates_and_notify_raises_msix() {
        let mut r = rig();
        enable_msix(&mut r.dev);
        bring_up(&mut r.dev);
        w8(&mut r.dev, 0x14, ALL);
        assert_eq!(r.dev.status(), ALL);
        assert_eq!(r.dev.metrics().activations.load(Ordering::Relaxed), 1);
        // A notify through MMIO (no ioeventfd) reaches the handler on the loop thread.
        w16(&mut r.dev, NOTIFY_OFFSET, 0);
        wait_until("the notification", || {
            r.notified.load(Ordering::SeqCst) == 1
        });
        wait_until("the interrupt", || !r.sink.triggered().is_empty());
        assert_eq!(
            r.sink.triggered()[0],
            (
                0,
                MsiMessage {
                    address: 0xfee0_0000,
                    data: 0x40
                }
            )
        );
        assert_eq!(
            r.dev
                .ioeventfds()
                .iter()
                .map(|(o, _)| *o)
                .collect::<Vec<_>>(),
            vec![0x3000, 0x3004]
        );
    }

    #[test]
    fn features_without_version_1_are_refused() {
        let mut r = rig();
        w8(&mut r.dev, 0x14, status::ACKNOWLEDGE);
        w8(&mut r.dev, 0x14, status::ACKNOWLEDGE | status::DRIVER);
        w32(&mut r.dev, 0x0c, 1);
        w8(
            &mut r.dev,
            0x14,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        assert_eq!(r8(&mut r.dev, 0x14) & status::FEATURES_OK, 0);
        // Bits the device never offered are refused too.
        w32(&mut r.dev, 0x08, 1);
        w32(&mut r.dev, 0x0c, 0x8000_0001);
        w8(
            &mut r.dev,
            0x14,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        assert_eq!(r8(&mut r.dev, 0x14) & status::FEATURES_OK, 0);
        assert_eq!(r.dev.metrics().bad_features.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn out_of_order_status_is_ignored() {
        let mut r = rig();
        w8(&mut r.dev, 0x14, status::DRIVER_OK);
        w8(&mut r.dev, 0x14, status::ACKNOWLEDGE | status::FEATURES_OK);
        assert_eq!(r.dev.status(), 0);
        assert_eq!(r.dev.metrics().bad_status.load(Ordering::Relaxed), 2);
        // The device-owned NEEDS_RESET bit in a write is ignored, not taken.
        w8(
            &mut r.dev,
            0x14,
            status::DEVICE_NEEDS_RESET | status::ACKNOWLEDGE,
        );
        assert_eq!(r.dev.status(), status::ACKNOWLEDGE);
    }

    #[test]
    fn queue_outside_guest_memory_needs_reset() {
        let mut r = rig();
        bring_up(&mut r.dev);
        w16(&mut r.dev, 0x16, 1);
        // Queue 1 is already enabled: the move is refused.
        w32(&mut r.dev, 0x24, 0x10);
        assert_eq!(r.dev.metrics().bad_queue_config.load(Ordering::Relaxed), 1);
        r.dev.reset();
        bring_up(&mut r.dev);
        r.dev.reset();
        // Rebuild with queue 1's rings far outside the 1 MiB of guest memory.
        w8(&mut r.dev, 0x14, status::ACKNOWLEDGE);
        w8(&mut r.dev, 0x14, status::ACKNOWLEDGE | status::DRIVER);
        w32(&mut r.dev, 0x08, 1);
        w32(&mut r.dev, 0x0c, 1);
        w8(
            &mut r.dev,
            0x14,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        for q in 0..2u16 {
            w16(&mut r.dev, 0x16, q);
            w32(&mut r.dev, 0x20, 0x1000);
            w32(&mut r.dev, 0x24, u32::from(q) * 0x7fff_ffff);
            w16(&mut r.dev, 0x1c, 1);
        }
        w8(&mut r.dev, 0x14, ALL);
        assert_ne!(r.dev.status() & status::DEVICE_NEEDS_RESET, 0);
        assert_eq!(r.dev.metrics().activations.load(Ordering::Relaxed), 0);
        // A reset clears it.
        w8(&mut r.dev, 0x14, 0);
        assert_eq!(r.dev.status(), 0);
    }

    #[test]
    fn bad_queue_sizes_and_vectors_are_refused() {
        let mut r = rig();
        w16(&mut r.dev, 0x16, 0);
        for size in [0u16, 3, 32, u16::MAX] {
            w16(&mut r.dev, 0x18, size);
        }
        assert_eq!(r16(&mut r.dev, 0x18), 16);
        w16(&mut r.dev, 0x1a, 77);
        assert_eq!(r16(&mut r.dev, 0x1a), NO_VECTOR);
        // A queue that does not exist reads size 0 and takes no writes.
        w16(&mut r.dev, 0x16, 9);
        assert_eq!(r16(&mut r.dev, 0x18), 0);
        w16(&mut r.dev, 0x18, 8);
        w16(&mut r.dev, 0x1c, 1);
        let m = r.dev.metrics();
        assert_eq!(m.bad_queue_config.load(Ordering::Relaxed), 6);
        assert_eq!(m.bad_vector.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn reset_stops_handler_and_clears_state() {
        let mut r = rig();
        enable_msix(&mut r.dev);
        bring_up(&mut r.dev);
        w8(&mut r.dev, 0x14, ALL);
        w8(&mut r.dev, 0x14, 0);
        assert_eq!(r.resets.load(Ordering::SeqCst), 1);
        assert_eq!(r.dev.status(), 0);
        w16(&mut r.dev, 0x16, 0);
        assert_eq!(r16(&mut r.dev, 0x1c), 0);
        assert_eq!(r16(&mut r.dev, 0x1a), NO_VECTOR);
        // Notifications after reset reach no handler.
        w16(&mut r.dev, NOTIFY_OFFSET, 0);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(r.notified.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn garbage_on_every_bar_offset_never_panics() {
        let mut r = rig();
        enable_msix(&mut r.dev);
        bring_up(&mut r.dev);
        let mut x = 0x9e37_79b9u32;
        for offset in (0..BAR_SIZE + 16).step_by(1) {
            for len in [1usize, 2, 3, 4, 8] {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let data = x.to_le_bytes().repeat(2);
                r.dev.bar_write(0, offset, &data[..len]);
                let mut out = vec![0u8; len];
                r.dev.bar_read(0, offset, &mut out);
            }
        }
        r.dev.bar_write(1, 0, &[1]);
        assert!(r.dev.metrics().bad_access.load(Ordering::Relaxed) > 0);
    }

    #[test]
    fn pci_cfg_capability_reaches_the_bar_and_refuses_bad_windows() {
        let mut r = rig();
        let cap = r.dev.pci_cfg_reg;
        assert_eq!((r.dev.config_read(cap) >> 24) as u8, 5);
        // Read num_queues (common cfg 0x12, 2 bytes) through the window.
        r.dev.config_write(cap + 1, 0, &[0]);
        r.dev.config_write(cap + 2, 0, &0x12u32.to_le_bytes());
        r.dev.config_write(cap + 3, 0, &2u32.to_le_bytes());
        assert_eq!(r.dev.config_read(cap + 4), 2);
        // Write the status register through it.
        r.dev.config_write(cap + 2, 0, &0x14u32.to_le_bytes());
        r.dev.config_write(cap + 3, 0, &1u32.to_le_bytes());
        r.dev
            .config_write(cap + 4, 0, &[status::ACKNOWLEDGE, 0, 0, 0]);
        assert_eq!(r.dev.status(), status::ACKNOWLEDGE);
        // Bad windows: another BAR, odd length, misaligned, past the end.
        let before = r.dev.metrics().bad_access.load(Ordering::Relaxed);
        for (bar, offset, len) in [
            (1u8, 0u32, 4u32),
            (0, 0, 3),
            (0, 1, 2),
            (0, u32::try_from(BAR_SIZE).unwrap(), 4),
        ] {
            r.dev.config_write(cap + 1, 0, &[bar]);
            r.dev.config_write(cap + 2, 0, &offset.to_le_bytes());
            r.dev.config_write(cap + 3, 0, &len.to_le_bytes());
            assert_eq!(r.dev.config_read(cap + 4), 0);
        }
        assert_eq!(
            r.dev.metrics().bad_access.load(Ordering::Relaxed),
            before + 4
        );
    }

    #[test]
    fn bar_relocation_through_config_space() {
        let mut r = rig();
        // As Linux does: decoding off while both halves change, then on.
        assert!(r
            .dev
            .config_write(4, 0, &0xc000_0000u32.to_le_bytes())
            .is_empty());
        assert!(r.dev.config_write(5, 0, &0u32.to_le_bytes()).is_empty());
        let moves = r
            .dev
            .config_write(1, 0, &u32::from(COMMAND_MEMORY).to_le_bytes());
        assert_eq!(moves.len(), 1);
        assert_eq!(moves[0].old, BAR);
        assert_eq!(moves[0].new, 0xc000_0000);
        assert_eq!(r.dev.bar_address(), 0xc000_0000);
    }
}
