//! FAKE host trees for tests and demos: builds a sysfs/proc/dev tree under a directory from
//! a JSON description (tests/fixtures/hosts/*.sysfs.json) and emulates the kernel's reactions
//! to the writes tenantvm makes (`kernel`): unbind, `drivers_probe` honouring
//! `driver_override`, function reset, `sriov_numvfs`, VF vGPU types, mdev create/remove.
//! Never used against a real host: [`Sysfs::new`] has no emulation.
//!
//! A tree can be linked to a SIMULATED GPU host file ([`FakeHost::attach_sim`]); the
//! simulated driver ([`crate::backend::sim::driver`]) then decides what the GPUs' SR-IOV and
//! vGPU files say, so the ordering rules of MIG-backed vGPU hold across the two: enabling VFs
//! wipes the simulated GPU instances, a VF's creatable types list only profiles with a free
//! instance, and `gpu_instance_id` reads ENXIO until a type is set.
//!
//! Crash points: [`FakeHost::crash_after`] lets the next `n` mutating operations (every write
//! through the fake kernel, and whatever a test routes through [`FakeHost::crash_point`])
//! happen and makes the one after fail as if the process had died there, without doing it.

mod kernel;

use std::io;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{KernelEmulation, Sysfs};
use crate::backend::sim::{SimBackend, SimHost};
use crate::backend::BackendError;

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

