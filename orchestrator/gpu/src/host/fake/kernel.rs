//! The FAKE kernel: performs (or refuses, with the errno the kernel would return) every write
//! through a fake [`Sysfs`], and answers reads of the attributes whose value is computed by a
//! driver (a VF's `nvidia/creatable_vgpu_types`, `gpu_instance_id`, `placement_id`).

use std::io;
use std::path::Path;

use super::{
    add_device, bind_link, crash_point, devices_dir, sim_of, spec_of, w, FakeDevice, RESETS_FILE,
};
use crate::host::vgpu::profile_for_type;
use crate::host::Sysfs;
use crate::mig;

fn errno(code: i32, why: &str) -> io::Error {
    tracing::debug!(errno = code, why, "FAKE kernel refuses");
    io::Error::from_raw_os_error(code)
}

fn rel_parts(sysfs: &Sysfs, path: &Path) -> io::Result<Vec<String>> {
    Ok(path
        .strip_prefix(sysfs.root())
        .map_err(io::Error::other)?
        .to_string_lossy()
        .split('/')
        .map(str::to_string)
        .collect())
}

/// Performs a write through a fake tree.
pub(super) fn write(sysfs: &Sysfs, path: &Path, value: &str) -> io::Result<()> {
    let root = sysfs.root();
    crash_point(root)?;
    let parts = rel_parts(sysfs, path)?;
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    let v = value.trim();
    match parts.as_slice() {
        ["sys", "bus", "pci", "drivers_probe"] => probe(root, v),
        ["sys", "bus", "pci", "devices", bdf, "driver", "unbind"] => {
            let dev = devices_dir(root).join(bdf);
            let drv = std::fs::read_link(dev.join("driver"))
                .map_err(|_| errno(libc::ENODEV, "no driver to unbind"))?;
            std::fs::remove_file(dev.join("driver"))?;
            std::fs::remove_file(drv.join(bdf))
        }
        ["sys", "bus", "pci", "devices", _, "driver_override"] => w(
            path,
            &format!("{}\n", if v.is_empty() { "(null)" } else { v }),
        ),
        ["sys", "bus", "pci", "devices", bdf, "sriov_numvfs"] => set_vfs(root, bdf, v),
        ["sys", "bus", "pci", "devices", bdf, "reset"] => reset(root, bdf, v),
        ["sys", "bus", "pci", "devices", vf, "nvidia", "current_vgpu_type"] => {
            set_vgpu_type(sysfs, vf, v)
        }
        ["sys", "bus", "pci", "devices", bdf, "mdev_supported_types", t, "create"] => {
            create_mdev(root, bdf, t, v)
        }
        ["sys", "bus", "mdev", "devices", uuid, "remove"] => remove_mdev(root, uuid),
        _ => {
            if !path.is_file() {
                return Err(errno(libc::ENOENT, "no such attribute"));
            }
            std::fs::write(path, value)
        }
    }
}

/// Answers a read of a driver-computed attribute; None for plain files.
pub(super) fn read(sysfs: &Sysfs, path: &Path) -> Option<io::Result<Vec<u8>>> {
    let parts = rel_parts(sysfs, path).ok()?;
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    match parts.as_slice() {
        ["sys", "bus", "pci", "devices", vf, "nvidia", attr] => match *attr {
            "creatable_vgpu_types" => Some(creatable(sysfs, vf).map(String::into_bytes)),
            "gpu_instance_id" | "placement_id" => Some(served_instance(sysfs, vf).and_then(|i| {
                let (gi, start) =
                    i.ok_or_else(|| errno(libc::ENXIO, "no vGPU type is set on the VF"))?;
                let v = if *attr == "gpu_instance_id" {
                    gi
                } else {
                    start
                };
                Ok(format!("{v}\n").into_bytes())
            })),
            _ => None,
        },
        _ => None,
    }
}

fn probe(root: &Path, bdf: &str) -> io::Result<()> {
    let dev = devices_dir(root).join(bdf);
    if !dev.is_dir() {
        return Err(errno(libc::ENODEV, "no such device"));
    }
    if dev.join("driver").exists() {
        return Ok(());
    }
    let spec = spec_of(root)?;
    let ov = std::fs::read_to_string(dev.join("driver_override"))?
        .trim()
        .to_string();
    let known = spec.devices.iter().find(|d| d.bdf == bdf);
    let target = if !ov.is_empty() && ov != "(null)" {
        Some(ov)
    } else if dev.join("physfn").exists() {
        Some("nvidia".to_string())
    } else {
        known.and_then(|d| d.driver.clone())
    };
    let Some(target) = target else { return Ok(()) };
    if target == "vfio-pci" && known.is_some_and(|d| d.refuse_vfio) {
        return Ok(());
    }
    if root.join("sys/bus/pci/drivers").join(&target).is_dir() {
        bind_link(root, bdf, &target)?;
    }
    Ok(())
}

