//! Whole-GPU passthrough: bind every endpoint of the GPU's IOMMU group to vfio-pci
//! (`driver_override`, unbind, `drivers_probe`) and give the previous drivers back at
//! departure. Bridges stay with the host. Other functions of the GPU's own slot (its HDMI
//! audio, USB-C and UCSI functions) go with it; any other device of the group that a host
//! driver holds makes the bind refuse, since passing it to a tenant would take it from the
//! host.
//!
//! Crash safety: [`plan_bind`] reads the drivers the devices have now and touches nothing; the
//! caller records the [`VfioBinding`] before [`apply_bind`] moves any device, so a process
//! killed half-way still knows every device's original driver. Both [`apply_bind`] and
//! [`rebind_host_drivers`] check each device first and only move the ones not yet where they
//! should be, so either can be run again until it succeeds.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::{HostDeviceError, PciAddress, PciDevice, Sysfs};

/// The driver a passed-through device must have.
pub const VFIO_DRIVER: &str = "vfio-pci";

/// Drivers that mean "nobody on the host uses this device".
const UNUSED_DRIVERS: &[&str] = &[VFIO_DRIVER, "pci-stub"];

/// One device bound to vfio-pci and what it had before.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoundDevice {
    /// The device.
    pub address: String,
    /// Driver before the bind (None: unbound).
    pub previous_driver: Option<String>,
    /// `driver_override` before the bind (None: `(null)`).
    pub previous_override: Option<String>,
}

/// A group handed to vfio-pci; store it to release the group later (even after a restart).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VfioBinding {
    /// The IOMMU group (`/dev/vfio/<group>`).
    pub group: u32,
    /// The GPU asked for.
    pub gpu: String,
    /// Every endpoint bound, the GPU included.
    pub devices: Vec<BoundDevice>,
}

/// Why a device could not be given back to its host driver (departure step
/// [`RebindError::STEP`]).
#[derive(Debug, Error)]
pub enum RebindError {
    /// A sysfs write or read failed.
    #[error("Rebinding {device} to its host driver ({wanted}) failed: {source}")]
    Sysfs {
        /// The device.
        device: String,
        /// The driver it should get back.
        wanted: String,
        /// The cause.
        source: HostDeviceError,
    },
    /// The kernel bound another driver (or none).
    #[error("Rebinding {device} to its host driver failed: it is bound to {actual}, not {wanted}; check that the {wanted} module is loaded and see `dmesg`")]
    Mismatch {
        /// The device.
        device: String,
        /// The driver it should have.
        wanted: String,
        /// What it has.
        actual: String,
    },
}

impl RebindError {
    /// The departure step this error belongs to, as receipts name it.
    pub const STEP: &'static str = "rebind-host-driver";
}

/// The endpoints of the GPU's group that would be bound, or why the group cannot be taken.
pub fn group_endpoints(
    sysfs: &Sysfs,
    gpu: &PciAddress,
) -> Result<(u32, Vec<PciDevice>), HostDeviceError> {
    let dev = sysfs.device(gpu)?;
    if sysfs.physfn(gpu).is_some() && sysfs.device_dir(gpu).join("nvidia").is_dir() {
        return Err(HostDeviceError::VgpuVf(gpu.to_string()));
    }
    let vfs: u32 = sysfs
        .read(&sysfs.device_dir(gpu).join("sriov_numvfs"))
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if vfs > 0 {
        return Err(HostDeviceError::VfsEnabled {
            device: gpu.to_string(),
            vfs,
        });
    }
    let group = dev
        .iommu_group
        .ok_or_else(|| HostDeviceError::NoIommuGroup(gpu.to_string()))?;
    let mut endpoints = Vec::new();
    for m in sysfs.group_members(group)? {
        if m.is_bridge() {
            continue;
        }
        let same_slot = m.address.slot() == gpu.slot();
        let host_driver = m.driver.as_deref().filter(|d| !UNUSED_DRIVERS.contains(d));
        if let (false, Some(driver)) = (same_slot, host_driver) {
            return Err(HostDeviceError::GroupInUse {
                group,
                device: m.address.to_string(),
                driver: driver.to_string(),
            });
        }
        endpoints.push(m);
    }
    Ok((group, endpoints))
}

fn dev_path(sysfs: &Sysfs, addr: &str, file: &str) -> std::path::PathBuf {
    sysfs.path("sys/bus/pci/devices").join(addr).join(file)
}

fn read_override(sysfs: &Sysfs, addr: &str) -> Result<Option<String>, HostDeviceError> {
    let v = sysfs.read(&dev_path(sysfs, addr, "driver_override"))?;
    Ok(if v.is_empty() || v == "(null)" {
        None
    } else {
        Some(v)
    })
}

fn current_driver(sysfs: &Sysfs, addr: &PciAddress) -> Result<Option<String>, HostDeviceError> {
    Ok(sysfs.device(addr)?.driver)
}

