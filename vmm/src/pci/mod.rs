//! The PCI platform of the VM: the root (host bridge and virtio functions) on the buses
//! (ECAM on the MMIO bus, 0xCF8/0xCFC on the port bus), BAR placement and guest BAR
//! moves, MSI-X through KVM GSI routing and irqfds, queue notifications through
//! ioeventfds, and the device event-loop thread where every virtio device runs.

pub mod interrupts;
pub mod vfio;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use kvm_ioctls::{IoEventAddress, NoDatamatch};
use tenantvm_devices::bus::{Bus, BusError};
use tenantvm_devices::pci::{
    BarAllocator, BarAllocatorError, BarKind, BarMove, BarRelocation, BarRelocationError,
    MsixMetrics, PciBarWindow, PciConfigIo, PciConfigMmio, PciRoot, PciRootError, PciWindows,
    ECAM_BASE, ECAM_BUS_SIZE, PCI_CONFIG_IO_PORT, PCI_CONFIG_IO_PORT_LEN,
};
use tenantvm_devices::virtio::transport::{VirtioPciDevice, VirtioPciError, BAR_SIZE};
use tenantvm_devices::virtio::{
    EventLoopError, EventLoopThread, GuestMemoryMmap, ThreadInit, VirtioDevice,
};
use vmm_sys_util::eventfd::EventFd;

use self::interrupts::{GsiRouting, KvmMsiSink, MsiRoutingError};
use crate::acpi::PciHostBridge;
use crate::vstate::vm::Vm;

/// First I/O port the host bridge hands to devices (none use I/O BARs today).
const PCI_IO_WINDOW: std::ops::RangeInclusive<u16> = 0x1000..=0xffff;

