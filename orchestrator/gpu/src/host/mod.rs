//! Host device work through sysfs: PCI devices, IOMMU groups, vfio-pci binding, SR-IOV
//! virtual functions, vGPU types and mdevs, and GPU sharing without a partition (MPS,
//! time-sliced vGPU: [`soft_sharing`]).
//!
//! Every path is under a configurable root ([`Sysfs::new`]): `/` on a real host, where the
//! writes reach the kernel, or a fake tree in tests ([`fake`]), where a small emulation of the
//! kernel's reactions (unbind, probe, VF creation, mdev create/remove) keeps the flows
//! checkable end to end.

pub mod fake;
pub mod mdev;
pub mod reset;
pub mod soft_sharing;
pub mod sriov;
pub mod uuid;
pub mod vfio;
pub mod vgpu;

use std::io;
use std::path::{Path, PathBuf};

use serde::Serialize;
use thiserror::Error;

use crate::mig::VgpuSupport;

/// Errors of host device work.
#[derive(Debug, Error)]
pub enum HostDeviceError {
    /// A sysfs file could not be read or written.
    #[error("Sysfs {op} of {path} failed: {source}")]
    Io {
        /// `read` or `write` or `list`.
        op: &'static str,
        /// The path.
        path: String,
        /// The cause.
        source: io::Error,
    },
    /// A PCI address that is malformed.
    #[error("`{0}` is not a PCI address: use the form 0000:18:00.0")]
    BadAddress(String),
    /// No such PCI device.
    #[error("No PCI device {0} on this host: list them with `lspci -D`")]
    NoDevice(String),
    /// The device has no IOMMU group.
    #[error("PCI device {0} has no IOMMU group: enable the IOMMU (intel_iommu=on or amd_iommu=on on the kernel command line)")]
    NoIommuGroup(String),
    /// vfio-pci is not loaded.
    #[error("The vfio-pci driver is not loaded: run `modprobe vfio-pci`")]
    NoVfioDriver,
    /// Another device of the group is in use by the host.
    #[error("IOMMU group {group} also holds {device} (driver {driver}), which the host is using: move it to another slot, unbind it yourself, or give the VM the whole group on purpose")]
    GroupInUse {
        /// The group.
        group: u32,
        /// The other device.
        device: String,
        /// Its driver.
        driver: String,
    },
    /// The kernel did not bind the driver asked for.
    #[error("Binding {device} to {wanted} failed: it is bound to {actual}; see `dmesg`")]
    BindFailed {
        /// The device.
        device: String,
        /// The driver asked for.
        wanted: String,
        /// What it has now.
        actual: String,
    },
    /// The device is a vGPU virtual function, which must stay on the nvidia driver.
    #[error("{0} is a vGPU virtual function: it stays bound to nvidia (never vfio-pci); hand it to the VM by its sysfs path")]
    VgpuVf(String),
    /// The GPU has SR-IOV virtual functions enabled (it is in vGPU mode).
    #[error("{device} has {vfs} SR-IOV virtual functions enabled (it is in vGPU mode): let its vGPU tenants depart and leave vGPU mode before giving it whole")]
    VfsEnabled {
        /// The GPU.
        device: String,
        /// Enabled VFs.
        vfs: u32,
    },
}

/// A PCI address (`0000:18:00.0`), validated.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct PciAddress(String);

impl PciAddress {
    /// Validates `dddd:bb:dd.f` (hex digits).
    pub fn parse(s: &str) -> Result<Self, HostDeviceError> {
        let b = s.as_bytes();
        let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
        let ok = b.len() == 12
            && b[4] == b':'
            && b[7] == b':'
            && b[10] == b'.'
            && hex(0..4)
            && hex(5..7)
            && hex(8..10)
            && (b'0'..=b'7').contains(&b[11]);
        if ok {
            Ok(PciAddress(s.to_ascii_lowercase()))
        } else {
            Err(HostDeviceError::BadAddress(s.to_string()))
        }
    }

    /// The address as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Domain, bus and device without the function: functions of one slot share it.
    pub fn slot(&self) -> &str {
        &self.0[..10]
    }
}

impl std::fmt::Display for PciAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What sysfs says about one PCI device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PciDevice {
    /// Address.
    pub address: PciAddress,
    /// Vendor id.
    pub vendor: u16,
    /// Device id.
    pub device: u16,
    /// Class code (24 bits, e.g. 0x030200 for a 3D controller).
    pub class: u32,
    /// Bound driver, if any.
    pub driver: Option<String>,
    /// IOMMU group, if any.
    pub iommu_group: Option<u32>,
}

impl PciDevice {
    /// PCI-to-PCI bridges (class 0x0604) and host bridges (0x0600) stay with the host.
    pub fn is_bridge(&self) -> bool {
        matches!(self.class >> 8, 0x0600 | 0x0604)
    }

    /// Display (0x03xx) controllers.
    pub fn is_gpu(&self) -> bool {
        self.class >> 16 == 0x03
    }
}

