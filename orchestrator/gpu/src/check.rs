//! `tenantvm host check`: the preflight. One line per check with pass, warn or fail and, when
//! it is not a pass, the fix. Everything is read under a [`Sysfs`] root, so the checks run
//! against the real host (`/`) or a fake tree.

use std::fmt::Write as _;
use std::os::fd::AsRawFd;

use serde::Serialize;

use crate::host::{soft_sharing, vfio::VFIO_DRIVER, vgpu_support, PciDevice, Sysfs};
use crate::mig::{self, GpuFacts, Sharing, VgpuSupport, NVIDIA_VENDOR_ID};

/// Outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Fine.
    Pass,
    /// Works, with a limitation.
    Warn,
    /// tenantvm cannot work like this.
    Fail,
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckResult {
    /// Short name (`kvm`, `iommu`, `gpu 0000:18:00.0`...).
    pub name: String,
    /// Outcome.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do, when not a pass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
    /// For a GPU's main line: how it can be used ([`mig::decide`], the rule placement
    /// follows too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sharing: Option<Sharing>,
}

fn result(
    name: impl Into<String>,
    status: Status,
    detail: impl Into<String>,
    fix: Option<&str>,
) -> CheckResult {
    CheckResult {
        name: name.into(),
        status,
        detail: detail.into(),
        fix: fix.map(str::to_string),
        sharing: None,
    }
}

/// KVM_GET_API_VERSION, _IO(0xAE, 0x00).
const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;

fn check_kvm(s: &Sysfs) -> CheckResult {
    let path = s.path("dev/kvm");
    match std::fs::File::options().read(true).write(true).open(&path) {
        // SAFETY: KVM_GET_API_VERSION takes no argument and only returns an integer.
        Ok(f) => match unsafe { libc::ioctl(f.as_raw_fd(), KVM_GET_API_VERSION as _, 0) } {
            12 => result("kvm", Status::Pass, "/dev/kvm answers API version 12", None),
            v => result(
                "kvm",
                Status::Fail,
                format!("{} is not a usable KVM device (KVM_GET_API_VERSION gave {v})", path.display()),
                Some("load kvm_intel or kvm_amd and check that /dev/kvm is the KVM device"),
            ),
        },
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => result(
            "kvm",
            Status::Fail,
            "/dev/kvm exists but cannot be opened",
            Some("run tenantvmd as root (or a user in the kvm group)"),
        ),
        Err(_) => result(
            "kvm",
            Status::Fail,
            "/dev/kvm is missing",
            Some("enable virtualization (VT-x/AMD-V) in the firmware and `modprobe kvm_intel` or `modprobe kvm_amd`"),
        ),
    }
}

fn check_iommu(s: &Sysfs) -> CheckResult {
    let groups = s.iommu_groups();
    if groups.is_empty() {
        let cmdline = s.read(&s.path("proc/cmdline")).unwrap_or_default();
        return result(
            "iommu",
            Status::Fail,
            format!("no IOMMU groups (kernel command line: `{cmdline}`)"),
            Some("enable VT-d/AMD-Vi in the firmware and add intel_iommu=on (Intel) or amd_iommu=on (AMD), plus iommu=pt, to the kernel command line"),
        );
    }
    result(
        "iommu",
        Status::Pass,
        format!("{} IOMMU groups", groups.len()),
        None,
    )
}

fn check_vfio(s: &Sysfs) -> CheckResult {
    let driver = s.has_driver(VFIO_DRIVER) || s.path("sys/module/vfio_pci").is_dir();
    let container = s.path("dev/vfio/vfio").exists();
    match (driver, container) {
        (true, true) => result(
            "vfio-pci",
            Status::Pass,
            "vfio-pci loaded, /dev/vfio/vfio present",
            None,
        ),
        (true, false) => result(
            "vfio-pci",
            Status::Fail,
            "vfio-pci loaded but /dev/vfio/vfio is missing",
            Some("`modprobe vfio` and check udev created /dev/vfio/vfio"),
        ),
        (false, _) => result(
            "vfio-pci",
            Status::Fail,
            "vfio-pci is not loaded",
            Some("`modprobe vfio-pci` (and add it to /etc/modules-load.d/)"),
        ),
    }
}

/// What `host check` knows about one GPU from sysfs: the facts [`mig::decide`] rules on. The
/// NVML backend gathers the same (plus memory) for placement.
pub fn gpu_facts(s: &Sysfs, d: &PciDevice) -> GpuFacts {
    GpuFacts {
        device_id: d.device,
        memory_mib: None,
        driver_major: s.nvidia_driver().map(|(_, m)| m),
        vgpu: vgpu_support(s, &d.address),
    }
}