/// Binds one device to `driver` (none: leaves it unbound) through driver_override, unbind
/// and drivers_probe; checks the kernel bound it.
pub(crate) fn rebind(
    sysfs: &Sysfs,
    addr: &PciAddress,
    driver: Option<&str>,
    override_value: &str,
) -> Result<(), HostDeviceError> {
    let a = addr.as_str();
    sysfs.write(&dev_path(sysfs, a, "driver_override"), override_value)?;
    if let Some(cur) = current_driver(sysfs, addr)? {
        if Some(cur.as_str()) == driver {
            return Ok(());
        }
        sysfs.write(&dev_path(sysfs, a, "driver/unbind"), a)?;
    }
    let Some(want) = driver else { return Ok(()) };
    sysfs.write(&sysfs.path("sys/bus/pci/drivers_probe"), a)?;
    let actual = current_driver(sysfs, addr)?;
    if actual.as_deref() != Some(want) {
        return Err(HostDeviceError::BindFailed {
            device: a.to_string(),
            wanted: want.to_string(),
            actual: actual.unwrap_or_else(|| "no driver".into()),
        });
    }
    Ok(())
}

/// What binding the GPU's group would do: every endpoint with the driver and override it has
/// now. Touches nothing; record the result before [`apply_bind`].
pub fn plan_bind(sysfs: &Sysfs, gpu: &PciAddress) -> Result<VfioBinding, HostDeviceError> {
    if !sysfs.has_driver(VFIO_DRIVER) {
        return Err(HostDeviceError::NoVfioDriver);
    }
    let (group, endpoints) = group_endpoints(sysfs, gpu)?;
    let mut devices = Vec::with_capacity(endpoints.len());
    for d in endpoints {
        devices.push(BoundDevice {
            previous_override: read_override(sysfs, d.address.as_str())?,
            address: d.address.to_string(),
            previous_driver: d.driver.clone(),
        });
    }
    Ok(VfioBinding {
        group,
        gpu: gpu.to_string(),
        devices,
    })
}

/// Moves every device of a recorded binding to vfio-pci; devices already there are left
/// alone. On failure the devices are given back to their recorded drivers before the error
/// is returned.
pub fn apply_bind(sysfs: &Sysfs, binding: &VfioBinding) -> Result<(), HostDeviceError> {
    for d in &binding.devices {
        let addr = PciAddress::parse(&d.address)?;
        let done = current_driver(sysfs, &addr)?.as_deref() == Some(VFIO_DRIVER)
            && read_override(sysfs, &d.address)?.as_deref() == Some(VFIO_DRIVER);
        if done {
            continue;
        }
        if let Err(e) = rebind(sysfs, &addr, Some(VFIO_DRIVER), VFIO_DRIVER) {
            if let Err(undo) = rebind_host_drivers(sysfs, binding) {
                tracing::error!(error = %undo, "restoring drivers after a failed bind also failed");
            }
            return Err(e);
        }
    }
    tracing::info!(group = binding.group, gpu = %binding.gpu, devices = binding.devices.len(), "IOMMU group bound to vfio-pci");
    Ok(())
}

/// [`plan_bind`] then [`apply_bind`], for callers that keep nothing across a crash.
pub fn bind_group(sysfs: &Sysfs, gpu: &PciAddress) -> Result<VfioBinding, HostDeviceError> {
    let binding = plan_bind(sysfs, gpu)?;
    apply_bind(sysfs, &binding)?;
    Ok(binding)
}

/// The sysfs paths of the bound devices, the GPU first: what the VMM is given
/// (`--device vfio,path=...`, QEMU's `-device vfio-pci,sysfsdev=...`).
pub fn device_paths(sysfs: &Sysfs, binding: &VfioBinding) -> Vec<std::path::PathBuf> {
    let mut v: Vec<&BoundDevice> = binding.devices.iter().collect();
    v.sort_by_key(|d| d.address != binding.gpu);
    v.into_iter()
        .map(|d| sysfs.path("sys/bus/pci/devices").join(&d.address))
        .collect()
}

