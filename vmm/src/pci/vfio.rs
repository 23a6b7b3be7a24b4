//! Passed-through devices in the VM: opening them (kernel VFIO, or the model GPU in test
//! builds), reset at attach, BAR placement in windows sized for them, mmappable BAR areas
//! as KVM memory slots (moved when the guest moves a BAR), MSI/MSI-X through irqfds the
//! device signals directly (no VMM wake-up per interrupt), guest RAM mapped once for DMA
//! (IOVA = guest physical address), and reset at detach into the exit report.
//!
//! Kernel devices are opened through iommufd and their cdev where the kernel offers it and
//! the device's `iommu` option allows it (`auto`, the default), through the legacy
//! container and group otherwise. A VM has at most one container and one iommufd (one
//! IOAS), shared by its devices of each kind; guest RAM is mapped once into each that
//! exists, and each group file or device cdev file is added to the KVM VFIO device.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use kvm_bindings::{
    kvm_create_device, kvm_device_attr, kvm_device_type_KVM_DEV_TYPE_VFIO,
    kvm_userspace_memory_region, KVM_DEV_VFIO_FILE, KVM_DEV_VFIO_FILE_ADD,
};
use kvm_ioctls::{DeviceFd, VmFd};
use tenantvm_devices::pci::vfio::{
    self, irq_vectors, DeviceProbe, GpuDirectCap, GpuDirectError, Iommufd, IommufdError,
    KernelVfioDevice, KvmVfioFiles, MappedArea, MappingError, ShadowError, SysfsError, VfioBackend,
    VfioBackendError, VfioContainer, VfioDeviceError, VfioInterface, VfioIommuMode,
    VfioKernelError, VfioPciDevice,
};
use tenantvm_devices::pci::{
    BarAllocatorError, BarKind, BarMove, MsiInterruptSink, MsiMessage, MsiSinkError, PciBarWindow,
    PciWindows, MMIO64_ALIGN, MMIO64_DEFAULT_SIZE,
};
use tenantvm_vmm_api::{DeviceReport, ExitStatus, PassthroughConfig, ResetOutcome};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::interrupts::{GsiRouting, MsiRoutingError};
use super::{msix_counters, PciPlatform, PciSetupError};
use crate::vstate::vm::Vm;

/// The guest's physical address bits are capped here (as Cloud Hypervisor does): 4-level
/// guest paging and firmware assume at most 46.
pub const GUEST_MAX_PHYS_BITS: u8 = 46;
/// First KVM memory slot used for BAR areas (guest RAM uses the slots below).
const FIRST_BAR_SLOT: u32 = 64;
/// Where the exit report's device entries are path-named for the model GPU.
pub const MODEL_GPU_PATH: &str = "model-gpu";

