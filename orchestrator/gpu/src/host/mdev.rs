//! The legacy vGPU route (vGPU 16 and older, A100): an mdev of the type that matches the MIG
//! profile, created under `mdev_supported_types/<type>/create` with a UUID and handed to the
//! VM by its sysfs path (`/sys/bus/mdev/devices/<uuid>`; QEMU's `-device
//! vfio-pci,sysfsdev=...`). As for MIG-backed VFs, the GPU instance must exist first.
//!
//! [`plan_mdev`] chooses the type and the UUID and touches nothing: record it, then
//! [`create_mdev`]; both [`create_mdev`] and [`remove_mdev`] do nothing when already done.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::uuid::VmUuid;
use super::vgpu::{type_for_profile, vgpu_suffix, VgpuType};
use super::{HostDeviceError, PciAddress, Sysfs};
use crate::mig::MigProfile;

/// Errors of the mdev route.
#[derive(Debug, Error)]
pub enum MdevError {
    /// A sysfs read or write failed.
    #[error("mdev on {parent}: {source}")]
    Sysfs {
        /// The parent device.
        parent: String,
        /// The cause.
        source: HostDeviceError,
    },
    /// No mdev type matches the profile.
    #[error("No mdev type on {parent} matches {wanted}; types: {offered}")]
    NoType {
        /// The parent device.
        parent: String,
        /// What was looked for.
        wanted: String,
        /// What the driver offers.
        offered: String,
    },
    /// The type has no instances left.
    #[error("mdev type {type_id} on {parent} has no instances available: release one, or create the GPU instance first")]
    NoRoom {
        /// The parent device.
        parent: String,
        /// The type.
        type_id: String,
    },
}

/// An mdev vGPU; record it before [`create_mdev`], keep it to remove the mdev.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MdevAssignment {
    /// The parent device (the GPU, or a VF of it).
    pub parent: String,
    /// The type.
    pub vgpu_type: VgpuType,
    /// The mdev's UUID.
    pub uuid: VmUuid,
}

impl MdevAssignment {
    /// The path the VMM is given.
    pub fn sysfs_path(&self, sysfs: &Sysfs) -> PathBuf {
        sysfs.path("sys/bus/mdev/devices").join(self.uuid.as_str())
    }
}

fn sys_err(parent: &PciAddress) -> impl Fn(HostDeviceError) -> MdevError + '_ {
    move |source| MdevError::Sysfs {
        parent: parent.to_string(),
        source,
    }
}

/// The mdev types of a parent device with their free instances.
pub fn mdev_types(sysfs: &Sysfs, parent: &PciAddress) -> Result<Vec<(VgpuType, u32)>, MdevError> {
    let dir = sysfs.device_dir(parent).join("mdev_supported_types");
    sysfs
        .list(&dir)
        .into_iter()
        .map(|id| {
            let name = sysfs
                .read(&dir.join(&id).join("name"))
                .map_err(sys_err(parent))?;
            let avail = sysfs
                .read(&dir.join(&id).join("available_instances"))
                .map_err(sys_err(parent))?
                .parse()
                .unwrap_or(0);
            Ok((VgpuType { id, name }, avail))
        })
        .collect()
}

/// Chooses the type matching `profile` (with room) and a fresh UUID. Touches nothing.
pub fn plan_mdev(
    sysfs: &Sysfs,
    parent: &PciAddress,
    profile: &MigProfile,
) -> Result<MdevAssignment, MdevError> {
    let types = mdev_types(sysfs, parent)?;
    let plain: Vec<VgpuType> = types.iter().map(|(t, _)| t.clone()).collect();
    let Some(t) = type_for_profile(&plain, profile) else {
        return Err(MdevError::NoType {
            parent: parent.to_string(),
            wanted: format!("a type ending in {}", vgpu_suffix(profile)),
            offered: plain
                .iter()
                .map(|t| format!("{} ({})", t.name, t.id))
                .collect::<Vec<_>>()
                .join(", "),
        });
    };
    let avail = types
        .iter()
        .find(|(x, _)| x.id == t.id)
        .map_or(0, |(_, a)| *a);
    if avail == 0 {
        return Err(MdevError::NoRoom {
            parent: parent.to_string(),
            type_id: t.id.clone(),
        });
    }
    Ok(MdevAssignment {
        parent: parent.to_string(),
        vgpu_type: t.clone(),
        uuid: VmUuid::generate(),
    })
}

/// Creates the recorded mdev; nothing to do when it exists.
pub fn create_mdev(sysfs: &Sysfs, m: &MdevAssignment) -> Result<(), MdevError> {
    let parent = PciAddress::parse(&m.parent).map_err(|source| MdevError::Sysfs {
        parent: m.parent.clone(),
        source,
    })?;
    if m.sysfs_path(sysfs).exists() {
        return Ok(());
    }
    let create = sysfs
        .device_dir(&parent)
        .join("mdev_supported_types")
        .join(&m.vgpu_type.id)
        .join("create");
    sysfs
        .write(&create, m.uuid.as_str())
        .map_err(sys_err(&parent))
}

/// Removes the mdev; nothing to do when it is gone.
pub fn remove_mdev(sysfs: &Sysfs, m: &MdevAssignment) -> Result<(), MdevError> {
    let path = m.sysfs_path(sysfs);
    if !path.exists() {
        return Ok(());
    }
    sysfs
        .write(&path.join("remove"), "1")
        .map_err(|source| MdevError::Sysfs {
            parent: m.parent.clone(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;
    use crate::mig::model_by_key;

    #[test]
    fn mdev_create_and_remove_are_idempotent_and_track_available_instances() {
        let host = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
        let s = host.sysfs();
        let parent = PciAddress::parse("0000:05:00.0").unwrap();
        let p = model_by_key("a100-40gb")
            .unwrap()
            .profile("3g.20gb")
            .unwrap();
        let a = plan_mdev(&s, &parent, p).unwrap();
        assert_eq!(a.vgpu_type.name, "GRID A100-3-20C");
        assert!(!a.sysfs_path(&s).exists(), "planning touches nothing");
        create_mdev(&s, &a).unwrap();
        create_mdev(&s, &a).unwrap();
        assert!(a.sysfs_path(&s).exists());
        let b = plan_mdev(&s, &parent, p).unwrap();
        assert_ne!(a.uuid, b.uuid);
        create_mdev(&s, &b).unwrap();
        let e = plan_mdev(&s, &parent, p).unwrap_err();
        assert!(matches!(e, MdevError::NoRoom { .. }), "{e}");
        remove_mdev(&s, &a).unwrap();
        remove_mdev(&s, &a).unwrap();
        remove_mdev(&s, &b).unwrap();
        let avail = mdev_types(&s, &parent)
            .unwrap()
            .into_iter()
            .find(|(t, _)| t.id == a.vgpu_type.id)
            .unwrap()
            .1;
        assert_eq!(avail, 2);
        let e = plan_mdev(
            &s,
            &parent,
            model_by_key("a100-40gb")
                .unwrap()
                .profile("7g.40gb")
                .unwrap(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("-7-40C"), "{e}");
    }
}
