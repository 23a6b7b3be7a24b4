//! [`Describe`] over a tenantvm-gpu backend: what a placed share is (for `tenantvm
//! gpu-info`), how busy its slice is (for the tenant's metrics) and the host's GPUs.

use tenantvm_gpu::backend::{GpuInfo, SliceUsage};

use super::backend::{find_gpu, mig_label, pci, BackendPlanner};
use super::error::{plan_err, GpuError};
use super::seam::{Describe, DeviceRoute};
use super::types::{AssignedGpu, DeviceRecord, NVIDIA_VENDOR};
use crate::backend::PassthroughDevice;
use crate::store::GpuPlacement;

impl Describe for BackendPlanner {
    /// What `placement` is, for `tenantvm gpu-info`: [`AssignedGpu::basic`] plus the
    /// card's name, the slice's memory and profile (the database's NVML figure for a MIG
    /// profile, the backend's total for a whole card), the devices handed over, and the ids
    /// the guest should see (whole: the host device's own, read from sysfs; vGPU: NVIDIA's
    /// vendor id only).
    fn describe(
        &self,
        placement: &GpuPlacement,
        record: Option<&DeviceRecord>,
    ) -> Result<AssignedGpu, GpuError> {
        let mut a = AssignedGpu::basic(placement, record);
        let info = self.gpu_info(&placement.gpu)?;
        a.model = Some(info.name.clone());
        if placement.label == "whole" {
            a.memory_mib = Some(info.memory_mib).filter(|m| *m > 0);
        } else {
            let (profile, _) = mig_label(&info, placement)?;
            a.mig_profile = Some(profile.name.to_string());
            a.memory_mib = Some(profile.memory_mib);
        }
        let Some(record) = record.filter(|r| r.attaches()) else {
            return Ok(a);
        };
        a.host_devices = match self.devices(record) {
            Ok(devices) => devices
                .iter()
                .map(|d| match d {
                    PassthroughDevice::Pci { address, .. } => address.clone(),
                    PassthroughDevice::Mdev { uuid, .. } => uuid.clone(),
                })
                .collect(),
            Err(_) => vec![info.pci_address.clone()],
        };
        match record {
            DeviceRecord::Whole { .. } => {
                if let (Some(sysfs), Ok(addr)) = (self.sysfs(), pci(&info.pci_address)) {
                    let id = |attr: &str| {
                        let text = sysfs.read(&sysfs.device_dir(&addr).join(attr)).ok()?;
                        u16::from_str_radix(text.trim_start_matches("0x"), 16).ok()
                    };
                    a.vendor = id("vendor");
                    a.device = id("device").filter(|_| a.vendor.is_some());
                }
            }
            _ => a.vendor = Some(NVIDIA_VENDOR),
        }
        Ok(a)
    }

    fn usage(&self, placement: &GpuPlacement) -> Result<Option<SliceUsage>, GpuError> {
        let gpus = self.backend().gpus().map_err(plan_err)?;
        let info = find_gpu(&gpus, &placement.gpu)
            .ok_or_else(|| plan_err(format!("GPU {} is gone", placement.gpu)))?;
        let gi_id = match self.mig_of(placement)? {
            None => None,
            Some((_, profile, start)) => Some(
                info.instances
                    .iter()
                    .find(|i| i.profile_id == profile.id && i.start == start)
                    .map(|i| i.gi_id)
                    .ok_or_else(|| {
                        plan_err(format!(
                            "GPU {}: no instance {} (not made yet, or already released)",
                            placement.gpu, placement.label
                        ))
                    })?,
            ),
        };
        self.backend().usage(info.index, gi_id).map_err(plan_err)
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        self.backend().gpus().map_err(plan_err)
    }
}
