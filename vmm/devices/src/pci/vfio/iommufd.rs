//! The iommufd interface of kernel VFIO (Linux 6.6+): `/dev/iommu` holds an IO address
//! space (IOAS) into which guest RAM is mapped, and the device is opened through its
//! character device `/dev/vfio/devices/vfioN` (named by sysfs `<device>/vfio-dev/vfioN`),
//! bound to the iommufd and attached to the IOAS, instead of through a group and a
//! container.
//!
//! This file has the pieces: which interface opens a device ([`select_interface`], from the
//! configured [`VfioIommuMode`] and what the kernel offers), the iommufd ([`Iommufd`]: IOAS
//! allocation, DMA map and unmap) and the device's bind and attach ([`bind_and_attach`]),
//! with iommufd's struct layouts from `<linux/iommufd.h>` (written here: `vfio-bindings`
//! does not cover that header) and VFIO's from `vfio-bindings` (`abi.rs`). The kernel backend
//! (`kernel.rs`, `KernelVfioDevice::open_cdev`) uses them; the VMM keeps one [`Iommufd`] per
//! VM, maps all guest RAM into its IOAS once (IOVA = guest physical address) and adds each
//! device's cdev to the KVM VFIO pseudo-device before binding it (`KVM_DEV_VFIO_FILE_ADD`, the attribute
//! groups use).
//!
//! sysfs has shown `vfio-dev/vfioN` since Linux 6.1 even without the cdev; the node under
//! `/dev/vfio/devices` exists only with `CONFIG_VFIO_DEVICE_CDEV`, so both are checked.
//! Debian's kernels are built without iommufd (`# CONFIG_IOMMUFD is not set`); the nested
//! test host's scenario `vfio-iommufd` runs this path on a kernel built with
//! `scripts/build-iommufd-kernel.sh` (docs/testing.md).

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};

use super::kvm_files::KvmVfioFiles;

pub use tenantvm_vmm_api::VfioIommuMode;

use super::abi::{
    vfio_device_attach_iommufd_pt, vfio_device_bind_iommufd, ATTACH_IOMMUFD_PT_ARGSZ,
    BIND_IOMMUFD_ARGSZ,
};
pub use super::abi::{VFIO_DEVICE_ATTACH_IOMMUFD_PT, VFIO_DEVICE_BIND_IOMMUFD};

/// `_IO(';', nr)`: iommufd's ioctls (`<linux/iommufd.h>`, which `vfio-bindings` does not
/// cover) share VFIO's type and carry no size.
const fn io(nr: u32) -> libc::c_ulong {
    ((b';' as libc::c_ulong) << 8) | nr as libc::c_ulong
}

/// IOMMU_IOAS_ALLOC.
pub const IOMMU_IOAS_ALLOC: libc::c_ulong = io(0x81);
/// IOMMU_IOAS_MAP.
pub const IOMMU_IOAS_MAP: libc::c_ulong = io(0x85);
/// IOMMU_IOAS_UNMAP.
pub const IOMMU_IOAS_UNMAP: libc::c_ulong = io(0x86);
/// The ioctls of this path. All of them are issued while the VM is set up, before any
/// thread installs its seccomp filter, so no filter allows them: a device thread or vCPU
/// that asked for one would be stopped.
pub const IOMMUFD_IOCTLS: [libc::c_ulong; 5] = [
    IOMMU_IOAS_ALLOC,
    IOMMU_IOAS_MAP,
    IOMMU_IOAS_UNMAP,
    VFIO_DEVICE_BIND_IOMMUFD,
    VFIO_DEVICE_ATTACH_IOMMUFD_PT,
];

/// IOMMU_IOAS_MAP flags: FIXED_IOVA | WRITEABLE | READABLE.
const MAP_FIXED_RW: u32 = 0b111;