fn reset(root: &Path, bdf: &str, value: &str) -> io::Result<()> {
    if value != "1" {
        return Err(errno(libc::EINVAL, "write 1 to reset"));
    }
    let dev = devices_dir(root).join(bdf);
    if !dev.join("reset").exists() {
        return Err(errno(libc::ENOENT, "no reset method"));
    }
    let spec = spec_of(root)?;
    let d = spec.devices.iter().find(|d| d.bdf == bdf);
    if d.is_some_and(|d| d.reset_fails) {
        return Err(errno(libc::EIO, "the function reset failed"));
    }
    if d.is_some_and(|d| d.reset_breaks) {
        std::fs::write(dev.join("config"), [0xffu8; 64])?;
    }
    let mut log = std::fs::read_to_string(root.join(RESETS_FILE)).unwrap_or_default();
    log.push_str(bdf);
    log.push('\n');
    w(&root.join(RESETS_FILE), &log)
}

fn parse_bdf(bdf: &str) -> Option<(String, u32, u32)> {
    let bus_part = bdf.get(..8)?;
    let dev = u32::from_str_radix(bdf.get(8..10)?, 16).ok()?;
    let func = u32::from_str_radix(bdf.get(11..12)?, 16).ok()?;
    Some((bus_part.to_string(), dev, func))
}

fn read_trim(path: &Path) -> io::Result<String> {
    Ok(std::fs::read_to_string(path)?.trim().to_string())
}

fn set_vfs(root: &Path, pf: &str, value: &str) -> io::Result<()> {
    let n: u32 = value
        .parse()
        .map_err(|_| errno(libc::EINVAL, "not a number"))?;
    let spec = spec_of(root)?;
    let d = spec
        .devices
        .iter()
        .find(|d| d.bdf == pf)
        .ok_or_else(|| errno(libc::ENOENT, "not an SR-IOV device"))?;
    if n > d.sriov_totalvfs {
        return Err(errno(libc::ERANGE, "more VFs than sriov_totalvfs"));
    }
    let pf_dir = devices_dir(root).join(pf);
    let current: u32 = read_trim(&pf_dir.join("sriov_numvfs"))?
        .parse()
        .unwrap_or(0);
    if n == current {
        return Ok(());
    }
    if current != 0 && n != 0 {
        return Err(errno(libc::EBUSY, "write 0 before changing the VF count"));
    }
    // The driver's say: the GPU's rebind wipes its GPU instances; VFs with vGPUs stay.
    if let Some(sim) = sim_of(root) {
        sim.driver_set_vfs(pf, n)
            .map_err(|r| errno(r.errno, &r.why))?;
    }
    if n == 0 {
        remove_vfs(&pf_dir)?;
    } else {
        add_vfs(root, d, &pf_dir, n)?;
    }
    w(&pf_dir.join("sriov_numvfs"), &format!("{n}\n"))
}

fn remove_vfs(pf_dir: &Path) -> io::Result<()> {
    for name in std::fs::read_dir(pf_dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("virtfn"))
    {
        let vf = std::fs::read_link(pf_dir.join(&name))?;
        let vf_name = vf
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if let Ok(drv) = std::fs::read_link(vf.join("driver")) {
            let _ = std::fs::remove_file(drv.join(&vf_name));
        }
        if let Ok(group) = std::fs::read_link(vf.join("iommu_group")) {
            let _ = std::fs::remove_dir_all(group);
        }
        std::fs::remove_file(pf_dir.join(&name))?;
        std::fs::remove_dir_all(vf)?;
    }
    Ok(())
}

