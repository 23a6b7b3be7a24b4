//! `--device` bad input: each case gets a clear message and its own exit status
//! (docs/vmm.md), and the exit report is still written. The device checks run before KVM
//! is touched, so these run on any host; the cases that need a VFIO-bound device skip
//! where there is none. With the `test-model-gpu` feature, a model GPU is attached under
//! KVM and its resets come back in the exit report.

mod common;

use std::path::{Path, PathBuf};

use common::{status_and_stderr, tiny_elf, vmm, write_file, HELLO_POWEROFF};
use tenantvm_vmm_api::ExitReport;

fn run(args: &[&str]) -> (Option<i32>, String) {
    let out = vmm().args(args).output().expect("run tenantvm-vmm");
    let (status, stderr) = status_and_stderr(&out);
    assert!(!stderr.contains("panicked"), "the VMM panicked: {stderr}");
    (status, stderr)
}

fn tiny_kernel(dir: &Path) -> String {
    write_file(dir, "tiny.elf", &tiny_elf(HELLO_POWEROFF, 0))
        .display()
        .to_string()
}

fn report(path: &Path) -> ExitReport {
    let text = std::fs::read_to_string(path).expect("exit report written");
    serde_json::from_str(&text).expect("exit report parses")
}

/// The first PCI device on this host bound to a driver that is not a VFIO driver.
fn host_bound_device() -> Option<(PathBuf, String)> {
    let mut entries: Vec<_> = std::fs::read_dir("/sys/bus/pci/devices")
        .ok()?
        .filter_map(|e| e.ok())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    entries.into_iter().find_map(|e| {
        let driver = e.path().join("driver").read_link().ok()?;
        let driver = driver.file_name()?.to_str()?.to_owned();
        (!driver.contains("vfio")).then(|| {
            (
                PathBuf::from("/sys/bus/pci/devices").join(e.file_name()),
                driver,
            )
        })
    })
}

/// The first device bound to vfio-pci on this host.
fn vfio_bound_device() -> Option<PathBuf> {
    let dir = std::fs::read_dir("/sys/bus/pci/drivers/vfio-pci").ok()?;
    dir.filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| tenantvm_vmm_api::devices::is_pci_address(n))
        .map(|n| PathBuf::from("/sys/bus/pci/devices").join(n))
}

#[test]
fn device_path_that_is_not_a_pci_device_exits_21_and_still_reports() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let out = dir.path().join("exit.json");
    let (status, stderr) = run(&[
        "--kernel",
        &kernel,
        "--device",
        "vfio,path=/sys/bus/pci/devices/0000:ff:1f.7",
        "--exit-report",
        out.to_str().unwrap(),
    ]);
    assert_eq!(status, Some(21), "{stderr}");
    assert!(stderr.contains("is not a PCI device"), "{stderr}");
    let r = report(&out);
    assert_eq!(r.status, 21);
    // One entry per configured device, even one refused before it was touched.
    assert_eq!(r.devices.len(), 1);
    assert_eq!(
        r.devices[0].reset_at_attach,
        tenantvm_vmm_api::ResetOutcome::NotAttempted
    );
}

#[test]
fn device_bound_to_a_host_driver_exits_22_naming_the_driver() {
    let Some((path, driver)) = host_bound_device() else {
        tenantvm_skip::skip!("no PCI device bound to a host driver here");
    };
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let device = format!("vfio,path={}", path.display());
    let (status, stderr) = run(&["--kernel", &kernel, "--device", &device]);
    assert_eq!(status, Some(22), "{stderr}");
    assert!(stderr.contains(&format!("bound to {driver}")), "{stderr}");
    assert!(stderr.contains("vfio-pci"), "{stderr}");
}

#[test]
fn vfio_bound_device_without_dev_vfio_exits_24() {
    if Path::new("/dev/vfio/vfio").exists() {
        tenantvm_skip::skip!("/dev/vfio/vfio exists here, the case needs a host without it");
    }
    let Some(path) = vfio_bound_device() else {
        tenantvm_skip::skip!("no device bound to vfio-pci here");
    };
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let device = format!("vfio,path={}", path.display());
    let (status, stderr) = run(&["--kernel", &kernel, "--device", &device]);
    assert_eq!(status, Some(24), "{stderr}");
    assert!(stderr.contains("modprobe vfio-pci"), "{stderr}");
}

#[test]
fn malformed_or_too_many_devices_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let (status, stderr) = run(&["--kernel", &kernel, "--device", "vfio,path=/dev/vfio/3"]);
    assert_eq!(status, Some(2), "{stderr}");
    for clique in ["16", "x", ""] {
        let device =
            format!("vfio,path=/sys/bus/pci/devices/0000:41:00.0,gpudirect_clique={clique}");
        let (status, stderr) = run(&["--kernel", &kernel, "--device", &device]);
        assert_eq!(status, Some(2), "{clique}: {stderr}");
        assert!(
            stderr.contains("gpudirect_clique=0-15"),
            "{clique}: {stderr}"
        );
    }
    let one = "vfio,path=/sys/bus/pci/devices/0000:41:00.0";
    let mut args = vec!["--kernel", kernel.as_str()];
    for _ in 0..9 {
        args.extend(["--device", one]);
    }
    let (status, stderr) = run(&args);
    assert_eq!(status, Some(2), "{stderr}");
    assert!(stderr.contains("at most 8"), "{stderr}");
}

