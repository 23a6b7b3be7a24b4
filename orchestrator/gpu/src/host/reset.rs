//! The checked function reset of a whole GPU at departure, through sysfs: after the VM has
//! stopped and while the devices are still on vfio-pci, write `1` to each device's `reset`
//! (the kernel runs the first method of `reset_method` that works: FLR, then a secondary bus
//! reset, ...) and check that the device answers again with its own ids in config space.
//!
//! The GPU itself must reset; its companion functions (HDMI audio, USB-C) are reset when they
//! can be, and a companion without a reset method is recorded as such.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::vfio::{VfioBinding, VFIO_DRIVER};
use super::{HostDeviceError, PciAddress, Sysfs};

/// Why a device reset failed (departure step [`ResetError::STEP`]).
#[derive(Debug, Error)]
pub enum ResetError {
    /// The kernel knows no reset method for the GPU.
    #[error("{device} cannot be reset: the kernel has no reset method for it (no `reset` attribute); the card must stay quarantined until the host is power-cycled")]
    NoResetMethod {
        /// The device.
        device: String,
    },
    /// A host driver holds the device.
    #[error("{device} is bound to {driver}, not vfio-pci: a reset would pull the device from under that driver; the reset belongs between the VM's stop and the rebind")]
    HostDriverBound {
        /// The device.
        device: String,
        /// Its driver.
        driver: String,
    },
    /// The reset itself failed.
    #[error("Resetting {device} failed: {source}; stop whatever still holds the device (the VMM) and run the departure again")]
    Failed {
        /// The device.
        device: String,
        /// The cause.
        source: HostDeviceError,
    },
    /// After the reset the device does not answer with its ids.
    #[error("{device} did not come back from its reset: config space reads vendor {vendor:04x} device {device_id:04x}, expected {expected_vendor:04x}:{expected_device:04x}")]
    NotResponding {
        /// The device.
        device: String,
        /// Vendor id read back.
        vendor: u16,
        /// Device id read back.
        device_id: u16,
        /// Vendor id expected.
        expected_vendor: u16,
        /// Device id expected.
        expected_device: u16,
    },
    /// Sysfs could not be read.
    #[error("Resetting {device}: {source}")]
    Sysfs {
        /// The device.
        device: String,
        /// The cause.
        source: HostDeviceError,
    },
}

impl ResetError {
    /// The departure step this error belongs to, as receipts name it.
    pub const STEP: &'static str = "device-reset";
}

/// What happened to one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum DeviceReset {
    /// Reset, and it answered with its ids afterwards.
    Reset {
        /// The kernel's `reset_method` list (empty on kernels before 5.15, which do not
        /// have the attribute): the first that works is used.
        methods: Vec<String>,
    },
    /// A companion function without a reset method (the GPU never is one).
    NoMethod,
    /// Not reset again: the device is back on its host driver, which the departure only does
    /// after the reset step.
    AlreadyRebound {
        /// Its driver.
        driver: String,
    },
}

/// The reset of a whole GPU, for the receipt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetRecord {
    /// The GPU.
    pub gpu: String,
    /// Per device of the binding, the GPU first.
    pub devices: Vec<(String, DeviceReset)>,
}

impl ResetRecord {
    /// How it was done, in words.
    pub fn method(&self) -> String {
        match self.devices.first() {
            Some((_, DeviceReset::Reset { methods })) if !methods.is_empty() => format!(
                "PCI function reset through sysfs (the kernel's first working method of: {})",
                methods.join(", ")
            ),
            Some((_, DeviceReset::AlreadyRebound { driver })) => {
                format!("not repeated: the GPU is back on {driver}, which follows its reset")
            }
            _ => "PCI function reset through sysfs".into(),
        }
    }
}

fn config_ids(sysfs: &Sysfs, addr: &PciAddress) -> Result<(u16, u16), HostDeviceError> {
    let path = sysfs.device_dir(addr).join("config");
    let c = sysfs.read_bytes(&path)?;
    if c.len() < 4 {
        return Ok((0xffff, 0xffff));
    }
    Ok((
        u16::from_le_bytes([c[0], c[1]]),
        u16::from_le_bytes([c[2], c[3]]),
    ))
}

