//! VFIO passthrough of a PCI function (a whole GPU, an SR-IOV virtual function, any PCI
//! device bound to a VFIO driver).
//!
//! One concern per file:
//! - `abi`: the VFIO ABI from `vfio-bindings` (layouts, flags, request numbers);
//! - `backend`: the [`VfioBackend`] trait between this logic and a device;
//! - `model`: a software model GPU behind that trait, for tests (a fake, named so);
//! - `capability`: walking a device's PCI capability lists (loop-guarded);
//! - `region_caps`: parsing VFIO region capability chains (sparse mmap areas);
//! - `areas`: which parts of a BAR are mmapped and which stay trapped;
//! - `mapping`: one aligned mmap of a BAR area;
//! - `shadow`: the configuration space the guest sees;
//! - `gpudirect`: NVIDIA's GPUDirect clique capability (emulated, optional);
//! - `device`: the [`VfioPciDevice`] on the PCI root;
//! - `sysfs`: what sysfs says (VFIO registration, driver, IOMMU group, group viability);
//! - `kernel`: the kernel backend (a device opened through the VFIO container/group
//!   interface or through iommufd and its cdev);
//! - `kvm_files`: handing group and cdev files to the VM's KVM VFIO device before opening;
//! - `iommufd`: the iommufd/cdev interface: which interface opens a device (the
//!   `iommu=auto|legacy|iommufd` option and what the kernel offers), the IOAS, bind and
//!   attach.
//!
//! The device is hostile input too: everything read from it (capability chains, region
//! capabilities, sparse areas, BAR sizes) is checked before use.

mod abi;
mod areas;
mod backend;
mod capability;
mod device;
mod gpudirect;
mod iommufd;
mod kernel;
mod kvm_files;
mod mapping;
pub mod model;
mod region_caps;
mod shadow;
mod sysfs;

pub use areas::{mmap_areas, AreaError, PAGE_SIZE};
pub use backend::{
    region_index, IrqIndex, IrqInfo, MmapSource, RegionInfo, VfioBackend, VfioBackendError,
    REGION_FLAG_MMAP, REGION_FLAG_READ, REGION_FLAG_WRITE,
};
pub use capability::{ext_id, walk_caps, walk_ext_caps, ExtCap, PciCap, EXT_CAP_START};
pub use device::{irq_vectors, PlannedArea, VfioDeviceError, VfioMetrics, VfioPciDevice};
pub use gpudirect::{
    GpuDirectCap, GpuDirectError, GPUDIRECT_CAP_OFFSET, MAX_CLIQUE, NVIDIA_VENDOR_ID,
};
pub use iommufd::{
    bind_and_attach, cdev_name, choose_interface, select_interface, Iommufd, IommufdError,
    VfioInterface, VfioIommuMode, IOMMUFD_IOCTLS,
};
pub use kernel::{
    KernelVfioDevice, VfioContainer, VfioGroup, VfioKernelError,
    VFIO_DEVICE_GET_PCI_HOT_RESET_INFO, VFIO_DEVICE_PCI_HOT_RESET, VFIO_DEVICE_RESET,
    VFIO_DEVICE_SET_IRQS, VFIO_IOCTLS,
};
pub use kvm_files::KvmVfioFiles;
pub use mapping::{MappedArea, MappingError};
pub use region_caps::{
    encode_region_caps, parse_region_caps, RegionCap, RegionCapError, SparseArea, REGION_INFO_SIZE,
};
pub use shadow::{
    probe, ConfigShadow, DeviceProbe, HiddenCap, IrqChange, MsixLayout, ProbedBar, ShadowError,
    ShadowWrite,
};
pub use sysfs::{inspect, SysfsDevice, SysfsError, VfioRegistration};
