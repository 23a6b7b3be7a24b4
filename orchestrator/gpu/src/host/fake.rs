//! FAKE host trees for tests and demos: builds a sysfs/proc/dev tree under a directory from
//! a JSON description (tests/fixtures/hosts/*.sysfs.json) and emulates the kernel's reactions
//! to the writes tenantvm makes (unbind, drivers_probe, sriov_numvfs, mdev create/remove).
//! Never used against a real host: [`Sysfs::new`] has no emulation.

use std::io;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::Sysfs;

/// A fake host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FakeHostSpec {
    /// What the tree stands for.
    #[serde(default)]
    pub comment: String,
    /// PCI devices.
    pub devices: Vec<FakeDevice>,
    /// Registered PCI drivers.
    #[serde(default)]
    pub drivers: Vec<String>,
    /// Loaded modules (`/sys/module/<name>`).
    #[serde(default)]
    pub modules: Vec<String>,
    /// NVIDIA driver version (`/sys/module/nvidia/version`).
    #[serde(default)]
    pub nvidia_version: Option<String>,
    /// Kernel command line.
    #[serde(default)]
    pub cmdline: String,
    /// `v1` or `v2`.
    #[serde(default)]
    pub cgroup: String,
    /// Reserved 2 MiB huge pages.
    #[serde(default)]
    pub hugepages_2m: u64,
    /// Reserved 1 GiB huge pages.
    #[serde(default)]
    pub hugepages_1g: u64,
    /// Whether `dev/kvm` links to the real /dev/kvm.
    #[serde(default)]
    pub kvm: bool,
}

/// One fake PCI device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FakeDevice {
    /// Address.
    pub bdf: String,
    /// Vendor id (`0x10de`).
    pub vendor: String,
    /// Device id.
    pub device: String,
    /// Class code (`0x030200`).
    pub class: String,
    /// Bound driver (also the driver a probe gives it without an override).
    #[serde(default)]
    pub driver: Option<String>,
    /// IOMMU group.
    #[serde(default)]
    pub iommu_group: Option<u32>,
    /// SR-IOV VFs the device can have (0: no SR-IOV capability).
    #[serde(default)]
    pub sriov_totalvfs: u32,
    /// Device id of the VFs.
    #[serde(default)]
    pub vf_device: Option<String>,
    /// vGPU types each VF offers (`[id, name]`).
    #[serde(default)]
    pub vgpu_types: Vec<(u32, String)>,
    /// mdev types of the device.
    #[serde(default)]
    pub mdev_types: Vec<FakeMdevType>,
    /// The fake kernel refuses to bind vfio-pci to it (to test rollback).
    #[serde(default)]
    pub refuse_vfio: bool,
}

/// One fake mdev type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FakeMdevType {
    /// Type directory name (`nvidia-470`).
    pub id: String,
    /// Its `name`.
    pub name: String,
    /// `available_instances`.
    pub available: u32,
}

/// A fake host tree; removed when dropped.
#[derive(Debug)]
pub struct FakeHost {
    root: PathBuf,
    keep: bool,
}

const SPEC_FILE: &str = ".fake-kernel/spec.json";

fn w(path: &Path, text: &str) -> io::Result<()> {
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p)?;
    }
    std::fs::write(path, text)
}

fn devices_dir(root: &Path) -> PathBuf {
    root.join("sys/bus/pci/devices")
}

fn bind_link(root: &Path, bdf: &str, driver: &str) -> io::Result<()> {
    let drv = root.join("sys/bus/pci/drivers").join(driver);
    let dev = devices_dir(root).join(bdf);
    symlink(&drv, dev.join("driver"))?;
    symlink(&dev, drv.join(bdf))
}

