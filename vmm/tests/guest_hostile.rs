//! The hostile test guest: malformed virtio-blk chains and garbage written to PCI
//! configuration space, BARs, notify registers and the common configuration. The VMM must
//! stay up and answer its control socket, the guest sees error statuses, DEVICE_NEEDS_RESET
//! and a device that recovers after a reset, and the counters say what happened.

use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

use tenantvm_testkit::{api_request, exit, guest, require_kvm, GuestImage, Verdict, VmRun};

const WAIT: Duration = Duration::from_secs(120);

/// Runs hostile test `name` until it holds, returns its report and the metrics.
fn run_hostile(name: &str, dir: &Path) -> (tenantvm_testkit::Report, Value) {
    let sock = dir.join("vm.sock");
    let disk = dir.join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let vm = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test(name)
    .args([
        "--api-sock".to_string(),
        sock.display().to_string(),
        "--disk".into(),
        format!("path={}", disk.display()),
    ])
    .spawn()
    .unwrap();
    vm.wait_for_serial(&format!("TVMTEST {name} HOLD"), WAIT)
        .unwrap_or_else(|e| panic!("{e}: {}", vm.serial()));
    let report = tenantvm_testkit::parse_report(&vm.serial(), name).unwrap();
    let status = api_request(&sock, &json!({"command": "status"})).unwrap();
    assert_eq!(status["state"], "running", "{status}");
    let metrics = api_request(&sock, &json!({"command": "metrics"})).unwrap();
    assert_eq!(metrics["ok"], true, "{metrics}");
    api_request(&sock, &json!({"command": "shutdown"})).unwrap();
    let out = vm.wait().unwrap();
    assert_eq!(out.status, Some(exit::SHUTDOWN), "{}", out.describe());
    assert_eq!(report.verdict, Verdict::Pass, "{}", out.describe());
    (report, metrics["devices"].clone())
}

fn counter(m: &Value, device: &str, name: &str) -> u64 {
    m[device][name]
        .as_u64()
        .unwrap_or_else(|| panic!("{device}.{name} missing: {m}"))
}

#[test]
fn malformed_block_chains_get_errors_and_counters() {
    require_kvm!("malformed_block_chains_get_errors_and_counters");
    let dir = tempfile::tempdir().unwrap();
    let (report, m) = run_hostile("hostile-blk", dir.path());
    assert_eq!(report.field("refused"), Some("5"), "{}", report.detail);
    assert_eq!(report.field("needs_reset"), Some("1"));
    assert_eq!(report.field("recovered"), Some("1"));
    // The reused head is served once, never twice.
    assert_eq!(report.field("reused_completions"), Some("1"));
    // Loop, outside memory, wrong direction, overflow, past the end, too long a chain.
    assert!(counter(&m, "disk0", "invalid_requests") >= 5, "{m}");
    assert_eq!(counter(&m, "disk0", "unsupported_requests"), 1, "{m}");
    assert_eq!(counter(&m, "disk0", "head_reuse"), 1, "{m}");
    assert_eq!(counter(&m, "disk0", "queue_errors"), 1, "{m}");
    assert_eq!(counter(&m, "disk0", "write_ops"), 0, "{m}");
    // The guest reset the device after DEVICE_NEEDS_RESET and started it again.
    assert!(counter(&m, "disk0.transport", "resets") >= 1, "{m}");
    assert_eq!(counter(&m, "disk0.transport", "activations"), 2, "{m}");
    // Notifications came through the ioeventfds, not MMIO exits.
    assert!(counter(&m, "disk0", "notifications") >= 1, "{m}");
    assert_eq!(counter(&m, "disk0.transport", "mmio_notifies"), 0, "{m}");
}

#[test]
fn garbage_to_config_space_bars_and_notify_is_survived_and_counted() {
    require_kvm!("garbage_to_config_space_bars_and_notify_is_survived_and_counted");
    let dir = tempfile::tempdir().unwrap();
    let (report, m) = run_hostile("hostile-config", dir.path());
    assert_eq!(report.field("recovered"), Some("1"), "{}", report.detail);
    assert!(counter(&m, "rng.transport", "bad_access") > 0, "{m}");
    assert!(counter(&m, "rng.msix", "bad_access") > 0, "{m}");
    assert!(counter(&m, "pci", "bad_access") > 0, "{m}");
    // The device answered the request made after the garbage.
    assert_eq!(counter(&m, "rng", "requests"), 1, "{m}");
}
