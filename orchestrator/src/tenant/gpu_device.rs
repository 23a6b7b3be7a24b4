//! How a reserved GPU share reaches the tenant's VM and is given back, over tenantvm-gpu's
//! routes (`tenantvm_gpu::route`): the record the daemon stores for it ([`DeviceRecord`])
//! and the [`BackendPlanner`]'s host work on sysfs.
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

use serde::{Deserialize, Serialize};
use tenantvm_gpu::backend::GpuInfo;
use tenantvm_gpu::host::mdev::{self, MdevAssignment};
use tenantvm_gpu::host::{PciAddress, Sysfs};
use tenantvm_gpu::mig::{MigProfile, VgpuSupport};
use tenantvm_gpu::route::vgpu::{self, VgpuAttachment, VgpuHost};
use tenantvm_gpu::route::whole::{self, VfioBinding};

use crate::backend::PassthroughDevice;
use crate::receipt::{Assurance, StepResult};
use crate::store::GpuPlacement;
use crate::tenant::gpu::{find_gpu, BackendPlanner};
use crate::tenant::gpu_info::{AssignedGpu, NVIDIA_VENDOR};
use crate::tenant::host::{DeviceResetOutcome, GpuPlanError};

/// What the host did (or will do) to hand a tenant's share to its VM: stored before the step
/// that acts on it, read by every later step (also after a restart).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "route", rename_all = "snake_case", deny_unknown_fields)]
pub enum DeviceRecord {
    /// Nothing reaches the VM.
    NotAttached {
        /// Why (a simulated host; a route the daemon does not drive yet).
        reason: String,
        /// The card (ledger id) whose MIG mode was off and which this tenant's MIG
        /// instance turns on; the card's last MIG tenant turns it off again as it leaves.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mig_turned_on: Option<String>,
    },
    /// A whole GPU: its IOMMU group on vfio-pci.
    Whole {
        /// The binding (drivers and overrides before it), to give the group back.
        binding: VfioBinding,
        /// The card was in MIG mode (no instance on it): prepare-gpu-host turns MIG off
        /// before the bind, and release-gpu turns it back on. Recorded before either.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        mig_turned_off: bool,
    },
    /// A MIG instance as an mdev vGPU (vGPU 16 and older); QEMU passes it (`sysfsdev=`).
    MdevVgpu {
        /// The parent device (the GPU).
        parent: String,
        /// The mdev (type and UUID), chosen by bind-gpu once the instance exists and
        /// recorded before it is created.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        assignment: Option<MdevAssignment>,
        /// As for [`DeviceRecord::NotAttached`]: the card whose MIG mode this tenant turns on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mig_turned_on: Option<String>,
    },
    /// A MIG instance as the vGPU of an SR-IOV VF.
    SriovVgpu {
        /// The card's preparation (whether this tenant turned MIG and VFs on).
        host: VgpuHost,
        /// The typed VF, once bind-gpu ran.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attachment: Option<VgpuAttachment>,
    },
}

impl DeviceRecord {
    /// Whether a device is handed to the VM.
    pub fn attaches(&self) -> bool {
        !matches!(self, DeviceRecord::NotAttached { .. })
    }

    /// The card whose MIG mode was off before this tenant and which the daemon turns off
    /// again when the card's last MIG tenant leaves (vGPU: its host's `enables_mig`, for
    /// which the card is the PF).
    pub fn mig_turned_on(&self) -> Option<&str> {
        match self {
            DeviceRecord::NotAttached { mig_turned_on, .. }
            | DeviceRecord::MdevVgpu { mig_turned_on, .. } => mig_turned_on.as_deref(),
            DeviceRecord::SriovVgpu { host, .. } => host.enables_mig.then_some(host.pf.as_str()),
            DeviceRecord::Whole { .. } => None,
        }
    }

    /// Records that this tenant's card `gpu` had MIG off and that its turning it on is this
    /// record's to undo (a whole GPU has no MIG mode to restore: unchanged).
    pub fn take_mig_turned_on(&mut self, gpu: &str) {
        match self {
            DeviceRecord::NotAttached { mig_turned_on, .. }
            | DeviceRecord::MdevVgpu { mig_turned_on, .. } => {
                *mig_turned_on = Some(gpu.to_string());
            }
            DeviceRecord::SriovVgpu { host, .. } => host.enables_mig = true,
            DeviceRecord::Whole { .. } => {}
        }
    }

