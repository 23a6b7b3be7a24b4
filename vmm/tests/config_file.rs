//! `--config FILE`: a JSON file with the flags' fields boots a VM; flags override it.

mod common;

use std::process::Stdio;

use common::{tiny_elf, vmm, write_file, HELLO_POWEROFF};

#[test]
fn config_file_boots_and_flags_override_it() {
    if !common::kvm_available("config_file_boots_and_flags_override_it") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = write_file(dir.path(), "guest.elf", &tiny_elf(HELLO_POWEROFF, 0));
    let log = dir.path().join("serial.log");
    let config = serde_json::json!({
        "kernel": kernel,
        "memory_mib": 16,
        "vcpus": 2,
        "serial": format!("file:{}", log.display()),
        "cmdline": "console=ttyS0",
        "boot": "linux",
    });
    let config_path = write_file(dir.path(), "vm.json", config.to_string().as_bytes());

    let out = vmm()
        .args(["--config", config_path.to_str().unwrap()])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "ok\n");

    // --serial on the command line wins over the file's setting.
    let out = vmm()
        .args([
            "--config",
            config_path.to_str().unwrap(),
            "--serial",
            "stdout",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "ok\n",
        "the file was not written again"
    );
}

#[test]
fn missing_config_file_exits_2() {
    let out = vmm()
        .args(["--config", "/nonexistent/vm.json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Cannot read config file"));
}