/// Why a passed-through device could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum PassthroughError {
    /// sysfs refuses the device.
    #[error(transparent)]
    Sysfs(#[from] SysfsError),
    /// Kernel VFIO refused the device or the DMA mapping.
    #[error(transparent)]
    Kernel(#[from] VfioKernelError),
    /// The device's configuration space or BARs are unusable.
    #[error("Device {path}: {source}")]
    Probe {
        /// The device.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: ShadowError,
    },
    /// The device cannot have the GPUDirect clique capability it was configured with.
    #[error("Device {path}: {source}")]
    GpuDirect {
        /// The device.
        path: PathBuf,
        /// Why.
        #[source]
        source: GpuDirectError,
    },
    /// The device could not be built.
    #[error("Device {path}: {source}")]
    Device {
        /// The device.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: VfioDeviceError,
    },
    /// The BARs do not fit.
    #[error("The passed-through devices' BARs do not fit: {0}")]
    Placement(#[from] BarAllocatorError),
    /// A BAR area could not be mapped.
    #[error(transparent)]
    Mapping(#[from] MappingError),
    /// A device's sparse-mmap areas are malformed.
    #[error("Device {path}: {reason}")]
    Areas {
        /// The device.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// KVM refused a memory slot, the VFIO pseudo-device or an irqfd.
    #[error("KVM: cannot {what}: {source}")]
    Kvm {
        /// What was asked.
        what: &'static str,
        /// What KVM said.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// MSI routes or irqfds could not be set up.
    #[error(transparent)]
    Msi(#[from] MsiRoutingError),
    /// The device refused its INTx eventfds.
    #[error("Cannot wire INTx of the device in slot {slot}: {source}")]
    Intx {
        /// PCI slot.
        slot: u8,
        /// What the device said.
        #[source]
        source: VfioBackendError,
    },
    /// The model GPU (test builds) could not be created.
    #[error("Cannot create the model GPU: {0}")]
    Model(#[source] std::io::Error),
    /// The PCI platform refused the device.
    #[error(transparent)]
    Pci(Box<PciSetupError>),
}

impl PassthroughError {
    /// The process exit status (docs/vmm.md).
    pub fn exit_status(&self) -> ExitStatus {
        let sysfs = |e: &SysfsError| match e {
            SysfsError::NotADevice(_) => ExitStatus::VfioDevicePath,
            SysfsError::NotVfioBound { .. } => ExitStatus::VfioNotBound,
            SysfsError::NoIommuGroup(_) | SysfsError::GroupNotViable { .. } => {
                ExitStatus::VfioGroup
            }
        };
        match self {
            PassthroughError::Sysfs(e) => sysfs(e),
            PassthroughError::Kernel(VfioKernelError::Sysfs(e)) => sysfs(e),
            PassthroughError::Kernel(VfioKernelError::GroupNotViable(_)) => ExitStatus::VfioGroup,
            PassthroughError::Kernel(VfioKernelError::DmaMemlock { .. })
            | PassthroughError::Kernel(VfioKernelError::Iommufd(IommufdError::DmaMemlock {
                ..
            })) => ExitStatus::VfioDmaMap,
            PassthroughError::Kernel(_) | PassthroughError::Probe { .. } => {
                ExitStatus::VfioUnavailable
            }
            PassthroughError::Placement(_) => ExitStatus::BarPlacement,
            PassthroughError::GpuDirect { .. } => ExitStatus::ConfigError,
            _ => ExitStatus::VmmError,
        }
    }
}

/// What a configured device is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSource {
    /// A device bound to a VFIO driver, as configured (its sysfs path and options).
    Kernel(PassthroughConfig),
    /// The model GPU (a test fake).
    Model,
}

/// One opened, probed device, not yet on the PCI root.
struct Opened {
    /// Its entry in the exit report.
    report: usize,
    path: PathBuf,
    backend: Arc<dyn VfioBackend>,
    kernel: Option<Arc<KernelVfioDevice>>,
    model: Option<Arc<vfio::model::ModelGpu>>,
    probe: DeviceProbe,
}

/// An attached device: what detach needs.
struct Attached {
    /// Its entry in the exit report.
    report: usize,
    backend: Arc<dyn VfioBackend>,
    function: Arc<Mutex<VfioPciDevice>>,
}

/// The VM's passed-through devices, from opening to the reset at detach. Dropping it
/// detaches whatever is still attached, so every way out of the VMM short of SIGKILL
/// resets the devices and records it.
pub struct Passthrough {
    container: Option<Arc<VfioContainer>>,
    iommufd: Option<Arc<Iommufd>>,
    opened: Vec<Opened>,
    attached: Vec<Attached>,
    /// Reset at attach but refused at probing: still reset at detach.
    unprobed: Vec<(usize, Arc<dyn VfioBackend>)>,
    reports: Arc<Mutex<Vec<DeviceReport>>>,
    /// The VM's KVM VFIO device (with the first kernel device).
    kvm_vfio: Option<KvmVfioDevice>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The VM's KVM VFIO pseudo-device: group and cdev files are added to it before their
/// devices are opened or bound (the kernel hands a device the VM's KVM at that moment).
struct KvmVfioDevice(DeviceFd);

impl KvmVfioDevice {
    fn create(vm: &VmFd) -> Result<Self, PassthroughError> {
        let mut create = kvm_create_device {
            type_: kvm_device_type_KVM_DEV_TYPE_VFIO,
            fd: 0,
            flags: 0,
        };
        vm.create_device(&mut create)
            .map(Self)
            .map_err(|source| PassthroughError::Kvm {
                what: "create the KVM VFIO device",
                source,
            })
    }
}

impl KvmVfioFiles for KvmVfioDevice {
    fn add(&self, file: BorrowedFd<'_>) -> std::io::Result<()> {
        let fd: i32 = file.as_raw_fd();
        let attr = kvm_device_attr {
            group: KVM_DEV_VFIO_FILE,
            attr: u64::from(KVM_DEV_VFIO_FILE_ADD),
            addr: &fd as *const i32 as u64,
            flags: 0,
        };
        self.0
            .set_device_attr(&attr)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
    }
}

impl Passthrough {
    /// Records in the report of every device opened through `interface` how long mapping
    /// guest RAM for DMA there took.
    fn record_dma_map(&self, interface: VfioIommuMode, took: std::time::Duration) {
        let ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
        for r in lock(&self.reports).iter_mut() {
            if r.interface == Some(interface) {
                r.dma_map_ms = Some(ms);
            }
        }
    }

    /// Opens every device (checking sysfs, then through iommufd or the group, with
    /// `dev_dir`, normally `/dev`, holding `iommu` and `vfio/`), resets it, and probes its
    /// BARs. Each group or cdev file goes to the KVM VFIO device of `vm` (created with the
    /// first kernel device) before its device is opened or bound, as vendor drivers that
    /// need the VM at open (NVIDIA's vGPU) require. `reports` gets one entry per configured
    /// device, in order, up front (`not_attempted`), filled in as each reset happens.
    pub fn open(
        sources: &[DeviceSource],
        dev_dir: &Path,
        reports: Arc<Mutex<Vec<DeviceReport>>>,
        vm: &VmFd,
    ) -> Result<Self, PassthroughError> {
        let mut this = Self {
            container: None,
            iommufd: None,
            opened: Vec::new(),
            attached: Vec::new(),
            unprobed: Vec::new(),
            reports,
            kvm_vfio: None,
        };
        let first = {
            let mut reports = lock(&this.reports);
            let first = reports.len();
            reports.extend(sources.iter().map(|s| DeviceReport {
                path: match s {
                    DeviceSource::Kernel(config) => config.path.clone(),
                    DeviceSource::Model => MODEL_GPU_PATH.into(),
                },
                reset_at_attach: ResetOutcome::NotAttempted,
                reset_at_detach: ResetOutcome::NotAttempted,
                interface: None,
                dma_map_ms: None,
            }));
            first
        };
        for (report, source) in (first..).zip(sources) {
            let (path, backend, kernel, model): (PathBuf, Arc<dyn VfioBackend>, _, _) = match source
            {
                DeviceSource::Kernel(PassthroughConfig { path, iommu, .. }) => {
                    // sysfs first: its errors say what to do about this device.
                    vfio::inspect(path, &dev_dir.join("vfio"))?;
                    let device = Arc::new(this.open_kernel(path, *iommu, dev_dir, vm)?);
                    let interface = if device.iommufd_devid().is_some() {
                        VfioIommuMode::Iommufd
                    } else {
                        VfioIommuMode::Legacy
                    };
                    if let Some(r) = lock(&this.reports).get_mut(report) {
                        r.interface = Some(interface);
                    }
                    (path.clone(), device.clone(), Some(device), None)
                }
                DeviceSource::Model => {
                    let gpu = Arc::new(
                        vfio::model::ModelGpu::new(vfio::model::ModelReset::Flr)
                            .map_err(PassthroughError::Model)?,
                    );
                    (MODEL_GPU_PATH.into(), gpu.clone(), None, Some(gpu))
                }
            };
            let reset = backend.reset();
            if let Some(r) = lock(&this.reports).get_mut(report) {
                r.reset_at_attach = reset;
            }
            let mut probe = match vfio::probe(backend.as_ref()) {
                Ok(probe) => probe,
                Err(source) => {
                    this.unprobed.push((report, backend));
                    return Err(PassthroughError::Probe { path, source });
                }
            };
            let clique = match source {
                DeviceSource::Kernel(config) => config.gpudirect_clique,
                DeviceSource::Model => None,
            };
            if let Some(clique) = clique {
                match GpuDirectCap::for_device(backend.as_ref(), clique) {
                    Ok(cap) => probe.gpudirect = Some(cap),
                    Err(source) => {
                        this.unprobed.push((report, backend));
                        return Err(PassthroughError::GpuDirect { path, source });
                    }
                }
            }
            this.opened.push(Opened {
                report,
                path,
                backend,
                kernel,
                model,
                probe,
            });
        }
        Ok(this)
    }

    /// Opens a kernel device through the interface `mode` and the kernel choose: the
    /// VM's iommufd (opened with the first such device) and the device's cdev, or the VM's
    /// container (likewise) and the device's group. Under `auto`, a `/dev/iommu` that
    /// exists but does not open (a jail that did not give it) means the legacy path.
    fn open_kernel(
        &mut self,
        path: &Path,
        mode: VfioIommuMode,
        dev_dir: &Path,
        vm: &VmFd,
    ) -> Result<KernelVfioDevice, PassthroughError> {
        if self.kvm_vfio.is_none() {
            self.kvm_vfio = Some(KvmVfioDevice::create(vm)?);
        }
        let kvm = self.kvm_vfio.as_ref().map(|k| k as &dyn KvmVfioFiles);
        let interface =
            vfio::select_interface(mode, path, dev_dir).map_err(VfioKernelError::from)?;
        if let VfioInterface::Cdev { iommu, device } = interface {
            let iommufd = match &self.iommufd {
                Some(fd) => Some(fd.clone()),
                None => match Iommufd::open(&iommu) {
                    Ok(fd) => {
                        let fd = Arc::new(fd);
                        self.iommufd = Some(fd.clone());
                        Some(fd)
                    }
                    Err(IommufdError::Open { .. }) if mode == VfioIommuMode::Auto => None,
                    Err(e) => return Err(VfioKernelError::from(e).into()),
                },
            };
            if let Some(iommufd) = iommufd {
                return Ok(KernelVfioDevice::open_cdev(iommufd, &device, path, kvm)?);
            }
        }
        let container = match &self.container {
            Some(c) => c.clone(),
            None => {
                let c = VfioContainer::open(&dev_dir.join("vfio"))?;
                self.container = Some(c.clone());
                c
            }
        };
        Ok(KernelVfioDevice::open(container, path, kvm)?)
    }

    /// Whether any device is configured.
    pub fn is_empty(&self) -> bool {
        self.opened.is_empty() && self.attached.is_empty()
    }

    /// The PCI windows for a guest whose RAM ends at `ram_end`: the 64-bit window grows by
    /// what the devices' 64-bit BARs need, naturally aligned.
    pub fn windows(&self, ram_end: u64, phys_bits: u8) -> Result<PciWindows, PassthroughError> {
        let bars: Vec<(BarKind, u64)> = self
            .opened
            .iter()
            .flat_map(|o| o.probe.bars.iter().map(|b| (b.kind, b.size)))
            .collect();
        plan_windows(ram_end, phys_bits, &bars)
    }

    /// Resets every attached device at detach (interrupts off first) and records the
    /// outcomes. Safe to call more than once.
    pub fn detach(&mut self) {
        let mut resets: Vec<(usize, Arc<dyn VfioBackend>)> = Vec::new();
        for device in self.attached.drain(..) {
            lock(&device.function).disable_interrupts();
            resets.push((device.report, device.backend));
        }
        // Opened (or refused at probing) but never attached: still reset, the device was.
        resets.extend(self.opened.drain(..).map(|d| (d.report, d.backend)));
        resets.append(&mut self.unprobed);
        for (report, backend) in resets {
            let outcome = backend.reset();
            if let Some(r) = lock(&self.reports).get_mut(report) {
                r.reset_at_detach = outcome;
            }
        }
    }
}

impl Drop for Passthrough {
    fn drop(&mut self) {
        self.detach();
    }
}

/// The PCI windows for RAM ending at `ram_end`, `phys_bits` physical address bits, and
/// passed-through BARs `bars`: the 64-bit window is the default (for virtio) plus every
/// 64-bit BAR, plus the largest BAR again as alignment slack, rounded to the window
/// alignment. Refused with a clear error when it does not fit under `phys_bits`.
pub fn plan_windows(
    ram_end: u64,
    phys_bits: u8,
    bars: &[(BarKind, u64)],
) -> Result<PciWindows, PassthroughError> {
    let bars64: Vec<u64> = bars
        .iter()
        .filter(|(k, _)| matches!(k, BarKind::Memory64 { .. }))
        .map(|(_, s)| *s)
        .collect();
    let extra = if bars64.is_empty() {
        0
    } else {
        let sum = bars64.iter().try_fold(0u64, |a, s| a.checked_add(*s));
        let largest = bars64.iter().copied().max().unwrap_or(0);
        sum.and_then(|s| s.checked_add(if largest > MMIO64_ALIGN { largest } else { 0 }))
            .ok_or(BarAllocatorError::Size(u64::MAX))?
    };
    let size = MMIO64_DEFAULT_SIZE
        .checked_add(extra)
        .and_then(|s| s.checked_next_multiple_of(MMIO64_ALIGN))
        .ok_or(BarAllocatorError::Size(extra))?;
    Ok(PciWindows::new(ram_end, phys_bits, size)?)
}

/// The guest's physical address bits: the host's, capped at [`GUEST_MAX_PHYS_BITS`].
pub fn guest_phys_bits() -> u8 {
    super::host_phys_bits().min(GUEST_MAX_PHYS_BITS)
}

/// One BAR area mapped into the guest as a KVM memory slot.
pub(super) struct BarSlot {
    kvm_slot: u32,
    offset: u64,
    area: MappedArea,
}

/// The KVM slots of every passed-through BAR, by (PCI slot, BAR index).
#[derive(Default)]
pub(super) struct BarSlots {
    slots: Mutex<HashMap<(u8, usize), Vec<BarSlot>>>,
    next: AtomicU32,
}

fn set_slot(
    vm: &Vm,
    kvm_slot: u32,
    gpa: u64,
    area: &MappedArea,
    present: bool,
) -> Result<(), kvm_ioctls::Error> {
    let region = kvm_userspace_memory_region {
        slot: kvm_slot,
        guest_phys_addr: gpa,
        memory_size: if present { area.len() } else { 0 },
        userspace_addr: area.host_addr(),
        flags: 0,
    };
    // SAFETY: the host range is a live mapping owned by `area`, which `BarSlots` keeps
    // for as long as the slot exists (the VM is dropped before the platform's slots).
    unsafe { vm.fd().set_user_memory_region(region) }
}

impl BarSlots {
    /// Moves the slots of BAR `mv.index` of PCI slot `slot` to the BAR's new address.
    pub(super) fn move_bar(&self, vm: &Vm, slot: u8, mv: &BarMove) -> Result<(), String> {
        let slots = lock(&self.slots);
        let Some(list) = slots.get(&(slot, mv.index)) else {
            return Ok(());
        };
        for s in list {
            set_slot(vm, s.kvm_slot, mv.old + s.offset, &s.area, false)
                .map_err(|e| format!("cannot remove the BAR slot: {e}"))?;
            set_slot(vm, s.kvm_slot, mv.new + s.offset, &s.area, true)
                .map_err(|e| format!("cannot add the BAR slot: {e}"))?;
        }
        Ok(())
    }

    fn add(
        &self,
        vm: &Vm,
        slot: u8,
        bar: usize,
        gpa: u64,
        offset: u64,
        area: MappedArea,
    ) -> Result<(), PassthroughError> {
        let kvm_slot = FIRST_BAR_SLOT + self.next.fetch_add(1, Ordering::Relaxed);
        set_slot(vm, kvm_slot, gpa + offset, &area, true).map_err(|source| {
            PassthroughError::Kvm {
                what: "map a BAR area into the guest",
                source,
            }
        })?;
        lock(&self.slots)
            .entry((slot, bar))
            .or_default()
            .push(BarSlot {
                kvm_slot,
                offset,
                area,
            });
        Ok(())
    }
}

/// MSI/MSI-X vectors of a passed-through function: a GSI and an irqfd each. The device
/// signals the irqfd itself. A masked vector's irqfd is detached from KVM, so what the
/// device signals meanwhile stays counted in the eventfd, and KVM delivers it when the
/// irqfd is attached again on unmask (the pending bit, without the VMM).
pub struct VfioMsiSink {
    routing: Arc<GsiRouting>,
    vectors: Vec<(u32, EventFd, AtomicBool)>,
}

impl VfioMsiSink {
    /// Allocates `vectors` GSIs and eventfds (not yet attached to KVM).
    pub fn new(routing: Arc<GsiRouting>, vectors: u16) -> Result<Self, MsiRoutingError> {
        let mut list = Vec::with_capacity(usize::from(vectors));
        for _ in 0..vectors {
            let gsi = routing.allocate()?;
            let fd = EventFd::new(EFD_NONBLOCK).map_err(MsiRoutingError::Irqfd)?;
            list.push((gsi, fd, AtomicBool::new(false)));
        }
        Ok(Self {
            routing,
            vectors: list,
        })
    }

    /// Clones of the eventfds, for the device.
    pub fn eventfds(&self) -> Result<Vec<EventFd>, MsiRoutingError> {
        self.vectors
            .iter()
            .map(|(_, fd, _)| fd.try_clone().map_err(MsiRoutingError::Irqfd))
            .collect()
    }
}

impl MsiInterruptSink for VfioMsiSink {
    fn update(&self, vector: u16, message: MsiMessage, masked: bool) -> Result<(), MsiSinkError> {
        let route_err = |reason: String| MsiSinkError::Route { vector, reason };
        let (gsi, fd, attached) = self
            .vectors
            .get(usize::from(vector))
            .ok_or_else(|| route_err("no such vector".into()))?;
        let vm = self.routing.vm();
        if masked {
            if attached.swap(false, Ordering::AcqRel) {
                vm.fd()
                    .unregister_irqfd(fd, *gsi)
                    .map_err(|e| route_err(e.to_string()))?;
            }
            return Ok(());
        }
        self.routing
            .set_msi(*gsi, Some(message))
            .map_err(|e| route_err(e.to_string()))?;
        if !attached.swap(true, Ordering::AcqRel) {
            vm.fd()
                .register_irqfd(fd, *gsi)
                .map_err(|e| route_err(e.to_string()))?;
        }
        Ok(())
    }

    fn trigger(&self, vector: u16, _message: MsiMessage) -> Result<(), MsiSinkError> {
        let (_, fd, _) = self
            .vectors
            .get(usize::from(vector))
            .ok_or(MsiSinkError::Trigger {
                vector,
                reason: "no such vector".into(),
            })?;
        fd.write(1).map_err(|e| MsiSinkError::Trigger {
            vector,
            reason: e.to_string(),
        })
    }
}

impl PciPlatform {
    /// Puts every opened device of `pt` on the PCI root: BARs placed, trapped ranges on
    /// the MMIO bus, mmappable areas as KVM slots, MSI through irqfds, and guest RAM mapped
    /// for DMA (kernel devices: once, into the VM's container or iommufd; the model GPU
    /// writes guest RAM through vm-memory).
    pub fn add_passthrough(&mut self, pt: &mut Passthrough) -> Result<(), PassthroughError> {
        // Each group and cdev file went to the KVM VFIO device when its device was opened
        // (`Passthrough::open`); guest RAM is mapped for DMA here, once per container and
        // per iommufd.
        // Each mapping is timed (the kernel pins all guest RAM; huge pages change what that
        // costs) and the time goes to the exit report of the devices it serves.
        if let Some(container) = pt.container.clone() {
            let started = std::time::Instant::now();
            self.map_dma(|iova, size, host| {
                // SAFETY: the guest memory mapping lives as long as the VM (and the
                // container, which `Passthrough` drops first); the VMM touches guest RAM
                // only through vm-memory's volatile accessors, never through Rust
                // references.
                unsafe { container.map_dma(iova, size, host) }.map_err(PassthroughError::Kernel)
            })?;
            pt.record_dma_map(VfioIommuMode::Legacy, started.elapsed());
        }
        if let Some(iommufd) = pt.iommufd.clone() {
            let started = std::time::Instant::now();
            self.map_dma(|iova, size, host| {
                // SAFETY: as for the container: guest memory outlives the iommufd (dropped
                // with `Passthrough`) and is never referenced, only volatile-accessed.
                unsafe { iommufd.map_dma(iova, size, host) }
                    .map_err(|e| PassthroughError::Kernel(e.into()))
            })?;
            pt.record_dma_map(VfioIommuMode::Iommufd, started.elapsed());
        }
        for (index, opened) in std::mem::take(&mut pt.opened).into_iter().enumerate() {
            let attached = self.attach_one(index, opened)?;
            pt.attached.push(attached);
        }
        Ok(())
    }

    /// Maps every guest RAM region for DMA with `map(iova, size, host_addr)`, IOVA = guest
    /// physical address.
    fn map_dma(
        &self,
        mut map: impl FnMut(u64, u64, u64) -> Result<(), PassthroughError>,
    ) -> Result<(), PassthroughError> {
        for region in self.mem.iter() {
            let host = region
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .map_err(|e| PassthroughError::Areas {
                    path: "guest RAM".into(),
                    reason: e.to_string(),
                })?;
            map(region.start_addr().0, region.len(), host as u64)?;
        }
        Ok(())
    }

    fn attach_one(&mut self, index: usize, opened: Opened) -> Result<Attached, PassthroughError> {
        let path = opened.path.clone();
        let mut addresses = Vec::new();
        {
            let mut alloc = lock(&self.relocation.alloc);
            for bar in &opened.probe.bars {
                addresses.push((bar.index, alloc.allocate(bar.kind, bar.size)?));
            }
        }
        let vectors = irq_vectors(&opened.probe).max(1);
        let sink = Arc::new(VfioMsiSink::new(self.routing.clone(), vectors)?);
        let irqfds = sink.eventfds()?;
        if let Some(model) = &opened.model {
            let mem = self.mem.clone();
            model.set_dma_handler(Arc::new(move |gpa, bytes| {
                mem.write_slice(bytes, GuestAddress(gpa))
                    .map_err(|e| e.to_string())
            }));
        }
        let probe = opened.probe.clone();
        let function = VfioPciDevice::new(
            opened.backend.clone(),
            opened.probe,
            &addresses,
            sink,
            irqfds,
        )
        .map_err(|source| PassthroughError::Device {
            path: path.clone(),
            source,
        })?;
        let plan = function.mmap_plan().map_err(|e| PassthroughError::Areas {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let metrics = function.metrics();
        let msix = function.msix_metrics();
        let function = Arc::new(Mutex::new(function));
        let slot = lock(&self.root)
            .add_device(function.clone())
            .map_err(|e| PassthroughError::Pci(Box::new(e.into())))?;
        for bar in &probe.bars {
            let addr = addresses
                .iter()
                .find(|(i, _)| *i == bar.index)
                .map_or(0, |(_, a)| *a);
            self.mmio
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(
                    Arc::new(Mutex::new(PciBarWindow::new(function.clone(), bar.index))),
                    addr,
                    bar.size,
                )
                .map_err(|e| PassthroughError::Pci(Box::new(e.into())))?;
        }
        for area in plan {
            let Some(source) = opened.backend.region_mmap(area.bar as u32) else {
                continue;
            };
            let mapped = MappedArea::map(source, area.offset, area.size)?;
            let gpa = addresses
                .iter()
                .find(|(i, _)| *i == area.bar)
                .map_or(0, |(_, a)| *a);
            self.relocation
                .bar_slots
                .add(&self.vm, slot, area.bar, gpa, area.offset, mapped)?;
        }
        self.wire_intx(&opened.backend, &function, slot)?;
        let name = format!("vfio{index}");
        self.counters
            .add(name.clone(), Box::new(move || metrics.snapshot()));
        if let Some(msix) = msix {
            self.counters.add(
                format!("{name}.msix"),
                Box::new(move || msix_counters(&msix)),
            );
        }
        drop(opened.kernel);
        Ok(Attached {
            report: opened.report,
            backend: opened.backend,
            function,
        })
    }
}

impl PciPlatform {
    /// INTx of a device that has it: a KVM irqfd with a resample eventfd on the slot's GSI
    /// (`pci::intx_gsi`, what the DSDT's `_PRT` tells the guest), so the level-triggered
    /// line is raised by VFIO and unmasked at the guest's EOI without the VMM.
    fn wire_intx(
        &self,
        backend: &Arc<dyn VfioBackend>,
        function: &Arc<Mutex<VfioPciDevice>>,
        slot: u8,
    ) -> Result<(), PassthroughError> {
        let mut pin = [0u8];
        let offered = backend
            .irq_info(vfio::IrqIndex::Intx)
            .is_some_and(|i| i.count > 0);
        if !offered || backend.config_read(0x3d, &mut pin).is_err() || !(1..=4).contains(&pin[0]) {
            return Ok(());
        }
        let gsi = tenantvm_devices::pci::intx_gsi(slot, pin[0] - 1);
        let kvm = |what| move |source| PassthroughError::Kvm { what, source };
        let trigger = EventFd::new(EFD_NONBLOCK)
            .map_err(|e| PassthroughError::Msi(MsiRoutingError::Irqfd(e)))?;
        let resample = EventFd::new(EFD_NONBLOCK)
            .map_err(|e| PassthroughError::Msi(MsiRoutingError::Irqfd(e)))?;
        self.vm
            .fd()
            .register_irqfd_with_resample(&trigger, &resample, gsi)
            .map_err(kvm("register an INTx irqfd with resample"))?;
        lock(function)
            .enable_intx(trigger, resample)
            .map_err(|source| PassthroughError::Intx { slot, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEM64: BarKind = BarKind::Memory64 { prefetchable: true };

    #[test]
    fn h100_bars_grow_the_64bit_window_naturally_aligned() {
        let w = plan_windows(16 << 30, 46, &[(MEM64, 128 << 30), (MEM64, 32 << 20)]).unwrap();
        assert_eq!(w.mmio64_base % MMIO64_ALIGN, 0);
        assert!(w.mmio64_size >= MMIO64_DEFAULT_SIZE + (128 << 30));
        // No devices: the default window.
        let plain = plan_windows(16 << 30, 46, &[]).unwrap();
        assert_eq!(plain.mmio64_size, MMIO64_DEFAULT_SIZE);
    }

    #[test]
    fn bars_beyond_the_address_bits_are_refused_with_their_own_status() {
        // 39 bits (512 GiB): four 128 GiB BARs and the default window do not fit.
        let err = plan_windows(16 << 30, 39, &[(MEM64, 128 << 30); 4]).unwrap_err();
        assert_eq!(err.exit_status(), ExitStatus::BarPlacement);
        assert!(err.to_string().contains("physical address bits"), "{err}");
    }

    #[test]
    fn sysfs_and_kernel_errors_map_to_distinct_statuses() {
        let p = PathBuf::from("/sys/bus/pci/devices/0000:00:01.0");
        let cases = [
            (
                PassthroughError::Sysfs(SysfsError::NotADevice(p.clone())),
                ExitStatus::VfioDevicePath,
            ),
            (
                PassthroughError::Sysfs(SysfsError::NotVfioBound {
                    path: p.clone(),
                    driver: "nvidia".into(),
                }),
                ExitStatus::VfioNotBound,
            ),
            (
                PassthroughError::Sysfs(SysfsError::NoIommuGroup(p.clone())),
                ExitStatus::VfioGroup,
            ),
            (
                PassthroughError::Kernel(VfioKernelError::NoVfio("/dev/vfio/vfio".into())),
                ExitStatus::VfioUnavailable,
            ),
            (
                PassthroughError::Kernel(VfioKernelError::DmaMemlock { iova: 0, size: 1 }),
                ExitStatus::VfioDmaMap,
            ),
            (
                PassthroughError::Kernel(VfioKernelError::Iommufd(IommufdError::DmaMemlock {
                    iova: 0,
                    size: 1,
                })),
                ExitStatus::VfioDmaMap,
            ),
            (
                PassthroughError::Kernel(VfioKernelError::Iommufd(IommufdError::Unavailable {
                    device: p.clone(),
                    reason: "no cdev".into(),
                })),
                ExitStatus::VfioUnavailable,
            ),
        ];
        for (err, status) in cases {
            assert_eq!(err.exit_status(), status, "{err}");
        }
    }

    #[test]
    fn guest_phys_bits_stay_within_the_cap() {
        assert!(guest_phys_bits() <= GUEST_MAX_PHYS_BITS);
    }

    /// The VMM's open path judges a device by its VFIO registration: NVIDIA's vGPU VF on
    /// the `nvidia` driver (with its cdev in a FAKE sysfs tree) passes the sysfs check and
    /// reaches the kernel step; the same VF without registration is refused (22), naming
    /// its driver.
    #[test]
    fn a_vgpu_vf_on_nvidias_driver_passes_sysfs_and_reaches_the_kernel() {
        use std::os::unix::fs::symlink;
        let Ok(kvm) = kvm_ioctls::Kvm::new() else {
            tenantvm_skip::skip!("no /dev/kvm here");
        };
        let vm = kvm.create_vm().unwrap();
        let tree = tempfile::tempdir().unwrap();
        let vf = |name: &str, group: u32, cdev: bool| {
            let dev = tree.path().join("devices").join(name);
            std::fs::create_dir_all(&dev).unwrap();
            std::fs::write(dev.join("config"), [0u8; 64]).unwrap();
            let driver = tree.path().join("drivers/nvidia");
            std::fs::create_dir_all(&driver).unwrap();
            symlink(&driver, dev.join("driver")).unwrap();
            let g = tree.path().join("iommu_groups").join(group.to_string());
            std::fs::create_dir_all(g.join("devices")).unwrap();
            symlink(&g, dev.join("iommu_group")).unwrap();
            symlink(&dev, g.join("devices").join(name)).unwrap();
            if cdev {
                std::fs::create_dir_all(dev.join("vfio-dev/vfio5")).unwrap();
            }
            dev
        };
        // An empty device folder: no /dev/vfio/vfio, no /dev/iommu.
        let dev_dir = tree.path().join("dev");
        std::fs::create_dir_all(&dev_dir).unwrap();
        let open = |path: PathBuf| {
            let reports = Arc::new(Mutex::new(Vec::new()));
            let sources = [DeviceSource::Kernel(PassthroughConfig::new(path))];
            match Passthrough::open(&sources, &dev_dir, reports, &vm) {
                Ok(_) => panic!("a FAKE device cannot be opened"),
                Err(e) => e,
            }
        };
        let registered = open(vf("0000:41:00.4", 20, true));
        assert!(
            !matches!(registered, PassthroughError::Sysfs(_)),
            "sysfs refused a VF its driver registered with VFIO: {registered}"
        );
        let unregistered = open(vf("0000:41:00.5", 21, false));
        assert_eq!(unregistered.exit_status(), ExitStatus::VfioNotBound);
        assert!(
            unregistered.to_string().contains("bound to nvidia"),
            "{unregistered}"
        );
    }
}
