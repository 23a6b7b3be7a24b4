//! MIG-backed vGPU on SR-IOV virtual functions (vGPU 17+, Hopper and newer), through a VF's
//! `nvidia/` attributes. The VF stays on the nvidia driver (never vfio-pci) and is handed to
//! the VM by its sysfs path; NVIDIA's vendor-specific VFIO framework serves it.
//!
//! What the driver does (and what [`crate::host::fake`] models):
//! - `creatable_vgpu_types` (`ID : vGPU Name` lines under a header) lists only types whose MIG
//!   profile has a GPU instance without a vGPU: empty until the instance exists;
//! - writing a type id to `current_vgpu_type` starts the vGPU on such an instance; `0` stops it;
//! - `gpu_instance_id` and `placement_id` read ENXIO until a type is set, then name the
//!   instance the VF serves. The caller checks that it is the instance it planned
//!   ([`crate::route::vgpu`]).
//!
//! These functions are single steps; the order they run in is the route's business.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::{HostDeviceError, PciAddress, Sysfs};
use crate::mig::{GpuModel, MigProfile};

/// Errors of vGPU work on a VF.
#[derive(Debug, Error)]
pub enum VgpuError {
    /// A sysfs read or write failed.
    #[error("vGPU on {vf}: {source}")]
    Sysfs {
        /// The VF.
        vf: String,
        /// The cause.
        source: HostDeviceError,
    },
    /// The device is not a VF with NVIDIA's vGPU attributes.
    #[error("{0} is not a vGPU virtual function (no nvidia/current_vgpu_type): are VFs enabled and NVIDIA's vGPU manager loaded?")]
    NotAVgpuVf(String),
    /// Every VF of the GPU carries a vGPU.
    #[error("Every virtual function of {0} already has a vGPU: release one first")]
    NoFreeVf(String),
    /// No creatable type matches the profile.
    #[error("No creatable vGPU type on {vf} matches {wanted}; creatable: {creatable}")]
    NoCreatableType {
        /// The VF.
        vf: String,
        /// What was looked for.
        wanted: String,
        /// What the driver offers.
        creatable: String,
    },
    /// The type read back is not the one written.
    #[error("{vf}: wrote vGPU type {wanted}, the driver reports {actual}")]
    TypeNotSet {
        /// The VF.
        vf: String,
        /// The type written.
        wanted: String,
        /// The type read back.
        actual: String,
    },
    /// The driver answered with something unreadable.
    #[error("{vf}: {attribute} reads `{value}`, not a number")]
    Unreadable {
        /// The VF.
        vf: String,
        /// The attribute.
        attribute: &'static str,
        /// What it said.
        value: String,
    },
}

/// One vGPU type the driver offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VgpuType {
    /// Type id to write to `current_vgpu_type` (or the mdev type directory name).
    pub id: String,
    /// Name, e.g. `NVIDIA H100XM-3-40C`.
    pub name: String,
}

/// The name suffix of the MIG-backed vGPU type for a profile: `3g.40gb` → `-3-40C`,
/// `1g.10gb+me` → `-1-10CME`.
pub fn vgpu_suffix(profile: &MigProfile) -> String {
    let (base, me) = match profile.name.strip_suffix("+me") {
        Some(b) => (b, "ME"),
        None => (profile.name, ""),
    };
    let gb = base.split('.').nth(1).unwrap_or("").trim_end_matches("gb");
    format!("-{}-{}C{}", profile.compute_slices, gb, me)
}

/// Picks the type whose name ends with the profile's suffix.
pub fn type_for_profile<'t>(types: &'t [VgpuType], profile: &MigProfile) -> Option<&'t VgpuType> {
    let suffix = vgpu_suffix(profile);
    types.iter().find(|t| t.name.ends_with(&suffix))
}

/// The MIG profile of `model` a vGPU type name stands for.
pub fn profile_for_type<'m>(model: &'m GpuModel, type_name: &str) -> Option<&'m MigProfile> {
    model
        .profiles
        .iter()
        .find(|p| type_name.ends_with(&vgpu_suffix(p)))
}

/// Parses `creatable_vgpu_types` (`ID : vGPU Name` lines under a header).
pub fn parse_creatable(text: &str) -> Vec<VgpuType> {
    text.lines()
        .filter_map(|l| {
            let (id, name) = l.split_once(':')?;
            let id = id.trim();
            id.parse::<u32>().ok()?;
            Some(VgpuType {
                id: id.to_string(),
                name: name.trim().to_string(),
            })
        })
        .collect()
}

/// What a VF says now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VfState {
    /// The VF.
    pub vf: String,
    /// Its vGPU type id; None for `0` (free).
    pub vgpu_type: Option<String>,
    /// The GPU instance its vGPU runs on (None: ENXIO, no type set).
    pub gpu_instance_id: Option<u32>,
    /// The driver's `placement_id` (None: ENXIO, no type set).
    pub placement_id: Option<u32>,
}

