//! [`DeviceRoute`] over a tenantvm-gpu backend: how a reserved GPU share reaches the
//! tenant's VM and is given back, over tenantvm-gpu's routes (`tenantvm_gpu::route`), acting
//! on the record the daemon stores for it ([`DeviceRecord`]) through sysfs. The route itself
//! is the GPU crate's decision ([`route_for`]), asked once, by [`DeviceRoute::plan_device`].
//!
//! - whole GPU: its IOMMU group bound to vfio-pci (the binding recorded before it is
//!   applied); a card in MIG mode (with no instance) has MIG turned off first, recorded
//!   before it is done, since a guest's CUDA sees no device on a card in MIG mode;
//!   departure: checked reset, host drivers back, then scrub, MIG back on if it was, and
//!   release;
//! - MIG-backed vGPU on an SR-IOV VF: MIG on and VFs enabled first (enabling VFs wipes every
//!   GPU instance), then the instance, then the vGPU type on a free VF, whose
//!   `gpu_instance_id` must be the planned instance; departure: type 0, scrub, instance
//!   destroyed, and when the card's last vGPU tenant leaves: VFs off, MIG off last;
//! - a MIG instance as an mdev vGPU (vGPU 16 and older): the instance, then an mdev of the
//!   profile's type (chosen and recorded, then created); the VM gets it by its sysfs path
//!   (QEMU only); departure removes it before the scrub;
//! - a simulated host: nothing is handed to the VM and the record says why.

use tenantvm_gpu::backend::GpuInfo;
use tenantvm_gpu::host::mdev;
use tenantvm_gpu::host::PciAddress;
use tenantvm_gpu::plan::Share;
use tenantvm_gpu::route::{route_for, vgpu, whole, Route};

use super::backend::{mig_label, pci, BackendPlanner};
use super::error::{device_err, GpuError};
use super::seam::DeviceRoute;
use super::types::{DeviceRecord, DeviceResetOutcome};
use crate::backend::PassthroughDevice;
use crate::receipt::{Assurance, StepResult};
use crate::store::GpuPlacement;

impl DeviceRoute for BackendPlanner {
    /// Decides the route of `placement` and reads what it will do; touches nothing.
    fn plan_device(&self, placement: &GpuPlacement) -> Result<DeviceRecord, GpuError> {
        let info = self.gpu_info(&placement.gpu)?;
        // A MIG share on a card with MIG off: create-gpu-instance turns it on, and this
        // record says so, so that the card's last MIG tenant turns it off again.
        let mig_turned_on =
            (placement.label.contains('@') && !info.mig_enabled).then(|| placement.gpu.clone());
        let Some(sysfs) = self.sysfs() else {
            return Ok(DeviceRecord::NotAttached {
                reason: "SIMULATED GPU host: no device is handed to the VM".into(),
                mig_turned_on,
            });
        };
        // The route is the GPU crate's decision (`route_for`, on the same facts placement
        // judged the card by); this only reads what taking it will do.
        let share = share_of(&info, placement)?;
        match route_for(&info, &share).map_err(device_err)? {
            Route::Whole => {
                whole::check_free(sysfs, &info).map_err(device_err)?;
                let binding =
                    whole::plan_bind(sysfs, &pci(&info.pci_address)?).map_err(device_err)?;
                Ok(DeviceRecord::Whole {
                    binding,
                    mig_turned_off: info.mig_enabled,
                })
            }
            Route::SriovVgpu => Ok(DeviceRecord::SriovVgpu {
                host: vgpu::plan_host(sysfs, &info).map_err(device_err)?,
                attachment: None,
            }),
            Route::MdevVgpu => Ok(DeviceRecord::MdevVgpu {
                parent: info.pci_address.clone(),
                assignment: None,
                mig_turned_on,
            }),
            Route::Simulated => Ok(DeviceRecord::NotAttached {
                reason: "SIMULATED vGPU: no device is handed to the VM".into(),
                mig_turned_on,
            }),
        }
    }