fn default_reset_method() -> String {
    "flr bus".into()
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
    /// vGPU types each VF offers (`[id, name]`); which are creatable at a given moment is the
    /// simulated driver's answer.
    #[serde(default)]
    pub vgpu_types: Vec<(u32, String)>,
    /// mdev types of the device.
    #[serde(default)]
    pub mdev_types: Vec<FakeMdevType>,
    /// The fake kernel refuses to bind vfio-pci to it (to test rollback).
    #[serde(default)]
    pub refuse_vfio: bool,
    /// Its `reset_method` (`flr bus` by default for endpoints); empty: the kernel has no
    /// reset for it and there is no `reset` file.
    #[serde(default = "default_reset_method")]
    pub reset_method: String,
    /// A write to `reset` fails (EIO).
    #[serde(default)]
    pub reset_fails: bool,
    /// A reset "succeeds" but the device does not come back (config space reads all ones).
    #[serde(default)]
    pub reset_breaks: bool,
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

const STATE_DIR: &str = ".fake-kernel";
const SPEC_FILE: &str = ".fake-kernel/spec.json";
const SIM_FILE: &str = ".fake-kernel/sim-host.json";
const CRASH_FILE: &str = ".fake-kernel/crash-after";
const OPS_FILE: &str = ".fake-kernel/ops";
const RESETS_FILE: &str = ".fake-kernel/resets";

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

fn hex16(s: &str) -> u16 {
    u16::from_str_radix(s.trim().trim_start_matches("0x"), 16).unwrap_or(0xffff)
}

/// The first 64 bytes of a type-0 config space: ids, class.
fn config_space(d: &FakeDevice) -> Vec<u8> {
    let mut c = vec![0u8; 64];
    c[0..2].copy_from_slice(&hex16(&d.vendor).to_le_bytes());
    c[2..4].copy_from_slice(&hex16(&d.device).to_le_bytes());
    let class = u32::from_str_radix(d.class.trim_start_matches("0x"), 16).unwrap_or(0);
    c[9..12].copy_from_slice(&class.to_le_bytes()[0..3]);
    c
}

fn add_device(root: &Path, d: &FakeDevice) -> io::Result<()> {
    let dir = devices_dir(root).join(&d.bdf);
    std::fs::create_dir_all(&dir)?;
    w(&dir.join("vendor"), &format!("{}\n", d.vendor))?;
    w(&dir.join("device"), &format!("{}\n", d.device))?;
    w(&dir.join("class"), &format!("{}\n", d.class))?;
    w(&dir.join("driver_override"), "(null)\n")?;
    std::fs::write(dir.join("config"), config_space(d))?;
    let is_bridge = d.class.starts_with("0x0604") || d.class.starts_with("0x0600");
    if !is_bridge && !d.reset_method.trim().is_empty() {
        w(&dir.join("reset_method"), &format!("{}\n", d.reset_method))?;
        w(&dir.join("reset"), "")?;
    }
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

fn fixture(text: &str) -> FakeHostSpec {
    serde_json::from_str(text).expect("fixture parses")
}

impl FakeHost {
    /// Reads a spec from a JSON file.
    pub fn load_spec(path: &Path) -> io::Result<FakeHostSpec> {
        let text = std::fs::read_to_string(path)?;
        serde_json::from_str(&text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    /// The 8×H100 host of tests/fixtures/hosts/h100x8.sysfs.json.
    pub fn h100x8_spec() -> FakeHostSpec {
        fixture(include_str!(
            "../../../../../tests/fixtures/hosts/h100x8.sysfs.json"
        ))
    }

    /// The GPU-with-audio host of tests/fixtures/hosts/gpu-audio.sysfs.json.
    pub fn audio_host_spec() -> FakeHostSpec {
        fixture(include_str!(
            "../../../../../tests/fixtures/hosts/gpu-audio.sysfs.json"
        ))
    }

    /// The host of GPUs without MIG of tests/fixtures/hosts/whole-only.sysfs.json.
    pub fn whole_only_spec() -> FakeHostSpec {
        fixture(include_str!(
            "../../../../../tests/fixtures/hosts/whole-only.sysfs.json"
        ))
    }

    /// Builds the tree in a fresh temporary directory (removed on drop).
    pub fn build(spec: &FakeHostSpec) -> io::Result<Self> {
        let root = std::env::temp_dir().join(format!(
            "tenantvm-fakehost-{}",
            super::uuid::VmUuid::generate()
        ));
        let mut host = Self::build_in(spec, &root)?;
        host.keep = false;
        Ok(host)
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
            emulate: Some(KernelEmulation {
                write: kernel::write,
                read: kernel::read,
            }),
            overlay: None,
        }
    }

    /// Links a SIMULATED GPU host to the tree: its file is kept in the tree, the fake kernel
    /// asks its driver about the GPUs' SR-IOV and vGPU files, and the returned backend is the
    /// host's NVML stand-in.
    pub fn attach_sim(&self, host: &SimHost) -> Result<SimBackend, BackendError> {
        let path = self.root.join(SIM_FILE);
        let body = serde_json::to_string_pretty(host).map_err(|e| BackendError::SimFile {
            path: path.display().to_string(),
            detail: e.to_string(),
        })?;
        w(&path, &body).map_err(|e| BackendError::SimFile {
            path: path.display().to_string(),
            detail: e.to_string(),
        })?;
        SimBackend::open(&path)
    }

    /// Lets the next `n` mutating operations happen; the one after fails as a crash would.
    pub fn crash_after(&self, n: u64) -> io::Result<()> {
        w(&self.root.join(CRASH_FILE), &n.to_string())
    }

    /// No more crash points.
    pub fn no_crash(&self) -> io::Result<()> {
        match std::fs::remove_file(self.root.join(CRASH_FILE)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// A mutating operation is about to happen: counts it, or fails when the crash budget is
    /// spent. Tests route backend calls through this so that crash points fall between them.
    pub fn crash_point(&self) -> io::Result<()> {
        crash_point(&self.root)
    }

    /// Mutating operations counted so far.
    pub fn ops(&self) -> u64 {
        std::fs::read_to_string(self.root.join(OPS_FILE))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// How many times the device at `bdf` was reset.
    pub fn resets(&self, bdf: &str) -> usize {
        std::fs::read_to_string(self.root.join(RESETS_FILE))
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == bdf)
            .count()
    }
}

impl Drop for FakeHost {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

/// The error a crash point returns.
pub const CRASH_MESSAGE: &str = "FAKE crash point: the process died here";

fn crash_point(root: &Path) -> io::Result<()> {
    let state = root.join(STATE_DIR);
    let ops: u64 = std::fs::read_to_string(root.join(OPS_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    if let Ok(left) = std::fs::read_to_string(root.join(CRASH_FILE)) {
        let left: u64 = left.trim().parse().unwrap_or(0);
        if left == 0 {
            return Err(io::Error::other(CRASH_MESSAGE));
        }
        std::fs::write(root.join(CRASH_FILE), (left - 1).to_string())?;
    }
    std::fs::create_dir_all(state)?;
    std::fs::write(root.join(OPS_FILE), (ops + 1).to_string())
}

fn spec_of(root: &Path) -> io::Result<FakeHostSpec> {
    FakeHost::load_spec(&root.join(SPEC_FILE))
}

fn sim_of(root: &Path) -> Option<SimBackend> {
    let path = root.join(SIM_FILE);
    if !path.exists() {
        return None;
    }
    SimBackend::open(&path).ok()
}

#[cfg(test)]
mod tests;