fn nv(sysfs: &Sysfs, vf: &PciAddress, file: &str) -> std::path::PathBuf {
    sysfs.device_dir(vf).join("nvidia").join(file)
}

fn sys_err(vf: &PciAddress) -> impl Fn(HostDeviceError) -> VgpuError + '_ {
    move |source| VgpuError::Sysfs {
        vf: vf.to_string(),
        source,
    }
}

fn read_id(
    sysfs: &Sysfs,
    vf: &PciAddress,
    attribute: &'static str,
) -> Result<Option<u32>, VgpuError> {
    let Some(v) = sysfs
        .read_unless_enxio(&nv(sysfs, vf, attribute))
        .map_err(sys_err(vf))?
    else {
        return Ok(None);
    };
    v.parse().map(Some).map_err(|_| VgpuError::Unreadable {
        vf: vf.to_string(),
        attribute,
        value: v,
    })
}

/// Reads a VF's type and, when one is set, the instance its vGPU serves.
pub fn vf_state(sysfs: &Sysfs, vf: &PciAddress) -> Result<VfState, VgpuError> {
    // Read, not looked for: a driver overlay (the SIMULATED driver on a real VF) answers
    // attributes that are no files.
    let t = match sysfs.read(&nv(sysfs, vf, "current_vgpu_type")) {
        Ok(t) => t,
        Err(HostDeviceError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            return Err(VgpuError::NotAVgpuVf(vf.to_string()))
        }
        Err(e) => return Err(sys_err(vf)(e)),
    };
    let vgpu_type = (t != "0").then_some(t);
    let (gpu_instance_id, placement_id) = if vgpu_type.is_some() {
        (
            read_id(sysfs, vf, "gpu_instance_id")?,
            read_id(sysfs, vf, "placement_id")?,
        )
    } else {
        (None, None)
    };
    Ok(VfState {
        vf: vf.to_string(),
        vgpu_type,
        gpu_instance_id,
        placement_id,
    })
}

/// The types the driver would create on this VF now.
pub fn creatable_types(sysfs: &Sysfs, vf: &PciAddress) -> Result<Vec<VgpuType>, VgpuError> {
    let text = sysfs
        .read(&nv(sysfs, vf, "creatable_vgpu_types"))
        .map_err(sys_err(vf))?;
    Ok(parse_creatable(&text))
}

/// Writes a type to a free VF and reads the type back; returns the VF's state, in which
/// `gpu_instance_id` now names the instance the driver chose.
pub fn set_vgpu_type(
    sysfs: &Sysfs,
    vf: &PciAddress,
    vgpu_type: &VgpuType,
) -> Result<VfState, VgpuError> {
    sysfs
        .write(&nv(sysfs, vf, "current_vgpu_type"), &vgpu_type.id)
        .map_err(sys_err(vf))?;
    let state = vf_state(sysfs, vf)?;
    if state.vgpu_type.as_deref() != Some(vgpu_type.id.as_str()) {
        return Err(VgpuError::TypeNotSet {
            vf: vf.to_string(),
            wanted: vgpu_type.id.clone(),
            actual: state.vgpu_type.unwrap_or_else(|| "0".into()),
        });
    }
    Ok(state)
}

/// Stops the VF's vGPU (type 0); nothing to do when it has none.
pub fn clear_vgpu_type(sysfs: &Sysfs, vf: &PciAddress) -> Result<(), VgpuError> {
    if vf_state(sysfs, vf)?.vgpu_type.is_none() {
        return Ok(());
    }
    sysfs
        .write(&nv(sysfs, vf, "current_vgpu_type"), "0")
        .map_err(sys_err(vf))?;
    match vf_state(sysfs, vf)?.vgpu_type {
        None => Ok(()),
        Some(actual) => Err(VgpuError::TypeNotSet {
            vf: vf.to_string(),
            wanted: "0".into(),
            actual,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mig::model_by_key;

    #[test]
    fn vgpu_suffix_follows_nvidia_type_names() {
        let h = model_by_key("h100-80gb").unwrap();
        assert_eq!(vgpu_suffix(h.profile("3g.40gb").unwrap()), "-3-40C");
        assert_eq!(vgpu_suffix(h.profile("1g.10gb+me").unwrap()), "-1-10CME");
        assert_eq!(vgpu_suffix(h.profile("1g.20gb").unwrap()), "-1-20C");
        let types = parse_creatable(
            "ID    : vGPU Name\n1061  : NVIDIA H100XM-1-10CME\n1062  : NVIDIA H100XM-1-10C\n",
        );
        assert_eq!(
            type_for_profile(&types, h.profile("1g.10gb").unwrap())
                .unwrap()
                .id,
            "1062"
        );
        assert_eq!(
            profile_for_type(h, "NVIDIA H100XM-1-10CME").unwrap().name,
            "1g.10gb+me"
        );
        assert_eq!(
            profile_for_type(h, "NVIDIA H100XM-2-20C").unwrap().name,
            "2g.20gb"
        );
        assert!(profile_for_type(h, "NVIDIA H100XM-80Q").is_none());
    }
}
