//! `tenantvm gpu-info` against a real guest agent (issue 14: "nvidia-smi inside the guest
//! sees exactly its slice's memory").
//!
//! - `gpu_info_reports_a_linux_guests_devices_on_a_simulated_gpu_host`: the guest image
//!   (guest-image/build.sh) under the daemon with the SIMULATED GPU host
//!   (tests/fixtures/hosts/sim-mixed.json): a tenant with a whole-card request; the real
//!   agent in the real guest lists its PCI functions (the virtio devices), says its image
//!   has no nvidia-smi, and the daemon says nothing was handed to the VM (simulated): a
//!   match, with notes. Skips like e2e_linux_guest (root, qemu-system-x86_64, the image
//!   set); `TENANTVM_E2E_BACKEND` picks the backend (default `qemu-tcg`).
//! - `nvidia_smi_in_the_guest_sees_exactly_its_slice`: gated on a real GPU host, with
//!   `TENANTVM_TEST_GPU=<nvml index>` (a GPU host, docs/gpu.md),
//!   `TENANTVM_TEST_GPU_IMAGE=DIR` (an image set whose guest has the NVIDIA driver and
//!   nvidia-smi: docs/guest-image.md, the GPU recipe) and root; `TENANTVM_TEST_GPU_SLICE` is the request (`whole`, the default, or a MIG
//!   profile such as `1g.10gb`), `TENANTVM_E2E_BACKEND` the backend (default `vmm`). The
//!   tenant gets its slice, and nvidia-smi in the guest must list exactly one GPU whose
//!   memory.total is within the documented tolerance of the slice's memory. Otherwise it
//!   prints `SKIP` with the missing piece. Nothing is downloaded.
//! - `a_passed_through_device_is_seen_by_the_guest_with_its_real_ids`: gated on
//!   `TENANTVM_TEST_VFIO_DEVICE=/sys/bus/pci/devices/BDF` (issue 12): that device, handed
//!   whole to a tenant, appears in the guest with its real ids.

mod support;

use std::path::PathBuf;

use support::cli::{must, tenantvm, text};
use support::daemon::{self, TestDaemon};
use support::guest_image::{have, image_set, image_set_missing, install_image};
use tenantvm::api::gpu_info::GpuInfoView;
use tenantvm::gpu::guest_view::memory_matches;
use tenantvm_agent_protocol::NvidiaSmi;

fn linux_skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (jails set uids, cgroups and namespaces)".into());
    }
    if !have("qemu-system-x86_64") {
        return Some("qemu-system-x86_64 is not installed (run scripts/setup.sh)".into());
    }
    image_set_missing()
}

/// Creates tenant `name` with `gpu` (a TOML inline table) on the guest image installed
/// as `image`, and waits until it runs; returns its token file.
fn create(d: &TestDaemon, name: &str, gpu: &str, image: &str, memory_mib: u32) -> PathBuf {
    let spec = d.dir.path().join(format!("{name}.toml"));
    std::fs::write(
        &spec,
        format!(
            "name = \"{name}\"\nvcpus = 1\nmemory_mib = {memory_mib}\ndisk_gib = 1\n\
             gpu = {gpu}\n[image]\nname = \"{image}\"\n"
        ),
    )
    .unwrap();
    let token = d.dir.path().join(format!("{name}.token"));
    must(
        tenantvm(
            d,
            &d.admin_token_file(),
            &[
                "create",
                spec.to_str().unwrap(),
                "--token-out",
                token.to_str().unwrap(),
                "--timeout-s",
                "900",
            ],
        ),
        "create",
        d,
    );
    token
}

fn gpu_info(d: &TestDaemon, token: &std::path::Path, name: &str) -> (Option<i32>, GpuInfoView) {
    let o = tenantvm(d, token, &["gpu-info", name, "--json"]);
    let view = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "gpu-info --json: {e}\n{}\n--- daemon ---\n{}",
            text(&o),
            d.log()
        )
    });
    (o.status.code(), view)
}

#[test]
fn gpu_info_reports_a_linux_guests_devices_on_a_simulated_gpu_host() {
    if let Some(why) = linux_skip_reason() {
        tenantvm_skip::skip!("{why}");
    }
    let set = image_set();
    let backend = std::env::var("TENANTVM_E2E_BACKEND").unwrap_or_else(|_| "qemu-tcg".into());
    let (d, _sim) = TestDaemon::new().with_sim_gpu_host();
    let mut d = d.with_args(&[
        "--backend",
        &backend,
        "--boot-timeout-s",
        "120",
        "--agent-timeout-s",
        "600",
    ]);
    install_image(&set, &d.dir.path().join("img"), "linux");
    d.start(None);
    let name = daemon::unique("gpuinfo");
    let token = create(&d, &name, "{ whole_gpu = true }", "linux", 512);
    let (code, view) = gpu_info(&d, &token, &name);
    assert_eq!(code, Some(0), "{view:#?}");
    assert!(view.matches, "{view:#?}");
    let assigned = view.assigned.as_ref().expect("a GPU share");
    assert_eq!(assigned.route, "not-attached", "{view:#?}");
    assert!(assigned.memory_mib.is_some(), "{view:#?}");
    // The real guest's PCI list: its virtio devices (vendor 1af4), read by the real agent.
    assert!(
        view.guest.pci.iter().any(|f| f.vendor == 0x1af4),
        "{view:#?}"
    );
    assert!(
        matches!(view.guest.nvidia_smi, NvidiaSmi::Absent { .. }),
        "{view:#?}"
    );
    // The table too.
    let o = must(tenantvm(&d, &token, &["gpu-info", &name]), "gpu-info", &d);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("not attached: SIMULATED"), "{out}");
    assert!(out.contains("GUEST NVIDIA-SMI: not in the image"), "{out}");
    must(
        tenantvm(
            &d,
            &d.admin_token_file(),
            &["destroy", &name, "--timeout-s", "600"],
        ),
        "destroy",
        &d,
    );
}

