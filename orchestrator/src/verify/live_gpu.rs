//! The live host's GPU state for check 10 ([`GpuSnapshot`]), read only: MIG instances from
//! the GPU backend the operator names (`--gpu-backend`), reservations from the daemon's
//! store (`<state-dir>/state.db`, opened read-only, never migrated), and, under the sysfs root
//! (`--gpu-sysfs-root`), each GPU's driver binding and its VFs' `nvidia/current_vgpu_type`
//! and bindings. The quarantine list comes from the daemon's API (the caller passes it).

use std::path::Path;

use tenantvm_gpu::host::{soft_sharing, sriov, vgpu, PciAddress, Sysfs};

use super::checks::gpu_departure::GpuSnapshot;
use super::host::HostError;

/// The driver a device handed to a VM is bound to.
const VFIO: &str = "vfio-pci";

/// Reads the GPU state: `backend` (`nvml`, `sim:FILE`; none: no GPUs looked at), the
/// store `store_db`, the sysfs under `sysfs_root`; `quarantined` as the daemon
/// lists them (`<gpu>/<label>`).
pub fn snapshot(
    backend: Option<&str>,
    store_db: &Path,
    sysfs_root: &Path,
    quarantined: Vec<String>,
) -> Result<GpuSnapshot, HostError> {
    let mut s = GpuSnapshot {
        quarantined: quarantined.into_iter().collect(),
        ..GpuSnapshot::default()
    };
    s.reservations = reservations(store_db)?;
    let Some(arg) = backend else {
        s.not_seen
            .push("no --gpu-backend: MIG instances, VFs and bindings not looked at".into());
        return Ok(s);
    };
    let unsupported =
        |e: &dyn std::fmt::Display| HostError::Unsupported(format!("GPU backend {arg}: {e}"));
    let spec: tenantvm_gpu::backend::BackendSpec = arg.parse().map_err(|e| unsupported(&e))?;
    let gpus = tenantvm_gpu::backend::open(&spec)
        .and_then(|b| b.gpus())
        .map_err(|e| unsupported(&e))?;
    let sysfs = Sysfs::new(sysfs_root);
    for g in gpus {
        for i in &g.instances {
            s.instances.insert(format!(
                "{} gi {} profile {} @{}{}",
                g.pci_address,
                i.gi_id,
                i.profile_id,
                i.start,
                if i.has_compute_instance {
                    ""
                } else {
                    " (no compute instance)"
                }
            ));
        }
        if g.assigned_whole {
            // A simulated host's record of a GPU handed out whole (bound to vfio-pci).
            s.vfio_bound
                .insert(format!("{} (assigned whole)", g.pci_address));
        }
        devices(&sysfs, &g.pci_address, &mut s);
    }
    Ok(s)
}

/// A GPU's binding and its VFs' vGPU types and bindings, from sysfs.
pub fn devices(sysfs: &Sysfs, pci: &str, s: &mut GpuSnapshot) {
    let Ok(addr) = PciAddress::parse(pci) else {
        s.not_seen
            .push(format!("GPU {pci}: not a PCI address, sysfs not read"));
        return;
    };
    let dev = match sysfs.device(&addr) {
        Ok(d) => d,
        Err(e) => {
            s.not_seen.push(format!(
                "GPU {pci}: {e} under {} (a simulated GPU?): its VFs and binding not read",
                sysfs.root().display()
            ));
            return;
        }
    };
    if dev.driver.as_deref() == Some(VFIO) {
        s.vfio_bound.insert(pci.to_string());
    }
    for vf in sriov::vfs(sysfs, &addr) {
        match vgpu::vf_state(sysfs, &vf) {
            Ok(st) => {
                if let Some(t) = st.vgpu_type {
                    s.vf_types.insert(format!("{vf} current_vgpu_type {t}"));
                }
            }
            Err(vgpu::VgpuError::NotAVgpuVf(_)) => {}
            Err(e) => s.not_seen.push(format!("VF {vf}: {e}")),
        }
        if sysfs
            .device(&vf)
            .is_ok_and(|d| d.driver.as_deref() == Some(VFIO))
        {
            s.vfio_bound.insert(vf.to_string());
        }
    }
}

