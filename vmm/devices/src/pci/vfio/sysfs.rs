//! What sysfs says about a device handed to the VMM: that the path is a PCI device, which
//! driver it is bound to, its IOMMU group, and whether every other member of the group is
//! in a state VFIO accepts. Every path is relative to the device directory given, so tests
//! run on a fake tree.

use std::path::{Path, PathBuf};

/// Drivers (besides VFIO drivers) a group member may be bound to without making the
/// group unusable: the PCI stub, and bridges' port driver.
const HARMLESS_DRIVERS: [&str; 2] = ["pci-stub", "pcieport"];

/// Why a device cannot be passed through, as sysfs shows it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SysfsError {
    /// The path is not a PCI device directory.
    #[error("{0} is not a PCI device (no such sysfs directory with a `config` file); give /sys/bus/pci/devices/DDDD:BB:DD.F")]
    NotADevice(PathBuf),
    /// The device is bound to no driver or to a host driver.
    #[error("{path} is bound to {driver}, not to a VFIO driver; bind it to vfio-pci first (tenantvm host bind, or driver_override + drivers_probe)")]
    NotVfioBound {
        /// The device.
        path: PathBuf,
        /// Its driver, or "no driver".
        driver: String,
    },
    /// The device has no IOMMU group (no IOMMU, or it is off).
    #[error("{0} has no IOMMU group: enable the IOMMU (intel_iommu=on / amd_iommu=on) in the host kernel command line")]
    NoIommuGroup(PathBuf),
    /// Another member of the group is bound to a host driver.
    #[error("IOMMU group {group} of {path} is not viable: member {member} is bound to host driver {driver}; bind it to vfio-pci as well, or unbind it")]
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

/// A device ready for VFIO, as sysfs describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysfsDevice {
    /// The device directory.
    pub path: PathBuf,
    /// Its name (the PCI address).
    pub name: String,
    /// Its driver (a VFIO driver).
    pub driver: String,
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

/// Whether `driver` is a VFIO driver (vfio-pci, or a vendor's, such as
/// nvgrace_gpu_vfio_pci or mlx5_vfio_pci).
pub fn is_vfio_driver(driver: &str) -> bool {
    driver.contains("vfio")
}

/// Checks `path` can be passed through: a PCI device, bound to a VFIO driver, in an IOMMU
/// group whose other members are unbound, VFIO-bound, or harmless.
pub fn inspect(path: &Path) -> Result<SysfsDevice, SysfsError> {
    if !path.join("config").is_file() {
        return Err(SysfsError::NotADevice(path.to_path_buf()));
    }
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| SysfsError::NotADevice(path.to_path_buf()))?
        .to_owned();
    let driver = driver_of(path);
    let driver = match driver {
        Some(d) if is_vfio_driver(&d) => d,
        other => {
            return Err(SysfsError::NotVfioBound {
                path: path.to_path_buf(),
                driver: other.unwrap_or_else(|| "no driver".into()),
            })
        }
    };
    let group_link = path.join("iommu_group");
    let group = link_name(&group_link)
        .and_then(|g| g.parse::<u32>().ok())
        .ok_or_else(|| SysfsError::NoIommuGroup(path.to_path_buf()))?;
    let mut members: Vec<_> = std::fs::read_dir(group_link.join("devices"))
        .map_err(|_| SysfsError::NoIommuGroup(path.to_path_buf()))?
        .filter_map(|e| e.ok())
        .collect();
    members.sort_by_key(|e| e.file_name());
    for member in members {
        let member_name = member.file_name().to_string_lossy().into_owned();
        if member_name == name {
            continue;
        }
        if let Some(d) = driver_of(&member.path()) {
            if !is_vfio_driver(&d) && !HARMLESS_DRIVERS.contains(&d.as_str()) {
                return Err(SysfsError::GroupNotViable {
                    path: path.to_path_buf(),
                    group,
                    member: member_name,
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
        group,
        reset_methods,
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    /// A fake /sys: devices with drivers, and IOMMU groups listing their members.
    struct Tree(tempfile::TempDir);

    impl Tree {
        fn new() -> Self {
            Self(tempfile::tempdir().unwrap())
        }
        fn dev(&self, name: &str) -> PathBuf {
            self.0.path().join("devices").join(name)
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
    }

    #[test]
    fn vfio_bound_device_in_a_clean_group_is_accepted() {
        let t = Tree::new();
        let dev = t.add("0000:41:00.0", Some("vfio-pci"), Some(7));
        t.add("0000:40:01.0", Some("pcieport"), Some(7));
        std::fs::write(dev.join("reset_method"), "flr bus\n").unwrap();
        let d = inspect(&dev).unwrap();
        assert_eq!((d.group, d.driver.as_str()), (7, "vfio-pci"));
        assert_eq!(d.reset_methods, ["flr", "bus"]);
    }

    #[test]
    fn group_member_on_a_host_driver_is_named() {
        let t = Tree::new();
        let dev = t.add("0000:41:00.0", Some("vfio-pci"), Some(7));
        t.add("0000:41:00.1", Some("snd_hda_intel"), Some(7));
        let err = inspect(&dev).unwrap_err();
        assert!(
            matches!(err, SysfsError::GroupNotViable { ref member, ref driver, .. }
            if member == "0000:41:00.1" && driver == "snd_hda_intel")
        );
        assert!(err.to_string().contains("0000:41:00.1"));
    }

    #[test]
    fn bad_inputs_have_their_own_errors() {
        let t = Tree::new();
        assert!(matches!(
            inspect(&t.dev("0000:99:00.0")),
            Err(SysfsError::NotADevice(_))
        ));
        let host = t.add("0000:42:00.0", Some("nvidia"), Some(8));
        assert!(matches!(
            inspect(&host),
            Err(SysfsError::NotVfioBound { ref driver, .. }) if driver == "nvidia"
        ));
        let unbound = t.add("0000:43:00.0", None, Some(9));
        assert!(matches!(
            inspect(&unbound),
            Err(SysfsError::NotVfioBound { ref driver, .. }) if driver == "no driver"
        ));
        let no_group = t.add("0000:44:00.0", Some("vfio-pci"), None);
        assert_eq!(inspect(&no_group), Err(SysfsError::NoIommuGroup(no_group)));
        // A vendor VFIO driver is a VFIO driver.
        let vendor = t.add("0000:45:00.4", Some("nvgrace_gpu_vfio_pci"), Some(10));
        assert!(inspect(&vendor).is_ok());
    }
}