/// Which VFIO interface opens a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VfioInterface {
    /// iommufd: `/dev/iommu` and the device's cdev.
    Cdev {
        /// `/dev/iommu`.
        iommu: PathBuf,
        /// `/dev/vfio/devices/vfioN`.
        device: PathBuf,
    },
    /// The legacy container (`/dev/vfio/vfio`) and group (`/dev/vfio/<group>`).
    Legacy,
}

/// Why the iommufd path failed.
#[derive(Debug, thiserror::Error)]
pub enum IommufdError {
    /// A file could not be opened.
    #[error("Cannot open {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Guest RAM could not be mapped for lack of lockable memory.
    #[error("Mapping {size:#x} bytes of guest RAM at {iova:#x} for DMA failed: out of locked memory; the VMM needs RLIMIT_MEMLOCK of at least the guest RAM size (ulimit -l, or the jail's memlock limit)")]
    DmaMemlock {
        /// IOVA (= guest physical address).
        iova: u64,
        /// Bytes.
        size: u64,
    },
    /// `iommu=iommufd` was asked for a device the kernel does not offer it for.
    #[error("{device} cannot be opened through iommufd (iommu=iommufd): {reason}; use iommu=auto or iommu=legacy for the container/group interface")]
    Unavailable {
        /// The device's sysfs directory.
        device: PathBuf,
        /// What is missing, and the fix.
        reason: String,
    },
    /// The VM's KVM VFIO device refused the device's cdev file.
    #[error("Adding {path} to the VM's KVM VFIO device (KVM_DEV_VFIO_FILE_ADD) failed: {source}")]
    KvmFile {
        /// The cdev.
        path: PathBuf,
        /// What KVM answered.
        #[source]
        source: std::io::Error,
    },
    /// An ioctl failed.
    #[error("{op} failed: {source}")]
    Ioctl {
        /// The ioctl.
        op: &'static str,
        /// What the kernel answered.
        #[source]
        source: std::io::Error,
    },
}

fn ioctl_err(op: &'static str) -> IommufdError {
    IommufdError::Ioctl {
        op,
        source: std::io::Error::last_os_error(),
    }
}

/// The device's VFIO cdev name (`vfioN`): the one rule, shared with the orchestrator's
/// choice of jail nodes.
pub use tenantvm_vmm_api::devices::cdev_name;

/// The interface to open the device at `sysfs_device` with, given the device folder
/// `dev_root` (normally `/dev`): the cdev when `<dev_root>/iommu` and
/// `<dev_root>/vfio/devices/vfioN` both exist, the legacy group path otherwise.
pub fn choose_interface(sysfs_device: &Path, dev_root: &Path) -> VfioInterface {
    let iommu = dev_root.join("iommu");
    let cdev = cdev_name(sysfs_device).map(|n| dev_root.join("vfio/devices").join(n));
    match cdev {
        Some(device) if iommu.exists() && device.exists() => VfioInterface::Cdev { iommu, device },
        _ => VfioInterface::Legacy,
    }
}

/// The interface to open the device at `sysfs_device` with under `mode`, given the device
/// folder `dev_root` (normally `/dev`): `legacy` always takes the container/group path,
/// `auto` takes the cdev when the kernel offers it ([`choose_interface`]), `iommufd` takes
/// the cdev or says what is missing.
pub fn select_interface(
    mode: VfioIommuMode,
    sysfs_device: &Path,
    dev_root: &Path,
) -> Result<VfioInterface, IommufdError> {
    match mode {
        VfioIommuMode::Legacy => Ok(VfioInterface::Legacy),
        VfioIommuMode::Auto => Ok(choose_interface(sysfs_device, dev_root)),
        VfioIommuMode::Iommufd => {
            let unavailable = |reason: String| IommufdError::Unavailable {
                device: sysfs_device.to_path_buf(),
                reason,
            };
            let Some(name) = cdev_name(sysfs_device) else {
                return Err(unavailable(format!(
                    "sysfs shows no VFIO device for it ({}/vfio-dev/vfioN is absent: a kernel \
                     before 6.1, or the device is not bound to a VFIO driver)",
                    sysfs_device.display()
                )));
            };
            let iommu = dev_root.join("iommu");
            if !iommu.exists() {
                return Err(unavailable(format!(
                    "{} is missing (the kernel lacks CONFIG_IOMMUFD, or the iommufd module is \
                     not loaded: modprobe iommufd; in a jail, give the VMM that node)",
                    iommu.display()
                )));
            }
            let device = dev_root.join("vfio/devices").join(&name);
            if !device.exists() {
                return Err(unavailable(format!(
                    "{} is missing (the kernel lacks CONFIG_VFIO_DEVICE_CDEV, or the VMM was \
                     not given the node)",
                    device.display()
                )));
            }
            Ok(VfioInterface::Cdev { iommu, device })
        }
    }
}