/// The NVIDIA GPUs of a host (physical functions; VFs are not GPUs of their own).
pub fn nvidia_gpus(s: &Sysfs) -> Vec<PciDevice> {
    s.devices()
        .unwrap_or_default()
        .into_iter()
        .filter(|d| d.vendor == NVIDIA_VENDOR_ID && d.is_gpu())
        .filter(|d| s.physfn(&d.address).is_none())
        .collect()
}

fn check_gpu(s: &Sysfs, d: &PciDevice) -> Vec<CheckResult> {
    let name = format!("gpu {}", d.address);
    let id = format!("{:04x}:{:04x}", d.vendor, d.device);
    let facts = gpu_facts(s, d);
    let class = mig::decide(&facts);
    let m = class.model;
    let mut out = Vec::new();
    let mut line = match &class.sharing {
        Sharing::Mig => {
            let mut line = format!(
                "{} ({id}): MIG, driver >= R{}: shared by MIG-backed vGPU, or given whole",
                m.name, m.min_driver
            );
            if !m.confirmed {
                line.push_str(" (profile figures unconfirmed: NVML's win at run time)");
            }
            result(&name, Status::Pass, line, None)
        }
        Sharing::WholeOnly(w) => result(
            &name,
            Status::Warn,
            format!(
                "{} ({id}): can only be given whole: {}",
                m.name,
                w.explain()
            ),
            Some(w.fix()),
        ),
    };
    line.sharing = Some(class.sharing.clone());
    out.push(line);
    if let Some(g) = d.iommu_group {
        let others: Vec<String> = s
            .group_members(g)
            .unwrap_or_default()
            .into_iter()
            .filter(|m| !m.is_bridge() && m.address.slot() != d.address.slot())
            .map(|m| {
                format!(
                    "{} ({})",
                    m.address,
                    m.driver.unwrap_or_else(|| "no driver".into())
                )
            })
            .collect();
        if !others.is_empty() {
            out.push(result(
                format!("{name} group"),
                Status::Warn,
                format!("IOMMU group {g} also holds {}", others.join(", ")),
                Some("move the GPU or the other device to another slot, or enable ACS on the switch; tenantvm refuses to pass a group the host uses"),
            ));
        }
    } else {
        out.push(result(
            format!("{name} group"),
            Status::Fail,
            "no IOMMU group",
            Some("enable the IOMMU (see the iommu check)"),
        ));
    }
    if m.has_mig() {
        let (status, detail, fix) = match &facts.vgpu {
            VgpuSupport::Sriov { total_vfs } => (
                Status::Pass,
                format!("SR-IOV with {total_vfs} VFs, vGPU manager loaded (MIG-backed vGPU)"),
                None,
            ),
            VgpuSupport::Mdev => (
                Status::Pass,
                "mdev vGPU types present (older vGPU driver)".to_string(),
                None,
            ),
            VgpuSupport::Missing { reason } => (
                Status::Warn,
                reason.clone(),
                Some("MIG-backed vGPU needs SR-IOV and NVIDIA's vGPU manager; whole-GPU passthrough still works"),
            ),
            VgpuSupport::Simulated => (Status::Pass, "simulated".to_string(), None),
        };
        out.push(result(format!("{name} vgpu"), status, detail, fix));
    }
    out
}

/// MPS and time-sliced vGPU types share a GPU without a hardware partition: no isolation
/// boundary between tenants ([`soft_sharing`]). One failing line per finding, or one pass.
fn check_soft_sharing(s: &Sysfs, gpus: &[PciDevice]) -> Vec<CheckResult> {
    let addresses: Vec<_> = gpus.iter().map(|d| d.address.clone()).collect();
    let found = soft_sharing::find(s, &addresses);
    if found.is_empty() {
        return vec![result(
            "gpu sharing",
            Status::Pass,
            "no MPS process, no time-sliced vGPU type: GPUs are shared only through MIG",
            None,
        )];
    }
    found
        .iter()
        .map(|f| {
            let mut r = result("gpu sharing", Status::Fail, f.to_string(), None);
            r.fix = Some(f.fix());
            r
        })
        .collect()
}