    /// The route's name, for receipts and logs.
    pub fn route(&self) -> &'static str {
        match self {
            DeviceRecord::NotAttached { .. } => "not-attached",
            DeviceRecord::Whole { .. } => "whole-gpu",
            DeviceRecord::SriovVgpu { .. } => "sriov-vgpu",
            DeviceRecord::MdevVgpu { .. } => "mdev-vgpu",
        }
    }
}

/// Host device work failed (not a placement: the message says what the host refused).
fn plan_err(e: impl std::fmt::Display) -> GpuPlanError {
    GpuPlanError::Device(e.to_string())
}

fn pci(address: &str) -> Result<PciAddress, GpuPlanError> {
    PciAddress::parse(address).map_err(plan_err)
}

/// The (profile, start) of a MIG placement label.
fn mig_label<'m>(
    info: &'m GpuInfo,
    placement: &GpuPlacement,
) -> Result<(&'m MigProfile, u32), GpuPlanError> {
    let (name, start) = placement
        .label
        .split_once('@')
        .ok_or_else(|| plan_err(format!("{} is not a MIG placement", placement.label)))?;
    let start = start
        .parse()
        .map_err(|_| plan_err(format!("unreadable placement {:?}", placement.label)))?;
    let model = info
        .gpu_model()
        .ok_or_else(|| plan_err(format!("GPU {} has no known model", info.pci_address)))?;
    Ok((model.profile(name).map_err(plan_err)?, start))
}

impl BackendPlanner {
    fn gpu_info(&self, id: &str) -> Result<GpuInfo, GpuPlanError> {
        let gpus = self.backend().gpus().map_err(plan_err)?;
        find_gpu(&gpus, id)
            .cloned()
            .ok_or_else(|| plan_err(format!("GPU {id} is gone")))
    }

    fn sysfs_or(&self) -> Result<&Sysfs, GpuPlanError> {
        self.sysfs()
            .ok_or_else(|| plan_err("this planner has no sysfs to act on"))
    }

    /// Decides the route of `placement` and reads what it will do; touches nothing.
    pub(crate) fn plan_device_route(
        &self,
        placement: &GpuPlacement,
    ) -> Result<DeviceRecord, GpuPlanError> {
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
        if placement.label == "whole" {
            whole::check_free(sysfs, &info).map_err(plan_err)?;
            let binding = whole::plan_bind(sysfs, &pci(&info.pci_address)?).map_err(plan_err)?;
            return Ok(DeviceRecord::Whole {
                binding,
                mig_turned_off: info.mig_enabled,
            });
        }
        match &info.vgpu {
            VgpuSupport::Sriov { .. } => Ok(DeviceRecord::SriovVgpu {
                host: vgpu::plan_host(sysfs, &info).map_err(plan_err)?,
                attachment: None,
            }),
            VgpuSupport::Mdev => Ok(DeviceRecord::MdevVgpu {
                parent: info.pci_address.clone(),
                assignment: None,
                mig_turned_on,
            }),
            VgpuSupport::Simulated | VgpuSupport::Missing { .. } => Ok(DeviceRecord::NotAttached {
                reason: "SIMULATED vGPU: no device is handed to the VM".into(),
                mig_turned_on,
            }),
        }
    }