fn add_device(root: &Path, d: &FakeDevice) -> io::Result<()> {
    let dir = devices_dir(root).join(&d.bdf);
    std::fs::create_dir_all(&dir)?;
    w(&dir.join("vendor"), &format!("{}\n", d.vendor))?;
    w(&dir.join("device"), &format!("{}\n", d.device))?;
    w(&dir.join("class"), &format!("{}\n", d.class))?;
    w(&dir.join("driver_override"), "(null)\n")?;
    if let Some(g) = d.iommu_group {
        let gdir = root.join(format!("sys/kernel/iommu_groups/{g}"));
        std::fs::create_dir_all(gdir.join("devices"))?;
        symlink(&gdir, dir.join("iommu_group"))?;
        symlink(&dir, gdir.join("devices").join(&d.bdf))?;
    }
    if let Some(drv) = &d.driver {
        bind_link(root, &d.bdf, drv)?;
    }
    if d.sriov_totalvfs > 0 {
        w(
            &dir.join("sriov_totalvfs"),
            &format!("{}\n", d.sriov_totalvfs),
        )?;
        w(&dir.join("sriov_numvfs"), "0\n")?;
        w(&dir.join("sriov_offset"), "4\n")?;
        w(&dir.join("sriov_stride"), "1\n")?;
    }
    for t in &d.mdev_types {
        let tdir = dir.join("mdev_supported_types").join(&t.id);
        w(&tdir.join("name"), &format!("{}\n", t.name))?;
        w(
            &tdir.join("available_instances"),
            &format!("{}\n", t.available),
        )?;
        w(&tdir.join("create"), "")?;
    }
    Ok(())
}

