//! The kernel backend: a device bound to a VFIO driver, opened through the legacy VFIO
//! container/group interface (`/dev/vfio/vfio`, `/dev/vfio/<group>`:
//! [`KernelVfioDevice::open`]) or through iommufd and the device's cdev (`/dev/iommu`,
//! `/dev/vfio/devices/vfioN`: [`KernelVfioDevice::open_cdev`], pieces in `iommufd.rs`).
//! Once open, both are the same device file and the same [`VfioBackend`]; they differ in
//! how guest RAM is mapped for DMA (the container or the iommufd's IOAS), in what the KVM
//! VFIO pseudo-device is given (the group file or the device file), and in the hot reset's
//! proof of ownership (group fds, or none: the iommufd vouches).
//!
//! The ioctls are issued here rather than through vfio-ioctls' `VfioContainer` and
//! `VfioDevice`, for three things those do not give: the group file descriptors (a hot
//! reset, VFIO_DEVICE_PCI_HOT_RESET, must present the fd of every affected group), checked
//! return codes (vfio-ioctls ignores VFIO_DEVICE_RESET's, and its region read/write only
//! logs failures), and the raw region-info capability chain, which goes through this
//! crate's own bounded parser (`region_caps`). Struct layouts, flags and request numbers
//! come from `vfio-bindings` (`abi.rs`); docs/vmm.md lists each call and why it is ours.

mod container;

use std::ffi::CString;
use std::fs::File;
use std::mem::{offset_of, size_of};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tenantvm_vmm_api::ResetOutcome;
use vmm_sys_util::eventfd::EventFd;

use super::backend::{
    IrqIndex, IrqInfo, MmapSource, RegionInfo, VfioBackend, VfioBackendError, REGION_FLAG_READ,
    REGION_FLAG_WRITE,
};
use super::iommufd::{bind_and_attach, Iommufd, IommufdError};
use super::kvm_files::KvmVfioFiles;
use super::region_caps::{parse_region_caps, RegionCapError, REGION_INFO_SIZE};
use super::sysfs::{inspect, SysfsDevice, SysfsError};
pub use container::{VfioContainer, VfioGroup};

use super::abi::{
    argsz, vfio_device_info, vfio_irq_info, vfio_irq_set, vfio_pci_dependent_device,
    vfio_pci_hot_reset, vfio_pci_hot_reset_info, vfio_region_info, VFIO_CHECK_EXTENSION,
    VFIO_DEVICE_FLAGS_PCI, VFIO_DEVICE_FLAGS_RESET, VFIO_DEVICE_GET_INFO, VFIO_DEVICE_GET_IRQ_INFO,
    VFIO_DEVICE_GET_REGION_INFO, VFIO_GET_API_VERSION, VFIO_GROUP_GET_DEVICE_FD,
    VFIO_GROUP_GET_STATUS, VFIO_GROUP_SET_CONTAINER, VFIO_IOMMU_UNMAP_DMA,
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_IRQ_SET_DATA_NONE, VFIO_PCI_HOT_RESET_FLAG_DEV_ID_OWNED, VFIO_REGION_INFO_FLAG_CAPS,
    VFIO_SET_IOMMU,
};
pub use super::abi::{
    VFIO_DEVICE_GET_PCI_HOT_RESET_INFO, VFIO_DEVICE_PCI_HOT_RESET, VFIO_DEVICE_RESET,
    VFIO_DEVICE_SET_IRQS,
};