#[cfg(not(feature = "test-model-gpu"))]
#[test]
fn production_build_has_no_model_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let (status, stderr) = run(&["--kernel", &kernel, "--device", "model-gpu"]);
    assert_eq!(status, Some(2), "{stderr}");
}

#[cfg(feature = "test-model-gpu")]
#[test]
fn model_gpu_is_reset_at_attach_and_detach_and_reported() {
    if !common::kvm_available("model_gpu_is_reset_at_attach_and_detach_and_reported") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let out = dir.path().join("exit.json");
    let (status, stderr) = run(&[
        "--kernel",
        &kernel,
        "--serial",
        "none",
        "--device",
        "model-gpu",
        "--device",
        "model-gpu",
        "--exit-report",
        out.to_str().unwrap(),
    ]);
    assert_eq!(status, Some(0), "{stderr}");
    let r = report(&out);
    assert_eq!(r.status, 0);
    // Two GPUs, two 128 GiB BARs placed side by side, each reset twice.
    assert_eq!(r.devices.len(), 2);
    let flr = tenantvm_vmm_api::ResetOutcome::Reset {
        method: Some("flr".into()),
    };
    for d in &r.devices {
        assert_eq!(d.reset_at_attach, flr);
        assert_eq!(d.reset_at_detach, flr);
    }
}

#[test]
fn devices_uuid_and_exit_report_come_from_the_config_file_too() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let out = dir.path().join("exit.json");
    let config = write_file(
        dir.path(),
        "vm.json",
        serde_json::json!({
            "kernel": kernel,
            "devices": [{"path": "/sys/bus/pci/devices/0000:ff:1f.6"}],
            "uuid": "0b1e5b2f-6c3d-4c8e-9a52-3f1d2e4a5b6c",
            "exit_report": out,
        })
        .to_string()
        .as_bytes(),
    );
    let (status, stderr) = run(&["--config", config.to_str().unwrap(), "--check"]);
    assert_eq!(status, Some(0), "{stderr}");
    let (status, stderr) = run(&["--config", config.to_str().unwrap()]);
    assert_eq!(status, Some(21), "{stderr}");
    assert!(stderr.contains("0000:ff:1f.6"), "{stderr}");
    assert_eq!(report(&out).status, 21);
}

#[test]
fn gpudirect_clique_out_of_range_in_the_config_file_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let device = |clique: u32| {
        serde_json::json!({
            "kernel": kernel,
            "devices": [{"path": "/sys/bus/pci/devices/0000:ff:1f.6", "gpudirect_clique": clique}],
        })
        .to_string()
    };
    let ok = write_file(dir.path(), "ok.json", device(15).as_bytes());
    let (status, stderr) = run(&["--config", ok.to_str().unwrap(), "--check"]);
    assert_eq!(status, Some(0), "{stderr}");
    let bad = write_file(dir.path(), "bad.json", device(16).as_bytes());
    let (status, stderr) = run(&["--config", bad.to_str().unwrap(), "--check"]);
    assert_eq!(status, Some(2), "{stderr}");
    assert!(stderr.contains("use 0 to 15"), "{stderr}");
}

/// A VFIO-bound device that is not NVIDIA's (QEMU's edu in the nested host) is refused the
/// GPUDirect clique with status 2, a message naming its vendor id, and a report.
#[test]
fn gpudirect_clique_on_a_non_nvidia_device_exits_2() {
    if !Path::new("/dev/vfio/vfio").exists() {
        tenantvm_skip::skip!("no /dev/vfio/vfio here");
    }
    let Some(path) = vfio_bound_device()
        .filter(|p| std::fs::read_to_string(p.join("vendor")).is_ok_and(|v| v.trim() != "0x10de"))
    else {
        tenantvm_skip::skip!("no non-NVIDIA device bound to vfio-pci here");
    };
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let out = dir.path().join("exit.json");
    let device = format!("vfio,path={},gpudirect_clique=1", path.display());
    let (status, stderr) = run(&[
        "--kernel",
        &kernel,
        "--device",
        &device,
        "--exit-report",
        out.to_str().unwrap(),
    ]);
    assert_eq!(status, Some(2), "{stderr}");
    assert!(stderr.contains("is for NVIDIA GPUs"), "{stderr}");
    assert!(stderr.contains("remove gpudirect_clique"), "{stderr}");
    // Opened and reset before the refusal: still reset at detach and reported.
    let r = report(&out);
    assert_eq!(r.status, 2);
    assert_ne!(
        r.devices[0].reset_at_detach,
        tenantvm_vmm_api::ResetOutcome::NotAttempted
    );
}

#[test]
fn uuid_takes_qemus_spelling_and_refuses_garbage() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let uuid = "0b1e5b2f-6c3d-4c8e-9a52-3f1d2e4a5b6c";
    for flag in ["--uuid", "-uuid"] {
        let out = vmm()
            .args(["--kernel", &kernel, flag, uuid, "--check"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{flag}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(uuid),
            "{flag}"
        );
    }
    let (status, stderr) = run(&["--kernel", &kernel, "-uuid", "not-a-uuid"]);
    assert_eq!(status, Some(2), "{stderr}");
}