fn reset_one(
    sysfs: &Sysfs,
    address: &str,
    previous_driver: Option<&str>,
    is_gpu: bool,
) -> Result<DeviceReset, ResetError> {
    let sys_err = |source| ResetError::Sysfs {
        device: address.to_string(),
        source,
    };
    let addr = PciAddress::parse(address).map_err(sys_err)?;
    let dev = sysfs.device(&addr).map_err(sys_err)?;
    if let Some(driver) = dev.driver.as_deref().filter(|d| *d != VFIO_DRIVER) {
        if previous_driver == Some(driver) {
            return Ok(DeviceReset::AlreadyRebound {
                driver: driver.to_string(),
            });
        }
        return Err(ResetError::HostDriverBound {
            device: address.to_string(),
            driver: driver.to_string(),
        });
    }
    let dir = sysfs.device_dir(&addr);
    if !dir.join("reset").exists() {
        return if is_gpu {
            Err(ResetError::NoResetMethod {
                device: address.to_string(),
            })
        } else {
            Ok(DeviceReset::NoMethod)
        };
    }
    let methods: Vec<String> = sysfs
        .read(&dir.join("reset_method"))
        .map(|m| m.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default();
    sysfs
        .write(&dir.join("reset"), "1")
        .map_err(|source| ResetError::Failed {
            device: address.to_string(),
            source,
        })?;
    let (vendor, device_id) = config_ids(sysfs, &addr).map_err(sys_err)?;
    if (vendor, device_id) != (dev.vendor, dev.device) {
        return Err(ResetError::NotResponding {
            device: address.to_string(),
            vendor,
            device_id,
            expected_vendor: dev.vendor,
            expected_device: dev.device,
        });
    }
    Ok(DeviceReset::Reset { methods })
}

/// Resets every device of a whole-GPU binding, the GPU first, and checks each came back. Run
/// it after the VM has stopped and before [`super::vfio::rebind_host_drivers`]; run again
/// after a crash, it resets again (harmless), or records that the devices are already back on
/// their host drivers.
pub fn reset_gpu(sysfs: &Sysfs, binding: &VfioBinding) -> Result<ResetRecord, ResetError> {
    let mut devices: Vec<&super::vfio::BoundDevice> = binding.devices.iter().collect();
    devices.sort_by_key(|d| d.address != binding.gpu);
    let mut out = Vec::with_capacity(devices.len());
    for d in devices {
        let is_gpu = d.address == binding.gpu;
        let r = reset_one(sysfs, &d.address, d.previous_driver.as_deref(), is_gpu)?;
        out.push((d.address.clone(), r));
    }
    tracing::info!(gpu = %binding.gpu, "GPU reset");
    Ok(ResetRecord {
        gpu: binding.gpu.clone(),
        devices: out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::{FakeHost, FakeHostSpec};
    use crate::host::vfio::{bind_group, rebind_host_drivers};

    const GPU: &str = "0000:01:00.0";

    fn host(edit: impl FnOnce(&mut FakeHostSpec)) -> FakeHost {
        let mut spec = FakeHost::audio_host_spec();
        edit(&mut spec);
        FakeHost::build(&spec).unwrap()
    }

    fn gpu_spec(spec: &mut FakeHostSpec) -> &mut crate::host::fake::FakeDevice {
        spec.devices.iter_mut().find(|d| d.bdf == GPU).unwrap()
    }

    #[test]
    fn reset_runs_on_every_bound_device_and_checks_the_ids() {
        let h = host(|_| {});
        let s = h.sysfs();
        let b = bind_group(&s, &PciAddress::parse(GPU).unwrap()).unwrap();
        let r = reset_gpu(&s, &b).unwrap();
        assert_eq!(r.devices[0].0, GPU, "the GPU first");
        assert_eq!(
            r.devices[0].1,
            DeviceReset::Reset {
                methods: vec!["flr".into(), "bus".into()]
            }
        );
        assert_eq!(h.resets(GPU), 1);
        assert_eq!(h.resets("0000:01:00.1"), 1);
        assert!(r.method().contains("flr, bus"), "{}", r.method());
    }

    #[test]
    fn a_gpu_without_a_reset_method_or_whose_reset_fails_is_an_error() {
        let h = host(|s| gpu_spec(s).reset_method = String::new());
        let s = h.sysfs();
        let b = bind_group(&s, &PciAddress::parse(GPU).unwrap()).unwrap();
        let e = reset_gpu(&s, &b).unwrap_err();
        assert!(matches!(e, ResetError::NoResetMethod { .. }), "{e}");
        assert!(e.to_string().contains("quarantined"), "{e}");

        let h = host(|s| gpu_spec(s).reset_fails = true);
        let s = h.sysfs();
        let b = bind_group(&s, &PciAddress::parse(GPU).unwrap()).unwrap();
        assert!(matches!(
            reset_gpu(&s, &b).unwrap_err(),
            ResetError::Failed { .. }
        ));
    }

    #[test]
    fn a_device_that_does_not_come_back_fails_the_check() {
        let h = host(|s| gpu_spec(s).reset_breaks = true);
        let s = h.sysfs();
        let b = bind_group(&s, &PciAddress::parse(GPU).unwrap()).unwrap();
        let e = reset_gpu(&s, &b).unwrap_err();
        assert!(
            matches!(e, ResetError::NotResponding { vendor: 0xffff, .. }),
            "{e}"
        );
    }

    #[test]
    fn a_companion_without_a_method_is_recorded_not_fatal() {
        let h = host(|s| {
            s.devices
                .iter_mut()
                .find(|d| d.bdf == "0000:01:00.1")
                .unwrap()
                .reset_method = String::new();
        });
        let s = h.sysfs();
        let b = bind_group(&s, &PciAddress::parse(GPU).unwrap()).unwrap();
        let r = reset_gpu(&s, &b).unwrap();
        assert_eq!(r.devices[1].1, DeviceReset::NoMethod);
    }

    #[test]
    fn after_the_rebind_a_second_run_does_not_reset_under_the_host_driver() {
        let h = host(|_| {});
        let s = h.sysfs();
        let b = bind_group(&s, &PciAddress::parse(GPU).unwrap()).unwrap();
        reset_gpu(&s, &b).unwrap();
        rebind_host_drivers(&s, &b).unwrap();
        let again = reset_gpu(&s, &b).unwrap();
        assert_eq!(
            again.devices[0].1,
            DeviceReset::AlreadyRebound {
                driver: "nvidia".into()
            }
        );
        assert_eq!(h.resets(GPU), 1, "no second reset under nvidia");
        // A GPU a host driver holds that is not its recorded one is refused.
        let mut other = b.clone();
        other.devices[0].previous_driver = Some("nouveau".into());
        assert!(matches!(
            reset_gpu(&s, &other).unwrap_err(),
            ResetError::HostDriverBound { .. }
        ));
    }
}
