//! The legacy VFIO container and its groups (`/dev/vfio/vfio`, `/dev/vfio/<group>`): one
//! IOMMU address space per VM into which guest RAM is mapped for DMA, and the group files
//! a hot reset must present.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, PoisonError};

use super::{ioctl_err, VfioKernelError};
use crate::pci::vfio::abi::{
    argsz, vfio_group_status, vfio_iommu_type1_dma_map, vfio_iommu_type1_dma_unmap,
    VFIO_TYPE1v2_IOMMU, VFIO_API_VERSION, VFIO_CHECK_EXTENSION, VFIO_DMA_MAP_FLAG_READ,
    VFIO_DMA_MAP_FLAG_WRITE, VFIO_GET_API_VERSION, VFIO_GROUP_FLAGS_VIABLE, VFIO_GROUP_GET_STATUS,
    VFIO_GROUP_SET_CONTAINER, VFIO_IOMMU_MAP_DMA, VFIO_IOMMU_UNMAP_DMA, VFIO_SET_IOMMU,
};

/// A VFIO group file, kept open while a device of it is in use.
#[derive(Debug)]
pub struct VfioGroup {
    id: u32,
    pub(super) file: File,
    /// Whether the file went to the VM's KVM VFIO device (once per group).
    pub(super) kvm_added: AtomicBool,
}

impl VfioGroup {
    /// The group number.
    pub fn id(&self) -> u32 {
        self.id
    }
    /// The group file (for the KVM VFIO pseudo-device).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

/// A VFIO container: one IOMMU address space shared by every device of the VM, into which
/// all guest RAM is mapped (IOVA = guest physical address).
#[derive(Debug)]
pub struct VfioContainer {
    file: File,
    pub(super) dev_dir: PathBuf,
    groups: Mutex<HashMap<u32, Arc<VfioGroup>>>,
}

/// Opens `path` for reading and writing.
fn open_rw(path: &Path) -> Result<File, VfioKernelError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| VfioKernelError::Open {
            path: path.to_path_buf(),
            source,
        })
}

impl VfioContainer {
    /// Opens `<dev_dir>/vfio` (normally `/dev/vfio/vfio`) and checks the API.
    pub fn open(dev_dir: &Path) -> Result<Arc<Self>, VfioKernelError> {
        let path = dev_dir.join("vfio");
        if !path.exists() {
            return Err(VfioKernelError::NoVfio(path));
        }
        let file = open_rw(&path)?;
        // SAFETY: VFIO_GET_API_VERSION takes no argument and touches no memory.
        let version = unsafe { libc::ioctl(file.as_raw_fd(), VFIO_GET_API_VERSION) };
        if i64::from(version) != i64::from(VFIO_API_VERSION) {
            return Err(VfioKernelError::ApiVersion(version));
        }
        // SAFETY: VFIO_CHECK_EXTENSION takes an integer argument and touches no memory.
        let type1 = unsafe {
            libc::ioctl(
                file.as_raw_fd(),
                VFIO_CHECK_EXTENSION,
                libc::c_ulong::from(VFIO_TYPE1v2_IOMMU),
            )
        };
        if type1 != 1 {
            return Err(VfioKernelError::NoType1);
        }
        Ok(Arc::new(Self {
            file,
            dev_dir: dev_dir.to_path_buf(),
            groups: Mutex::default(),
        }))
    }

    /// The groups attached so far.
    pub fn groups(&self) -> Vec<Arc<VfioGroup>> {
        self.groups
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// Group `id`, opened, checked viable and attached to this container on first use
    /// (the first group also sets the IOMMU type).
    pub(super) fn group(&self, id: u32) -> Result<Arc<VfioGroup>, VfioKernelError> {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(g) = groups.get(&id) {
            return Ok(g.clone());
        }
        let file = open_rw(&self.dev_dir.join(id.to_string()))?;
        let mut status = vfio_group_status {
            argsz: argsz::<vfio_group_status>(),
            flags: 0,
        };
        // SAFETY: `status` is a `struct vfio_group_status` the kernel fills.
        if unsafe { libc::ioctl(file.as_raw_fd(), VFIO_GROUP_GET_STATUS, &mut status) } < 0 {
            return Err(ioctl_err("VFIO_GROUP_GET_STATUS"));
        }
        if status.flags & VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(VfioKernelError::GroupNotViable(id));
        }
        let container = self.file.as_raw_fd();
        // SAFETY: the argument points at a live int holding the container fd.
        if unsafe { libc::ioctl(file.as_raw_fd(), VFIO_GROUP_SET_CONTAINER, &container) } < 0 {
            return Err(ioctl_err("VFIO_GROUP_SET_CONTAINER"));
        }
        if groups.is_empty() {
            // SAFETY: VFIO_SET_IOMMU takes an integer argument and touches no memory.
            let iommu = libc::c_ulong::from(VFIO_TYPE1v2_IOMMU);
            // SAFETY: as above.
            if unsafe { libc::ioctl(container, VFIO_SET_IOMMU, iommu) } < 0 {
                return Err(ioctl_err("VFIO_SET_IOMMU"));
            }
        }
        let group = Arc::new(VfioGroup {
            id,
            file,
            kvm_added: AtomicBool::new(false),
        });
        groups.insert(id, group.clone());
        Ok(group)
    }

    /// Maps `size` bytes at host address `host_addr` for device DMA at `iova`.
    ///
    /// # Safety
    ///
    /// `[host_addr, host_addr + size)` must stay mapped until [`Self::unmap_dma`] (or the
    /// container closes), and while it is mapped no Rust reference to that memory may
    /// exist: devices read and write it at any time. Guest memory accessed only through
    /// vm-memory's volatile accessors satisfies this.
    pub unsafe fn map_dma(
        &self,
        iova: u64,
        size: u64,
        host_addr: u64,
    ) -> Result<(), VfioKernelError> {
        let map = vfio_iommu_type1_dma_map {
            argsz: argsz::<vfio_iommu_type1_dma_map>(),
            flags: VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
            vaddr: host_addr,
            iova,
            size,
        };
        // SAFETY: `map` is a valid vfio_iommu_type1_dma_map the kernel only reads; the
        // caller guarantees the mapped range's lifetime and aliasing rules.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), VFIO_IOMMU_MAP_DMA, &map) } < 0 {
            let source = std::io::Error::last_os_error();
            if source.raw_os_error() == Some(libc::ENOMEM) {
                return Err(VfioKernelError::DmaMemlock { iova, size });
            }
            return Err(VfioKernelError::Ioctl {
                op: "VFIO_IOMMU_MAP_DMA",
                source,
            });
        }
        Ok(())
    }

    /// Removes the DMA mapping at `iova`.
    pub fn unmap_dma(&self, iova: u64, size: u64) -> Result<(), VfioKernelError> {
        let mut unmap = vfio_iommu_type1_dma_unmap {
            argsz: argsz::<vfio_iommu_type1_dma_unmap>(),
            iova,
            size,
            ..Default::default()
        };
        // SAFETY: `unmap` is a valid vfio_iommu_type1_dma_unmap without flags (no bitmap
        // follows it); the kernel may write `size` back, within the struct.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), VFIO_IOMMU_UNMAP_DMA, &mut unmap) } < 0 {
            return Err(ioctl_err("VFIO_IOMMU_UNMAP_DMA"));
        }
        Ok(())
    }
}