    /// vGPU: MIG on, then VFs on (each only if needed). Whole, recorded as in MIG mode:
    /// MIG off (if still on), checked. Nothing for the other routes.
    pub(crate) fn prepare_device_host(
        &self,
        placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<(), GpuPlanError> {
        match record {
            DeviceRecord::SriovVgpu { host, .. } => {
                vgpu::prepare_host(self.sysfs_or()?, self.backend(), host).map_err(plan_err)?;
            }
            DeviceRecord::Whole {
                mig_turned_off: true,
                ..
            } => self.mig_off_for_whole(&placement.gpu)?,
            _ => {}
        }
        Ok(())
    }

    /// MIG off on a card about to be given whole, unless it is off already (a re-run);
    /// refused while it holds instances, and checked afterwards: a change NVML leaves
    /// pending (until a GPU reset) would hand the guest a card in MIG mode.
    fn mig_off_for_whole(&self, gpu: &str) -> Result<(), GpuPlanError> {
        let info = self.gpu_info(gpu)?;
        if !info.mig_enabled {
            return Ok(());
        }
        whole::check_free(self.sysfs_or()?, &info).map_err(plan_err)?;
        self.backend()
            .set_mig_mode(info.index, false)
            .map_err(plan_err)?;
        if self.gpu_info(gpu)?.mig_enabled {
            return Err(plan_err(format!(
                "GPU {gpu}: MIG mode is still on after turning it off (the change is pending until the GPU is reset): stop what uses the GPU, run `nvidia-smi -r -i {}`, and create the tenant again",
                info.index
            )));
        }
        Ok(())
    }

    /// mdev: chooses the type (with room, now that the instance exists) and the mdev's
    /// UUID; touches nothing (bind-gpu records it before creating the mdev). The other
    /// routes have nothing to choose.
    pub(crate) fn plan_bind_route(
        &self,
        placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<DeviceRecord, GpuPlanError> {
        match record {
            DeviceRecord::MdevVgpu {
                parent,
                assignment: None,
                mig_turned_on,
            } => {
                let info = self.gpu_info(&placement.gpu)?;
                let (profile, _) = mig_label(&info, placement)?;
                let assignment =
                    mdev::plan_mdev(self.sysfs_or()?, &pci(parent)?, profile).map_err(plan_err)?;
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
    pub(crate) fn bind_device_route(
        &self,
        placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<DeviceRecord, GpuPlanError> {
        match record {
            DeviceRecord::NotAttached { .. } => Ok(record.clone()),
            DeviceRecord::Whole { binding, .. } => {
                whole::apply_bind(self.sysfs_or()?, binding).map_err(plan_err)?;
                self.rescan_gpus();
                Ok(record.clone())
            }
            DeviceRecord::MdevVgpu { assignment, .. } => {
                let a = assignment
                    .as_ref()
                    .ok_or_else(|| plan_err("no mdev is chosen yet (bind-gpu plans it first)"))?;
                mdev::create_mdev(self.sysfs_or()?, a).map_err(plan_err)?;
                Ok(record.clone())
            }
            DeviceRecord::SriovVgpu { host, .. } => {
                let info = self.gpu_info(&placement.gpu)?;
                let (profile, start) = mig_label(&info, placement)?;
                let gi = vgpu::ensure_instance(self.backend(), host.gpu, profile, start)
                    .map_err(plan_err)?;
                let attachment = vgpu::attach(self.sysfs_or()?, &pci(&host.pf)?, &gi, profile)
                    .map_err(plan_err)?;
                Ok(DeviceRecord::SriovVgpu {
                    host: host.clone(),
                    attachment: Some(attachment),
                })
            }
        }
    }

    /// The devices the VM gets, the GPU first, each with its IOMMU group.
    pub(crate) fn device_list(
        &self,
        record: &DeviceRecord,
    ) -> Result<Vec<PassthroughDevice>, GpuPlanError> {
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
                    .ok_or_else(|| plan_err("no mdev is created yet (bind-gpu)"))?;
                let sysfs = self.sysfs_or()?;
                let link = a.sysfs_path(sysfs).join("iommu_group");
                let group = std::fs::read_link(&link)
                    .ok()
                    .and_then(|t| t.file_name()?.to_str()?.parse().ok())
                    .ok_or_else(|| {
                        plan_err(format!(
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
                    .ok_or_else(|| plan_err("no vGPU is set on a VF yet (bind-gpu)"))?;
                let group = self
                    .sysfs_or()?
                    .device(&pci(&a.vf)?)
                    .map_err(plan_err)?
                    .iommu_group
                    .ok_or_else(|| plan_err(format!("VF {} has no IOMMU group", a.vf)))?;
                Ok(vec![PassthroughDevice::Pci {
                    address: a.vf.clone(),
                    iommu_group: group,
                }])
            }
        }
    }

    /// Whole: the checked reset of every bound device (the GPU first). None for the other
    /// routes (their reset is the planner's [`crate::tenant::host::GpuPlanner::reset`]).
    pub(crate) fn reset_device_route(
        &self,
        record: &DeviceRecord,
    ) -> Result<Option<DeviceResetOutcome>, GpuPlanError> {
        let DeviceRecord::Whole { binding, .. } = record else {
            return Ok(None);
        };
        let rec = whole::reset_gpu(self.sysfs_or()?, binding).map_err(plan_err)?;
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
    pub(crate) fn rebind_device_route(&self, record: &DeviceRecord) -> Result<(), GpuPlanError> {
        if let DeviceRecord::Whole { binding, .. } = record {
            whole::rebind_host_drivers(self.sysfs_or()?, binding).map_err(plan_err)?;
            self.rescan_gpus();
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

    /// Whole: the driver each device of the group is bound to now (None: unbound), read
    /// from sysfs. Nothing for the other routes.
    pub(crate) fn device_drivers_now(
        &self,
        record: &DeviceRecord,
    ) -> Result<Vec<(String, Option<String>)>, GpuPlanError> {
        let DeviceRecord::Whole { binding, .. } = record else {
            return Ok(Vec::new());
        };
        let sysfs = self.sysfs_or()?;
        binding
            .devices
            .iter()
            .map(|d| {
                let dev = sysfs.device(&pci(&d.address)?).map_err(plan_err)?;
                Ok((d.address.clone(), dev.driver))
            })
            .collect()
    }

    /// vGPU: type 0 on every VF serving the tenant's instance; mdev: the mdev removed.
    pub(crate) fn detach_device_route(
        &self,
        placement: &GpuPlacement,
        record: &DeviceRecord,
    ) -> Result<(), GpuPlanError> {
        if let DeviceRecord::MdevVgpu {
            assignment: Some(a),
            ..
        } = record
        {
            mdev::remove_mdev(self.sysfs_or()?, a).map_err(plan_err)?;
        }
        if let DeviceRecord::SriovVgpu { host, .. } = record {
            let info = self.gpu_info(&placement.gpu)?;
            let (profile, start) = mig_label(&info, placement)?;
            vgpu::detach_instance(self.sysfs_or()?, self.backend(), host.gpu, profile, start)
                .map_err(plan_err)?;
        }
        Ok(())
    }

    /// vGPU, the card's last vGPU tenant gone: VFs off, then MIG off if this record turned
    /// it on. Whole, recorded as in MIG mode: MIG back on (`card`, after the scrub, with
    /// the card back on its host driver), unless it is on already (a re-run).
    pub(crate) fn leave_device_mode(
        &self,
        card: &str,
        record: &DeviceRecord,
    ) -> Result<(), GpuPlanError> {
        match record {
            DeviceRecord::SriovVgpu { host, .. } => {
                vgpu::leave_vgpu_mode(self.sysfs_or()?, self.backend(), host).map_err(plan_err)?;
            }
            DeviceRecord::Whole {
                mig_turned_off: true,
                ..
            } => {
                let info = self.gpu_info(card)?;
                if !info.mig_enabled {
                    self.backend()
                        .set_mig_mode(info.index, true)
                        .map_err(plan_err)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The card's last MIG tenant gone: MIG off again on `gpu`, unless it is off already or
    /// instances remain on it (not this daemon's to destroy: MIG stays on and the outcome
    /// says why).
    pub(crate) fn restore_mig_off(&self, gpu: &str) -> Result<MigRestore, GpuPlanError> {
        let info = self.gpu_info(gpu)?;
        if !info.mig_enabled {
            return Ok(MigRestore::AlreadyOff);
        }
        if !info.instances.is_empty() {
            return Ok(MigRestore::LeftOn(format!(
                "GPU instances {:?} remain on it",
                info.instances.iter().map(|i| i.gi_id).collect::<Vec<_>>()
            )));
        }
        self.backend()
            .set_mig_mode(info.index, false)
            .map_err(plan_err)?;
        Ok(MigRestore::TurnedOff)
    }
}

impl BackendPlanner {
    /// Receipt evidence on the route's parts (see [`crate::tenant::host::GpuPlanner::route_evidence`]):
    /// for a vGPU on an SR-IOV VF, which parts were real and which SIMULATED (a simulated
    /// host on a real host's functions: the PF's VFs and the VF handed over are real, MIG,
    /// the instance and the vGPU type simulated), the VF and its type, and how many VFs the
    /// PF has now (read from sysfs).
    pub(crate) fn route_parts(&self, record: &DeviceRecord) -> Vec<(String, String)> {
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

/// What restoring a card's MIG mode did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigRestore {
    /// MIG was on and is off now.
    TurnedOff,
    /// MIG was off already (a re-run after a crash).
    AlreadyOff,
    /// MIG stays on, and why (instances the daemon did not make remain).
    LeftOn(String),
}

impl BackendPlanner {
    /// What `placement` is, for `tenantvm gpu-info`: [`AssignedGpu::basic`] plus the
    /// card's name, the slice's memory and profile (the database's NVML figure for a MIG
    /// profile, the backend's total for a whole card), the devices handed over, and the ids
    /// the guest should see (whole: the host device's own, read from sysfs; vGPU: NVIDIA's
    /// vendor id only).
    pub(crate) fn describe_slice(
        &self,
        placement: &GpuPlacement,
        record: Option<&DeviceRecord>,
    ) -> Result<AssignedGpu, GpuPlanError> {
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
        a.host_devices = match self.device_list(record) {
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
}