/// Every VFIO ioctl request number this backend issues (the VMM's seccomp filter allows
/// exactly these on the device thread and vCPU threads). VFIO_IOMMU_MAP_DMA shares its
/// number with VFIO_DEVICE_PCI_HOT_RESET (they go to different files).
pub const VFIO_IOCTLS: [libc::c_ulong; 14] = [
    VFIO_GET_API_VERSION,
    VFIO_CHECK_EXTENSION,
    VFIO_SET_IOMMU,
    VFIO_GROUP_GET_STATUS,
    VFIO_GROUP_SET_CONTAINER,
    VFIO_GROUP_GET_DEVICE_FD,
    VFIO_DEVICE_GET_INFO,
    VFIO_DEVICE_GET_REGION_INFO,
    VFIO_DEVICE_GET_IRQ_INFO,
    VFIO_DEVICE_SET_IRQS,
    VFIO_DEVICE_RESET,
    VFIO_DEVICE_GET_PCI_HOT_RESET_INFO,
    VFIO_DEVICE_PCI_HOT_RESET,
    VFIO_IOMMU_UNMAP_DMA,
];

/// Largest region info (with capabilities) accepted from the kernel.
const MAX_REGION_INFO: u32 = 64 * 1024;
/// Most devices a hot reset may report as affected.
const MAX_HOT_RESET_DEVICES: u32 = 256;
/// Regions a PCI device has (BARs 0-5, ROM, config, VGA).
const PCI_REGIONS: u32 = 9;

/// Why the kernel backend could not open or drive a device.
#[derive(Debug, thiserror::Error)]
pub enum VfioKernelError {
    /// No VFIO container device.
    #[error("{0} is missing: load vfio-pci (modprobe vfio-pci) and give the VMM /dev/vfio")]
    NoVfio(PathBuf),
    /// sysfs refuses the device.
    #[error(transparent)]
    Sysfs(#[from] SysfsError),
    /// A device file could not be opened.
    #[error("Cannot open {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The kernel speaks another VFIO API version.
    #[error("The kernel's VFIO API version is {0}, this VMM speaks 0")]
    ApiVersion(i32),
    /// The kernel's VFIO offers no type1v2 IOMMU.
    #[error("The kernel's VFIO has no type1v2 IOMMU (is the IOMMU on?)")]
    NoType1,
    /// The kernel says the group is not viable.
    #[error(
        "VFIO group {0} is not viable: every device in it must be registered with VFIO (bound to vfio-pci, or to a vendor driver that registers it), unbound, or a bridge"
    )]
    GroupNotViable(u32),
    /// The device is not a PCI device.
    #[error("{0} is not a VFIO PCI device")]
    NotPci(PathBuf),
    /// A region's capability chain is malformed.
    #[error("Region {index} of the device: {source}")]
    RegionCaps {
        /// Region index.
        index: u32,
        /// What is wrong.
        #[source]
        source: RegionCapError,
    },
    /// Mapping guest memory for DMA failed for lack of lockable memory.
    #[error("Mapping {size:#x} bytes of guest RAM at {iova:#x} for DMA failed: out of locked memory; the VMM needs RLIMIT_MEMLOCK of at least the guest RAM size (ulimit -l, or the jail's memlock limit)")]
    DmaMemlock {
        /// IOVA (= guest physical address).
        iova: u64,
        /// Bytes.
        size: u64,
    },
    /// The iommufd path failed.
    #[error(transparent)]
    Iommufd(#[from] IommufdError),
    /// The VM's KVM VFIO device refused a group file.
    #[error("Adding VFIO group {group} to the VM's KVM VFIO device (KVM_DEV_VFIO_FILE_ADD) failed: {source}")]
    KvmFile {
        /// The group.
        group: u32,
        /// What KVM answered.
        #[source]
        source: std::io::Error,
    },
    /// Another ioctl failed.
    #[error("{op} failed: {source}")]
    Ioctl {
        /// The ioctl.
        op: &'static str,
        /// What the kernel answered.
        #[source]
        source: std::io::Error,
    },
}

fn ioctl_err(op: &'static str) -> VfioKernelError {
    VfioKernelError::Ioctl {
        op,
        source: std::io::Error::last_os_error(),
    }
}

#[derive(Debug)]
struct Region {
    info: RegionInfo,
    offset: u64,
}

