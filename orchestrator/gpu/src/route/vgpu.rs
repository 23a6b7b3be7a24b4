//! The MIG-backed vGPU route on SR-IOV virtual functions (vGPU 17+, Hopper and newer). The VF
//! stays on the nvidia driver; the VM gets it by its sysfs path and needs a UUID on the
//! VMM's command line ([`crate::host::uuid::VmUuid`]).
//!
//! The order is forced by the driver: enabling VFs rebinds the GPU and WIPES every GPU
//! instance on it (MIG mode survives), and a VF offers no vGPU type until a GPU instance of
//! its profile exists. So, per card once, then per tenant:
//!
//! 1. [`plan_host`] (record the [`VgpuHost`]) → [`prepare_host`]: MIG mode on, then VFs
//!    enabled; refused while the card holds instances that enabling VFs would wipe;
//! 2. [`ensure_instance`]: the GPU instance the planner chose (profile at its start), then its
//!    compute instance;
//! 3. [`attach`]: a free VF gets the vGPU type of the profile; its `gpu_instance_id` (ENXIO
//!    until then) must name that instance, or the type is cleared and the step fails;
//!
//! and at departure (after the VM stopped):
//!
//! 4. [`detach`]: type 0 (only if the VF still serves this tenant's instance), or
//!    [`detach_instance`], which finds the VFs by the tenant's instance and so also clears a
//!    type a crash kept from being recorded;
//! 5. the daemon scrubs and verifies the instance's memory;
//! 6. [`destroy_instance`]: compute instances, then the GPU instance;
//! 7. only when the card leaves vGPU mode: [`leave_vgpu_mode`]: VFs disabled, then MIG off
//!    (MIG mode cannot change while VFs are enabled).
//!
//! Every step checks what is done and does the rest, so a sequence run again after a crash
//! converges. [`vgpu_state`] reads what a reconcile needs.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::backend::{BackendError, GpuBackend, GpuInfo, GpuInstance};
use crate::host::sriov::{self, SriovError};
use crate::host::vgpu::{self, type_for_profile, vgpu_suffix, VfState, VgpuError, VgpuType};
use crate::host::{PciAddress, Sysfs};
use crate::mig::MigProfile;

/// Errors of the vGPU route; [`VgpuRouteError::step`] names the step that failed.
#[derive(Debug, Error)]
pub enum VgpuRouteError {
    /// A GPU-instance call failed.
    #[error("{step}: {source}")]
    Backend {
        /// The step.
        step: &'static str,
        /// The cause.
        source: BackendError,
    },
    /// Enabling or disabling VFs failed.
    #[error("{step}: {source}")]
    Sriov {
        /// The step.
        step: &'static str,
        /// The cause.
        source: SriovError,
    },
    /// Work on a VF failed.
    #[error("{step}: {source}")]
    Vgpu {
        /// The step.
        step: &'static str,
        /// The cause.
        source: VgpuError,
    },
    /// The GPU is not one the planner or the backend knows.
    #[error("{step}: GPU {gpu} is not on this host (or has no MIG)")]
    NoSuchGpu {
        /// The step.
        step: &'static str,
        /// GPU index.
        gpu: u32,
    },
    /// Enabling VFs would destroy instances the card holds.
    #[error("prepare-vgpu-host: GPU {gpu} ({pf}) holds GPU instances {instances:?} and has no VFs yet; enabling VFs rebinds the GPU and wipes every instance; let their users finish and destroy them first")]
    WouldWipe {
        /// GPU index.
        gpu: u32,
        /// PCI address.
        pf: String,
        /// Their ids.
        instances: Vec<u32>,
    },
    /// The driver put the vGPU on another instance than the planned one.
    #[error("set-vgpu-type: the driver started the vGPU of {vf} on GPU instance {got}, not on {wanted} ({profile} at slot {start}, the planner's choice); the type was cleared again. Another free instance of that profile exists on the card: a leftover a reconcile should destroy")]
    WrongInstance {
        /// The VF.
        vf: String,
        /// The planned instance.
        wanted: u32,
        /// The instance the driver chose.
        got: u32,
        /// Its profile.
        profile: String,
        /// Its start.
        start: u32,
    },
    /// The card cannot leave vGPU mode yet.
    #[error("leave-vgpu-mode: GPU {gpu} still has {what}; every vGPU tenant must depart first")]
    StillInUse {
        /// GPU index.
        gpu: u32,
        /// What remains.
        what: String,
    },
}