    /// vGPU: MIG on, then VFs on (each only if needed). Whole, recorded as in MIG mode:
    /// MIG off (if still on), checked. Nothing for the other routes.
    fn prepare_device(
        &self,
        placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<(), GpuError> {
        match record {
            DeviceRecord::SriovVgpu { host, .. } => {
                vgpu::prepare_host(self.sysfs_or()?, self.backend(), host).map_err(device_err)?;
            }
            DeviceRecord::Whole {
                mig_turned_off: true,
                ..
            } => self.mig_off_for_whole(&placement.gpu)?,
            _ => {}
        }
        Ok(())
    }

    /// mdev: chooses the type (with room, now that the instance exists) and the mdev's
    /// UUID; touches nothing (bind-gpu records it before creating the mdev). The other
    /// routes have nothing to choose.
    fn plan_bind(
        &self,
        placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<DeviceRecord, GpuError> {
        match record {
            DeviceRecord::MdevVgpu {
                parent,
                assignment: None,
                mig_turned_on,
            } => {
                let info = self.gpu_info(&placement.gpu)?;
                let (profile, _) = mig_label(&info, placement)?;
                let assignment = mdev::plan_mdev(self.sysfs_or()?, &pci(parent)?, profile)
                    .map_err(device_err)?;
                Ok(DeviceRecord::MdevVgpu {
                    parent: parent.clone(),
                    assignment: Some(assignment),
                    mig_turned_on: mig_turned_on.clone(),
                })
            }
            _ => Ok(record.clone()),
        }
    }

    /// Whole: the group onto vfio-pci. vGPU: the instance's compute instance, then the
    /// vGPU type on a free VF, checked against the planned instance.
    fn bind_device(
        &self,
        placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<DeviceRecord, GpuError> {
        match record {
            DeviceRecord::NotAttached { .. } => Ok(record.clone()),
            DeviceRecord::Whole { binding, .. } => {
                whole::apply_bind(self.sysfs_or()?, binding).map_err(device_err)?;
                self.rescan_gpus();
                Ok(record.clone())
            }
            DeviceRecord::MdevVgpu { assignment, .. } => {
                let a = assignment
                    .as_ref()
                    .ok_or_else(|| device_err("no mdev is chosen yet (bind-gpu plans it first)"))?;
                mdev::create_mdev(self.sysfs_or()?, a).map_err(device_err)?;
                Ok(record.clone())
            }
            DeviceRecord::SriovVgpu { host, .. } => {
                let info = self.gpu_info(&placement.gpu)?;
                let (profile, start) = mig_label(&info, placement)?;
                let gi = vgpu::ensure_instance(self.backend(), host.gpu, profile, start)
                    .map_err(device_err)?;
                let attachment = vgpu::attach(self.sysfs_or()?, &pci(&host.pf)?, &gi, profile)
                    .map_err(device_err)?;
                Ok(DeviceRecord::SriovVgpu {
                    host: host.clone(),
                    attachment: Some(attachment),
                })
            }
        }
    }

    /// The devices the VM gets, the GPU first, each with its IOMMU group.
    fn devices(&self, record: &DeviceRecord) -> Result<Vec<PassthroughDevice>, GpuError> {
        match record {
            DeviceRecord::NotAttached { .. } => Ok(Vec::new()),
            DeviceRecord::Whole { binding, .. } => {
                let sysfs = self.sysfs_or()?;
                Ok(whole::device_paths(sysfs, binding)
                    .iter()
                    .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .map(|address| PassthroughDevice::Pci {
                        address,
                        iommu_group: binding.group,
                    })
                    .collect())
            }
            DeviceRecord::MdevVgpu { assignment, .. } => {
                let a = assignment
                    .as_ref()
                    .ok_or_else(|| device_err("no mdev is created yet (bind-gpu)"))?;
                let sysfs = self.sysfs_or()?;
                let link = a.sysfs_path(sysfs).join("iommu_group");
                let group = std::fs::read_link(&link)
                    .ok()
                    .and_then(|t| t.file_name()?.to_str()?.parse().ok())
                    .ok_or_else(|| {
                        device_err(format!(
                            "mdev {} has no IOMMU group ({} unreadable): is vfio-mdev loaded?",
                            a.uuid,
                            link.display()
                        ))
                    })?;
                Ok(vec![PassthroughDevice::Mdev {
                    uuid: a.uuid.to_string(),
                    iommu_group: group,
                }])
            }
            DeviceRecord::SriovVgpu { attachment, .. } => {
                let a = attachment
                    .as_ref()
                    .ok_or_else(|| device_err("no vGPU is set on a VF yet (bind-gpu)"))?;
                let group = self
                    .sysfs_or()?
                    .device(&pci(&a.vf)?)
                    .map_err(device_err)?
                    .iommu_group
                    .ok_or_else(|| device_err(format!("VF {} has no IOMMU group", a.vf)))?;
                Ok(vec![PassthroughDevice::Pci {
                    address: a.vf.clone(),
                    iommu_group: group,
                }])
            }
        }
    }

    /// Whole: the checked reset of every bound device (the GPU first). None for the other
    /// routes (their reset is the planner's [`crate::gpu::Cleaning::reset`]).
    fn reset_device(&self, record: &DeviceRecord) -> Result<Option<DeviceResetOutcome>, GpuError> {
        let DeviceRecord::Whole { binding, .. } = record else {
            return Ok(None);
        };
        let rec = whole::reset_gpu(self.sysfs_or()?, binding).map_err(device_err)?;
        let mut evidence = std::collections::BTreeMap::new();
        for (device, how) in &rec.devices {
            evidence.insert(format!("reset {device}"), format!("{how:?}"));
        }
        Ok(Some(DeviceResetOutcome {
            method: rec.method(),
            result: StepResult::Ok,
            assurance: Assurance::Verified,
            evidence,
        }))
    }

    /// Whole: every device of the group back on its recorded host driver, checked.
    fn rebind_device(&self, record: &DeviceRecord) -> Result<(), GpuError> {
        if let DeviceRecord::Whole { binding, .. } = record {
            whole::rebind_host_drivers(self.sysfs_or()?, binding).map_err(device_err)?;
            self.rescan_gpus();
        }
        Ok(())
    }

    /// Whole: the driver each device of the group is bound to now (None: unbound), read
    /// from sysfs. Nothing for the other routes.
    fn device_drivers(
        &self,
        record: &DeviceRecord,
    ) -> Result<Vec<(String, Option<String>)>, GpuError> {
        let DeviceRecord::Whole { binding, .. } = record else {
            return Ok(Vec::new());
        };
        let sysfs = self.sysfs_or()?;
        binding
            .devices
            .iter()
            .map(|d| {
                let dev = sysfs.device(&pci(&d.address)?).map_err(device_err)?;
                Ok((d.address.clone(), dev.driver))
            })
            .collect()
    }

    /// vGPU: type 0 on every VF serving the tenant's instance; mdev: the mdev removed.
    fn detach_device(
        &self,
        placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<(), GpuError> {
        if let DeviceRecord::MdevVgpu {
            assignment: Some(a),
            ..
        } = record
        {
            mdev::remove_mdev(self.sysfs_or()?, a).map_err(device_err)?;
        }
        if let DeviceRecord::SriovVgpu { host, .. } = record {
            let info = self.gpu_info(&placement.gpu)?;
            let (profile, start) = mig_label(&info, placement)?;
            vgpu::detach_instance(self.sysfs_or()?, self.backend(), host.gpu, profile, start)
                .map_err(device_err)?;
        }
        Ok(())
    }

    /// vGPU, the card's last vGPU tenant gone: VFs off, then MIG off if this record turned
    /// it on. Whole, recorded as in MIG mode: MIG back on (`card`, after the scrub, with
    /// the card back on its host driver), unless it is on already (a re-run).
    fn leave_device_mode(&self, card: &str, record: &DeviceRecord) -> Result<(), GpuError> {
        match record {
            DeviceRecord::SriovVgpu { host, .. } => {
                vgpu::leave_vgpu_mode(self.sysfs_or()?, self.backend(), host)
                    .map_err(device_err)?;
            }
            DeviceRecord::Whole {
                mig_turned_off: true,
                ..
            } => {
                let info = self.gpu_info(card)?;
                if !info.mig_enabled {
                    self.backend()
                        .set_mig_mode(info.index, true)
                        .map_err(device_err)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Receipt evidence on the route's parts (see [`crate::gpu::DeviceRoute::route_evidence`]):
    /// for a vGPU on an SR-IOV VF, which parts were real and which SIMULATED (a simulated
    /// host on a real host's functions: the PF's VFs and the VF handed over are real, MIG,
    /// the instance and the vGPU type simulated), the VF and its type, and how many VFs the
    /// PF has now (read from sysfs).
    fn route_evidence(&self, record: &DeviceRecord) -> Vec<(String, String)> {
        let DeviceRecord::SriovVgpu { host, attachment } = record else {
            return Vec::new();
        };
        let Some(sysfs) = self.sysfs() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let simulated_backend = self.backend().kind() == "sim";
        match (simulated_backend, sysfs.overlay()) {
            (true, Some(driver)) => {
                out.push((
                    "real".into(),
                    format!("SR-IOV on {}: VFs enabled and disabled through sriov_numvfs by this host's kernel; the VF handed to the VM (its IOMMU group, VFIO, the VMM's reset)", host.pf),
                ));
                out.push((
                    "simulated".into(),
                    format!("MIG mode, the GPU instance, the vGPU type on the VF and the scrub: {driver}"),
                ));
            }
            (true, None) => out.push((
                "simulated".into(),
                "everything: a simulated GPU host without a sysfs root".into(),
            )),
            (false, _) => out.push((
                "real".into(),
                format!(
                    "SR-IOV, MIG and the vGPU type on {} through the {} backend and NVIDIA's vGPU manager",
                    host.pf,
                    self.backend().kind()
                ),
            )),
        }
        if let Some(a) = attachment {
            out.push((
                "vf".into(),
                format!("{}, a virtual function of {}", a.vf, a.pf),
            ));
            out.push((
                "vgpu type".into(),
                format!(
                    "{} ({}) on GPU instance {}",
                    a.vgpu_type.id, a.vgpu_type.name, a.gpu_instance_id
                ),
            ));
        }
        if let Ok(pf) = PciAddress::parse(&host.pf) {
            let now = match tenantvm_gpu::host::sriov::enabled_vfs(sysfs, &pf) {
                Ok(n) => format!("{n} (sriov_numvfs, read now)"),
                Err(e) => format!("unreadable: {e}"),
            };
            out.push((format!("vfs of {}", host.pf), now));
        }
        out
    }
}

/// The planner's share a ledger placement names on `info` (`whole`, or a MIG profile at a
/// start), for [`route_for`].
fn share_of(info: &GpuInfo, placement: &GpuPlacement) -> Result<Share, GpuError> {
    if placement.label == "whole" {
        return Ok(Share::WholeGpu {
            memory_mib: info.memory_mib,
        });
    }
    let (profile, start) = mig_label(info, placement)?;
    Ok(Share::Mig {
        profile_id: profile.id,
        profile: profile.name.to_string(),
        start,
        size: profile.size,
        memory_mib: profile.memory_mib,
    })
}

impl BackendPlanner {
    /// MIG off on a card about to be given whole, unless it is off already (a re-run);
    /// refused while it holds instances, and checked afterwards: a change NVML leaves
    /// pending (until a GPU reset) would hand the guest a card in MIG mode.
    fn mig_off_for_whole(&self, gpu: &str) -> Result<(), GpuError> {
        let info = self.gpu_info(gpu)?;
        if !info.mig_enabled {
            return Ok(());
        }
        whole::check_free(self.sysfs_or()?, &info).map_err(device_err)?;
        self.backend()
            .set_mig_mode(info.index, false)
            .map_err(device_err)?;
        if self.gpu_info(gpu)?.mig_enabled {
            return Err(device_err(format!(
                "GPU {gpu}: MIG mode is still on after turning it off (the change is pending until the GPU is reset): stop what uses the GPU, run `nvidia-smi -r -i {}`, and create the tenant again",
                info.index
            )));
        }
        Ok(())
    }

    /// After a card left its driver or came back to it: the backend enumerates the GPUs
    /// again (NVML's indexes and handles are stale otherwise). A failure is only logged:
    /// the bind or rebind itself is done, and the NVML backend opens a session again at
    /// its next call.
    fn rescan_gpus(&self) {
        if let Err(e) = self.backend().rescan() {
            tracing::warn!(error = %e, "the GPU backend could not enumerate the GPUs again");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant::test_utils::EDU_TREE;
    use tenantvm_gpu::backend::{self as gpu_backend, BackendSpec};
    use tenantvm_gpu::host::fake::FakeHost;
    use tenantvm_gpu::host::Sysfs;

    /// An H100 (SIMULATED) at the FAKE tree's device, with the vGPU manager `vgpu`.
    fn h100_at_edu(dir: &tempfile::TempDir, tree: &FakeHost, vgpu: &str) -> BackendPlanner {
        let path = dir.path().join(format!("host-{vgpu}.json"));
        let text = format!(
            r#"{{"gpus": [{{"index": 0, "model": "h100-80gb", "pci_address": "0000:00:03.0",
            "driver": "570.124.06", "vgpu": "{vgpu}", "mig_enabled": true, "instances": [],
            "iommu_group": 5}}]}}"#
        );
        std::fs::write(&path, text).unwrap();
        BackendPlanner::new(gpu_backend::open(&BackendSpec::Sim(path)).unwrap())
            .with_sysfs(Sysfs::new(tree.root()))
    }

    fn mig_share() -> GpuPlacement {
        GpuPlacement {
            gpu: "0000:00:03.0".into(),
            slots: vec![0],
            label: "1g.10gb@0".into(),
        }
    }

    #[test]
    fn the_route_is_the_gpu_crates_decision() {
        let tree = FakeHost::build(&serde_json::from_str(EDU_TREE).unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();

        // A MIG share on a card whose vGPU is simulated: the simulated route, nothing
        // handed over, and the record says why.
        let p = h100_at_edu(&dir, &tree, "simulated");
        let record = p.plan_device(&mig_share()).unwrap();
        let DeviceRecord::NotAttached { reason, .. } = &record else {
            panic!("{record:?}")
        };
        assert!(reason.contains("SIMULATED vGPU"), "{reason}");

        // The same share on a card without a vGPU manager has no route: the GPU crate
        // classes the card whole-only, and the step says so instead of claiming a
        // simulated vGPU on a host that has none.
        let p = h100_at_edu(&dir, &tree, "none");
        let err = p.plan_device(&mig_share()).unwrap_err().to_string();
        assert!(err.contains("can only be given whole"), "{err}");

        // A whole share of it is the whole-card route.
        let whole = GpuPlacement {
            slots: (0..8).collect(),
            label: "whole".into(),
            ..mig_share()
        };
        let record = p.plan_device(&whole).unwrap();
        assert!(matches!(record, DeviceRecord::Whole { .. }), "{record:?}");
    }
}