/// Why the PCI platform or a device on it could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum PciSetupError {
    /// The PCI windows do not fit this guest (RAM size, physical address width).
    #[error(transparent)]
    Windows(#[from] BarAllocatorError),
    /// A bus range is taken.
    #[error("PCI bus mapping: {0}")]
    Bus(#[from] BusError),
    /// All PCI slots are taken.
    #[error(transparent)]
    Root(#[from] PciRootError),
    /// The virtio transport refused the device.
    #[error(transparent)]
    Virtio(#[from] VirtioPciError),
    /// MSI routes or irqfds could not be created.
    #[error(transparent)]
    Msi(#[from] MsiRoutingError),
    /// The device thread could not start.
    #[error(transparent)]
    EventLoop(#[from] EventLoopError),
    /// A queue notification ioeventfd could not be registered or cloned.
    #[error("Cannot register a queue notification ioeventfd: {0}")]
    Ioeventfd(#[source] std::io::Error),
}

/// The ACPI description of the host bridge for `windows` (bus 0 only).
pub fn host_bridge(windows: &PciWindows) -> PciHostBridge {
    PciHostBridge {
        ecam_base: ECAM_BASE,
        last_bus: 0,
        mmio32: windows.mmio32_base as u32..=(windows.mmio32_base + windows.mmio32_size - 1) as u32,
        mmio64: windows.mmio64_base..=windows.mmio64_base + windows.mmio64_size - 1,
        io: PCI_IO_WINDOW,
    }
}

/// The guest's physical address width, from the host's CPUID leaf 0x8000_0008 (what KVM
/// passes through); 36 bits when the leaf is missing.
pub fn host_phys_bits() -> u8 {
    // `__cpuid` is safe to call on every x86_64 CPU (CPUID always exists in long mode).
    let max = std::arch::x86_64::__cpuid(0x8000_0000).eax;
    if max < 0x8000_0008 {
        return 36;
    }
    (std::arch::x86_64::__cpuid(0x8000_0008).eax & 0xff) as u8
}

/// A function returning a device's counters by name.
pub type CounterSource = Box<dyn Fn() -> Vec<(&'static str, u64)> + Send + Sync>;

/// Every device counter of the VM, by device name (the control socket's `metrics`).
#[derive(Default)]
pub struct DeviceCounters {
    sources: Vec<(String, CounterSource)>,
}

impl DeviceCounters {
    /// Adds a named source.
    pub fn add(&mut self, name: impl Into<String>, source: CounterSource) {
        self.sources.push((name.into(), source));
    }

    /// Reads every counter now.
    pub fn snapshot(&self) -> BTreeMap<String, BTreeMap<String, u64>> {
        self.sources
            .iter()
            .map(|(name, source)| {
                let counters = source()
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect();
                (name.clone(), counters)
            })
            .collect()
    }
}

fn load(counter: &std::sync::atomic::AtomicU64) -> u64 {
    counter.load(std::sync::atomic::Ordering::Relaxed)
}

fn msix_counters(m: &MsixMetrics) -> Vec<(&'static str, u64)> {
    vec![
        ("bad_access", load(&m.bad_access)),
        ("bad_vector", load(&m.bad_vector)),
        ("delivered", load(&m.delivered)),
        ("pended", load(&m.pended)),
        ("sink_errors", load(&m.sink_errors)),
    ]
}

/// Queue notification eventfds of one function, by offset in its BAR 0.
type NotifyFds = Vec<(u64, EventFd)>;

/// Carries out guest BAR moves: checks the range, moves the bus mapping and the
/// ioeventfds. Runs on a vCPU thread with the PCI root locked.
struct VmmBarRelocation {
    vm: Arc<Vm>,
    mmio: Arc<RwLock<Bus>>,
    alloc: Mutex<BarAllocator>,
    notify: Mutex<HashMap<u8, NotifyFds>>,
    /// KVM memory slots of passed-through BARs, moved with them.
    bar_slots: vfio::BarSlots,
}

impl VmmBarRelocation {
    fn move_ioeventfds(&self, slot: u8, old: u64, new: u64) {
        let notify = self.notify.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(fds) = notify.get(&slot) else { return };
        for (offset, fd) in fds {
            let fd_old = IoEventAddress::Mmio(old + offset);
            let fd_new = IoEventAddress::Mmio(new + offset);
            // Without an ioeventfd the notify write still reaches the device through the
            // MMIO bus (the transport writes the same EventFd), so a failure here slows
            // notifications down but loses none.
            if let Err(e) = self.vm.fd().unregister_ioevent(fd, &fd_old, NoDatamatch) {
                tracing::warn!("PCI slot {slot}: cannot drop the ioeventfd at {fd_old:?}: {e}");
            }
            if let Err(e) = self.vm.fd().register_ioevent(fd, &fd_new, NoDatamatch) {
                tracing::warn!("PCI slot {slot}: cannot add the ioeventfd at {fd_new:?}: {e}");
            }
        }
    }
}

impl BarRelocation for VmmBarRelocation {
    fn move_bar(&self, slot: u8, mv: &BarMove) -> Result<(), BarRelocationError> {
        let refused = BarRelocationError::Range {
            addr: mv.new,
            size: mv.size,
        };
        self.alloc
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .relocate(mv.kind, mv.old, mv.new, mv.size)
            .map_err(|_| refused)?;
        if let Err(e) = self.bar_slots.move_bar(&self.vm, slot, mv) {
            let _ = self
                .alloc
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .relocate(mv.kind, mv.new, mv.old, mv.size);
            return Err(BarRelocationError::Remap(e));
        }
        {
            let mut bus = self.mmio.write().unwrap_or_else(PoisonError::into_inner);
            let device = bus
                .remove(mv.old)
                .ok_or_else(|| BarRelocationError::Remap("BAR was not mapped".into()))?;
            if let Err(e) = bus.insert(device.clone(), mv.new, mv.size) {
                // The allocator said the range is free in the windows, but it may cover
                // another bus range (ECAM): undo both.
                let _ = bus.insert(device, mv.old, mv.size);
                let _ = self
                    .alloc
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .relocate(mv.kind, mv.new, mv.old, mv.size);
                return Err(BarRelocationError::Remap(e.to_string()));
            }
        }
        if mv.index == 0 {
            self.move_ioeventfds(slot, mv.old, mv.new);
        }
        Ok(())
    }
}

/// The VM's PCI platform.
pub struct PciPlatform {
    vm: Arc<Vm>,
    mem: GuestMemoryMmap,
    mmio: Arc<RwLock<Bus>>,
    root: Arc<Mutex<PciRoot>>,
    relocation: Arc<VmmBarRelocation>,
    routing: Arc<GsiRouting>,
    event_loop: Arc<EventLoopThread>,
    counters: DeviceCounters,
}

impl PciPlatform {
    /// Puts the root on the buses and starts the device thread, which runs
    /// `device_thread_init` (its seccomp filter) before it serves anything.
    pub fn new(
        vm: Arc<Vm>,
        mem: GuestMemoryMmap,
        windows: PciWindows,
        pio: &mut Bus,
        mmio: Arc<RwLock<Bus>>,
        device_thread_init: Option<ThreadInit>,
    ) -> Result<Self, PciSetupError> {
        let relocation = Arc::new(VmmBarRelocation {
            vm: vm.clone(),
            mmio: mmio.clone(),
            alloc: Mutex::new(BarAllocator::new(windows)?),
            notify: Mutex::default(),
            bar_slots: vfio::BarSlots::default(),
        });
        let root = Arc::new(Mutex::new(PciRoot::new(Some(relocation.clone()))));
        mmio.write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                Arc::new(Mutex::new(PciConfigMmio::new(root.clone()))),
                ECAM_BASE,
                ECAM_BUS_SIZE,
            )?;
        pio.insert(
            Arc::new(Mutex::new(PciConfigIo::new(root.clone()))),
            PCI_CONFIG_IO_PORT,
            PCI_CONFIG_IO_PORT_LEN,
        )?;
        let mut counters = DeviceCounters::default();
        let root_metrics = root
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .metrics();
        counters.add(
            "pci",
            Box::new(move || {
                vec![
                    ("bad_access", load(&root_metrics.bad_access)),
                    ("bar_moves", load(&root_metrics.bar_moves)),
                    ("bar_moves_refused", load(&root_metrics.bar_moves_refused)),
                ]
            }),
        );
        Ok(Self {
            routing: Arc::new(GsiRouting::new(vm.clone())),
            vm,
            mem,
            mmio,
            root,
            relocation,
            event_loop: Arc::new(EventLoopThread::spawn_with(
                "tenantvm-dev",
                device_thread_init,
            )?),
            counters,
        })
    }

    /// Plugs `device` in as a virtio-pci function named `name` (counters), with `extra`
    /// the device's own counters. Returns its slot.
    pub fn add_virtio(
        &mut self,
        name: &str,
        device: Box<dyn VirtioDevice>,
        extra: CounterSource,
    ) -> Result<u8, PciSetupError> {
        let vectors = device.queue_max_sizes().len() as u16 + 1;
        let sink = Arc::new(KvmMsiSink::new(self.routing.clone(), vectors)?);
        let kind = BarKind::Memory64 {
            prefetchable: false,
        };
        let bar = self
            .relocation
            .alloc
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .allocate(kind, BAR_SIZE)?;
        let function =
            VirtioPciDevice::new(device, self.mem.clone(), sink, self.event_loop.clone(), bar)?;
        let mut notify = Vec::new();
        for (offset, fd) in function.ioeventfds() {
            let fd = fd.try_clone().map_err(PciSetupError::Ioeventfd)?;
            self.vm
                .fd()
                .register_ioevent(&fd, &IoEventAddress::Mmio(bar + offset), NoDatamatch)
                .map_err(|e| PciSetupError::Ioeventfd(e.into()))?;
            notify.push((offset, fd));
        }
        let transport = function.metrics();
        let msix = function.msix_metrics();
        let function = Arc::new(Mutex::new(function));
        let slot = self
            .root
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .add_device(function.clone())?;
        self.relocation
            .notify
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(slot, notify);
        self.mmio
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                Arc::new(Mutex::new(PciBarWindow::new(function, 0))),
                bar,
                BAR_SIZE,
            )?;
        self.counters.add(name, extra);
        self.counters.add(
            format!("{name}.transport"),
            Box::new(move || transport.snapshot()),
        );
        self.counters.add(
            format!("{name}.msix"),
            Box::new(move || msix_counters(&msix)),
        );
        Ok(slot)
    }

    /// The device counters (moved out; the platform keeps running without them).
    pub fn take_counters(&mut self) -> DeviceCounters {
        std::mem::take(&mut self.counters)
    }

    /// The device thread, kept alive as long as the VM runs.
    pub fn event_loop(&self) -> Arc<EventLoopThread> {
        self.event_loop.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenantvm_devices::virtio::rng::Rng;
    use vm_memory::GuestAddress;

    /// A VM with the PCI platform and one rng function, or `None` without /dev/kvm.
    fn platform() -> Option<(PciPlatform, Bus, Arc<RwLock<Bus>>, u8)> {
        if !std::path::Path::new("/dev/kvm").exists() {
            tenantvm_skip::record_skip!("/dev/kvm is absent");
            return None;
        }
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap();
        let vm = Arc::new(Vm::new(&mem).expect("create a VM"));
        let windows =
            PciWindows::new(16 << 20, 46, tenantvm_devices::pci::MMIO64_DEFAULT_SIZE).unwrap();
        let mut pio = Bus::new();
        let mmio = Arc::new(RwLock::new(Bus::new()));
        let mut pci = PciPlatform::new(vm, mem, windows, &mut pio, mmio.clone(), None).unwrap();
        let slot = pci
            .add_virtio("rng", Box::new(Rng::new()), Box::new(Vec::new))
            .unwrap();
        Some((pci, pio, mmio, slot))
    }

    fn cfg_write(pio: &Bus, slot: u8, reg: u8, value: u32) {
        let addr = 0x8000_0000u32 | (u32::from(slot) << 11) | u32::from(reg);
        pio.write(0xcf8, &addr.to_le_bytes());
        pio.write(0xcfc, &value.to_le_bytes());
    }

    fn counter(pci: &mut PciPlatform, device: &str, name: &str) -> u64 {
        let counters = pci.take_counters();
        let value = counters.snapshot()[device][name];
        pci.counters = counters;
        value
    }

    fn mapped(mmio: &RwLock<Bus>, addr: u64) -> bool {
        mmio.read().unwrap().resolve(addr, 4).is_some()
    }

    #[test]
    fn guest_bar_move_follows_on_the_bus_and_bad_moves_are_refused() {
        let Some((mut pci, pio, mmio, slot)) = platform() else {
            return;
        };
        let old = tenantvm_devices::pci::MMIO64_ALIGN;
        assert!(mapped(&mmio, old));
        // A move into the 32-bit window, decoding on: the bus range follows.
        let new = 0xc000_0000u64;
        cfg_write(&pio, slot, 0x04, 0);
        cfg_write(&pio, slot, 0x10, new as u32);
        cfg_write(&pio, slot, 0x14, 0);
        cfg_write(&pio, slot, 0x04, 0x6);
        assert!(mapped(&mmio, new));
        assert!(!mapped(&mmio, old));
        assert_eq!(counter(&mut pci, "pci", "bar_moves"), 1);
        // A move onto the ECAM window is outside the BAR windows: refused, BAR stays put.
        cfg_write(&pio, slot, 0x10, ECAM_BASE as u32);
        assert!(mapped(&mmio, new));
        assert_eq!(counter(&mut pci, "pci", "bar_moves_refused"), 1);
    }

    #[test]
    fn counters_name_every_function_part() {
        let Some((mut pci, ..)) = platform() else {
            return;
        };
        let names: Vec<String> = pci.take_counters().snapshot().into_keys().collect();
        assert_eq!(names, ["pci", "rng", "rng.msix", "rng.transport"]);
    }

    #[test]
    fn host_bridge_matches_the_windows() {
        let windows = PciWindows::new(1 << 30, 46, 1 << 38).unwrap();
        let bridge = host_bridge(&windows);
        assert_eq!(bridge.ecam_base, ECAM_BASE);
        assert_eq!(bridge.ecam_len(), ECAM_BUS_SIZE);
        assert_eq!(*bridge.mmio32.start(), 0xc000_0000);
        assert_eq!(*bridge.mmio64.start(), windows.mmio64_base);
        assert!(host_phys_bits() >= 32);
    }
}
