//! Handing VFIO files to the VM's KVM VFIO pseudo-device before a device is opened.
//!
//! The kernel gives a VFIO device the VM's `struct kvm` at the moment the device is opened
//! through its group (`VFIO_GROUP_GET_DEVICE_FD` takes the group's) or bound through its
//! cdev (`VFIO_DEVICE_BIND_IOMMUFD` takes the cdev file's); both are set by
//! `KVM_DEV_VFIO_FILE_ADD`. A file added afterwards never reaches a device already open.
//! Vendor VFIO drivers that need the VM (NVIDIA's vGPU manager will not open a vGPU without
//! it) therefore need the file added first, which is QEMU's order too: the group goes to
//! the KVM VFIO device before the device fd is asked for, the cdev before it is bound.

use std::os::fd::BorrowedFd;

/// The VM's KVM VFIO pseudo-device, as the kernel backend uses it.
pub trait KvmVfioFiles {
    /// `KVM_DEV_VFIO_FILE_ADD` of `file`: a VFIO group file, or a device's cdev file.
    fn add(&self, file: BorrowedFd<'_>) -> std::io::Result<()>;
}