/// How a device was opened, and what keeps its DMA address space alive.
#[derive(Debug)]
enum Access {
    /// Through its group, attached to the VM's container.
    Group {
        group: Arc<VfioGroup>,
        _container: Arc<VfioContainer>,
    },
    /// Through its cdev, bound to the VM's iommufd and attached to its IOAS.
    Cdev {
        _iommufd: Arc<Iommufd>,
        /// The iommufd's id for the device (`out_devid` of the bind).
        devid: u32,
    },
}

/// A device bound to a VFIO driver, opened through its group or its cdev.
#[derive(Debug)]
pub struct KernelVfioDevice {
    file: File,
    access: Access,
    flags: u32,
    regions: Vec<Option<Region>>,
    irqs: [Option<IrqInfo>; 3],
    sysfs: SysfsDevice,
}

/// The `u32` of `struct vfio_region_info` at `field` (an `offset_of!`) in `buf`.
fn region_u32(buf: &[u8], field: usize) -> u32 {
    u32::from_ne_bytes(buf[field..field + 4].try_into().unwrap_or_default())
}

/// The `u64` of `struct vfio_region_info` at `field` in `buf`.
fn region_u64(buf: &[u8], field: usize) -> u64 {
    u64::from_ne_bytes(buf[field..field + 8].try_into().unwrap_or_default())
}

fn region_info(file: &File, index: u32) -> Result<Option<Region>, VfioKernelError> {
    // The fixed struct, then room for the capability chain the kernel appends: a byte
    // buffer, read through the struct's field offsets.
    let mut buf = vec![0u8; REGION_INFO_SIZE];
    let mut argsz = const { crate::narrow::const_u32(REGION_INFO_SIZE as u64) };
    let at_argsz = offset_of!(vfio_region_info, argsz);
    let at_index = offset_of!(vfio_region_info, index);
    for _ in 0..2 {
        buf.resize(argsz as usize, 0);
        buf[at_argsz..at_argsz + 4].copy_from_slice(&argsz.to_ne_bytes());
        buf[at_index..at_index + 4].copy_from_slice(&index.to_ne_bytes());
        // SAFETY: `buf` is at least `argsz` bytes, a vfio_region_info followed by room
        // for its capabilities; the kernel writes at most `argsz` bytes.
        if unsafe {
            libc::ioctl(
                file.as_raw_fd(),
                VFIO_DEVICE_GET_REGION_INFO,
                buf.as_mut_ptr(),
            )
        } < 0
        {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) {
                return Ok(None);
            }
            return Err(VfioKernelError::Ioctl {
                op: "VFIO_DEVICE_GET_REGION_INFO",
                source: e,
            });
        }
        let needed = region_u32(&buf, at_argsz);
        if needed <= argsz || needed > MAX_REGION_INFO {
            break;
        }
        argsz = needed;
    }
    let flags = region_u32(&buf, offset_of!(vfio_region_info, flags));
    let caps = if flags & VFIO_REGION_INFO_FLAG_CAPS != 0 {
        parse_region_caps(
            &buf,
            region_u32(&buf, offset_of!(vfio_region_info, cap_offset)),
        )
        .map_err(|source| VfioKernelError::RegionCaps { index, source })?
    } else {
        Vec::new()
    };
    Ok(Some(Region {
        info: RegionInfo {
            size: region_u64(&buf, offset_of!(vfio_region_info, size)),
            flags,
            caps,
        },
        offset: region_u64(&buf, offset_of!(vfio_region_info, offset)),
    }))
}

fn irq_info(file: &File, index: IrqIndex) -> Result<Option<IrqInfo>, VfioKernelError> {
    let mut info = vfio_irq_info {
        argsz: argsz::<vfio_irq_info>(),
        index: index.vfio_index(),
        ..Default::default()
    };
    // SAFETY: `info` is a struct vfio_irq_info the kernel fills.
    if unsafe { libc::ioctl(file.as_raw_fd(), VFIO_DEVICE_GET_IRQ_INFO, &mut info) } < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINVAL) {
            return Ok(None);
        }
        return Err(VfioKernelError::Ioctl {
            op: "VFIO_DEVICE_GET_IRQ_INFO",
            source: e,
        });
    }
    Ok((info.count > 0).then_some(IrqInfo {
        count: info.count,
        flags: info.flags,
    }))
}