fn check_cgroup(s: &Sysfs) -> CheckResult {
    if s.path("sys/fs/cgroup/cgroup.controllers").exists() {
        return result("cgroup", Status::Pass, "cgroup v2", None);
    }
    let v1: Vec<&str> = ["memory", "cpu", "pids"]
        .into_iter()
        .filter(|c| s.path("sys/fs/cgroup").join(c).is_dir())
        .collect();
    if v1.len() == 3 {
        result(
            "cgroup",
            Status::Warn,
            "cgroup v1 (memory, cpu, pids)",
            Some("boot with systemd.unified_cgroup_hierarchy=1 for cgroup v2; v1 works with fewer guarantees"),
        )
    } else {
        result(
            "cgroup",
            Status::Fail,
            format!("no cgroup v2 and only {v1:?} of the v1 controllers"),
            Some("mount cgroup v2 at /sys/fs/cgroup (or the v1 memory, cpu and pids controllers)"),
        )
    }
}

fn check_hugepages(s: &Sysfs) -> CheckResult {
    let read = |size: &str| -> u64 {
        s.read(&s.path(&format!(
            "sys/kernel/mm/hugepages/hugepages-{size}/nr_hugepages"
        )))
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
    };
    let (two_m, one_g) = (read("2048kB"), read("1048576kB"));
    if two_m == 0 && one_g == 0 {
        return result(
            "hugepages",
            Status::Warn,
            "no huge pages reserved",
            Some("reserve 1 GiB pages for guests with GPUs (their memory is pinned for DMA): add hugepagesz=1G hugepages=N to the kernel command line; a GPU tenant's RAM is then backed by them (spec `hugepages`, by default for GPU tenants where enough are free)"),
        );
    }
    result(
        "hugepages",
        Status::Pass,
        format!("{one_g} × 1 GiB, {two_m} × 2 MiB reserved (GPU tenants' RAM is backed by them where enough are free)"),
        None,
    )
}

/// Runs every check.
pub fn host_check(s: &Sysfs) -> Vec<CheckResult> {
    let mut out = vec![check_kvm(s), check_iommu(s), check_vfio(s)];
    let driver = s.nvidia_driver();
    out.push(match &driver {
        Some((v, _)) => result("nvidia driver", Status::Pass, format!("version {v}"), None),
        None => result(
            "nvidia driver",
            Status::Warn,
            "the nvidia module is not loaded",
            Some("install the NVIDIA data-center driver for MIG and vGPU; whole-GPU passthrough does not need it"),
        ),
    });
    let devices = s.devices().unwrap_or_default();
    let gpus = nvidia_gpus(s);
    if gpus.is_empty() {
        out.push(result(
            "gpus",
            Status::Warn,
            "no NVIDIA GPUs found",
            Some("tenants can run without GPUs; check `lspci -d 10de:`"),
        ));
    }
    for d in &gpus {
        out.extend(check_gpu(s, d));
    }
    if !gpus.is_empty() {
        out.extend(check_soft_sharing(s, &gpus));
    }
    let nvswitches = devices
        .iter()
        .filter(|d| d.vendor == NVIDIA_VENDOR_ID && d.class >> 8 == 0x0680)
        .count();
    if nvswitches > 0 {
        out.push(result(
            "nvswitch",
            Status::Warn,
            format!("{nvswitches} NVSwitches: SXM GPUs share an NVLink fabric"),
            Some("for whole-GPU passthrough run NVIDIA Fabric Manager in the shared NVSwitch virtualization model and give one VM only GPUs of one fabric partition (`fmpm -l`)"),
        ));
    }
    out.push(check_cgroup(s));
    out.push(check_hugepages(s));
    out
}