impl VgpuRouteError {
    /// The step that failed, as receipts and records name it.
    pub fn step(&self) -> &'static str {
        match self {
            VgpuRouteError::Backend { step, .. }
            | VgpuRouteError::Sriov { step, .. }
            | VgpuRouteError::Vgpu { step, .. }
            | VgpuRouteError::NoSuchGpu { step, .. } => step,
            VgpuRouteError::WouldWipe { .. } => STEP_PREPARE,
            VgpuRouteError::WrongInstance { .. } => STEP_SET_TYPE,
            VgpuRouteError::StillInUse { .. } => STEP_LEAVE,
        }
    }
}

/// Step: MIG mode on and VFs enabled.
pub const STEP_PREPARE: &str = "prepare-vgpu-host";
/// Step: the planned GPU instance and its compute instance.
pub const STEP_INSTANCE: &str = "create-instance";
/// Step: the vGPU type on a VF, checked against the planned instance.
pub const STEP_SET_TYPE: &str = "set-vgpu-type";
/// Step: type 0.
pub const STEP_CLEAR_TYPE: &str = "clear-vgpu-type";
/// Step: compute instances, then the GPU instance.
pub const STEP_DESTROY: &str = "destroy-instance";
/// Step: VFs disabled, MIG off.
pub const STEP_LEAVE: &str = "leave-vgpu-mode";

/// One card's preparation for vGPU; record it before [`prepare_host`], keep it for
/// [`leave_vgpu_mode`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VgpuHost {
    /// GPU index (the backend's).
    pub gpu: u32,
    /// Its PCI address (the PF).
    pub pf: String,
    /// MIG was off: preparing turns it on, leaving vGPU mode turns it off again.
    pub enables_mig: bool,
    /// VFs were off: preparing enables them.
    pub enables_vfs: bool,
}

/// A vGPU on a VF; record it, keep it for [`detach`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VgpuAttachment {
    /// The GPU (PF).
    pub pf: String,
    /// The VF handed to the VM.
    pub vf: String,
    /// The vGPU type set on it.
    pub vgpu_type: VgpuType,
    /// The GPU instance its vGPU runs on (checked against the plan).
    pub gpu_instance_id: u32,
    /// The driver's `placement_id` for it, as read back.
    pub placement_id: Option<u32>,
}

impl VgpuAttachment {
    /// The VF's sysfs path: what the VMM is given (`--device vfio,path=...`; QEMU's
    /// `-device vfio-pci,sysfsdev=...`).
    pub fn vf_path(&self, sysfs: &Sysfs) -> PathBuf {
        sysfs.path("sys/bus/pci/devices").join(&self.vf)
    }
}

fn gpu_info(
    backend: &dyn GpuBackend,
    gpu: u32,
    step: &'static str,
) -> Result<GpuInfo, VgpuRouteError> {
    backend
        .gpus()
        .map_err(|source| VgpuRouteError::Backend { step, source })?
        .into_iter()
        .find(|g| g.index == gpu)
        .ok_or(VgpuRouteError::NoSuchGpu { step, gpu })
}

fn pf_address(gpu: &GpuInfo, step: &'static str) -> Result<PciAddress, VgpuRouteError> {
    PciAddress::parse(&gpu.pci_address).map_err(|_| VgpuRouteError::NoSuchGpu {
        step,
        gpu: gpu.index,
    })
}

