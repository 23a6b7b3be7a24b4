//! SR-IOV virtual functions of a GPU through sysfs (`sriov_totalvfs`, `sriov_numvfs`,
//! `virtfnN`): what NVIDIA's `sriov-manage -e` / `-d` do. On a GPU with MIG, enabling VFs
//! rebinds the GPU and wipes every GPU instance on it (MIG mode survives), so it belongs to
//! host preparation, before any instance is made ([`crate::route::vgpu`]).

use thiserror::Error;

use super::{HostDeviceError, PciAddress, Sysfs};

/// Errors of VF enable and disable.
#[derive(Debug, Error)]
pub enum SriovError {
    /// The device has no SR-IOV capability.
    #[error("{0} has no SR-IOV capability: MIG-backed vGPU needs a GPU with SR-IOV (Ampere and newer) and NVIDIA's vGPU manager")]
    NoSriov(String),
    /// A sysfs read or write failed.
    #[error("SR-IOV on {device}: {source}")]
    Sysfs {
        /// The GPU.
        device: String,
        /// The cause.
        source: HostDeviceError,
    },
    /// The kernel did not end up with the VF count asked for.
    #[error("SR-IOV on {device}: asked for {wanted} VFs, the kernel has {actual}")]
    Count {
        /// The GPU.
        device: String,
        /// VFs asked for.
        wanted: u32,
        /// VFs there are.
        actual: u32,
    },
}

fn attr(sysfs: &Sysfs, pf: &PciAddress, name: &str) -> std::path::PathBuf {
    sysfs.device_dir(pf).join(name)
}

fn read_u32(sysfs: &Sysfs, pf: &PciAddress, name: &str) -> Result<u32, SriovError> {
    let v = sysfs
        .read(&attr(sysfs, pf, name))
        .map_err(|source| SriovError::Sysfs {
            device: pf.to_string(),
            source,
        })?;
    Ok(v.parse().unwrap_or(0))
}

/// `sriov_totalvfs`; `NoSriov` when the attribute is absent or 0.
pub fn total_vfs(sysfs: &Sysfs, pf: &PciAddress) -> Result<u32, SriovError> {
    if !attr(sysfs, pf, "sriov_totalvfs").exists() {
        return Err(SriovError::NoSriov(pf.to_string()));
    }
    match read_u32(sysfs, pf, "sriov_totalvfs")? {
        0 => Err(SriovError::NoSriov(pf.to_string())),
        n => Ok(n),
    }
}

/// `sriov_numvfs`: the VFs enabled now (0 without SR-IOV).
pub fn enabled_vfs(sysfs: &Sysfs, pf: &PciAddress) -> Result<u32, SriovError> {
    if !attr(sysfs, pf, "sriov_numvfs").exists() {
        return Ok(0);
    }
    read_u32(sysfs, pf, "sriov_numvfs")
}

/// The VFs of a PF (from its `virtfnN` links), in VF order.
pub fn vfs(sysfs: &Sysfs, pf: &PciAddress) -> Vec<PciAddress> {
    let dir = sysfs.device_dir(pf);
    let mut v: Vec<(u32, PciAddress)> = sysfs
        .list(&dir)
        .iter()
        .filter_map(|n| Some((n.strip_prefix("virtfn")?.parse::<u32>().ok()?, n)))
        .filter_map(|(i, n)| {
            let target = std::fs::read_link(dir.join(n)).ok()?;
            let name = target.file_name()?.to_string_lossy().into_owned();
            PciAddress::parse(&name).ok().map(|a| (i, a))
        })
        .collect();
    v.sort_by_key(|(i, _)| *i);
    v.into_iter().map(|(_, a)| a).collect()
}

fn set_numvfs(sysfs: &Sysfs, pf: &PciAddress, n: u32) -> Result<(), SriovError> {
    sysfs
        .write(&attr(sysfs, pf, "sriov_numvfs"), &n.to_string())
        .map_err(|source| SriovError::Sysfs {
            device: pf.to_string(),
            source,
        })?;
    let actual = enabled_vfs(sysfs, pf)?;
    if actual != n {
        return Err(SriovError::Count {
            device: pf.to_string(),
            wanted: n,
            actual,
        });
    }
    Ok(())
}

/// Enables every VF of the PF (as `sriov-manage -e` does) unless VFs are enabled already;
/// returns the VFs. WIPES every GPU instance of a MIG GPU when it enables them.
pub fn enable_vfs(sysfs: &Sysfs, pf: &PciAddress) -> Result<Vec<PciAddress>, SriovError> {
    let total = total_vfs(sysfs, pf)?;
    if enabled_vfs(sysfs, pf)? == 0 {
        tracing::info!(pf = %pf, total, "enabling SR-IOV virtual functions");
        set_numvfs(sysfs, pf, total)?;
    }
    Ok(vfs(sysfs, pf))
}

/// Disables the PF's VFs (as `sriov-manage -d` does); nothing to do when none are enabled.
/// The kernel refuses (EBUSY) while a VF is in use.
pub fn disable_vfs(sysfs: &Sysfs, pf: &PciAddress) -> Result<(), SriovError> {
    if enabled_vfs(sysfs, pf)? == 0 {
        return Ok(());
    }
    tracing::info!(pf = %pf, "disabling SR-IOV virtual functions");
    set_numvfs(sysfs, pf, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;

    #[test]
    fn enable_is_idempotent_and_disable_removes_the_vfs() {
        let host = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
        let s = host.sysfs();
        let pf = PciAddress::parse("0000:18:00.0").unwrap();
        assert_eq!(total_vfs(&s, &pf).unwrap(), 16);
        let v = enable_vfs(&s, &pf).unwrap();
        assert_eq!(v.len(), 16);
        assert_eq!(v[0].as_str(), "0000:18:00.4", "first VF at offset 4");
        let ops = host.ops();
        assert_eq!(enable_vfs(&s, &pf).unwrap(), v);
        assert_eq!(host.ops(), ops, "a second enable writes nothing");
        for vf in &v {
            assert_eq!(
                s.device(vf).unwrap().driver.as_deref(),
                Some("nvidia"),
                "VFs stay on nvidia"
            );
            assert_eq!(s.physfn(vf).as_ref(), Some(&pf));
        }
        disable_vfs(&s, &pf).unwrap();
        disable_vfs(&s, &pf).unwrap();
        assert!(vfs(&s, &pf).is_empty());
        assert!(s.device(&v[0]).is_err(), "the VF is gone");
    }

    #[test]
    fn a_device_without_sriov_is_refused() {
        let host = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
        let bridge = PciAddress::parse("0000:17:00.0").unwrap();
        let e = enable_vfs(&host.sysfs(), &bridge).unwrap_err();
        assert!(matches!(e, SriovError::NoSriov(_)), "{e}");
        assert_eq!(enabled_vfs(&host.sysfs(), &bridge).unwrap(), 0);
    }
}