/// `struct iommu_ioas_alloc` (size, flags, out_ioas_id).
fn ioas_alloc_arg() -> [u32; 3] {
    [12, 0, 0]
}

/// `struct iommu_ioas_map` (size, flags, ioas_id, reserved, user_va, length, iova) as
/// u64 words, little-endian halves for the four u32 fields.
fn ioas_map_arg(ioas: u32, iova: u64, size: u64, host_addr: u64) -> [u64; 5] {
    [
        40 | (u64::from(MAP_FIXED_RW) << 32),
        u64::from(ioas),
        host_addr,
        size,
        iova,
    ]
}

/// `struct iommu_ioas_unmap` (size, ioas_id, iova, length).
fn ioas_unmap_arg(ioas: u32, iova: u64, size: u64) -> [u64; 3] {
    [24 | (u64::from(ioas) << 32), iova, size]
}

/// `struct vfio_device_bind_iommufd`, its `argsz` covering up to `out_devid`: the form
/// every cdev kernel accepts ([`BIND_IOMMUFD_ARGSZ`]).
fn bind_arg(iommufd: RawFd) -> vfio_device_bind_iommufd {
    vfio_device_bind_iommufd {
        argsz: BIND_IOMMUFD_ARGSZ,
        iommufd,
        ..Default::default()
    }
}

/// `struct vfio_device_attach_iommufd_pt`, its `argsz` covering up to `pt_id`.
fn attach_arg(pt_id: u32) -> vfio_device_attach_iommufd_pt {
    vfio_device_attach_iommufd_pt {
        argsz: ATTACH_IOMMUFD_PT_ARGSZ,
        pt_id,
        ..Default::default()
    }
}

/// An open `/dev/iommu` with one IOAS for the VM's guest RAM.
#[derive(Debug)]
pub struct Iommufd {
    file: File,
    ioas: u32,
}

