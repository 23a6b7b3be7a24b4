//! What sysfs says about a device handed to the VMM: that the path is a PCI device, whether
//! the kernel has registered it with VFIO, its IOMMU group, and whether every other member
//! of the group is in a state VFIO accepts. Every path is relative to the device directory
//! and the device folder given, so tests run on a fake tree.
//!
//! Registration, not the driver's name, decides: vfio-pci registers the devices bound to
//! it, and so do vendor drivers whose names say nothing of VFIO (NVIDIA's `nvidia` driver
//! for its vGPU virtual functions, vGPU 17 and later). Since Linux 6.1 every device
//! registered with VFIO has a `vfio-dev/vfioN` directory in sysfs; an older kernel shows
//! only the group's node, `/dev/vfio/N`, which exists while any member of the group is
//! registered.

use std::path::{Path, PathBuf};

use tenantvm_vmm_api::devices::cdev_name;

/// Drivers a group member may be bound to without making the group unusable: the PCI
/// stub, and bridges' port driver (the kernel's own list of drivers VFIO tolerates).
const HARMLESS_DRIVERS: [&str; 2] = ["pci-stub", "pcieport"];

/// Why a device cannot be passed through, as sysfs shows it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SysfsError {
    /// The path is not a PCI device directory.
    #[error("{0} is not a PCI device (no such sysfs directory with a `config` file); give /sys/bus/pci/devices/DDDD:BB:DD.F")]
    NotADevice(PathBuf),
    /// The device is bound to no driver, or to a host driver that has not registered it
    /// with VFIO.
    #[error("{path} is bound to {driver}, which has not registered it with VFIO (sysfs shows no {path}/vfio-dev/vfioN, and no other sign of it); bind it to vfio-pci first (echo vfio-pci > {path}/driver_override, unbind it from its driver, echo its address > /sys/bus/pci/drivers_probe), or, for an NVIDIA vGPU virtual function, give it its vGPU type (nvidia/current_vgpu_type) with NVIDIA's vGPU manager loaded")]
    NotVfioBound {
        /// The device.
        path: PathBuf,
        /// Its driver, or "no driver".
        driver: String,
    },
    /// The device has no IOMMU group (no IOMMU, or it is off).
    #[error("{0} has no IOMMU group: enable the IOMMU (intel_iommu=on / amd_iommu=on) in the host kernel command line")]
    NoIommuGroup(PathBuf),
    /// Another member of the group is bound to a host driver that has not registered it
    /// with VFIO.
    #[error("IOMMU group {group} of {path} is not viable: member {member} is bound to host driver {driver}, which has not registered it with VFIO; bind it to vfio-pci as well, or unbind it")]
    GroupNotViable {
        /// The device asked for.
        path: PathBuf,
        /// Group number.
        group: u32,
        /// The member in the way.
        member: String,
        /// Its driver.
        driver: String,
    },
}

/// How sysfs shows that the kernel registered a device with VFIO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VfioRegistration {
    /// The device's own cdev, `vfio-dev/vfioN` (Linux 6.1 and later): certain.
    Cdev(String),
    /// A kernel before 6.1, which shows no cdevs: the group's node (`/dev/vfio/N`), which
    /// exists while any member of the group is registered. The kernel has the last word
    /// when the group is opened (its viable flag, then VFIO_GROUP_GET_DEVICE_FD).
    GroupNode(PathBuf),
}

/// A device ready for VFIO, as sysfs describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysfsDevice {
    /// The device directory.
    pub path: PathBuf,
    /// Its name (the PCI address).
    pub name: String,
    /// Its driver (vfio-pci, or a driver that registered it with VFIO itself).
    pub driver: String,
    /// How the kernel shows it registered the device with VFIO.
    pub registration: VfioRegistration,
    /// Its IOMMU group number.
    pub group: u32,
    /// The kernel's reset methods for it (`reset_method`), first is tried first; empty
    /// when the file is absent or empty.
    pub reset_methods: Vec<String>,
}