/// What shares the GPUs at `gpus` without a hardware partition, under the sysfs root (its
/// `proc/` for MPS processes, each GPU's VFs for time-sliced vGPU types), in words. A GPU
/// whose address does not parse is skipped (its VFs cannot be named).
pub fn soft_sharing(sysfs_root: &Path, gpus: &[String]) -> Vec<String> {
    let sysfs = Sysfs::new(sysfs_root);
    let addresses: Vec<PciAddress> = gpus
        .iter()
        .filter_map(|g| PciAddress::parse(g).ok())
        .collect();
    soft_sharing::find(&sysfs, &addresses)
        .iter()
        .map(ToString::to_string)
        .collect()
}

/// The store's reservations as `<gpu>/<label>` (read-only; an absent store holds none).
fn reservations(db: &Path) -> Result<std::collections::BTreeSet<String>, HostError> {
    if !db.exists() {
        return Ok(Default::default());
    }
    let err = |e: rusqlite::Error| HostError::Io {
        path: db.display().to_string(),
        message: e.to_string(),
    };
    let conn = rusqlite::Connection::open_with_flags(
        db,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(err)?;
    conn.busy_timeout(std::time::Duration::from_secs(10))
        .map_err(err)?;
    let mut stmt = conn
        .prepare("SELECT DISTINCT gpu, placement FROM gpu_reservations")
        .map_err(err)?;
    let rows = stmt
        .query_map([], |r| {
            Ok(format!(
                "{}/{}",
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?
            ))
        })
        .map_err(err)?;
    rows.collect::<Result<_, _>>().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-built sysfs tree: a GPU (PF) with one VF whose vGPU type is `vf_type`, bound
    /// to `driver`.
    fn tree(root: &Path, vf_type: &str, driver: &str) {
        let devs = root.join("sys/bus/pci/devices");
        let drivers = root.join("sys/bus/pci/drivers");
        for (addr, drv) in [("0000:0f:00.0", "nvidia"), ("0000:0f:00.4", driver)] {
            let d = devs.join(addr);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("vendor"), "0x10de\n").unwrap();
            std::fs::write(d.join("device"), "0x2335\n").unwrap();
            std::fs::write(d.join("class"), "0x030200\n").unwrap();
            std::fs::create_dir_all(drivers.join(drv)).unwrap();
            std::os::unix::fs::symlink(drivers.join(drv), d.join("driver")).unwrap();
        }
        std::os::unix::fs::symlink(devs.join("0000:0f:00.4"), devs.join("0000:0f:00.0/virtfn0"))
            .unwrap();
        let nv = devs.join("0000:0f:00.4/nvidia");
        std::fs::create_dir_all(&nv).unwrap();
        std::fs::write(nv.join("current_vgpu_type"), format!("{vf_type}\n")).unwrap();
        std::fs::write(nv.join("gpu_instance_id"), "3\n").unwrap();
        std::fs::write(nv.join("placement_id"), "0\n").unwrap();
    }

    #[test]
    fn a_vf_with_a_vgpu_type_and_a_vfio_binding_are_seen_and_a_clean_vf_is_not() {
        let dir = tempfile::tempdir().unwrap();
        tree(dir.path(), "557", "vfio-pci");
        let mut s = GpuSnapshot::default();
        devices(&Sysfs::new(dir.path()), "0000:0f:00.0", &mut s);
        assert_eq!(
            s.vf_types.iter().collect::<Vec<_>>(),
            ["0000:0f:00.4 current_vgpu_type 557"]
        );
        assert_eq!(s.vfio_bound.iter().collect::<Vec<_>>(), ["0000:0f:00.4"]);
        assert!(s.not_seen.is_empty(), "{s:?}");

        let clean = tempfile::tempdir().unwrap();
        tree(clean.path(), "0", "nvidia");
        let mut s = GpuSnapshot::default();
        devices(&Sysfs::new(clean.path()), "0000:0f:00.0", &mut s);
        assert!(s.vf_types.is_empty() && s.vfio_bound.is_empty(), "{s:?}");
    }

    #[test]
    fn a_gpu_sysfs_does_not_have_is_reported_not_seen() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = GpuSnapshot::default();
        devices(&Sysfs::new(dir.path()), "0000:0f:00.0", &mut s);
        assert_eq!(s.not_seen.len(), 1, "{s:?}");
    }

    #[test]
    fn reservations_are_read_from_the_store_read_only() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("state.db");
        assert!(reservations(&db).unwrap().is_empty());
        let store = crate::store::Store::open(&db).unwrap();
        drop(store);
        assert!(reservations(&db).unwrap().is_empty());
    }
}