/// Departure: gives every device of a binding its recorded driver and `driver_override`
/// back, and checks that the kernel bound that driver. Devices already back are left alone.
/// Every device is tried; the first failure is returned.
pub fn rebind_host_drivers(sysfs: &Sysfs, binding: &VfioBinding) -> Result<(), RebindError> {
    let mut first_error = None;
    for d in binding.devices.iter().rev() {
        let wanted = d
            .previous_driver
            .clone()
            .unwrap_or_else(|| "no driver".into());
        let sysfs_err = |source| RebindError::Sysfs {
            device: d.address.clone(),
            wanted: wanted.clone(),
            source,
        };
        let outcome = (|| {
            let addr = PciAddress::parse(&d.address).map_err(sysfs_err)?;
            let restore = d.previous_override.clone().unwrap_or_else(|| "\n".into());
            match rebind(sysfs, &addr, d.previous_driver.as_deref(), &restore) {
                Ok(()) => {}
                Err(HostDeviceError::BindFailed { actual, .. }) => {
                    return Err(RebindError::Mismatch {
                        device: d.address.clone(),
                        wanted: wanted.clone(),
                        actual,
                    })
                }
                Err(e) => return Err(sysfs_err(e)),
            }
            let actual = current_driver(sysfs, &addr).map_err(sysfs_err)?;
            if actual != d.previous_driver {
                return Err(RebindError::Mismatch {
                    device: d.address.clone(),
                    wanted: wanted.clone(),
                    actual: actual.unwrap_or_else(|| "no driver".into()),
                });
            }
            Ok(())
        })();
        if let Err(e) = outcome {
            tracing::error!(device = %d.address, error = %e, "could not restore driver");
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;

    #[test]
    fn binding_takes_the_gpu_and_its_audio_function_and_release_restores_them() {
        let host = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
        let s = host.sysfs();
        let gpu = PciAddress::parse("0000:01:00.0").unwrap();
        let b = bind_group(&s, &gpu).unwrap();
        assert_eq!(b.group, 12);
        let addrs: Vec<&str> = b.devices.iter().map(|d| d.address.as_str()).collect();
        assert_eq!(
            addrs,
            ["0000:01:00.0", "0000:01:00.1"],
            "bridge 0000:00:01.0 stays with the host"
        );
        for a in ["0000:01:00.0", "0000:01:00.1"] {
            assert_eq!(
                s.device(&PciAddress::parse(a).unwrap())
                    .unwrap()
                    .driver
                    .as_deref(),
                Some(VFIO_DRIVER)
            );
        }
        let bridge = s
            .device(&PciAddress::parse("0000:00:01.0").unwrap())
            .unwrap();
        assert_eq!(bridge.driver.as_deref(), Some("pcieport"));
        rebind_host_drivers(&s, &b).unwrap();
        let gpu_dev = s.device(&gpu).unwrap();
        assert_eq!(gpu_dev.driver.as_deref(), Some("nvidia"));
        let audio = s
            .device(&PciAddress::parse("0000:01:00.1").unwrap())
            .unwrap();
        assert_eq!(audio.driver.as_deref(), Some("snd_hda_intel"));
        assert_eq!(read_override(&s, "0000:01:00.0").unwrap(), None);
    }

    #[test]
    fn a_group_member_the_host_uses_makes_the_bind_refuse() {
        let host = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
        let s = host.sysfs();
        let e = bind_group(&s, &PciAddress::parse("0000:03:00.0").unwrap()).unwrap_err();
        assert!(
            matches!(&e, HostDeviceError::GroupInUse { device, .. } if device == "0000:04:00.0"),
            "{e}"
        );
        // Nothing was touched.
        let gpu = s
            .device(&PciAddress::parse("0000:03:00.0").unwrap())
            .unwrap();
        assert_eq!(gpu.driver.as_deref(), Some("nvidia"));
    }

    #[test]
    fn missing_vfio_driver_and_missing_iommu_are_refused_with_the_fix() {
        let mut spec = FakeHost::audio_host_spec();
        spec.drivers.retain(|d| d != VFIO_DRIVER);
        let host = FakeHost::build(&spec).unwrap();
        let e = bind_group(&host.sysfs(), &PciAddress::parse("0000:01:00.0").unwrap()).unwrap_err();
        assert!(e.to_string().contains("modprobe vfio-pci"), "{e}");
        let mut spec = FakeHost::audio_host_spec();
        for d in &mut spec.devices {
            d.iommu_group = None;
        }
        let host = FakeHost::build(&spec).unwrap();
        let e = bind_group(&host.sysfs(), &PciAddress::parse("0000:01:00.0").unwrap()).unwrap_err();
        assert!(e.to_string().contains("intel_iommu=on"), "{e}");
    }

    #[test]
    fn a_failed_probe_rolls_back_the_devices_already_moved() {
        let mut spec = FakeHost::audio_host_spec();
        // The audio function refuses vfio-pci (the fake kernel leaves it unbound).
        spec.devices
            .iter_mut()
            .find(|d| d.bdf == "0000:01:00.1")
            .unwrap()
            .refuse_vfio = true;
        let host = FakeHost::build(&spec).unwrap();
        let s = host.sysfs();
        let e = bind_group(&s, &PciAddress::parse("0000:01:00.0").unwrap()).unwrap_err();
        assert!(matches!(e, HostDeviceError::BindFailed { .. }), "{e}");
        let gpu = s
            .device(&PciAddress::parse("0000:01:00.0").unwrap())
            .unwrap();
        assert_eq!(gpu.driver.as_deref(), Some("nvidia"));
        let audio = s
            .device(&PciAddress::parse("0000:01:00.1").unwrap())
            .unwrap();
        assert_eq!(audio.driver.as_deref(), Some("snd_hda_intel"));
    }
}