fn link_name(path: &Path) -> Option<String> {
    Some(path.read_link().ok()?.file_name()?.to_str()?.to_owned())
}

fn driver_of(device: &Path) -> Option<String> {
    link_name(&device.join("driver"))
}

/// Checks `path` can be passed through: a PCI device the kernel has registered with VFIO
/// (whatever its driver), in an IOMMU group whose other members are unbound, registered,
/// or on a harmless driver. `vfio_dir` is the folder of the VFIO nodes (normally
/// `/dev/vfio`), where a kernel before 6.1 shows the group's node.
pub fn inspect(path: &Path, vfio_dir: &Path) -> Result<SysfsDevice, SysfsError> {
    if !path.join("config").is_file() {
        return Err(SysfsError::NotADevice(path.to_path_buf()));
    }
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| SysfsError::NotADevice(path.to_path_buf()))?
        .to_owned();
    let not_registered = |driver: Option<String>| SysfsError::NotVfioBound {
        path: path.to_path_buf(),
        driver: driver.unwrap_or_else(|| "no driver".into()),
    };
    let Some(driver) = driver_of(path) else {
        return Err(not_registered(None));
    };
    let group_link = path.join("iommu_group");
    let Some(group) = link_name(&group_link).and_then(|g| g.parse::<u32>().ok()) else {
        // Without a group nothing registers a device with VFIO but its own cdev shows;
        // a device on a host driver is named as such.
        return Err(match cdev_name(path) {
            Some(_) => SysfsError::NoIommuGroup(path.to_path_buf()),
            None => not_registered(Some(driver)),
        });
    };
    let mut members: Vec<_> = std::fs::read_dir(group_link.join("devices"))
        .map_err(|_| SysfsError::NoIommuGroup(path.to_path_buf()))?
        .filter_map(|e| e.ok())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .filter(|(member, _)| *member != name)
        .collect();
    members.sort();
    // A kernel that shows any cdev in the group shows every registered member's.
    let shows_cdevs =
        cdev_name(path).is_some() || members.iter().any(|(_, m)| cdev_name(m).is_some());
    let registration = match cdev_name(path) {
        Some(cdev) => VfioRegistration::Cdev(cdev),
        None if shows_cdevs => return Err(not_registered(Some(driver))),
        None => {
            let node = vfio_dir.join(group.to_string());
            if !node.exists() {
                return Err(not_registered(Some(driver)));
            }
            VfioRegistration::GroupNode(node)
        }
    };
    if shows_cdevs {
        // Without cdevs (a kernel before 6.1) sysfs cannot tell which members are
        // registered: the kernel's viable flag judges the group when it is opened.
        for (member, member_path) in &members {
            let Some(d) = driver_of(member_path) else {
                continue;
            };
            if cdev_name(member_path).is_none() && !HARMLESS_DRIVERS.contains(&d.as_str()) {
                return Err(SysfsError::GroupNotViable {
                    path: path.to_path_buf(),
                    group,
                    member: member.clone(),
                    driver: d,
                });
            }
        }
    }
    let reset_methods = std::fs::read_to_string(path.join("reset_method"))
        .map(|s| s.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    Ok(SysfsDevice {
        path: path.to_path_buf(),
        name,
        driver,
        registration,
        group,
        reset_methods,
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    /// A fake /sys and /dev: devices with drivers, IOMMU groups listing their members,
    /// VFIO cdevs in sysfs (`vfio-dev/vfioN`) and group nodes (`/dev/vfio/N`).
    struct Tree(tempfile::TempDir);

    impl Tree {
        fn new() -> Self {
            let t = Self(tempfile::tempdir().unwrap());
            std::fs::create_dir_all(t.dev_dir()).unwrap();
            t
        }
        fn dev(&self, name: &str) -> PathBuf {
            self.0.path().join("devices").join(name)
        }
        /// The fake /dev/vfio.
        fn dev_dir(&self) -> PathBuf {
            self.0.path().join("dev/vfio")
        }
        fn add(&self, name: &str, driver: Option<&str>, group: Option<u32>) -> PathBuf {
            let dev = self.dev(name);
            std::fs::create_dir_all(&dev).unwrap();
            std::fs::write(dev.join("config"), [0u8; 64]).unwrap();
            if let Some(d) = driver {
                let dir = self.0.path().join("drivers").join(d);
                std::fs::create_dir_all(&dir).unwrap();
                symlink(&dir, dev.join("driver")).unwrap();
            }
            if let Some(g) = group {
                let gdir = self.0.path().join("iommu_groups").join(g.to_string());
                std::fs::create_dir_all(gdir.join("devices")).unwrap();
                symlink(&gdir, dev.join("iommu_group")).unwrap();
                symlink(&dev, gdir.join("devices").join(name)).unwrap();
            }
            dev
        }
        /// The kernel registered `dev` with VFIO: its cdev in sysfs (kernel 6.1 and later).
        fn cdev(&self, dev: &Path, n: u32) {
            std::fs::create_dir_all(dev.join("vfio-dev").join(format!("vfio{n}"))).unwrap();
        }
        /// The group's legacy node, `/dev/vfio/N`.
        fn group_node(&self, group: u32) {
            std::fs::write(self.dev_dir().join(group.to_string()), b"").unwrap();
        }
        /// A device bound to vfio-pci with both signs of registration.
        fn add_vfio(&self, name: &str, group: u32, cdev: u32) -> PathBuf {
            let dev = self.add(name, Some("vfio-pci"), Some(group));
            self.cdev(&dev, cdev);
            self.group_node(group);
            dev
        }
    }

    #[test]
    fn vfio_bound_device_in_a_clean_group_is_accepted() {
        let t = Tree::new();
        let dev = t.add_vfio("0000:41:00.0", 7, 0);
        t.add("0000:40:01.0", Some("pcieport"), Some(7));
        std::fs::write(dev.join("reset_method"), "flr bus\n").unwrap();
        let d = inspect(&dev, &t.dev_dir()).unwrap();
        assert_eq!((d.group, d.driver.as_str()), (7, "vfio-pci"));
        assert_eq!(d.reset_methods, ["flr", "bus"]);
        assert_eq!(d.registration, VfioRegistration::Cdev("vfio0".into()));
    }

    #[test]
    fn group_member_on_a_host_driver_is_named() {
        let t = Tree::new();
        let dev = t.add_vfio("0000:41:00.0", 7, 0);
        t.add("0000:41:00.1", Some("snd_hda_intel"), Some(7));
        let err = inspect(&dev, &t.dev_dir()).unwrap_err();
        assert!(
            matches!(err, SysfsError::GroupNotViable { ref member, ref driver, .. }
            if member == "0000:41:00.1" && driver == "snd_hda_intel")
        );
        assert!(err.to_string().contains("0000:41:00.1"));
    }

    #[test]
    fn bad_inputs_have_their_own_errors() {
        let t = Tree::new();
        let dev_dir = t.dev_dir();
        assert!(matches!(
            inspect(&t.dev("0000:99:00.0"), &dev_dir),
            Err(SysfsError::NotADevice(_))
        ));
        let unbound = t.add("0000:43:00.0", None, Some(9));
        assert!(matches!(
            inspect(&unbound, &dev_dir),
            Err(SysfsError::NotVfioBound { ref driver, .. }) if driver == "no driver"
        ));
        let no_group = t.add("0000:44:00.0", Some("vfio-pci"), None);
        t.cdev(&no_group, 9);
        assert_eq!(
            inspect(&no_group, &dev_dir),
            Err(SysfsError::NoIommuGroup(no_group))
        );
        // A host driver's device without a group (no IOMMU): named by its driver.
        let host_no_group = t.add("0000:44:00.1", Some("virtio-pci"), None);
        assert!(matches!(
            inspect(&host_no_group, &dev_dir),
            Err(SysfsError::NotVfioBound { ref driver, .. }) if driver == "virtio-pci"
        ));
    }

    /// NVIDIA's vGPU VFs (vGPU 17 and later) stay on the `nvidia` driver, which registers
    /// them with VFIO itself: the kernel's registration decides, not the driver's name.
    #[test]
    fn a_device_the_kernel_registered_with_vfio_is_accepted_whatever_its_driver() {
        let t = Tree::new();
        let dev_dir = t.dev_dir();
        // The VF's cdev in sysfs.
        let vf = t.add("0000:41:00.4", Some("nvidia"), Some(20));
        t.cdev(&vf, 3);
        let d = inspect(&vf, &dev_dir).unwrap();
        assert_eq!((d.driver.as_str(), d.group), ("nvidia", 20));
        assert_eq!(d.registration, VfioRegistration::Cdev("vfio3".into()));
        // A kernel before 6.1 shows no cdev: the group's node, the device alone in it.
        let old = t.add("0000:41:00.5", Some("nvidia"), Some(21));
        t.group_node(21);
        let d = inspect(&old, &dev_dir).unwrap();
        assert_eq!(
            d.registration,
            VfioRegistration::GroupNode(dev_dir.join("21"))
        );
        // A vendor VFIO driver is judged the same way.
        let vendor = t.add("0000:45:00.4", Some("nvgrace_gpu_vfio_pci"), Some(10));
        t.cdev(&vendor, 4);
        inspect(&vendor, &dev_dir).unwrap();
        // A group member the kernel registered is viable whatever its driver.
        let gpu = t.add_vfio("0000:46:00.0", 30, 5);
        let sibling = t.add("0000:46:00.1", Some("nvidia"), Some(30));
        t.cdev(&sibling, 6);
        inspect(&gpu, &dev_dir).unwrap();
    }

    /// The control: the same drivers without VFIO registration are refused, naming the
    /// driver, whatever their name says.
    #[test]
    fn a_device_on_a_host_driver_without_vfio_registration_is_refused_naming_it() {
        let t = Tree::new();
        let dev_dir = t.dev_dir();
        let host = t.add("0000:42:00.0", Some("nvidia"), Some(8));
        let err = inspect(&host, &dev_dir).unwrap_err();
        assert!(
            matches!(err, SysfsError::NotVfioBound { ref driver, .. } if driver == "nvidia"),
            "{err}"
        );
        let text = err.to_string();
        assert!(text.contains("bound to nvidia"), "{text}");
        assert!(text.contains("vfio-dev/vfioN"), "{text}");
        assert!(!text.contains("tenantvm host bind"), "{text}");
        // A name with `vfio` in it is no registration either.
        let named = t.add("0000:47:00.0", Some("fake_vfio_named"), Some(11));
        assert!(matches!(
            inspect(&named, &dev_dir),
            Err(SysfsError::NotVfioBound { ref driver, .. }) if driver == "fake_vfio_named"
        ));
        // The group's node exists for a sibling's registration, not this device's: this
        // device is on a host driver, and sysfs shows the sibling's cdev.
        let gpu = t.add("0000:48:00.0", Some("nvidia"), Some(12));
        t.add_vfio("0000:48:00.1", 12, 7);
        assert!(matches!(
            inspect(&gpu, &dev_dir),
            Err(SysfsError::NotVfioBound { ref driver, .. }) if driver == "nvidia"
        ));
        // A group member on a host driver without registration makes the group unusable,
        // even when its driver's name says vfio.
        let dev = t.add_vfio("0000:49:00.0", 13, 8);
        t.add("0000:49:00.1", Some("fake_vfio_named"), Some(13));
        assert!(matches!(
            inspect(&dev, &dev_dir),
            Err(SysfsError::GroupNotViable { ref driver, .. }) if driver == "fake_vfio_named"
        ));
    }
}