fn add_vfs(root: &Path, d: &FakeDevice, pf_dir: &Path, n: u32) -> io::Result<()> {
    let (bus, dev, func) = parse_bdf(&d.bdf).ok_or_else(|| io::Error::other("bad PF address"))?;
    let max_group = std::fs::read_dir(root.join("sys/kernel/iommu_groups"))?
        .filter_map(|e| e.ok()?.file_name().to_string_lossy().parse::<u32>().ok())
        .max()
        .unwrap_or(0);
    for k in 0..n {
        let devfn = (dev << 3 | func) + 4 + k;
        let vf_bdf = format!("{bus}{:02x}.{}", devfn >> 3, devfn & 7);
        let vf = FakeDevice {
            bdf: vf_bdf.clone(),
            vendor: d.vendor.clone(),
            device: d.vf_device.clone().unwrap_or_else(|| d.device.clone()),
            class: d.class.clone(),
            driver: None,
            iommu_group: Some(max_group + 1 + k),
            sriov_totalvfs: 0,
            vf_device: None,
            vgpu_types: Vec::new(),
            mdev_types: Vec::new(),
            refuse_vfio: false,
            reset_method: "flr".into(),
            reset_fails: false,
            reset_breaks: false,
        };
        add_device(root, &vf)?;
        let vf_dir = devices_dir(root).join(&vf_bdf);
        std::os::unix::fs::symlink(pf_dir, vf_dir.join("physfn"))?;
        std::os::unix::fs::symlink(&vf_dir, pf_dir.join(format!("virtfn{k}")))?;
        // Values computed by the driver are answered by `read`; the files make them exist.
        w(&vf_dir.join("nvidia/creatable_vgpu_types"), "")?;
        w(&vf_dir.join("nvidia/gpu_instance_id"), "")?;
        w(&vf_dir.join("nvidia/placement_id"), "")?;
        w(&vf_dir.join("nvidia/current_vgpu_type"), "0\n")?;
        if root.join("sys/bus/pci/drivers/nvidia").is_dir() {
            bind_link(root, &vf_bdf, "nvidia")?;
        }
    }
    Ok(())
}

/// The PF of a VF and the PF's spec entry.
fn pf_of(root: &Path, vf: &str) -> io::Result<(String, FakeDevice)> {
    let pf = std::fs::read_link(devices_dir(root).join(vf).join("physfn"))
        .map_err(|_| errno(libc::ENOENT, "not a VF"))?;
    let pf = pf
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let spec = spec_of(root)?;
    let d = spec
        .devices
        .into_iter()
        .find(|d| d.bdf == pf)
        .ok_or_else(|| errno(libc::ENODEV, "unknown PF"))?;
    Ok((pf, d))
}

/// The vGPU types the PF's VFs support, each with its MIG profile name.
fn types_of(d: &FakeDevice) -> Vec<(u32, String, String)> {
    let Some(model) = mig::model_by_pci_device(hex16(&d.device)) else {
        return Vec::new();
    };
    d.vgpu_types
        .iter()
        .filter_map(|(id, name)| {
            let p = profile_for_type(model, name)?;
            Some((*id, name.clone(), p.name.to_string()))
        })
        .collect()
}

fn hex16(s: &str) -> u16 {
    u16::from_str_radix(s.trim().trim_start_matches("0x"), 16).unwrap_or(0xffff)
}

fn current_type(root: &Path, vf: &str) -> io::Result<String> {
    read_trim(&devices_dir(root).join(vf).join("nvidia/current_vgpu_type"))
}

/// `creatable_vgpu_types`: the header, then the types whose profile has a GPU instance that
/// carries no vGPU (nothing for a VF that already has a type, or without a linked driver).
fn creatable(sysfs: &Sysfs, vf: &str) -> io::Result<String> {
    let root = sysfs.root();
    let mut out = String::from("ID    : vGPU Name\n");
    let (pf, d) = pf_of(root, vf)?;
    if current_type(root, vf)? != "0" {
        return Ok(out);
    }
    let Some(sim) = sim_of(root) else {
        return Ok(out);
    };
    let instances = sim
        .driver_instances(&pf)
        .map_err(|r| errno(r.errno, &r.why))?;
    for (id, name, profile) in types_of(&d) {
        let free = instances
            .iter()
            .any(|i| i.vgpu_vf.is_none() && i.profile.eq_ignore_ascii_case(&profile));
        if free {
            out.push_str(&format!("{id:<6}: {name}\n"));
        }
    }
    Ok(out)
}

/// The (GPU-instance id, start) the VF's vGPU runs on, or None when it has no type.
fn served_instance(sysfs: &Sysfs, vf: &str) -> io::Result<Option<(u32, u32)>> {
    let root = sysfs.root();
    let (pf, _) = pf_of(root, vf)?;
    let Some(sim) = sim_of(root) else {
        return Ok(None);
    };
    let instances = sim
        .driver_instances(&pf)
        .map_err(|r| errno(r.errno, &r.why))?;
    Ok(instances
        .iter()
        .find(|i| i.vgpu_vf.as_deref() == Some(vf))
        .map(|i| (i.gi_id, i.start)))
}