/// Reads what preparing `gpu` for vGPU will do; touches nothing. Refuses a GPU without
/// SR-IOV, and one whose instances enabling VFs would wipe.
pub fn plan_host(sysfs: &Sysfs, gpu: &GpuInfo) -> Result<VgpuHost, VgpuRouteError> {
    let pf = pf_address(gpu, STEP_PREPARE)?;
    sriov::total_vfs(sysfs, &pf).map_err(|source| VgpuRouteError::Sriov {
        step: STEP_PREPARE,
        source,
    })?;
    let vfs = sriov::enabled_vfs(sysfs, &pf).map_err(|source| VgpuRouteError::Sriov {
        step: STEP_PREPARE,
        source,
    })?;
    if vfs == 0 && !gpu.instances.is_empty() {
        return Err(VgpuRouteError::WouldWipe {
            gpu: gpu.index,
            pf: gpu.pci_address.clone(),
            instances: gpu.instances.iter().map(|i| i.gi_id).collect(),
        });
    }
    Ok(VgpuHost {
        gpu: gpu.index,
        pf: gpu.pci_address.clone(),
        enables_mig: !gpu.mig_enabled,
        enables_vfs: vfs == 0,
    })
}

/// MIG mode on, then VFs enabled, each only if not so already.
pub fn prepare_host(
    sysfs: &Sysfs,
    backend: &dyn GpuBackend,
    host: &VgpuHost,
) -> Result<(), VgpuRouteError> {
    let step = STEP_PREPARE;
    let gpu = gpu_info(backend, host.gpu, step)?;
    let pf = pf_address(&gpu, step)?;
    let vfs =
        sriov::enabled_vfs(sysfs, &pf).map_err(|source| VgpuRouteError::Sriov { step, source })?;
    if !gpu.mig_enabled {
        backend
            .set_mig_mode(host.gpu, true)
            .map_err(|source| VgpuRouteError::Backend { step, source })?;
    }
    if vfs == 0 {
        let gpu = gpu_info(backend, host.gpu, step)?;
        if !gpu.instances.is_empty() {
            return Err(VgpuRouteError::WouldWipe {
                gpu: gpu.index,
                pf: gpu.pci_address.clone(),
                instances: gpu.instances.iter().map(|i| i.gi_id).collect(),
            });
        }
        sriov::enable_vfs(sysfs, &pf).map_err(|source| VgpuRouteError::Sriov { step, source })?;
    }
    Ok(())
}

/// The planned GPU instance (`profile` at `start`) with its compute instance: created if
/// missing, completed if a crash left it without a compute instance.
pub fn ensure_instance(
    backend: &dyn GpuBackend,
    gpu: u32,
    profile: &MigProfile,
    start: u32,
) -> Result<GpuInstance, VgpuRouteError> {
    let step = STEP_INSTANCE;
    let be = |source| VgpuRouteError::Backend { step, source };
    let info = gpu_info(backend, gpu, step)?;
    let gi = match info
        .instances
        .iter()
        .find(|i| i.profile_id == profile.id && i.start == start)
    {
        Some(i) => i.clone(),
        None => backend
            .create_gpu_instance(gpu, profile.id, start)
            .map_err(be)?,
    };
    if !gi.has_compute_instance {
        backend.ensure_compute_instance(gpu, gi.gi_id).map_err(be)?;
    }
    Ok(GpuInstance {
        has_compute_instance: true,
        ..gi
    })
}

/// The typed VFs of a GPU, with the instances they serve.
pub fn vgpu_state(sysfs: &Sysfs, pf: &PciAddress) -> Result<Vec<VfState>, VgpuError> {
    let mut out = Vec::new();
    for vf in sriov::vfs(sysfs, pf) {
        let s = vgpu::vf_state(sysfs, &vf)?;
        if s.vgpu_type.is_some() {
            out.push(s);
        }
    }
    Ok(out)
}