impl Iommufd {
    /// Opens `path` (normally `/dev/iommu`) and allocates the IOAS.
    pub fn open(path: &Path) -> Result<Self, IommufdError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| IommufdError::Open {
                path: path.to_path_buf(),
                source,
            })?;
        let mut arg = ioas_alloc_arg();
        // SAFETY: `arg` is a struct iommu_ioas_alloc the kernel fills (out_ioas_id).
        if unsafe { libc::ioctl(file.as_raw_fd(), IOMMU_IOAS_ALLOC, arg.as_mut_ptr()) } < 0 {
            return Err(ioctl_err("IOMMU_IOAS_ALLOC"));
        }
        Ok(Self { file, ioas: arg[2] })
    }

    /// The IOAS id devices attach to.
    pub fn ioas(&self) -> u32 {
        self.ioas
    }

    /// The iommufd's descriptor (devices bind to it).
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Maps `size` bytes at host address `host_addr` for device DMA at `iova`.
    ///
    /// # Safety
    ///
    /// As the legacy container's `map_dma`: the range must stay mapped until unmapped (or
    /// the iommufd closes), and no Rust reference to it may exist while it is mapped.
    pub unsafe fn map_dma(&self, iova: u64, size: u64, host_addr: u64) -> Result<(), IommufdError> {
        let mut arg = ioas_map_arg(self.ioas, iova, size, host_addr);
        // SAFETY: `arg` is a valid struct iommu_ioas_map (the kernel writes `iova` back,
        // within it); the caller guarantees the range's lifetime and aliasing rules.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), IOMMU_IOAS_MAP, arg.as_mut_ptr()) } < 0 {
            let source = std::io::Error::last_os_error();
            if source.raw_os_error() == Some(libc::ENOMEM) {
                return Err(IommufdError::DmaMemlock { iova, size });
            }
            return Err(IommufdError::Ioctl {
                op: "IOMMU_IOAS_MAP",
                source,
            });
        }
        Ok(())
    }

    /// Removes the DMA mapping at `iova`.
    pub fn unmap_dma(&self, iova: u64, size: u64) -> Result<(), IommufdError> {
        let mut arg = ioas_unmap_arg(self.ioas, iova, size);
        // SAFETY: `arg` is a valid struct iommu_ioas_unmap (the kernel writes `length`
        // back, within it).
        if unsafe { libc::ioctl(self.file.as_raw_fd(), IOMMU_IOAS_UNMAP, arg.as_mut_ptr()) } < 0 {
            return Err(ioctl_err("IOMMU_IOAS_UNMAP"));
        }
        Ok(())
    }
}