fn set_vgpu_type(sysfs: &Sysfs, vf: &str, value: &str) -> io::Result<()> {
    let root = sysfs.root();
    let (pf, d) = pf_of(root, vf)?;
    let file = devices_dir(root).join(vf).join("nvidia/current_vgpu_type");
    let id: u32 = value
        .parse()
        .map_err(|_| errno(libc::EINVAL, "not a type id"))?;
    let sim = sim_of(root);
    if id == 0 {
        if let Some(sim) = &sim {
            sim.driver_stop_vgpu(&pf, vf)
                .map_err(|r| errno(r.errno, &r.why))?;
        }
        return w(&file, "0\n");
    }
    if current_type(root, vf)? != "0" {
        return Err(errno(libc::EBUSY, "the VF already has a vGPU type"));
    }
    let creatable = crate::host::vgpu::parse_creatable(&creatable(sysfs, vf)?);
    if !creatable.iter().any(|t| t.id == id.to_string()) {
        return Err(errno(
            libc::EINVAL,
            "the type is not creatable on this VF now",
        ));
    }
    let Some((_, _, profile)) = types_of(&d).into_iter().find(|(t, _, _)| *t == id) else {
        return Err(errno(libc::EINVAL, "not a vGPU type of this GPU"));
    };
    let Some(sim) = sim else {
        return Err(errno(libc::ENODEV, "no simulated driver is linked"));
    };
    sim.driver_start_vgpu(&pf, vf, &profile)
        .map_err(|r| errno(r.errno, &r.why))?;
    w(&file, &format!("{id}\n"))
}

fn adjust_available(type_dir: &Path, delta: i64) -> io::Result<()> {
    let p = type_dir.join("available_instances");
    let n: i64 = read_trim(&p)?.parse().unwrap_or(0);
    w(&p, &format!("{}\n", (n + delta).max(0)))
}

fn create_mdev(root: &Path, parent: &str, type_id: &str, uuid: &str) -> io::Result<()> {
    let pdir = devices_dir(root).join(parent);
    let tdir = pdir.join("mdev_supported_types").join(type_id);
    if read_trim(&tdir.join("available_instances"))?
        .parse::<u32>()
        .unwrap_or(0)
        == 0
    {
        return Err(errno(libc::ENOSPC, "no instances available"));
    }
    let mdir = pdir.join(uuid);
    if mdir.exists() {
        return Err(errno(libc::EEXIST, "an mdev with this UUID exists"));
    }
    std::fs::create_dir_all(&mdir)?;
    w(&mdir.join("remove"), "")?;
    std::os::unix::fs::symlink(&tdir, mdir.join("mdev_type"))?;
    std::fs::create_dir_all(root.join("sys/bus/mdev/devices"))?;
    std::os::unix::fs::symlink(&mdir, root.join("sys/bus/mdev/devices").join(uuid))?;
    // vfio-mdev gives each mdev an IOMMU group of its own (`/dev/vfio/<group>`).
    let groups = root.join("sys/kernel/iommu_groups");
    let next = std::fs::read_dir(&groups)?
        .filter_map(|e| e.ok()?.file_name().to_string_lossy().parse::<u32>().ok())
        .max()
        .map_or(0, |g| g + 1);
    let gdir = groups.join(next.to_string());
    std::fs::create_dir_all(gdir.join("devices"))?;
    std::os::unix::fs::symlink(&gdir, mdir.join("iommu_group"))?;
    std::os::unix::fs::symlink(&mdir, gdir.join("devices").join(uuid))?;
    adjust_available(&tdir, -1)
}

fn remove_mdev(root: &Path, uuid: &str) -> io::Result<()> {
    let link = root.join("sys/bus/mdev/devices").join(uuid);
    let mdir = std::fs::read_link(&link).map_err(|_| errno(libc::ENOENT, "no such mdev"))?;
    let tdir = std::fs::read_link(mdir.join("mdev_type"))?;
    if let Ok(group) = std::fs::read_link(mdir.join("iommu_group")) {
        let _ = std::fs::remove_dir_all(group);
    }
    std::fs::remove_dir_all(&mdir)?;
    std::fs::remove_file(&link)?;
    adjust_available(&tdir, 1)
}