/// Starts the vGPU of `profile` on a free VF of `pf` and checks that it runs on `gi`; if the
/// driver chose another instance the type is cleared and the step fails. A VF that already
/// serves `gi` (the step ran before a crash) is returned as it is.
pub fn attach(
    sysfs: &Sysfs,
    pf: &PciAddress,
    gi: &GpuInstance,
    profile: &MigProfile,
) -> Result<VgpuAttachment, VgpuRouteError> {
    let step = STEP_SET_TYPE;
    let vg = |source| VgpuRouteError::Vgpu { step, source };
    let vfs = sriov::vfs(sysfs, pf);
    let mut free = None;
    for vf in &vfs {
        let s = vgpu::vf_state(sysfs, vf).map_err(vg)?;
        match (&s.vgpu_type, s.gpu_instance_id) {
            (Some(t), Some(id)) if id == gi.gi_id => {
                let name = vgpu::creatable_types(sysfs, vf)
                    .ok()
                    .and_then(|ts| ts.into_iter().find(|x| &x.id == t))
                    .map_or_else(
                        || format!("vGPU type {t} ({})", vgpu_suffix(profile)),
                        |x| x.name,
                    );
                return Ok(VgpuAttachment {
                    pf: pf.to_string(),
                    vf: vf.to_string(),
                    vgpu_type: VgpuType {
                        id: t.clone(),
                        name,
                    },
                    gpu_instance_id: id,
                    placement_id: s.placement_id,
                });
            }
            (None, _) if free.is_none() => free = Some(vf.clone()),
            _ => {}
        }
    }
    let Some(vf) = free else {
        return Err(vg(VgpuError::NoFreeVf(pf.to_string())));
    };
    let types = vgpu::creatable_types(sysfs, &vf).map_err(vg)?;
    let Some(t) = type_for_profile(&types, profile).cloned() else {
        return Err(vg(VgpuError::NoCreatableType {
            vf: vf.to_string(),
            wanted: format!(
                "a type ending in {} for MIG profile {}",
                vgpu_suffix(profile),
                profile.name
            ),
            creatable: if types.is_empty() {
                "none: the driver offers a type only while a GPU instance of its profile exists without a vGPU (were VFs enabled after the instance was made? that wipes it)".into()
            } else {
                types
                    .iter()
                    .map(|t| format!("{} ({})", t.name, t.id))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        }));
    };
    let state = vgpu::set_vgpu_type(sysfs, &vf, &t).map_err(vg)?;
    match state.gpu_instance_id {
        Some(id) if id == gi.gi_id => Ok(VgpuAttachment {
            pf: pf.to_string(),
            vf: vf.to_string(),
            vgpu_type: t,
            gpu_instance_id: id,
            placement_id: state.placement_id,
        }),
        other => {
            vgpu::clear_vgpu_type(sysfs, &vf).map_err(vg)?;
            Err(VgpuRouteError::WrongInstance {
                vf: vf.to_string(),
                wanted: gi.gi_id,
                got: other.unwrap_or(u32::MAX),
                profile: profile.name.to_string(),
                start: gi.start,
            })
        }
    }
}

/// Stops the attachment's vGPU (type 0). Nothing to do when the VF is free; a VF that now
/// runs another vGPU (another type, instance or placement: GPU-instance ids are reused once
/// an instance is destroyed) belongs to someone else since and is left alone. Sysfs cannot
/// tell the same profile re-created at the same slot from the original; the daemon's ledger
/// keeps the slot reserved until this departure is done, so nobody else gets it meanwhile.
pub fn detach(sysfs: &Sysfs, a: &VgpuAttachment) -> Result<(), VgpuRouteError> {
    let step = STEP_CLEAR_TYPE;
    let vg = |source| VgpuRouteError::Vgpu { step, source };
    let vf = PciAddress::parse(&a.vf).map_err(|source| {
        vg(VgpuError::Sysfs {
            vf: a.vf.clone(),
            source,
        })
    })?;
    if !sysfs.device_dir(&vf).exists() {
        return Ok(()); // VFs disabled since: nothing runs on it.
    }
    let s = vgpu::vf_state(sysfs, &vf).map_err(vg)?;
    let Some(t) = &s.vgpu_type else {
        return Ok(());
    };
    let ours = s.gpu_instance_id == Some(a.gpu_instance_id)
        && *t == a.vgpu_type.id
        && (a.placement_id.is_none() || s.placement_id == a.placement_id);
    if ours {
        vgpu::clear_vgpu_type(sysfs, &vf).map_err(vg)
    } else {
        tracing::warn!(vf = %a.vf, now = ?s, "VF runs another vGPU now; left alone");
        Ok(())
    }
}

/// Departure without trusting the record: stops every vGPU that runs on the GPU instance of
/// `profile` at `start` (the tenant's reserved slice, so any VF serving it is the tenant's),
/// even one whose attachment a crash kept from being recorded. Nothing to do when the
/// instance is gone or no VF serves it.
pub fn detach_instance(
    sysfs: &Sysfs,
    backend: &dyn GpuBackend,
    gpu: u32,
    profile: &MigProfile,
    start: u32,
) -> Result<(), VgpuRouteError> {
    let step = STEP_CLEAR_TYPE;
    let vg = |source| VgpuRouteError::Vgpu { step, source };
    let info = gpu_info(backend, gpu, step)?;
    let Some(gi) = info
        .instances
        .iter()
        .find(|i| i.profile_id == profile.id && i.start == start)
    else {
        return Ok(());
    };
    let pf = pf_address(&info, step)?;
    for s in vgpu_state(sysfs, &pf).map_err(vg)? {
        if s.gpu_instance_id == Some(gi.gi_id) {
            let vf = PciAddress::parse(&s.vf).map_err(|source| {
                vg(VgpuError::Sysfs {
                    vf: s.vf.clone(),
                    source,
                })
            })?;
            vgpu::clear_vgpu_type(sysfs, &vf).map_err(vg)?;
        }
    }
    Ok(())
}

/// Destroys the GPU instance of `profile` at `start` (compute instances first); nothing to do
/// when it is gone. Refused while a vGPU runs on it.
pub fn destroy_instance(
    backend: &dyn GpuBackend,
    gpu: u32,
    profile: &MigProfile,
    start: u32,
) -> Result<(), VgpuRouteError> {
    let step = STEP_DESTROY;
    let info = gpu_info(backend, gpu, step)?;
    let Some(gi) = info
        .instances
        .iter()
        .find(|i| i.profile_id == profile.id && i.start == start)
    else {
        return Ok(());
    };
    match backend.destroy_instance(gpu, gi.gi_id) {
        Ok(()) | Err(BackendError::NoSuchInstance { .. }) => Ok(()),
        Err(source) => Err(VgpuRouteError::Backend { step, source }),
    }
}

/// Takes the card out of vGPU mode once no vGPU tenant is left on it: VFs disabled, then
/// MIG off if preparing turned it on. Refused while instances or typed VFs remain.
pub fn leave_vgpu_mode(
    sysfs: &Sysfs,
    backend: &dyn GpuBackend,
    host: &VgpuHost,
) -> Result<(), VgpuRouteError> {
    let step = STEP_LEAVE;
    let gpu = gpu_info(backend, host.gpu, step)?;
    let pf = pf_address(&gpu, step)?;
    let typed = vgpu_state(sysfs, &pf).map_err(|source| VgpuRouteError::Vgpu { step, source })?;
    if !typed.is_empty() {
        return Err(VgpuRouteError::StillInUse {
            gpu: host.gpu,
            what: format!(
                "vGPUs on {}",
                typed
                    .iter()
                    .map(|s| s.vf.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    if !gpu.instances.is_empty() {
        return Err(VgpuRouteError::StillInUse {
            gpu: host.gpu,
            what: format!(
                "GPU instances {:?}",
                gpu.instances.iter().map(|i| i.gi_id).collect::<Vec<_>>()
            ),
        });
    }
    sriov::disable_vfs(sysfs, &pf).map_err(|source| VgpuRouteError::Sriov { step, source })?;
    if host.enables_mig && gpu.mig_enabled {
        backend
            .set_mig_mode(host.gpu, false)
            .map_err(|source| VgpuRouteError::Backend { step, source })?;
    }
    Ok(())
}