/// The results as text, one line each (and a fix line under non-passes).
pub fn to_text(results: &[CheckResult]) -> String {
    let mut out = String::new();
    for r in results {
        let tag = match r.status {
            Status::Pass => "pass",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        };
        let _ = writeln!(out, "{tag}  {:<24} {}", r.name, r.detail);
        if let Some(f) = &r.fix {
            let _ = writeln!(out, "      fix: {f}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;

    fn by_name<'a>(r: &'a [CheckResult], name: &str) -> &'a CheckResult {
        r.iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no check {name}: {r:#?}"))
    }

    #[test]
    fn h100_host_passes_iommu_vfio_gpus_and_vgpu() {
        let host = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
        let r = host_check(&host.sysfs());
        assert_eq!(by_name(&r, "iommu").status, Status::Pass);
        assert_eq!(by_name(&r, "vfio-pci").status, Status::Pass);
        assert_eq!(by_name(&r, "cgroup").status, Status::Pass);
        assert_eq!(by_name(&r, "hugepages").status, Status::Pass);
        let g = by_name(&r, "gpu 0000:18:00.0");
        assert_eq!(g.status, Status::Pass);
        assert!(g.detail.contains("H100"), "{}", g.detail);
        assert_eq!(by_name(&r, "gpu 0000:db:00.0 vgpu").status, Status::Pass);
        assert_eq!(
            r.iter().filter(|c| c.name.ends_with(" vgpu")).count(),
            8,
            "NVSwitches are not GPUs"
        );
        let fabric = by_name(&r, "nvswitch");
        assert_eq!(fabric.status, Status::Warn);
        assert!(
            fabric.detail.starts_with("4 NVSwitches"),
            "{}",
            fabric.detail
        );
    }

    #[test]
    fn audio_host_warns_about_shared_group_sku_and_old_driver() {
        let host = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
        let r = host_check(&host.sysfs());
        assert!(
            r.iter().all(|c| c.name != "gpu 0000:01:00.0 group"),
            "the audio function is the GPU's own slot"
        );
        let shared = by_name(&r, "gpu 0000:03:00.0 group");
        assert_eq!(shared.status, Status::Warn);
        assert!(
            shared.detail.contains("0000:04:00.0 (ixgbe)"),
            "{}",
            shared.detail
        );
        let l40s = by_name(&r, "gpu 0000:03:00.0");
        assert!(l40s.detail.contains("no MIG"), "{}", l40s.detail);
        assert!(
            l40s.detail.contains("no hardware partition"),
            "{}",
            l40s.detail
        );
        let rtx = by_name(&r, "gpu 0000:01:00.0");
        assert_eq!(
            rtx.status,
            Status::Warn,
            "R535 is older than R575: {}",
            rtx.detail
        );
        assert_eq!(by_name(&r, "cgroup").status, Status::Warn);
        assert!(by_name(&r, "hugepages")
            .fix
            .as_ref()
            .unwrap()
            .contains("hugepages"));
        assert_eq!(
            by_name(&r, "gpu 0000:05:00.0 vgpu").status,
            Status::Pass,
            "mdev types"
        );
        assert!(
            r.iter().all(|c| c.name != "nvswitch"),
            "no NVSwitch on this host"
        );
        let text = to_text(&r);
        assert!(text.contains("WARN  gpu 0000:03:00.0 group"), "{text}");
    }

    #[test]
    fn empty_root_fails_with_fixes() {
        let dir = tempfile::tempdir().unwrap();
        let r = host_check(&Sysfs::new(dir.path()));
        for name in ["kvm", "iommu", "vfio-pci", "cgroup"] {
            let c = by_name(&r, name);
            assert_eq!(c.status, Status::Fail, "{name}");
            assert!(c.fix.is_some(), "{name}");
        }
        assert_eq!(by_name(&r, "gpus").status, Status::Warn);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json[0]["status"], "fail");
    }

    /// MPS and time-sliced vGPU share a GPU without a partition: the host fails.
    #[test]
    fn mps_or_a_time_sliced_vgpu_fails_the_host() {
        let host = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
        let s = host.sysfs();
        // The control: the fixture shares nothing without MIG.
        let r = host_check(&s);
        assert_eq!(by_name(&r, "gpu sharing").status, Status::Pass);
        let comm = host.root().join("proc/4242");
        std::fs::create_dir_all(&comm).unwrap();
        std::fs::write(comm.join("comm"), "nvidia-cuda-mps-control\n").unwrap();
        let gpu = crate::host::PciAddress::parse("0000:18:00.0").unwrap();
        let vf = crate::host::sriov::enable_vfs(&s, &gpu).unwrap().remove(0);
        std::fs::write(s.device_dir(&vf).join("nvidia/current_vgpu_type"), "1056\n").unwrap();
        let r = host_check(&s);
        let failing: Vec<_> = r
            .iter()
            .filter(|c| c.name == "gpu sharing" && c.status == Status::Fail)
            .collect();
        assert_eq!(failing.len(), 2, "{r:#?}");
        assert!(failing[0].detail.contains("MPS") && failing[0].fix.is_some());
        assert!(failing[1].detail.contains(vf.as_str()));
    }

    #[test]
    fn real_kvm_is_detected_when_present() {
        if !std::path::Path::new("/dev/kvm").exists() {
            tenantvm_skip::skip!("/dev/kvm is absent on this machine");
        }
        let c = check_kvm(&Sysfs::new("/"));
        assert_eq!(c.status, Status::Pass, "{c:?}");
    }
}
