//! Which kernel VFIO interface a tenant's VMM uses, and so which device nodes its jail
//! gets: the legacy container and group nodes (`/dev/vfio/vfio`, `/dev/vfio/<group>`), or
//! iommufd (`/dev/iommu` and each device's cdev, `/dev/vfio/devices/vfioN`) where the host
//! offers it for every device and the backend speaks it (tenantvm-vmm does; Debian's QEMU
//! does not). The VMM is told the same choice (`iommu=legacy|iommufd`), so it never
//! looks for a node its jail lacks.

use std::path::{Path, PathBuf};

use super::{PassthroughDevice, VmSpec, VFIO_CONTAINER};

/// The host's iommufd node.
pub const IOMMU_NODE: &str = "/dev/iommu";
/// Where the host keeps VFIO device cdevs.
pub const VFIO_CDEV_DIR: &str = "/dev/vfio/devices";

/// How the VMM reaches its passed-through devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VfioInterface {
    /// The container and the devices' group nodes.
    Legacy,
    /// `/dev/iommu` and the devices' cdevs.
    Iommufd,
}

impl VfioInterface {
    /// The VMM's `iommu=` setting for this choice.
    pub fn vmm_mode(self) -> tenantvm_vmm_api::VfioIommuMode {
        match self {
            VfioInterface::Legacy => tenantvm_vmm_api::VfioIommuMode::Legacy,
            VfioInterface::Iommufd => tenantvm_vmm_api::VfioIommuMode::Iommufd,
        }
    }
}

/// `path` (absolute) under `root` (`/` on a real host; a fake tree in tests).
fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// The cdev of a PCI device as the host shows it: the name in its sysfs `vfio-dev/`
/// (`vfioN`, by the VMM's own rule, `cdev_name`) with a node under [`VFIO_CDEV_DIR`];
/// `None` for an mdev or where either is missing (a kernel without
/// `CONFIG_VFIO_DEVICE_CDEV` shows the name, never the node).
fn cdev_node(device: &PassthroughDevice, root: &Path) -> Option<PathBuf> {
    let PassthroughDevice::Pci { .. } = device else {
        return None;
    };
    let name = tenantvm_vmm_api::devices::cdev_name(&under(root, &device.sysfs_path()))?;
    let node = Path::new(VFIO_CDEV_DIR).join(name);
    under(root, &node).exists().then_some(node)
}

/// The interface for `spec`'s devices on the host below `root`: iommufd when the backend
/// speaks it, `/dev/iommu` exists and every device is a PCI function with a cdev node;
/// otherwise the legacy container/group.
pub fn choose(spec: &VmSpec, root: &Path, backend_speaks_iommufd: bool) -> VfioInterface {
    let iommufd = backend_speaks_iommufd
        && !spec.devices.is_empty()
        && under(root, Path::new(IOMMU_NODE)).exists()
        && spec.devices.iter().all(|d| cdev_node(d, root).is_some());
    if iommufd {
        VfioInterface::Iommufd
    } else {
        VfioInterface::Legacy
    }
}