impl FakeHost {
    /// Reads a spec from a JSON file.
    pub fn load_spec(path: &Path) -> io::Result<FakeHostSpec> {
        let text = std::fs::read_to_string(path)?;
        serde_json::from_str(&text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    /// The 8×H100 host of tests/fixtures/hosts/h100x8.sysfs.json.
    pub fn h100x8_spec() -> FakeHostSpec {
        serde_json::from_str(include_str!(
            "../../../../tests/fixtures/hosts/h100x8.sysfs.json"
        ))
        .expect("fixture parses")
    }

    /// The GPU-with-audio host of tests/fixtures/hosts/gpu-audio.sysfs.json.
    pub fn audio_host_spec() -> FakeHostSpec {
        serde_json::from_str(include_str!(
            "../../../../tests/fixtures/hosts/gpu-audio.sysfs.json"
        ))
        .expect("fixture parses")
    }

    /// Builds the tree in a fresh temporary directory (removed on drop).
    pub fn build(spec: &FakeHostSpec) -> io::Result<Self> {
        let root =
            std::env::temp_dir().join(format!("tenantvm-fakehost-{}", super::vgpu::new_uuid()));
        Self::build_in(spec, &root)?;
        Ok(FakeHost { root, keep: false })
    }

    /// Builds the tree under `root` (kept: for demos).
    pub fn build_in(spec: &FakeHostSpec, root: &Path) -> io::Result<FakeHost> {
        std::fs::create_dir_all(root.join("sys/bus/pci/devices"))?;
        std::fs::create_dir_all(root.join("sys/kernel/iommu_groups"))?;
        for drv in &spec.drivers {
            let d = root.join("sys/bus/pci/drivers").join(drv);
            std::fs::create_dir_all(&d)?;
            w(&d.join("unbind"), "")?;
            w(&d.join("bind"), "")?;
        }
        w(&root.join("sys/bus/pci/drivers_probe"), "")?;
        for d in &spec.devices {
            add_device(root, d)?;
        }
        for m in &spec.modules {
            std::fs::create_dir_all(root.join("sys/module").join(m))?;
        }
        if let Some(v) = &spec.nvidia_version {
            w(&root.join("sys/module/nvidia/version"), &format!("{v}\n"))?;
        }
        w(&root.join("proc/cmdline"), &format!("{}\n", spec.cmdline))?;
        if spec.cgroup == "v2" {
            w(
                &root.join("sys/fs/cgroup/cgroup.controllers"),
                "cpu memory pids\n",
            )?;
        } else {
            for c in ["memory", "cpu", "pids"] {
                std::fs::create_dir_all(root.join("sys/fs/cgroup").join(c))?;
            }
        }
        w(
            &root.join("sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"),
            &format!("{}\n", spec.hugepages_2m),
        )?;
        w(
            &root.join("sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages"),
            &format!("{}\n", spec.hugepages_1g),
        )?;
        std::fs::create_dir_all(root.join("dev"))?;
        if spec.kvm {
            symlink("/dev/kvm", root.join("dev/kvm"))?;
        }
        if spec.modules.iter().any(|m| m == "vfio") {
            w(&root.join("dev/vfio/vfio"), "")?;
        }
        w(
            &root.join(SPEC_FILE),
            &serde_json::to_string(spec).map_err(io::Error::other)?,
        )?;
        Ok(FakeHost {
            root: root.to_path_buf(),
            keep: true,
        })
    }

    /// The tree's root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A [`Sysfs`] over the tree with the fake kernel's reactions switched on.
    pub fn sysfs(&self) -> Sysfs {
        Sysfs {
            root: self.root.clone(),
            emulate: Some(emulate),
        }
    }
}

impl Drop for FakeHost {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

fn spec_of(root: &Path) -> io::Result<FakeHostSpec> {
    FakeHost::load_spec(&root.join(SPEC_FILE))
}

/// The fake kernel: called after every write through a fake [`Sysfs`].
fn emulate(sysfs: &Sysfs, path: &Path, value: &str) -> io::Result<()> {
    let root = sysfs.root();
    let rel = path
        .strip_prefix(root)
        .map_err(io::Error::other)?
        .to_string_lossy()
        .into_owned();
    let value = value.trim();
    let parts: Vec<&str> = rel.split('/').collect();
    match parts.as_slice() {
        ["sys", "bus", "pci", "drivers_probe"] => probe(root, value),
        ["sys", "bus", "pci", "devices", bdf, "driver", "unbind"] => {
            let dev = devices_dir(root).join(bdf);
            let drv = std::fs::read_link(dev.join("driver"))?;
            std::fs::remove_file(dev.join("driver"))?;
            std::fs::remove_file(drv.join(bdf))
        }
        ["sys", "bus", "pci", "devices", _, "driver_override"] if value.is_empty() => {
            w(path, "(null)\n")
        }
        ["sys", "bus", "pci", "devices", bdf, "sriov_numvfs"] => set_vfs(root, bdf, value),
        ["sys", "bus", "pci", "devices", bdf, "mdev_supported_types", t, "create"] => {
            create_mdev(root, bdf, t, value)
        }
        ["sys", "bus", "mdev", "devices", uuid, "remove"] => remove_mdev(root, uuid),
        _ => Ok(()),
    }
}

fn probe(root: &Path, bdf: &str) -> io::Result<()> {
    let dev = devices_dir(root).join(bdf);
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

fn parse_bdf(bdf: &str) -> Option<(String, u32, u32)> {
    let bus_part = &bdf[..8];
    let dev = u32::from_str_radix(&bdf[8..10], 16).ok()?;
    let func = u32::from_str_radix(&bdf[11..12], 16).ok()?;
    Some((bus_part.to_string(), dev, func))
}

fn set_vfs(root: &Path, pf: &str, value: &str) -> io::Result<()> {
    let n: u32 = value
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "not a number"))?;
    let spec = spec_of(root)?;
    let d = spec
        .devices
        .iter()
        .find(|d| d.bdf == pf)
        .ok_or_else(|| io::Error::other("unknown PF"))?;
    if n > d.sriov_totalvfs {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "more VFs than sriov_totalvfs",
        ));
    }
    let pf_dir = devices_dir(root).join(pf);
    // Remove existing VFs.
    for name in std::fs::read_dir(&pf_dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
    {
        let name = name.to_string_lossy().into_owned();
        if name.starts_with("virtfn") {
            let vf = std::fs::read_link(pf_dir.join(&name))?;
            std::fs::remove_file(pf_dir.join(&name))?;
            let _ = std::fs::remove_dir_all(vf);
        }
    }
    let (bus, dev, func) = parse_bdf(pf).ok_or_else(|| io::Error::other("bad PF address"))?;
    let max_group = std::fs::read_dir(root.join("sys/kernel/iommu_groups"))?
        .filter_map(|e| e.ok()?.file_name().to_string_lossy().parse::<u32>().ok())
        .max()
        .unwrap_or(0);
    let types: String = std::iter::once("ID    : vGPU Name\n".to_string())
        .chain(
            d.vgpu_types
                .iter()
                .map(|(id, name)| format!("{id:<6}: {name}\n")),
        )
        .collect();
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
        };
        add_device(root, &vf)?;
        let vf_dir = devices_dir(root).join(&vf_bdf);
        symlink(&pf_dir, vf_dir.join("physfn"))?;
        symlink(&vf_dir, pf_dir.join(format!("virtfn{k}")))?;
        w(&vf_dir.join("nvidia/creatable_vgpu_types"), &types)?;
        w(&vf_dir.join("nvidia/current_vgpu_type"), "0\n")?;
        if root.join("sys/bus/pci/drivers/nvidia").is_dir() {
            bind_link(root, &vf_bdf, "nvidia")?;
        }
    }
    w(&pf_dir.join("sriov_numvfs"), &format!("{n}\n"))
}