/// The gate of the real-GPU test: the image and the request, or why not.
fn gpu_gate() -> Result<(PathBuf, String), String> {
    if std::env::var_os("TENANTVM_TEST_GPU").is_none() {
        return Err("set TENANTVM_TEST_GPU=<nvml index> on a GPU host (docs/gpu.md)".into());
    }
    let image = std::env::var_os("TENANTVM_TEST_GPU_IMAGE")
        .map(PathBuf::from)
        .ok_or("set TENANTVM_TEST_GPU_IMAGE to an image set with the NVIDIA guest driver and nvidia-smi (docs/guest-image.md)")?;
    if !image.join("manifest.json").is_file() {
        return Err(format!("{} holds no image set", image.display()));
    }
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (jails set uids, cgroups and namespaces)".into());
    }
    let gpu = match std::env::var("TENANTVM_TEST_GPU_SLICE").as_deref() {
        Err(_) | Ok("whole") => "{ whole_gpu = true }".to_string(),
        Ok(profile) => format!("{{ profile = \"{profile}\" }}"),
    };
    Ok((image, gpu))
}

#[test]
fn nvidia_smi_in_the_guest_sees_exactly_its_slice() {
    let (image, gpu) = match gpu_gate() {
        Ok(v) => v,
        Err(why) => tenantvm_skip::skip!("{why}"),
    };
    let backend = std::env::var("TENANTVM_E2E_BACKEND").unwrap_or_else(|_| "vmm".into());
    let mut d = TestDaemon::new().with_args(&[
        "--backend",
        &backend,
        "--gpu-backend",
        "nvml",
        "--boot-timeout-s",
        "300",
        "--agent-timeout-s",
        "900",
    ]);
    install_image(&image, &d.dir.path().join("img"), "gpu");
    d.start(None);
    let name = daemon::unique("gpuslice");
    let token = create(&d, &name, &gpu, "gpu", 8192);
    let (code, view) = gpu_info(&d, &token, &name);
    let destroy = |d: &TestDaemon| {
        must(
            tenantvm(
                d,
                &d.admin_token_file(),
                &["destroy", &name, "--timeout-s", "900"],
            ),
            "destroy",
            d,
        )
    };
    let assigned = view.assigned.clone().expect("a GPU share");
    let slice_mib = assigned.memory_mib.expect("the slice's memory");
    let NvidiaSmi::Ran { gpus, .. } = &view.guest.nvidia_smi else {
        destroy(&d);
        panic!("nvidia-smi did not run in the guest: {view:#?}");
    };
    let rows = gpus.clone();
    destroy(&d);
    assert_eq!(rows.len(), 1, "exactly one GPU in the guest: {view:#?}");
    let guest_mib = rows[0].memory_total_mib.expect("memory.total");
    assert!(
        memory_matches(guest_mib, slice_mib),
        "nvidia-smi in the guest reports {guest_mib} MiB; the slice ({}) has {slice_mib} MiB",
        assigned.label
    );
    assert_eq!(code, Some(0), "{view:#?}");
    assert!(view.matches, "{view:#?}");
    eprintln!(
        "guest sees {} with {guest_mib} MiB; slice {} has {slice_mib} MiB",
        rows[0].name, assigned.label
    );
}

/// A PCI function's ids from sysfs (`vendor`, `device`: `0x10de`).
fn sysfs_ids(dev: &std::path::Path) -> Result<(u16, u16), String> {
    let read = |attr: &str| -> Result<u16, String> {
        let s = std::fs::read_to_string(dev.join(attr))
            .map_err(|e| format!("{}/{attr}: {e}", dev.display()))?;
        u16::from_str_radix(s.trim().trim_start_matches("0x"), 16)
            .map_err(|e| format!("{}/{attr} ({s:?}): {e}", dev.display()))
    };
    Ok((read("vendor")?, read("device")?))
}

/// The device of the real-device test and the image to boot it with.
struct RealDevice {
    /// Its sysfs directory.
    dev: PathBuf,
    /// Its address (`0000:41:00.0`).
    bdf: String,
    /// Its IOMMU group.
    group: u32,
    /// Vendor and device id.
    ids: (u16, u16),
    /// The image set to boot.
    image: PathBuf,
}

