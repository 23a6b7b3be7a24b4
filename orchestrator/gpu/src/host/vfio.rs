//! Whole-GPU passthrough: bind every endpoint of the GPU's IOMMU group to vfio-pci
//! (`driver_override`, unbind, `drivers_probe`) and give the previous drivers back on
//! release. Bridges stay with the host. Other functions of the GPU's own slot (its HDMI audio,
//! USB-C and UCSI functions) go with it; any other device of the group that a host driver
//! holds makes the bind refuse, since passing it to a tenant would take it from the host.

use serde::{Deserialize, Serialize};

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

/// The endpoints of the GPU's group that would be bound, or why the group cannot be taken.
pub fn group_endpoints(
    sysfs: &Sysfs,
    gpu: &PciAddress,
) -> Result<(u32, Vec<PciDevice>), HostDeviceError> {
    let dev = sysfs.device(gpu)?;
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

/// Binds one device to `driver` through driver_override, unbind and drivers_probe.
fn rebind(
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

/// Binds every endpoint of the GPU's IOMMU group to vfio-pci. On failure the devices
/// already moved are given back before the error is returned.
pub fn bind_group(sysfs: &Sysfs, gpu: &PciAddress) -> Result<VfioBinding, HostDeviceError> {
    if !sysfs.has_driver(VFIO_DRIVER) {
        return Err(HostDeviceError::NoVfioDriver);
    }
    let (group, endpoints) = group_endpoints(sysfs, gpu)?;
    let mut binding = VfioBinding {
        group,
        gpu: gpu.to_string(),
        devices: Vec::new(),
    };
    for d in endpoints {
        let previous_override = read_override(sysfs, d.address.as_str())?;
        binding.devices.push(BoundDevice {
            address: d.address.to_string(),
            previous_driver: d.driver.clone(),
            previous_override,
        });
        if let Err(e) = rebind(sysfs, &d.address, Some(VFIO_DRIVER), VFIO_DRIVER) {
            if let Err(undo) = release(sysfs, &binding) {
                tracing::error!(error = %undo, "restoring drivers after a failed bind also failed");
            }
            return Err(e);
        }
    }
    tracing::info!(group, gpu = %gpu, devices = binding.devices.len(), "IOMMU group bound to vfio-pci");
    Ok(binding)
}

/// Gives every device of a binding its previous driver and driver_override back.
pub fn release(sysfs: &Sysfs, binding: &VfioBinding) -> Result<(), HostDeviceError> {
    let mut first_error = None;
    for d in binding.devices.iter().rev() {
        let addr = PciAddress::parse(&d.address)?;
        let restore = d.previous_override.clone().unwrap_or_else(|| "\n".into());
        if let Err(e) = rebind(sysfs, &addr, d.previous_driver.as_deref(), &restore) {
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
        release(&s, &b).unwrap();
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
