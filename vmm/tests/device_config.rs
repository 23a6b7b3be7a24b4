//! Device flags and their failures: a missing disk (18), a vsock path that is not a socket
//! (19), malformed flags (2), each with one clear stderr line; and the `metrics` command
//! lists every device's counters while a guest runs.

use serde_json::json;
use std::time::Duration;
use tenantvm_testkit::{api_request, exit, guest, require_kvm, GuestImage, VmRun};

fn vmm() -> &'static str {
    env!("CARGO_BIN_EXE_tenantvm-vmm")
}

#[test]
fn missing_disk_exits_18_naming_the_path() {
    require_kvm!("missing_disk_exits_18_naming_the_path");
    let out = VmRun::new(vmm(), guest(GuestImage::Elf).unwrap())
        .test("boot")
        .args(["--disk", "path=/nonexistent/tenant.img"])
        .run()
        .unwrap();
    assert_eq!(out.status, Some(18), "{}", out.describe());
    assert!(
        out.stderr.contains("/nonexistent/tenant.img"),
        "{}",
        out.describe()
    );
}

#[test]
fn vsock_path_that_is_a_file_exits_19() {
    require_kvm!("vsock_path_that_is_a_file_exits_19");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("not-a-socket");
    std::fs::write(&path, b"x").unwrap();
    let out = VmRun::new(vmm(), guest(GuestImage::Elf).unwrap())
        .test("boot")
        .args([
            "--vsock".to_string(),
            format!("cid=3,socket={}", path.display()),
        ])
        .run()
        .unwrap();
    assert_eq!(out.status, Some(19), "{}", out.describe());
    assert!(out.stderr.contains("not a socket"), "{}", out.describe());
}

#[test]
fn malformed_device_flags_exit_2() {
    for args in [
        vec!["--disk", "path=/d.img,size=1G"],
        vec!["--disk", "readonly=on"],
        vec!["--vsock", "cid=3"],
        vec!["--vsock", "cid=1,socket=/tmp/x"],
        vec!["--rng", "maybe"],
    ] {
        let out = std::process::Command::new(vmm())
            .args(["--kernel", "/nonexistent"])
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        // A bad CID is only found when the device is built, which needs the kernel first.
        let expected = if args[1].starts_with("cid=1") { 10 } else { 2 };
        assert_eq!(out.status.code(), Some(expected), "{args:?}: {stderr}");
        assert!(!stderr.trim().is_empty(), "{args:?}");
    }
}

#[test]
fn metrics_command_lists_every_device() {
    require_kvm!("metrics_command_lists_every_device");
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let vm = VmRun::new(vmm(), guest(GuestImage::Elf).unwrap())
        .test("idle")
        .args([
            "--api-sock".to_string(),
            sock.display().to_string(),
            "--disk".into(),
            format!("path={}", disk.display()),
            "--vsock".into(),
            format!("cid=3,socket={}", dir.path().join("v.sock").display()),
        ])
        .spawn()
        .unwrap();
    vm.wait_for_serial("tick 1\r", Duration::from_secs(60))
        .unwrap();
    let m = api_request(&sock, &json!({"command": "metrics"})).unwrap();
    assert_eq!(m["ok"], true, "{m}");
    let devices = m["devices"].as_object().unwrap();
    for name in [
        "pci",
        "disk0",
        "disk0.transport",
        "disk0.msix",
        "vsock",
        "vsock.transport",
        "rng",
        "rng.msix",
    ] {
        assert!(devices.contains_key(name), "{name} missing: {m}");
    }
    assert_eq!(m["devices"]["disk0"]["invalid_requests"], 0, "{m}");
    assert_eq!(m["devices"]["pci"]["bar_moves"], 0, "{m}");
    let shutdown = api_request(&sock, &json!({"command": "shutdown"})).unwrap();
    assert_eq!(shutdown["ok"], true);
    let out = vm.wait().unwrap();
    assert_eq!(out.status, Some(exit::SHUTDOWN), "{}", out.describe());
}
