//! The control socket while a guest runs: status, pause (the guest's ticks stop), resume
//! (they go on), and shutdown, which ends the VMM with status 6.

use serde_json::json;
use std::time::Duration;
use tenantvm_testkit::{api_request, exit, guest, require_kvm, GuestImage, VmRun};

#[test]
fn pause_resume_status_and_shutdown_while_a_guest_runs() {
    require_kvm!("pause_resume_status_and_shutdown_while_a_guest_runs");
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let vm = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("idle")
    .vcpus(2)
    .args(["--api-sock".to_string(), sock.display().to_string()])
    .spawn()
    .unwrap();
    let wait = Duration::from_secs(60);
    vm.wait_for_serial("tick 2\r", wait).unwrap();

    let status = api_request(&sock, &json!({"command": "status"})).unwrap();
    assert_eq!(status["ok"], true, "{status}");
    assert_eq!(status["state"], "running", "{status}");
    assert_eq!(status["vcpus"], 2, "{status}");
    assert_eq!(status["memory_mib"], 128, "{status}");
    assert_eq!(status["pid"], vm.pid(), "{status}");

    let paused = api_request(&sock, &json!({"command": "pause"})).unwrap();
    assert_eq!(paused["ok"], true, "{paused}");
    let status = api_request(&sock, &json!({"command": "status"})).unwrap();
    assert_eq!(status["state"], "paused", "{status}");
    // While paused the guest cannot print; after resume its ticks go on past the last one.
    let ticks_when_paused = vm.serial().matches("tick ").count();

    let resumed = api_request(&sock, &json!({"command": "resume"})).unwrap();
    assert_eq!(resumed["ok"], true, "{resumed}");
    assert_eq!(
        api_request(&sock, &json!({"command": "status"})).unwrap()["state"],
        "running"
    );
    vm.wait_for_serial_count("tick ", ticks_when_paused + 2, wait)
        .unwrap();

    let bad = api_request(&sock, &json!({"command": "no-such-command"})).unwrap();
    assert_eq!(bad["ok"], false, "{bad}");

    let shutdown = api_request(&sock, &json!({"command": "shutdown"})).unwrap();
    assert_eq!(shutdown["ok"], true, "{shutdown}");
    let out = vm.wait().unwrap();
    assert_eq!(out.status, Some(exit::SHUTDOWN), "{}", out.describe());
}