impl KernelVfioDevice {
    /// Opens the device at sysfs `path` (checked with [`inspect`]) through its group in
    /// `container`, and reads its regions and interrupts. The group file goes to `kvm`
    /// (the VM's KVM VFIO device, once per group) before the device is opened, so the
    /// device's driver sees the VM when it opens ([`KvmVfioFiles`]).
    pub fn open(
        container: Arc<VfioContainer>,
        path: &Path,
        kvm: Option<&dyn KvmVfioFiles>,
    ) -> Result<Self, VfioKernelError> {
        let sysfs = inspect(path, &container.dev_dir)?;
        let group = container.group(sysfs.group)?;
        if let Some(kvm) = kvm {
            if !group.kvm_added.swap(true, Ordering::SeqCst) {
                kvm.add(group.fd())
                    .map_err(|source| VfioKernelError::KvmFile {
                        group: group.id(),
                        source,
                    })?;
            }
        }
        let name = CString::new(sysfs.name.as_bytes())
            .map_err(|_| VfioKernelError::NotPci(path.to_path_buf()))?;
        // SAFETY: `name` is a valid C string the kernel only reads.
        let fd = unsafe {
            libc::ioctl(
                group.file.as_raw_fd(),
                VFIO_GROUP_GET_DEVICE_FD,
                name.as_ptr(),
            )
        };
        if fd < 0 {
            return Err(ioctl_err("VFIO_GROUP_GET_DEVICE_FD"));
        }
        // SAFETY: the kernel returned a new descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let access = Access::Group {
            group,
            _container: container,
        };
        Self::with_file(file, access, path, sysfs)
    }

    /// Opens the device at sysfs `path` (checked with [`inspect`]) through its cdev
    /// `cdev` (`/dev/vfio/devices/vfioN`), hands the cdev file to `kvm` (the VM's KVM VFIO
    /// device), binds it to `iommufd` and attaches it to the iommufd's IOAS, and reads its
    /// regions and interrupts.
    pub fn open_cdev(
        iommufd: Arc<Iommufd>,
        cdev: &Path,
        path: &Path,
        kvm: Option<&dyn KvmVfioFiles>,
    ) -> Result<Self, VfioKernelError> {
        // `/dev/vfio/devices/vfioN`: the VFIO nodes' folder is two up.
        let vfio_dir = cdev
            .parent()
            .and_then(Path::parent)
            .unwrap_or(Path::new("/dev/vfio"));
        let sysfs = inspect(path, vfio_dir)?;
        let (file, devid) = bind_and_attach(cdev, &iommufd, kvm)?;
        let access = Access::Cdev {
            _iommufd: iommufd,
            devid,
        };
        Self::with_file(file, access, path, sysfs)
    }

    fn with_file(
        file: File,
        access: Access,
        path: &Path,
        sysfs: SysfsDevice,
    ) -> Result<Self, VfioKernelError> {
        let fd = file.as_raw_fd();
        let mut info = vfio_device_info {
            argsz: argsz::<vfio_device_info>(),
            ..Default::default()
        };
        // SAFETY: `info` is a struct vfio_device_info the kernel fills.
        if unsafe { libc::ioctl(fd, VFIO_DEVICE_GET_INFO, &mut info) } < 0 {
            return Err(ioctl_err("VFIO_DEVICE_GET_INFO"));
        }
        let flags = info.flags;
        if flags & VFIO_DEVICE_FLAGS_PCI == 0 {
            return Err(VfioKernelError::NotPci(path.to_path_buf()));
        }
        let regions = (0..info.num_regions.min(PCI_REGIONS))
            .map(|i| region_info(&file, i))
            .collect::<Result<Vec<_>, _>>()?;
        let irqs = [
            irq_info(&file, IrqIndex::Intx)?,
            irq_info(&file, IrqIndex::Msi)?,
            irq_info(&file, IrqIndex::Msix)?,
        ];
        Ok(Self {
            file,
            access,
            flags,
            regions,
            irqs,
            sysfs,
        })
    }

    /// The device's group, when it was opened through it (not through its cdev).
    pub fn group(&self) -> Option<&Arc<VfioGroup>> {
        match &self.access {
            Access::Group { group, .. } => Some(group),
            Access::Cdev { .. } => None,
        }
    }

    /// The iommufd's id for the device, when it was opened through its cdev.
    pub fn iommufd_devid(&self) -> Option<u32> {
        match &self.access {
            Access::Cdev { devid, .. } => Some(*devid),
            Access::Group { .. } => None,
        }
    }

    /// The file the KVM VFIO pseudo-device is given for this device
    /// (`KVM_DEV_VFIO_FILE_ADD`): the group file, or the device's cdev file.
    pub fn kvm_file(&self) -> BorrowedFd<'_> {
        match &self.access {
            Access::Group { group, .. } => group.fd(),
            Access::Cdev { .. } => self.file.as_fd(),
        }
    }

    /// What sysfs said about the device.
    pub fn sysfs(&self) -> &SysfsDevice {
        &self.sysfs
    }

    fn region(&self, index: u32) -> Result<&Region, VfioBackendError> {
        self.regions
            .get(index as usize)
            .and_then(Option::as_ref)
            .ok_or(VfioBackendError::NoRegion(index))
    }

    fn checked(
        &self,
        index: u32,
        offset: u64,
        len: usize,
        flag: u32,
    ) -> Result<u64, VfioBackendError> {
        let region = self.region(index)?;
        let end = offset.checked_add(len as u64);
        if region.info.flags & flag == 0 || end.is_none_or(|e| e > region.info.size) {
            return Err(VfioBackendError::Access { index, offset, len });
        }
        Ok(region.offset + offset)
    }

    fn set_irqs(
        &self,
        index: IrqIndex,
        flags: u32,
        fds: &[i32],
        count: u32,
    ) -> std::io::Result<()> {
        // struct vfio_irq_set, then its data: the eventfds.
        let data_size = u32::try_from(size_of_val(fds))
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        let head = vfio_irq_set {
            argsz: argsz::<vfio_irq_set>() + data_size,
            flags,
            index: index.vfio_index(),
            start: 0,
            count,
            ..Default::default()
        };
        let mut buf = Vec::with_capacity(head.argsz as usize);
        for v in [head.argsz, head.flags, head.index, head.start, head.count] {
            buf.extend_from_slice(&v.to_ne_bytes());
        }
        for fd in fds {
            buf.extend_from_slice(&fd.to_ne_bytes());
        }
        debug_assert_eq!(buf.len(), head.argsz as usize);
        // SAFETY: `buf` is a complete vfio_irq_set of `argsz` bytes the kernel only reads.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), VFIO_DEVICE_SET_IRQS, buf.as_ptr()) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// A secondary bus reset of the device's slot or bus: allowed only when every device
    /// it affects is this VM's. Through a group, that is every affected device in this
    /// device's group (the only group fd the VMM can present); through the cdev, the
    /// kernel says so itself (`VFIO_PCI_HOT_RESET_FLAG_DEV_ID_OWNED`: each affected device
    /// is bound to this device's iommufd or shares an IOMMU group with one that is), and
    /// the reset is asked for with no group fds.
    fn hot_reset(&self) -> Result<(), String> {
        let fd = self.file.as_raw_fd();
        let mut head = vfio_pci_hot_reset_info {
            argsz: argsz::<vfio_pci_hot_reset_info>(),
            ..Default::default()
        };
        // SAFETY: `head` is a vfio_pci_hot_reset_info with no room for entries; the kernel
        // writes `count` and fails with ENOSPC.
        let ret = unsafe { libc::ioctl(fd, VFIO_DEVICE_GET_PCI_HOT_RESET_INFO, &mut head) };
        let e = std::io::Error::last_os_error();
        if ret < 0 && e.raw_os_error() != Some(libc::ENOSPC) {
            return Err(format!("no bus reset possible: {e}"));
        }
        let count = head.count.min(MAX_HOT_RESET_DEVICES);
        // The header, then `count` struct vfio_pci_dependent_device entries, as u32 words
        // (both are made of 4-byte-aligned words).
        let head_words = size_of::<vfio_pci_hot_reset_info>() / 4;
        let entry_words = size_of::<vfio_pci_dependent_device>() / 4;
        let mut info = vec![0u32; head_words + entry_words * count as usize];
        // At most MAX_HOT_RESET_DEVICES entries: far below 4 GiB.
        info[0] = u32::try_from(info.len() * 4)
            .map_err(|_| format!("{count} dependent devices do not fit an argsz"))?;
        // SAFETY: `info` holds the header and `count` entries, `argsz` bytes in all.
        if unsafe { libc::ioctl(fd, VFIO_DEVICE_GET_PCI_HOT_RESET_INFO, info.as_mut_ptr()) } < 0 {
            return Err(format!(
                "VFIO_DEVICE_GET_PCI_HOT_RESET_INFO: {}",
                std::io::Error::last_os_error()
            ));
        }
        let info_flags = info[offset_of!(vfio_pci_hot_reset_info, flags) / 4];
        let info_count = info[offset_of!(vfio_pci_hot_reset_info, count) / 4];
        let reset: Vec<u32> = match &self.access {
            Access::Group { group, .. } => {
                let affected = info_count.min(count) as usize;
                // Each entry starts with its group id (the union's `group_id`).
                if let Some(other) = (0..affected)
                    .map(|i| info[head_words + entry_words * i])
                    .find(|&g| g != group.id())
                {
                    return Err(format!(
                        "a bus reset would also reset IOMMU group {other}, which this VM does \
                         not own"
                    ));
                }
                // struct vfio_pci_hot_reset, then its one group fd.
                vec![
                    argsz::<vfio_pci_hot_reset>() + 4,
                    0,
                    1,
                    group.file.as_raw_fd() as u32,
                ]
            }
            Access::Cdev { .. } => {
                if !hot_reset_owned(info_flags) {
                    return Err("a bus reset would also reset a device this VM's iommufd \
                                does not own"
                        .into());
                }
                // struct vfio_pci_hot_reset with an empty group fd array.
                vec![argsz::<vfio_pci_hot_reset>(), 0, 0]
            }
        };
        // SAFETY: `reset` is a complete vfio_pci_hot_reset (argsz covers it) the kernel
        // only reads.
        if unsafe { libc::ioctl(fd, VFIO_DEVICE_PCI_HOT_RESET, reset.as_ptr()) } < 0 {
            return Err(format!(
                "VFIO_DEVICE_PCI_HOT_RESET: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(())
    }
}

/// Whether a cdev-opened device's hot reset info `flags` say every affected device is
/// owned through its iommufd.
fn hot_reset_owned(flags: u32) -> bool {
    flags & VFIO_PCI_HOT_RESET_FLAG_DEV_ID_OWNED != 0
}

impl VfioBackend for KernelVfioDevice {
    fn region_info(&self, index: u32) -> Option<RegionInfo> {
        self.region(index).ok().map(|r| r.info.clone())
    }

    fn region_read(
        &self,
        index: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), VfioBackendError> {
        let at = self.checked(index, offset, data.len(), REGION_FLAG_READ)?;
        self.file
            .read_exact_at(data, at)
            .map_err(|source| VfioBackendError::Os {
                op: "VFIO region read",
                source,
            })
    }

    fn region_write(&self, index: u32, offset: u64, data: &[u8]) -> Result<(), VfioBackendError> {
        let at = self.checked(index, offset, data.len(), REGION_FLAG_WRITE)?;
        self.file
            .write_all_at(data, at)
            .map_err(|source| VfioBackendError::Os {
                op: "VFIO region write",
                source,
            })
    }

    fn region_mmap(&self, index: u32) -> Option<MmapSource<'_>> {
        let region = self.region(index).ok()?;
        region.info.mmappable().then(|| MmapSource {
            fd: self.file.as_fd(),
            offset: region.offset,
        })
    }

    fn irq_info(&self, index: IrqIndex) -> Option<IrqInfo> {
        self.irqs[index.vfio_index() as usize]
    }

    fn irq_enable(&self, index: IrqIndex, fds: &[&EventFd]) -> Result<(), VfioBackendError> {
        let offered = self.irq_info(index).map_or(0, |i| i.count);
        let count = match u32::try_from(fds.len()) {
            Ok(count) if count > 0 && count <= offered => count,
            _ => {
                return Err(VfioBackendError::Irq {
                    index,
                    asked: fds.len(),
                    offered,
                })
            }
        };
        let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
        self.set_irqs(
            index,
            VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
            &raw,
            count,
        )
        .map_err(|source| VfioBackendError::Os {
            op: "VFIO_DEVICE_SET_IRQS (enable)",
            source,
        })
    }

    fn irq_disable(&self, index: IrqIndex) -> Result<(), VfioBackendError> {
        self.set_irqs(
            index,
            VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
            &[],
            0,
        )
        .map_err(|source| VfioBackendError::Os {
            op: "VFIO_DEVICE_SET_IRQS (disable)",
            source,
        })
    }

    fn irq_unmask(&self, index: IrqIndex) -> Result<(), VfioBackendError> {
        self.set_irqs(
            index,
            VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_UNMASK,
            &[],
            1,
        )
        .map_err(|source| VfioBackendError::Os {
            op: "VFIO_DEVICE_SET_IRQS (unmask)",
            source,
        })
    }

    fn irq_unmask_on(&self, index: IrqIndex, fd: &EventFd) -> Result<(), VfioBackendError> {
        self.set_irqs(
            index,
            VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_UNMASK,
            &[fd.as_raw_fd()],
            1,
        )
        .map_err(|source| VfioBackendError::Os {
            op: "VFIO_DEVICE_SET_IRQS (unmask eventfd)",
            source,
        })
    }

    fn reset(&self) -> ResetOutcome {
        let mut errors = Vec::new();
        if self.flags & VFIO_DEVICE_FLAGS_RESET != 0 {
            // SAFETY: VFIO_DEVICE_RESET takes no argument.
            if unsafe { libc::ioctl(self.file.as_raw_fd(), VFIO_DEVICE_RESET) } == 0 {
                return ResetOutcome::Reset {
                    method: self.sysfs.reset_methods.first().cloned(),
                };
            }
            errors.push(format!(
                "VFIO_DEVICE_RESET: {}",
                std::io::Error::last_os_error()
            ));
        }
        match self.hot_reset() {
            Ok(()) => ResetOutcome::HotReset,
            Err(e) if errors.is_empty() && e.starts_with("no bus reset possible") => {
                ResetOutcome::Unsupported
            }
            Err(e) => {
                errors.push(e);
                ResetOutcome::Failed {
                    error: errors.join("; "),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_dev_vfio_names_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let err = VfioContainer::open(dir.path()).unwrap_err();
        assert!(matches!(err, VfioKernelError::NoVfio(_)));
        assert!(err.to_string().contains("modprobe vfio-pci"), "{err}");
    }

    #[test]
    fn cdev_hot_reset_needs_the_kernels_ownership_flag() {
        // VFIO_PCI_HOT_RESET_FLAG_DEV_ID alone (devids reported, one not owned): refused.
        assert!(!hot_reset_owned(1));
        assert!(hot_reset_owned(0b11));
    }

    #[test]
    fn dma_memlock_error_names_rlimit_memlock() {
        let err = VfioKernelError::DmaMemlock {
            iova: 0,
            size: 1 << 30,
        };
        assert!(err.to_string().contains("RLIMIT_MEMLOCK"));
    }
}
