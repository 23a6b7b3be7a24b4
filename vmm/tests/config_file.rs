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

#[test]
fn check_validates_without_touching_the_host_and_prints_the_resolved_config() {
    let dir = tempfile::tempdir().unwrap();
    // Paths as another mount namespace (the orchestrator's jail) sees them: nothing there.
    let config = serde_json::json!({
        "kernel": "/vm/kernel",
        "serial": "file:/log/serial.log",
        "api_sock": "/run/api.sock",
        "disks": [{"path": "/vm/disk0", "id": "disk0",
                   "rate_limit": {"bytes_per_sec": 1048576, "ops_per_sec": 100}}],
        "vsock": {"guest_cid": 3, "uds_path": "/run/vsock.sock"},
    });
    let path = write_file(dir.path(), "vm.json", config.to_string().as_bytes());
    let out = vmm()
        .args(["--config", path.to_str().unwrap(), "--check"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resolved: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(resolved["kernel"], "/vm/kernel");
    assert_eq!(resolved["memory_mib"], 128, "the default is filled in");
    assert_eq!(resolved["disks"][0]["rate_limit"]["ops_per_sec"], 100);
    assert_eq!(resolved["vsock"]["uds_path"], "/run/vsock.sock");
    assert_eq!(resolved["rng"], true);

    // Each problem gets the status a start would have and a message naming it.
    for (doc, status, needle) in [
        (r#"{"kernel":"/k","vcpu":2}"#, 2, "vcpu"),
        (
            r#"{"kernel":"/k","serial":"tty"}"#,
            2,
            "use stdout, none or file:PATH",
        ),
        (r#"{"kernel":"/k","vcpus":0}"#, 14, "at least one vCPU"),
        (r#"{"memory_mib":64}"#, 2, "No kernel given"),
    ] {
        let bad = write_file(dir.path(), "bad.json", doc.as_bytes());
        let out = vmm()
            .args(["--config", bad.to_str().unwrap(), "--check"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(status), "{doc}: {stderr}");
        assert!(stderr.contains(needle), "{doc}: {stderr}");
        assert!(out.stdout.is_empty(), "{doc}");
    }
}

#[test]
fn help_lists_every_exit_status_of_the_contract() {
    let out = vmm().arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    for status in tenantvm_vmm_api::ExitStatus::ALL {
        let line = format!("{:>3}  {}", status.code(), status.description());
        assert!(
            help.contains(&line),
            "{line:?} missing from --help:\n{help}"
        );
    }
}
