//! The VFIO ABI this crate speaks, taken from the rust-vmm `vfio-bindings` crate (generated
//! by bindgen from `<linux/vfio.h>`): every struct layout and flag the kernel backend
//! (`kernel.rs`), the iommufd path (`iommufd.rs`) and the region-capability parser
//! (`region_caps.rs`) use. bindgen cannot turn the header's `_IO(VFIO_TYPE, VFIO_BASE + n)`
//! macros into constants, so the request numbers are built here, once, from the header's
//! own `VFIO_TYPE` and `VFIO_BASE` with vmm-sys-util's `_IO` encoding (the same way the
//! `vfio-ioctls` crate builds its private ones).
//!
//! What is not VFIO stays out: iommufd's own ioctls (`IOMMU_IOAS_*`, `<linux/iommufd.h>`)
//! are in `iommufd.rs`.

use std::mem::{offset_of, size_of};

use vmm_sys_util::ioctl::{ioctl_expr, _IOC_NONE};

pub use vfio_bindings::bindings::vfio::{
    vfio_device_attach_iommufd_pt, vfio_device_bind_iommufd, vfio_device_info, vfio_group_status,
    vfio_info_cap_header, vfio_iommu_type1_dma_map, vfio_iommu_type1_dma_unmap, vfio_irq_info,
    vfio_irq_set, vfio_pci_dependent_device, vfio_pci_hot_reset, vfio_pci_hot_reset_info,
    vfio_region_info, vfio_region_info_cap_sparse_mmap, vfio_region_info_cap_type,
    vfio_region_sparse_mmap_area, VFIO_TYPE1v2_IOMMU, VFIO_API_VERSION, VFIO_DEVICE_FLAGS_PCI,
    VFIO_DEVICE_FLAGS_RESET, VFIO_DMA_MAP_FLAG_READ, VFIO_DMA_MAP_FLAG_WRITE,
    VFIO_GROUP_FLAGS_VIABLE, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK,
    VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE, VFIO_PCI_HOT_RESET_FLAG_DEV_ID_OWNED,
    VFIO_REGION_INFO_CAP_MSIX_MAPPABLE, VFIO_REGION_INFO_CAP_SPARSE_MMAP,
    VFIO_REGION_INFO_CAP_TYPE, VFIO_REGION_INFO_FLAG_CAPS, VFIO_REGION_INFO_FLAG_MMAP,
    VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_bindings::bindings::vfio::{VFIO_BASE, VFIO_TYPE};

/// `_IO(VFIO_TYPE, VFIO_BASE + nr)`: VFIO's ioctls carry no size in their number.
const fn vfio_io(nr: u32) -> libc::c_ulong {
    ioctl_expr(_IOC_NONE, VFIO_TYPE as u32, VFIO_BASE + nr, 0)
}

/// `VFIO_GET_API_VERSION`.
pub const VFIO_GET_API_VERSION: libc::c_ulong = vfio_io(0);
/// `VFIO_CHECK_EXTENSION`.
pub const VFIO_CHECK_EXTENSION: libc::c_ulong = vfio_io(1);
/// `VFIO_SET_IOMMU`.
pub const VFIO_SET_IOMMU: libc::c_ulong = vfio_io(2);
/// `VFIO_GROUP_GET_STATUS`.
pub const VFIO_GROUP_GET_STATUS: libc::c_ulong = vfio_io(3);
/// `VFIO_GROUP_SET_CONTAINER`.
pub const VFIO_GROUP_SET_CONTAINER: libc::c_ulong = vfio_io(4);
/// `VFIO_GROUP_GET_DEVICE_FD`.
pub const VFIO_GROUP_GET_DEVICE_FD: libc::c_ulong = vfio_io(6);
/// `VFIO_DEVICE_GET_INFO`.
pub const VFIO_DEVICE_GET_INFO: libc::c_ulong = vfio_io(7);
/// `VFIO_DEVICE_GET_REGION_INFO`.
pub const VFIO_DEVICE_GET_REGION_INFO: libc::c_ulong = vfio_io(8);
/// `VFIO_DEVICE_GET_IRQ_INFO`.
pub const VFIO_DEVICE_GET_IRQ_INFO: libc::c_ulong = vfio_io(9);
/// `VFIO_DEVICE_SET_IRQS` (the VMM's seccomp filters name it).
pub const VFIO_DEVICE_SET_IRQS: libc::c_ulong = vfio_io(10);
/// `VFIO_DEVICE_RESET` (the VMM's seccomp filters name it).
pub const VFIO_DEVICE_RESET: libc::c_ulong = vfio_io(11);
/// `VFIO_DEVICE_GET_PCI_HOT_RESET_INFO` (the VMM's seccomp filters name it).
pub const VFIO_DEVICE_GET_PCI_HOT_RESET_INFO: libc::c_ulong = vfio_io(12);
/// `VFIO_DEVICE_PCI_HOT_RESET` (the VMM's seccomp filters name it).
pub const VFIO_DEVICE_PCI_HOT_RESET: libc::c_ulong = vfio_io(13);
/// `VFIO_DEVICE_BIND_IOMMUFD`.
pub const VFIO_DEVICE_BIND_IOMMUFD: libc::c_ulong = vfio_io(18);
/// `VFIO_DEVICE_ATTACH_IOMMUFD_PT`.
pub const VFIO_DEVICE_ATTACH_IOMMUFD_PT: libc::c_ulong = vfio_io(19);
/// `VFIO_IOMMU_MAP_DMA` (the same number as `VFIO_DEVICE_PCI_HOT_RESET`: they go to
/// different files).
pub const VFIO_IOMMU_MAP_DMA: libc::c_ulong = vfio_io(13);
/// `VFIO_IOMMU_UNMAP_DMA`.
pub const VFIO_IOMMU_UNMAP_DMA: libc::c_ulong = vfio_io(14);

/// `sizeof(T)` as the `argsz` of a VFIO argument.
pub const fn argsz<T>() -> u32 {
    crate::narrow::const_u32(size_of::<T>() as u64)
}

/// The `argsz` of `struct vfio_device_bind_iommufd` this crate sends: up to `out_devid`,
/// the form every cdev kernel accepts (6.17 added an optional token pointer after it, read
/// only with `VFIO_DEVICE_BIND_FLAG_TOKEN`).
pub const BIND_IOMMUFD_ARGSZ: u32 = crate::narrow::const_u32(
    (offset_of!(vfio_device_bind_iommufd, out_devid) + size_of::<u32>()) as u64,
);
/// The `argsz` of `struct vfio_device_attach_iommufd_pt` this crate sends: up to `pt_id`
/// (the `pasid` after it is read only with `VFIO_DEVICE_ATTACH_PASID`).
pub const ATTACH_IOMMUFD_PT_ARGSZ: u32 = crate::narrow::const_u32(
    (offset_of!(vfio_device_attach_iommufd_pt, pt_id) + size_of::<u32>()) as u64,
);

#[cfg(test)]
mod tests {
    use super::*;

    /// The request numbers and sizes as `<linux/vfio.h>` defines them on x86-64, written
    /// out by hand: what the bindings give must match them.
    #[test]
    fn the_bindings_numbers_and_layouts_are_the_kernels() {
        for (got, want) in [
            (VFIO_GET_API_VERSION, 0x3b64),
            (VFIO_CHECK_EXTENSION, 0x3b65),
            (VFIO_SET_IOMMU, 0x3b66),
            (VFIO_GROUP_GET_STATUS, 0x3b67),
            (VFIO_GROUP_SET_CONTAINER, 0x3b68),
            (VFIO_GROUP_GET_DEVICE_FD, 0x3b6a),
            (VFIO_DEVICE_GET_INFO, 0x3b6b),
            (VFIO_DEVICE_GET_REGION_INFO, 0x3b6c),
            (VFIO_DEVICE_GET_IRQ_INFO, 0x3b6d),
            (VFIO_DEVICE_SET_IRQS, 0x3b6e),
            (VFIO_DEVICE_RESET, 0x3b6f),
            (VFIO_DEVICE_GET_PCI_HOT_RESET_INFO, 0x3b70),
            (VFIO_DEVICE_PCI_HOT_RESET, 0x3b71),
            (VFIO_IOMMU_MAP_DMA, 0x3b71),
            (VFIO_IOMMU_UNMAP_DMA, 0x3b72),
            (VFIO_DEVICE_BIND_IOMMUFD, 0x3b76),
            (VFIO_DEVICE_ATTACH_IOMMUFD_PT, 0x3b77),
        ] {
            assert_eq!(got, want, "{got:#x}");
        }
        for (got, want) in [
            (argsz::<vfio_group_status>(), 8),
            (argsz::<vfio_device_info>(), 24),
            (argsz::<vfio_region_info>(), 32),
            (argsz::<vfio_irq_info>(), 16),
            (argsz::<vfio_irq_set>(), 20),
            (argsz::<vfio_iommu_type1_dma_map>(), 32),
            (argsz::<vfio_iommu_type1_dma_unmap>(), 24),
            (argsz::<vfio_pci_hot_reset_info>(), 12),
            (argsz::<vfio_pci_dependent_device>(), 8),
            (argsz::<vfio_pci_hot_reset>(), 12),
            (argsz::<vfio_info_cap_header>(), 8),
            (BIND_IOMMUFD_ARGSZ, 16),
            (ATTACH_IOMMUFD_PT_ARGSZ, 12),
        ] {
            assert_eq!(got, want);
        }
        assert_eq!(VFIO_TYPE1v2_IOMMU, 3);
        assert_eq!(VFIO_PCI_HOT_RESET_FLAG_DEV_ID_OWNED, 1 << 1);
    }
}
