//! Every thread of a running VMM is under a seccomp filter (`/proc/PID/task/*/status`
//! says `Seccomp: 2`), the guest still runs and answers the control socket, and
//! `--seccomp off` leaves them unfiltered. What each filter refuses is tested in
//! `seccomp/tests.rs`; the rest of the KVM suite runs with the filters on.

use serde_json::json;
use std::time::Duration;
use tenantvm_testkit::{api_request, exit, guest, require_kvm, GuestImage, VmRun};

/// `(thread name, Seccomp mode)` of every thread of `pid`.
fn thread_modes(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status = std::fs::read_to_string(task.unwrap().path().join("status")).unwrap();
        let field = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .map(|v| v.trim().to_string())
                .unwrap()
        };
        out.push((field("Name:"), field("Seccomp:")));
    }
    out.sort();
    out
}

fn run_idle(seccomp: &str) -> Vec<(String, String)> {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let vm = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("idle")
    .vcpus(2)
    .args([
        "--api-sock".to_string(),
        sock.display().to_string(),
        "--seccomp".to_string(),
        seccomp.to_string(),
        "--disk".to_string(),
        format!("path={}", disk.display()),
    ])
    .spawn()
    .unwrap();
    vm.wait_for_serial("tick 2\r", Duration::from_secs(60))
        .unwrap();
    let modes = thread_modes(vm.pid());
    // The filtered main thread still serves the control socket.
    let status = api_request(&sock, &json!({"command": "status"})).unwrap();
    assert_eq!(status["state"], "running", "{status}");
    let shutdown = api_request(&sock, &json!({"command": "shutdown"})).unwrap();
    assert_eq!(shutdown["ok"], true, "{shutdown}");
    let out = vm.wait().unwrap();
    assert_eq!(out.status, Some(exit::SHUTDOWN), "{}", out.describe());
    modes
}

#[test]
fn every_vmm_thread_runs_under_its_filter() {
    require_kvm!("every_vmm_thread_runs_under_its_filter");
    let modes = run_idle("on");
    let names: Vec<&str> = modes.iter().map(|(n, _)| n.as_str()).collect();
    for expected in ["tenantvm-dev", "tenantvm-vmm", "vcpu0", "vcpu1"] {
        assert!(names.contains(&expected), "no {expected} thread: {modes:?}");
    }
    assert!(
        modes.iter().all(|(_, mode)| mode == "2"),
        "a thread without a filter: {modes:?}"
    );
}

#[test]
fn seccomp_off_leaves_threads_unfiltered() {
    require_kvm!("seccomp_off_leaves_threads_unfiltered");
    let modes = run_idle("off");
    assert!(
        modes.iter().all(|(_, mode)| mode == "0"),
        "filtered with --seccomp off: {modes:?}"
    );
}