fn adjust_available(type_dir: &Path, delta: i64) -> io::Result<()> {
    let p = type_dir.join("available_instances");
    let n: i64 = std::fs::read_to_string(&p)?.trim().parse().unwrap_or(0);
    w(&p, &format!("{}\n", (n + delta).max(0)))
}

fn create_mdev(root: &Path, parent: &str, type_id: &str, uuid: &str) -> io::Result<()> {
    let pdir = devices_dir(root).join(parent);
    let tdir = pdir.join("mdev_supported_types").join(type_id);
    let mdir = pdir.join(uuid);
    std::fs::create_dir_all(&mdir)?;
    w(&mdir.join("remove"), "")?;
    symlink(&tdir, mdir.join("mdev_type"))?;
    std::fs::create_dir_all(root.join("sys/bus/mdev/devices"))?;
    symlink(&mdir, root.join("sys/bus/mdev/devices").join(uuid))?;
    adjust_available(&tdir, -1)
}

fn remove_mdev(root: &Path, uuid: &str) -> io::Result<()> {
    let link = root.join("sys/bus/mdev/devices").join(uuid);
    let mdir = std::fs::read_link(&link)?;
    let tdir = std::fs::read_link(mdir.join("mdev_type"))?;
    std::fs::remove_dir_all(&mdir)?;
    std::fs::remove_file(&link)?;
    adjust_available(&tdir, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::PciAddress;

    #[test]
    fn the_h100x8_tree_has_eight_gpus_each_alone_in_its_group() {
        let host = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
        let s = host.sysfs();
        let devs = s.devices().unwrap();
        let gpus: Vec<_> = devs.iter().filter(|d| d.is_gpu()).collect();
        assert_eq!(gpus.len(), 8);
        for g in gpus {
            let members = s.group_members(g.iommu_group.unwrap()).unwrap();
            assert_eq!(members.len(), 1, "{}", g.address);
        }
        assert_eq!(
            devs.iter().filter(|d| d.device == 0x22a3).count(),
            4,
            "four NVSwitches"
        );
        assert!(devs.iter().filter(|d| d.is_bridge()).count() >= 24);
        let root = host.root().to_path_buf();
        drop(host);
        assert!(!root.exists(), "the tree is removed on drop");
    }

    #[test]
    fn fake_kernel_unbinds_and_probes_with_the_override() {
        let host = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
        let s = host.sysfs();
        let a = PciAddress::parse("0000:01:00.1").unwrap();
        let dir = s.path("sys/bus/pci/devices/0000:01:00.1");
        s.write(&dir.join("driver_override"), "vfio-pci").unwrap();
        s.write(&dir.join("driver/unbind"), a.as_str()).unwrap();
        assert_eq!(s.device(&a).unwrap().driver, None);
        s.write(&s.path("sys/bus/pci/drivers_probe"), a.as_str())
            .unwrap();
        assert_eq!(s.device(&a).unwrap().driver.as_deref(), Some("vfio-pci"));
    }
}