/// Opens the device cdev at `path`, hands it to `kvm` (the VM's KVM VFIO device: the
/// kernel takes the device's KVM at bind), binds it to `iommufd` and attaches it to its
/// IOAS; returns the device file (then used like a group's device fd) and the device id.
pub fn bind_and_attach(
    path: &Path,
    iommufd: &Iommufd,
    kvm: Option<&dyn KvmVfioFiles>,
) -> Result<(File, u32), IommufdError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| IommufdError::Open {
            path: path.to_path_buf(),
            source,
        })?;
    // The kernel takes the device's KVM at bind: the file goes to the VM first.
    if let Some(kvm) = kvm {
        kvm.add(file.as_fd())
            .map_err(|source| IommufdError::KvmFile {
                path: path.to_path_buf(),
                source,
            })?;
    }
    let mut bind = bind_arg(iommufd.fd());
    // SAFETY: `bind` is a struct vfio_device_bind_iommufd the kernel fills (out_devid);
    // its `argsz` is within the struct.
    if unsafe { libc::ioctl(file.as_raw_fd(), VFIO_DEVICE_BIND_IOMMUFD, &mut bind) } < 0 {
        return Err(ioctl_err("VFIO_DEVICE_BIND_IOMMUFD"));
    }
    let mut attach = attach_arg(iommufd.ioas());
    // SAFETY: `attach` is a struct vfio_device_attach_iommufd_pt (the kernel writes the
    // attached page table id back into pt_id); its `argsz` is within the struct.
    if unsafe { libc::ioctl(file.as_raw_fd(), VFIO_DEVICE_ATTACH_IOMMUFD_PT, &mut attach) } < 0 {
        return Err(ioctl_err("VFIO_DEVICE_ATTACH_IOMMUFD_PT"));
    }
    Ok((file, bind.out_devid))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::os::fd::BorrowedFd;

    /// A fake KVM VFIO device that records what it is given (fd numbers) and can refuse.
    #[derive(Default)]
    struct RecordingKvm {
        added: RefCell<Vec<RawFd>>,
        refuse: bool,
    }

    impl KvmVfioFiles for RecordingKvm {
        fn add(&self, file: BorrowedFd<'_>) -> std::io::Result<()> {
            self.added.borrow_mut().push(file.as_raw_fd());
            if self.refuse {
                return Err(std::io::Error::from_raw_os_error(libc::EBADF));
            }
            Ok(())
        }
    }

    fn fake_iommufd() -> Iommufd {
        Iommufd {
            file: File::open("/dev/null").unwrap(),
            ioas: 1,
        }
    }

    #[test]
    fn the_cdev_goes_to_kvm_before_it_is_bound() {
        // /dev/null stands in for the cdev: it opens read-write, and the bind ioctl then
        // fails (ENOTTY). The KVM VFIO device must have been given the file by then.
        let kvm = RecordingKvm::default();
        let err = bind_and_attach(Path::new("/dev/null"), &fake_iommufd(), Some(&kvm)).unwrap_err();
        assert!(
            matches!(
                err,
                IommufdError::Ioctl {
                    op: "VFIO_DEVICE_BIND_IOMMUFD",
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(kvm.added.borrow().len(), 1);
    }

    #[test]
    fn a_cdev_kvm_refuses_is_never_bound() {
        let kvm = RecordingKvm {
            refuse: true,
            ..Default::default()
        };
        let err = bind_and_attach(Path::new("/dev/null"), &fake_iommufd(), Some(&kvm)).unwrap_err();
        assert!(matches!(err, IommufdError::KvmFile { .. }), "{err}");
        assert!(err.to_string().contains("KVM_DEV_VFIO_FILE_ADD"), "{err}");
        assert_eq!(kvm.added.borrow().len(), 1);
    }

    #[test]
    fn ioctl_numbers_match_the_linux_headers() {
        // <linux/iommufd.h>: IOMMUFD_TYPE ';', IOAS_ALLOC 0x81, IOAS_MAP 0x85, UNMAP 0x86.
        assert_eq!(IOMMU_IOAS_ALLOC, 0x3b81);
        assert_eq!(IOMMU_IOAS_MAP, 0x3b85);
        assert_eq!(IOMMU_IOAS_UNMAP, 0x3b86);
        // <linux/vfio.h>: VFIO_BASE 100; BIND 18, ATTACH_PT 19.
        assert_eq!(VFIO_DEVICE_BIND_IOMMUFD, 0x3b76);
        assert_eq!(VFIO_DEVICE_ATTACH_IOMMUFD_PT, 0x3b77);
    }

    #[test]
    fn argument_layouts_match_the_structs() {
        assert_eq!(std::mem::size_of_val(&ioas_alloc_arg()), 12);
        let map = ioas_map_arg(7, 0x1000, 0x2000, 0x7f00_0000_0000);
        assert_eq!(std::mem::size_of_val(&map), 40);
        // size 40, flags FIXED|WRITE|READ, ioas_id 7, reserved 0, user_va, length, iova.
        assert_eq!(crate::narrow::low_u32(map[0]), 40);
        assert_eq!((map[0] >> 32) as u32, 0b111);
        assert_eq!(map[1], 7);
        assert_eq!((map[2], map[3], map[4]), (0x7f00_0000_0000, 0x2000, 0x1000));
        let unmap = ioas_unmap_arg(7, 0x1000, 0x2000);
        assert_eq!(
            (
                crate::narrow::low_u32(unmap[0]),
                crate::narrow::low_u32(unmap[0] >> 32)
            ),
            (24, 7)
        );
        let bind = bind_arg(9);
        assert_eq!(
            (bind.argsz, bind.flags, bind.iommufd, bind.out_devid),
            (16, 0, 9, 0)
        );
        let attach = attach_arg(7);
        assert_eq!((attach.argsz, attach.flags, attach.pt_id), (12, 0, 7));
    }

    #[test]
    fn cdev_is_chosen_only_when_the_kernel_offers_it() {
        let sys = tempfile::tempdir().unwrap();
        let dev = tempfile::tempdir().unwrap();
        // A 6.1 kernel: no vfio-dev folder, no /dev/iommu.
        assert_eq!(
            choose_interface(sys.path(), dev.path()),
            VfioInterface::Legacy
        );
        std::fs::create_dir_all(sys.path().join("vfio-dev/vfio3")).unwrap();
        assert_eq!(cdev_name(sys.path()).as_deref(), Some("vfio3"));
        // The cdev without /dev/iommu, then without its /dev node: still legacy.
        assert_eq!(
            choose_interface(sys.path(), dev.path()),
            VfioInterface::Legacy
        );
        std::fs::write(dev.path().join("iommu"), b"").unwrap();
        assert_eq!(
            choose_interface(sys.path(), dev.path()),
            VfioInterface::Legacy
        );
        std::fs::create_dir_all(dev.path().join("vfio/devices")).unwrap();
        std::fs::write(dev.path().join("vfio/devices/vfio3"), b"").unwrap();
        assert_eq!(
            choose_interface(sys.path(), dev.path()),
            VfioInterface::Cdev {
                iommu: dev.path().join("iommu"),
                device: dev.path().join("vfio/devices/vfio3"),
            }
        );
        // Names that are not vfioN are ignored.
        let odd = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(odd.path().join("vfio-dev/vfio")).unwrap();
        std::fs::create_dir_all(odd.path().join("vfio-dev/vfiox")).unwrap();
        assert_eq!(cdev_name(odd.path()), None);
    }

    /// A fake sysfs device directory and a fake `/dev` (plain files and folders; nothing
    /// here opens them).
    fn fake_tree(cdev: bool, iommu: bool, node: bool) -> (tempfile::TempDir, tempfile::TempDir) {
        let sys = tempfile::tempdir().unwrap();
        let dev = tempfile::tempdir().unwrap();
        if cdev {
            std::fs::create_dir_all(sys.path().join("vfio-dev/vfio0")).unwrap();
        }
        if iommu {
            std::fs::write(dev.path().join("iommu"), b"").unwrap();
        }
        if node {
            std::fs::create_dir_all(dev.path().join("vfio/devices")).unwrap();
            std::fs::write(dev.path().join("vfio/devices/vfio0"), b"").unwrap();
        }
        (sys, dev)
    }

    #[test]
    fn each_mode_selects_as_documented_on_a_fake_tree() {
        use VfioIommuMode::{Auto, Iommufd as Fd, Legacy};
        // Everything present: auto and iommufd take the cdev, legacy does not.
        let (sys, dev) = fake_tree(true, true, true);
        let cdev = VfioInterface::Cdev {
            iommu: dev.path().join("iommu"),
            device: dev.path().join("vfio/devices/vfio0"),
        };
        assert_eq!(
            select_interface(Auto, sys.path(), dev.path()).unwrap(),
            cdev
        );
        assert_eq!(select_interface(Fd, sys.path(), dev.path()).unwrap(), cdev);
        assert_eq!(
            select_interface(Legacy, sys.path(), dev.path()).unwrap(),
            VfioInterface::Legacy
        );
        // Each missing piece: auto falls back, iommufd says which piece and the way out.
        for (cdev, iommu, node, says) in [
            (false, true, true, "vfio-dev/vfioN is absent"),
            (true, false, true, "CONFIG_IOMMUFD"),
            (
                true,
                true,
                false,
                "vfio/devices/vfio0 is missing (the kernel lacks CONFIG_VFIO_DEVICE_CDEV",
            ),
        ] {
            let (sys, dev) = fake_tree(cdev, iommu, node);
            assert_eq!(
                select_interface(Auto, sys.path(), dev.path()).unwrap(),
                VfioInterface::Legacy
            );
            let err = select_interface(Fd, sys.path(), dev.path()).unwrap_err();
            assert!(matches!(err, IommufdError::Unavailable { .. }), "{err}");
            let text = err.to_string();
            assert!(text.contains(says), "{text}");
            assert!(text.contains("iommu=legacy"), "{text}");
        }
    }

    #[test]
    fn missing_dev_iommu_is_an_open_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = Iommufd::open(&dir.path().join("iommu")).unwrap_err();
        assert!(err.to_string().contains("iommu"), "{err}");
        assert!(matches!(err, IommufdError::Open { .. }));
    }
}