/// The VFIO nodes the VMM of `spec` gets through `interface`, and no others (host paths):
/// legacy, each device's group node once and the container; iommufd, `/dev/iommu` and each
/// device's cdev. None without devices.
pub fn nodes(spec: &VmSpec, interface: VfioInterface, root: &Path) -> Vec<PathBuf> {
    let mut nodes: Vec<PathBuf> = Vec::new();
    if spec.devices.is_empty() {
        return nodes;
    }
    match interface {
        VfioInterface::Legacy => {
            for device in &spec.devices {
                let node = device.vfio_node();
                if !nodes.contains(&node) {
                    nodes.push(node);
                }
            }
            nodes.push(PathBuf::from(VFIO_CONTAINER));
        }
        VfioInterface::Iommufd => {
            nodes.push(PathBuf::from(IOMMU_NODE));
            nodes.extend(spec.devices.iter().filter_map(|d| cdev_node(d, root)));
        }
    }
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(devices: Vec<PassthroughDevice>) -> VmSpec {
        VmSpec {
            vsock_cid: None,
            tenant: "alpha".into(),
            kernel: "/k".into(),
            initramfs: None,
            cmdline: String::new(),
            vcpus: 1,
            memory_mib: 32,
            disks: vec![],
            tenant_dir: "/t/alpha".into(),
            devices,
            uuid: None,
            hugepages: None,
        }
    }

    fn pci(address: &str, group: u32) -> PassthroughDevice {
        PassthroughDevice::Pci {
            address: address.into(),
            iommu_group: group,
        }
    }

    /// A fake host tree: `/dev/iommu` if `iommu`, and for each (address, N, node) the
    /// device's sysfs `vfio-dev/vfioN` and, if `node`, `/dev/vfio/devices/vfioN`.
    fn host(iommu: bool, devices: &[(&str, u32, bool)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("dev/vfio/devices")).unwrap();
        if iommu {
            std::fs::write(r.join("dev/iommu"), b"").unwrap();
        }
        for (address, n, node) in devices {
            std::fs::create_dir_all(
                r.join(format!("sys/bus/pci/devices/{address}/vfio-dev/vfio{n}")),
            )
            .unwrap();
            if *node {
                std::fs::write(r.join(format!("dev/vfio/devices/vfio{n}")), b"").unwrap();
            }
        }
        root
    }

    #[test]
    fn legacy_gives_each_group_once_and_the_container() {
        let s = spec(vec![
            pci("0000:41:00.0", 17),
            pci("0000:41:00.1", 17),
            pci("0000:c1:00.0", 40),
        ]);
        let root = host(false, &[]);
        assert_eq!(choose(&s, root.path(), true), VfioInterface::Legacy);
        assert_eq!(
            nodes(&s, VfioInterface::Legacy, root.path()),
            vec![
                PathBuf::from("/dev/vfio/17"),
                PathBuf::from("/dev/vfio/40"),
                PathBuf::from("/dev/vfio/vfio"),
            ]
        );
        assert!(nodes(&spec(vec![]), VfioInterface::Legacy, root.path()).is_empty());
    }

    #[test]
    fn iommufd_gives_dev_iommu_and_each_cdev_only() {
        let s = spec(vec![pci("0000:41:00.0", 17), pci("0000:c1:00.0", 40)]);
        let root = host(
            true,
            &[("0000:41:00.0", 0, true), ("0000:c1:00.0", 3, true)],
        );
        assert_eq!(choose(&s, root.path(), true), VfioInterface::Iommufd);
        assert_eq!(
            nodes(&s, VfioInterface::Iommufd, root.path()),
            vec![
                PathBuf::from("/dev/iommu"),
                PathBuf::from("/dev/vfio/devices/vfio0"),
                PathBuf::from("/dev/vfio/devices/vfio3"),
            ]
        );
        assert_eq!(
            VfioInterface::Iommufd.vmm_mode(),
            tenantvm_vmm_api::VfioIommuMode::Iommufd
        );
    }

    #[test]
    fn anything_missing_means_legacy() {
        let two = spec(vec![pci("0000:41:00.0", 17), pci("0000:c1:00.0", 40)]);
        // A backend without iommufd (QEMU 7.2).
        let all = host(
            true,
            &[("0000:41:00.0", 0, true), ("0000:c1:00.0", 3, true)],
        );
        assert_eq!(choose(&two, all.path(), false), VfioInterface::Legacy);
        // No /dev/iommu (Debian's kernels).
        let no_iommu = host(
            false,
            &[("0000:41:00.0", 0, true), ("0000:c1:00.0", 3, true)],
        );
        assert_eq!(choose(&two, no_iommu.path(), true), VfioInterface::Legacy);
        // One device's cdev name without its node (a 6.1 kernel shows the name only).
        let one_node = host(
            true,
            &[("0000:41:00.0", 0, true), ("0000:c1:00.0", 3, false)],
        );
        assert_eq!(choose(&two, one_node.path(), true), VfioInterface::Legacy);
        // An mdev has no cdev.
        let mdev = spec(vec![PassthroughDevice::Mdev {
            uuid: "5c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b".into(),
            iommu_group: 9,
        }]);
        assert_eq!(choose(&mdev, all.path(), true), VfioInterface::Legacy);
        // No devices: nothing to choose.
        assert_eq!(
            choose(&spec(vec![]), all.path(), true),
            VfioInterface::Legacy
        );
        // A malformed vfio-dev entry is no cdev.
        let odd = host(true, &[]);
        std::fs::create_dir_all(
            odd.path()
                .join("sys/bus/pci/devices/0000:41:00.0/vfio-dev/vfiox"),
        )
        .unwrap();
        let one = spec(vec![pci("0000:41:00.0", 17)]);
        assert_eq!(choose(&one, odd.path(), true), VfioInterface::Legacy);
    }
}