/// The fake kernel's hooks (fake trees only).
#[derive(Clone, Copy)]
pub(crate) struct KernelEmulation {
    /// Performs a write, the file's new contents included, or refuses it with an errno.
    pub write: fn(&Sysfs, &Path, &str) -> io::Result<()>,
    /// Answers a read of a dynamic attribute; `None`: read the file.
    pub read: fn(&Sysfs, &Path) -> Option<io::Result<Vec<u8>>>,
}

/// A driver that answers some attributes in place of the kernel's: the SIMULATED NVIDIA
/// driver laid over a real host's PCI functions ([`crate::backend::sim::vendor`]). What it
/// does not answer goes to the sysfs below it.
pub trait DriverOverlay: Send + Sync {
    /// Performs a write of an attribute it owns; `None`: not its attribute.
    fn write(&self, below: &Sysfs, path: &Path, value: &str) -> Option<io::Result<()>>;
    /// Answers a read of an attribute it owns; `None`: not its attribute.
    fn read(&self, below: &Sysfs, path: &Path) -> Option<io::Result<Vec<u8>>>;
    /// What it stands in for, in words (receipts and logs say so).
    fn describe(&self) -> String;
}

/// Sysfs (and /dev, /proc) under a root.
#[derive(Clone)]
pub struct Sysfs {
    root: PathBuf,
    emulate: Option<KernelEmulation>,
    overlay: Option<std::sync::Arc<dyn DriverOverlay>>,
}

impl std::fmt::Debug for Sysfs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sysfs")
            .field("root", &self.root)
            .field("fake", &self.emulate.is_some())
            .field("overlay", &self.overlay.as_ref().map(|o| o.describe()))
            .finish()
    }
}

fn parse_hex(s: &str) -> Option<u32> {
    u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok()
}

