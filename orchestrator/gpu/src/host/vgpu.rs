//! MIG-backed vGPU: SR-IOV virtual functions of the GPU, the vGPU type written to a free VF
//! (recent drivers: `nvidia/creatable_vgpu_types` → `nvidia/current_vgpu_type`), and the
//! mdev path for older drivers (`mdev_supported_types/<type>/create`, `<uuid>/remove`).
//! VFs stay on the nvidia driver; the VF itself is what is passed to the VM with VFIO.
//! All of this needs NVIDIA's licensed vGPU manager on the host.

use serde::{Deserialize, Serialize};

use super::{HostDeviceError, PciAddress, Sysfs};
use crate::mig::MigProfile;

/// One vGPU type the driver offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VgpuType {
    /// Type id to write to `current_vgpu_type` (or the mdev type directory name).
    pub id: String,
    /// Name, e.g. `NVIDIA H100-3-40C`.
    pub name: String,
}

/// A vGPU set on a VF; store it to clear the VF on release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VgpuAssignment {
    /// The physical function (the GPU).
    pub pf: String,
    /// The virtual function passed to the VM.
    pub vf: String,
    /// The vGPU type.
    pub vgpu_type: VgpuType,
}

fn pci(sysfs: &Sysfs, addr: &str, file: &str) -> std::path::PathBuf {
    sysfs.path("sys/bus/pci/devices").join(addr).join(file)
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

/// The VFs of a PF (from its `virtfnN` links), in VF order.
pub fn vfs(sysfs: &Sysfs, pf: &PciAddress) -> Vec<PciAddress> {
    let dir = pci(sysfs, pf.as_str(), "");
    let mut v: Vec<(u32, PciAddress)> = sysfs
        .list(&dir)
        .iter()
        .filter_map(|n| {
            n.strip_prefix("virtfn")?
                .parse::<u32>()
                .ok()
                .map(|i| (i, n.clone()))
        })
        .filter_map(|(i, n)| {
            let target = std::fs::read_link(dir.join(&n)).ok()?;
            let name = target.file_name()?.to_string_lossy().into_owned();
            PciAddress::parse(&name).ok().map(|a| (i, a))
        })
        .collect();
    v.sort_by_key(|(i, _)| *i);
    v.into_iter().map(|(_, a)| a).collect()
}

/// Enables every VF of the PF (what `sriov-manage -e` does) when none is enabled yet.
pub fn enable_vfs(sysfs: &Sysfs, pf: &PciAddress) -> Result<Vec<PciAddress>, HostDeviceError> {
    let total_path = pci(sysfs, pf.as_str(), "sriov_totalvfs");
    if !total_path.exists() {
        return Err(HostDeviceError::NoSriov(pf.to_string()));
    }
    let total = sysfs.read(&total_path)?;
    if total == "0" {
        return Err(HostDeviceError::NoSriov(pf.to_string()));
    }
    let num = pci(sysfs, pf.as_str(), "sriov_numvfs");
    if sysfs.read(&num)? == "0" {
        sysfs.write(&num, &total)?;
    }
    Ok(vfs(sysfs, pf))
}

/// Sets the vGPU type matching `profile` on the first free VF of `pf` (a GPU instance of
/// that profile must exist). Errors say whether no VF was free or no type matched.
pub fn assign_vgpu(
    sysfs: &Sysfs,
    pf: &PciAddress,
    profile: &MigProfile,
) -> Result<VgpuAssignment, HostDeviceError> {
    let mut offered: Vec<String> = Vec::new();
    let mut any_free = false;
    for vf in enable_vfs(sysfs, pf)? {
        let current = pci(sysfs, vf.as_str(), "nvidia/current_vgpu_type");
        if sysfs.read(&current)? != "0" {
            continue;
        }
        any_free = true;
        let types = parse_creatable(&sysfs.read(&pci(
            sysfs,
            vf.as_str(),
            "nvidia/creatable_vgpu_types",
        ))?);
        if let Some(t) = type_for_profile(&types, profile) {
            sysfs.write(&current, &t.id)?;
            let now = sysfs.read(&current)?;
            if now != t.id {
                return Err(HostDeviceError::BindFailed {
                    device: vf.to_string(),
                    wanted: format!("vGPU type {}", t.id),
                    actual: format!("vGPU type {now}"),
                });
            }
            return Ok(VgpuAssignment {
                pf: pf.to_string(),
                vf: vf.to_string(),
                vgpu_type: t.clone(),
            });
        }
        offered.extend(types.into_iter().map(|t| format!("{} ({})", t.name, t.id)));
    }
    if !any_free {
        return Err(HostDeviceError::NoFreeVf(pf.to_string()));
    }
    offered.dedup();
    Err(HostDeviceError::NoVgpuType {
        device: pf.to_string(),
        wanted: format!(
            "a type ending in {} for MIG profile {}",
            vgpu_suffix(profile),
            profile.name
        ),
        creatable: if offered.is_empty() {
            "none (is the GPU instance created?)".into()
        } else {
            offered.join(", ")
        },
    })
}

/// Clears the VF's vGPU type (writes 0).
pub fn release_vgpu(sysfs: &Sysfs, a: &VgpuAssignment) -> Result<(), HostDeviceError> {
    sysfs.write(&pci(sysfs, &a.vf, "nvidia/current_vgpu_type"), "0")
}

/// The mdev types of a parent device with their free instances (older drivers).
pub fn mdev_types(
    sysfs: &Sysfs,
    parent: &PciAddress,
) -> Result<Vec<(VgpuType, u32)>, HostDeviceError> {
    let dir = pci(sysfs, parent.as_str(), "mdev_supported_types");
    sysfs
        .list(&dir)
        .into_iter()
        .map(|id| {
            let name = sysfs.read(&dir.join(&id).join("name"))?;
            let avail = sysfs
                .read(&dir.join(&id).join("available_instances"))?
                .parse()
                .unwrap_or(0);
            Ok((VgpuType { id, name }, avail))
        })
        .collect()
}

/// Creates an mdev of the type matching `profile` on `parent`; returns its UUID.
pub fn create_mdev(
    sysfs: &Sysfs,
    parent: &PciAddress,
    profile: &MigProfile,
) -> Result<(VgpuType, String), HostDeviceError> {
    let types = mdev_types(sysfs, parent)?;
    let plain: Vec<VgpuType> = types.iter().map(|(t, _)| t.clone()).collect();
    let Some(t) = type_for_profile(&plain, profile) else {
        return Err(HostDeviceError::NoVgpuType {
            device: parent.to_string(),
            wanted: format!("an mdev type ending in {}", vgpu_suffix(profile)),
            creatable: plain
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
        return Err(HostDeviceError::Mdev {
            device: parent.to_string(),
            type_id: t.id.clone(),
            reason: "no instances available: release one or create the GPU instance first".into(),
        });
    }
    let uuid = new_uuid();
    let create = pci(sysfs, parent.as_str(), "mdev_supported_types")
        .join(&t.id)
        .join("create");
    sysfs.write(&create, &uuid)?;
    Ok((t.clone(), uuid))
}

/// Removes an mdev.
pub fn remove_mdev(sysfs: &Sysfs, uuid: &str) -> Result<(), HostDeviceError> {
    // Only the hyphenated form names an mdev; anything else never reaches a path.
    let name = uuid::Uuid::try_parse(uuid)
        .ok()
        .map(|u| u.hyphenated().to_string())
        .filter(|name| name.eq_ignore_ascii_case(uuid))
        .ok_or_else(|| HostDeviceError::BadAddress(uuid.to_string()))?;
    sysfs.write(
        &sysfs.path("sys/bus/mdev/devices").join(name).join("remove"),
        "1",
    )
}

/// A random (version 4) UUID, hyphenated lowercase as mdev names are.
pub fn new_uuid() -> String {
    uuid::Uuid::new_v4().hyphenated().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;
    use crate::mig::model_by_key;

    fn pf() -> PciAddress {
        PciAddress::parse("0000:18:00.0").unwrap()
    }

    #[test]
    fn vgpu_suffix_follows_nvidia_type_names() {
        let h = model_by_key("h100-80gb").unwrap();
        assert_eq!(vgpu_suffix(h.profile("3g.40gb").unwrap()), "-3-40C");
        assert_eq!(vgpu_suffix(h.profile("1g.10gb+me").unwrap()), "-1-10CME");
        let types = parse_creatable(
            "ID    : vGPU Name\n1061  : NVIDIA H100XM-1-10CME\n1062  : NVIDIA H100XM-1-10C\n",
        );
        assert_eq!(
            type_for_profile(&types, h.profile("1g.10gb").unwrap())
                .unwrap()
                .id,
            "1062"
        );
    }

    #[test]
    fn assign_enables_vfs_picks_a_free_one_and_release_clears_it() {
        let host = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
        let s = host.sysfs();
        let p = model_by_key("h100-80gb")
            .unwrap()
            .profile("3g.40gb")
            .unwrap();
        let a = assign_vgpu(&s, &pf(), p).unwrap();
        assert_eq!(a.vgpu_type.name, "NVIDIA H100XM-3-40C");
        assert_eq!(vfs(&s, &pf()).len(), 16);
        assert_eq!(a.vf, "0000:18:00.4", "first VF at offset 4");
        let b = assign_vgpu(&s, &pf(), p).unwrap();
        assert_eq!(b.vf, "0000:18:00.5", "the first VF is taken now");
        release_vgpu(&s, &a).unwrap();
        let c = assign_vgpu(&s, &pf(), p).unwrap();
        assert_eq!(c.vf, a.vf, "a cleared VF is free again");
    }

    #[test]
    fn no_sriov_no_free_vf_and_no_matching_type_are_distinct_errors() {
        let host = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
        let s = host.sysfs();
        let m = model_by_key("a100-40gb").unwrap();
        let e = assign_vgpu(&s, &pf(), m.profile("3g.20gb").unwrap()).unwrap_err();
        assert!(e.to_string().contains("-3-20C"), "{e}");
        let bridge = PciAddress::parse("0000:17:00.0").unwrap();
        let h = model_by_key("h100-80gb").unwrap();
        assert!(matches!(
            assign_vgpu(&s, &bridge, h.profile("7g.80gb").unwrap()),
            Err(HostDeviceError::NoSriov(_))
        ));
        for vf in enable_vfs(&s, &pf()).unwrap() {
            s.write(&pci(&s, vf.as_str(), "nvidia/current_vgpu_type"), "1")
                .unwrap();
        }
        assert!(matches!(
            assign_vgpu(&s, &pf(), h.profile("7g.80gb").unwrap()),
            Err(HostDeviceError::NoFreeVf(_))
        ));
    }

    #[test]
    fn mdev_create_and_remove_track_available_instances() {
        let host = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
        let s = host.sysfs();
        let parent = PciAddress::parse("0000:05:00.0").unwrap();
        let p = model_by_key("a100-40gb")
            .unwrap()
            .profile("3g.20gb")
            .unwrap();
        let (t, uuid) = create_mdev(&s, &parent, p).unwrap();
        assert_eq!(t.name, "GRID A100-3-20C");
        assert!(s.path("sys/bus/mdev/devices").join(&uuid).exists());
        let (_, again) = create_mdev(&s, &parent, p).unwrap();
        let e = create_mdev(&s, &parent, p).unwrap_err();
        assert!(e.to_string().contains("no instances available"), "{e}");
        remove_mdev(&s, &uuid).unwrap();
        remove_mdev(&s, &again).unwrap();
        assert_eq!(
            mdev_types(&s, &parent)
                .unwrap()
                .iter()
                .find(|(x, _)| x.id == t.id)
                .unwrap()
                .1,
            2
        );
        assert!(remove_mdev(&s, "../../x").is_err());
        let e = create_mdev(
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

    #[test]
    fn uuids_are_version_4() {
        let u = new_uuid();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert_ne!(u, new_uuid());
    }

    #[test]
    fn only_hyphenated_uuids_name_an_mdev_to_remove() {
        let host = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
        let s = host.sysfs();
        for bad in [
            "../../../../etc/passwd",
            "0123456789abcdef0123456789abcdef",
            "{01234567-89ab-cdef-0123-456789abcdef}",
            "urn:uuid:01234567-89ab-cdef-0123-456789abcdef",
            "01234567-89ab-cdef-0123-456789abcdeg",
        ] {
            assert!(
                matches!(remove_mdev(&s, bad), Err(HostDeviceError::BadAddress(_))),
                "{bad}"
            );
        }
    }
}