/// The gate of the real-device test: the device and image, or why not.
fn vfio_device_gate() -> Result<RealDevice, String> {
    let dev = std::env::var_os("TENANTVM_TEST_VFIO_DEVICE")
        .map(PathBuf::from)
        .ok_or(
            "set TENANTVM_TEST_VFIO_DEVICE=/sys/bus/pci/devices/<BDF> (a device this host may \
         hand to a VM: docs/testing.md, \"A real device\")",
        )?;
    let dev = dev
        .canonicalize()
        .map_err(|e| format!("{}: {e}", dev.display()))?;
    let bdf = dev
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| format!("{} does not name a PCI function", dev.display()))?
        .to_string();
    let group = std::fs::read_link(dev.join("iommu_group"))
        .map_err(|e| format!("{bdf} has no IOMMU group (is the IOMMU on?): {e}"))?;
    let group: u32 = group
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| {
            format!(
                "{bdf}'s IOMMU group link {} is not a number",
                group.display()
            )
        })?;
    let ids = sysfs_ids(&dev)?;
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (vfio binding, jails)".into());
    }
    let image = match std::env::var_os("TENANTVM_TEST_GPU_IMAGE") {
        Some(dir) => PathBuf::from(dir),
        None => {
            if let Some(why) = image_set_missing() {
                return Err(why);
            }
            image_set()
        }
    };
    Ok(RealDevice {
        dev,
        bdf,
        group,
        ids,
        image,
    })
}

/// Issue 12's real-host check: the device named by `TENANTVM_TEST_VFIO_DEVICE` is handed
/// whole to a tenant (tenantvmd over a SIMULATED GPU host file that places a whole-only
/// card at its address, as the nested scenario `gpu-guest-image` does with edu), the guest
/// image boots with it under tenantvm-vmm, and the guest's agent lists a PCI function with
/// the device's real vendor and device ids; on an NVIDIA device whose image has the driver,
/// nvidia-smi in the guest lists exactly one GPU. After destroy the device is off vfio-pci
/// again (back on the driver it had, or quarantined with the receipt saying so).
#[test]
fn a_passed_through_device_is_seen_by_the_guest_with_its_real_ids() {
    let RealDevice {
        dev,
        bdf,
        group,
        ids: (vendor, device),
        image,
    } = match vfio_device_gate() {
        Ok(v) => v,
        Err(why) => tenantvm_skip::skip!("{why}"),
    };
    let driver_before = std::fs::read_link(dev.join("driver")).ok();
    let mut d = TestDaemon::new();
    let sim = d.dir.path().join("sim-host.json");
    std::fs::write(
        &sim,
        format!(
            "{{\"comment\": \"SIMULATED: one whole-only GPU at the address of \
             TENANTVM_TEST_VFIO_DEVICE\", \"gpus\": [{{\"index\": 0, \"model\": \"l40s\", \
             \"pci_address\": \"{bdf}\", \"driver\": \"550.54.15\", \"vgpu\": \"none\", \
             \"iommu_group\": {group}}}]}}"
        ),
    )
    .unwrap();
    let backend = std::env::var("TENANTVM_E2E_BACKEND").unwrap_or_else(|_| "vmm".into());
    let sim_arg = format!("sim:{}", sim.display());
    d = d.with_args(&[
        "--backend",
        &backend,
        "--gpu-backend",
        &sim_arg,
        "--gpu-sysfs-root",
        "/",
        "--boot-timeout-s",
        "300",
        "--agent-timeout-s",
        "900",
    ]);
    install_image(&image, &d.dir.path().join("img"), "linux");
    d.start(None);
    let name = daemon::unique("vfiodev");
    let token = create(&d, &name, "{ whole_gpu = true }", "linux", 1024);
    let (code, view) = gpu_info(&d, &token, &name);
    must(
        tenantvm(
            &d,
            &d.admin_token_file(),
            &["destroy", &name, "--timeout-s", "900"],
        ),
        "destroy",
        &d,
    );
    let seen = view
        .guest
        .pci
        .iter()
        .any(|f| f.vendor == vendor && f.device == device);
    assert!(
        seen,
        "the guest does not list {vendor:04x}:{device:04x} ({bdf}): {view:#?}"
    );
    if vendor == 0x10de {
        if let NvidiaSmi::Ran { gpus, .. } = &view.guest.nvidia_smi {
            assert_eq!(gpus.len(), 1, "nvidia-smi in the guest: {view:#?}");
        } else {
            eprintln!("note: the image has no nvidia-smi; only the PCI ids were checked");
        }
    }
    assert_eq!(code, Some(0), "{view:#?}");
    let driver_after = std::fs::read_link(dev.join("driver")).ok();
    assert!(
        driver_after
            .as_ref()
            .and_then(|p| p.file_name())
            .is_none_or(|n| n != "vfio-pci")
            || driver_before
                .as_ref()
                .and_then(|p| p.file_name())
                .is_some_and(|n| n == "vfio-pci"),
        "{bdf} is still on vfio-pci after destroy (before: {driver_before:?})"
    );
    eprintln!("the guest sees {vendor:04x}:{device:04x} from {bdf}");
}