impl Sysfs {
    /// The real host's files under `root` (normally `/`).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Sysfs {
            root: root.into(),
            emulate: None,
            overlay: None,
        }
    }

    /// The same files with `overlay` answering the attributes it owns.
    pub fn with_overlay(self, overlay: std::sync::Arc<dyn DriverOverlay>) -> Self {
        Sysfs {
            overlay: Some(overlay),
            ..self
        }
    }

    /// What is below the overlay: the same files without it.
    pub fn below(&self) -> Sysfs {
        Sysfs {
            overlay: None,
            ..self.clone()
        }
    }

    /// What the overlay stands in for, when there is one.
    pub fn overlay(&self) -> Option<String> {
        self.overlay.as_ref().map(|o| o.describe())
    }

    /// The root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A path under the root (`rel` without a leading `/`).
    pub fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel.trim_start_matches('/'))
    }

    fn pci_dir(&self, addr: &PciAddress) -> PathBuf {
        self.path("sys/bus/pci/devices").join(addr.as_str())
    }

    /// Reads a file's bytes (through the fake kernel for a fake tree's dynamic attributes).
    pub fn read_bytes(&self, path: &Path) -> Result<Vec<u8>, HostDeviceError> {
        let overlaid = self
            .overlay
            .as_ref()
            .and_then(|o| o.read(&self.below(), path));
        let answer = match overlaid.or_else(|| self.emulate.and_then(|e| (e.read)(self, path))) {
            Some(answer) => answer,
            None => std::fs::read(path),
        };
        answer.map_err(|source| HostDeviceError::Io {
            op: "read",
            path: path.display().to_string(),
            source,
        })
    }

    /// Reads a file as trimmed text.
    pub fn read(&self, path: &Path) -> Result<String, HostDeviceError> {
        let bytes = self.read_bytes(path)?;
        Ok(String::from_utf8_lossy(&bytes).trim().to_string())
    }

    /// Reads an attribute that the kernel answers with ENXIO while it has no value (a VF's
    /// `nvidia/gpu_instance_id` before a vGPU type is set): `None` then.
    pub fn read_unless_enxio(&self, path: &Path) -> Result<Option<String>, HostDeviceError> {
        match self.read(path) {
            Ok(v) => Ok(Some(v)),
            Err(HostDeviceError::Io { source, .. })
                if source.raw_os_error() == Some(libc::ENXIO) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Writes `value` to a sysfs file (one write, as the kernel expects).
    pub fn write(&self, path: &Path, value: &str) -> Result<(), HostDeviceError> {
        tracing::debug!(path = %path.display(), value, "sysfs write");
        let io_err = |source| HostDeviceError::Io {
            op: "write",
            path: path.display().to_string(),
            source,
        };
        if let Some(done) = self
            .overlay
            .as_ref()
            .and_then(|o| o.write(&self.below(), path, value))
        {
            return done.map_err(io_err);
        }
        if let Some(emulate) = self.emulate {
            return (emulate.write)(self, path, value).map_err(io_err);
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(path)
            .map_err(io_err)?;
        std::io::Write::write_all(&mut f, value.as_bytes()).map_err(io_err)
    }

    /// The sysfs directory of a PCI device.
    pub fn device_dir(&self, addr: &PciAddress) -> PathBuf {
        self.pci_dir(addr)
    }

    /// The PF of a virtual function (its `physfn` link), or None for a PF.
    pub fn physfn(&self, addr: &PciAddress) -> Option<PciAddress> {
        self.link_name(&self.pci_dir(addr).join("physfn"))
            .and_then(|n| PciAddress::parse(&n).ok())
    }

    /// Major version of the loaded NVIDIA driver (`/sys/module/nvidia/version`).
    pub fn nvidia_driver(&self) -> Option<(String, u32)> {
        let v = self.read(&self.path("sys/module/nvidia/version")).ok()?;
        let major = v.split('.').next()?.parse().ok()?;
        Some((v, major))
    }

    /// Basename of a symlink's target (`driver` → `nvidia`), or None when it is absent.
    fn link_name(&self, path: &Path) -> Option<String> {
        std::fs::read_link(path)
            .ok()?
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
    }

    /// Lists a directory's entry names, sorted; empty when it does not exist.
    pub fn list(&self, path: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(path)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// What sysfs says about a device.
    pub fn device(&self, addr: &PciAddress) -> Result<PciDevice, HostDeviceError> {
        let dir = self.pci_dir(addr);
        if !dir.exists() {
            return Err(HostDeviceError::NoDevice(addr.to_string()));
        }
        let hex = |name: &str| -> Result<u32, HostDeviceError> {
            let p = dir.join(name);
            let s = self.read(&p)?;
            parse_hex(&s).ok_or_else(|| HostDeviceError::Io {
                op: "read",
                path: p.display().to_string(),
                source: io::Error::new(io::ErrorKind::InvalidData, format!("not hex: {s}")),
            })
        };
        Ok(PciDevice {
            address: addr.clone(),
            vendor: hex("vendor")? as u16,
            device: hex("device")? as u16,
            class: hex("class")?,
            driver: self.link_name(&dir.join("driver")),
            iommu_group: self
                .link_name(&dir.join("iommu_group"))
                .and_then(|g| g.parse().ok()),
        })
    }

    /// Every PCI device.
    pub fn devices(&self) -> Result<Vec<PciDevice>, HostDeviceError> {
        self.list(&self.path("sys/bus/pci/devices"))
            .iter()
            .filter_map(|a| PciAddress::parse(a).ok())
            .map(|a| self.device(&a))
            .collect()
    }

    /// The IOMMU groups that exist.
    pub fn iommu_groups(&self) -> Vec<u32> {
        let mut g: Vec<u32> = self
            .list(&self.path("sys/kernel/iommu_groups"))
            .iter()
            .filter_map(|s| s.parse().ok())
            .collect();
        g.sort_unstable();
        g
    }

    /// The devices of an IOMMU group.
    pub fn group_members(&self, group: u32) -> Result<Vec<PciDevice>, HostDeviceError> {
        self.list(&self.path(&format!("sys/kernel/iommu_groups/{group}/devices")))
            .iter()
            .filter_map(|a| PciAddress::parse(a).ok())
            .map(|a| self.device(&a))
            .collect()
    }

    /// Whether a PCI driver is registered (its module is loaded).
    pub fn has_driver(&self, name: &str) -> bool {
        self.path("sys/bus/pci/drivers").join(name).is_dir()
    }
}

/// How MIG instances of the GPU at `addr` could reach a VM, from sysfs: SR-IOV VFs with
/// NVIDIA's vGPU manager loaded, mdev types, or neither (and what is missing). `host check`
/// and the NVML backend both use this, so they feed [`crate::mig::decide`] the same facts.
pub fn vgpu_support(sysfs: &Sysfs, addr: &PciAddress) -> VgpuSupport {
    let dir = sysfs.pci_dir(addr);
    let total_vfs: u32 = sysfs
        .read(&dir.join("sriov_totalvfs"))
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let manager = sysfs.path("sys/module/nvidia_vgpu_vfio").is_dir();
    if total_vfs > 0 && manager {
        VgpuSupport::Sriov { total_vfs }
    } else if dir.join("mdev_supported_types").is_dir() {
        VgpuSupport::Mdev
    } else if total_vfs > 0 {
        VgpuSupport::Missing {
            reason: format!(
                "the GPU has {total_vfs} SR-IOV VFs but NVIDIA's vGPU manager (nvidia_vgpu_vfio) is not loaded"
            ),
        }
    } else {
        VgpuSupport::Missing {
            reason: "the GPU has neither SR-IOV VFs nor mdev types".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_are_validated() {
        let a = PciAddress::parse("0000:18:00.1").unwrap();
        assert_eq!(a.slot(), "0000:18:00");
        for bad in [
            "18:00.0",
            "0000:18:00.8",
            "0000:18:00:0",
            "../../etc/x",
            "0000:1g:00.0",
        ] {
            assert!(PciAddress::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn missing_device_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let s = Sysfs::new(dir.path());
        let e = s
            .device(&PciAddress::parse("0000:01:00.0").unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("lspci"), "{e}");
        assert!(s.devices().unwrap().is_empty());
        assert!(s.iommu_groups().is_empty());
    }
}
