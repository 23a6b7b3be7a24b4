//! Quarantine through the real daemon with the simulated GPU backend: a scrub forced to fail
//! (TENANTVM_TEST_SIM_SCRUB_FAIL, test-only) quarantines the slice, which no later create
//! gets, until `tenantvm gpu scrub` passes; the destroy itself still finishes with a receipt
//! that records the failed scrub. Skips without root or /dev/kvm.

mod support;

use support::daemon::{self, TestDaemon};
use support::departure::{cli, create, ok, receipts_of, text};
use tenantvm::gpu::scrub::departure::SIM_SCRUB_FAIL_ENV;
use tenantvm::receipt::{DepartureStep, StepResult};

/// The H200 of the fixture offers 7g.141gb at one place only.
const GPU: &str = "gpu = { kind = \"mig\", profile = \"7g.141gb\" }";

#[test]
fn a_failed_scrub_keeps_the_slice_out_until_a_scrub_passes() {
    if daemon::should_skip("a_failed_scrub_keeps_the_slice_out_until_a_scrub_passes") {
        return;
    }
    let (mut d, _sim) = TestDaemon::new().with_sim_gpu_host();
    // This test binary is its own process: the variable reaches only its daemons.
    std::env::set_var(SIM_SCRUB_FAIL_ENV, "all");
    d.start(None);

    let a = daemon::unique("qa");
    ok(create(&d, &a, GPU), "create a", &d);
    ok(cli(&d, None, &["destroy", &a]), "destroy a", &d);
    let r = receipts_of(&d, &a);
    assert_eq!(r.len(), 1);
    let scrub = r[0]
        .receipt
        .steps
        .iter()
        .find(|s| s.step == DepartureStep::GpuScrub)
        .unwrap();
    assert_eq!(scrub.result, StepResult::Failed);
    assert_eq!(scrub.evidence["quarantined"], "true");

    let q = ok(
        cli(&d, None, &["gpu", "quarantine", "--json"]),
        "quarantine",
        &d,
    );
    let list: serde_json::Value = serde_json::from_slice(&q.stdout).unwrap();
    let slices = list["slices"].as_array().unwrap();
    assert_eq!(slices.len(), 1, "{list}");
    let slice = format!(
        "{}/{}",
        slices[0]["gpu"].as_str().unwrap(),
        slices[0]["label"].as_str().unwrap()
    );
    // The GPU is named by its PCI address (NVML indexes shift as GPUs go to vfio-pci).
    assert_eq!(slice, "0000:0f:00.0/7g.141gb@0");

    // The only placement of the profile is quarantined: create fails at reserve-gpu.
    let b = daemon::unique("qb");
    let o = create(&d, &b, GPU);
    assert_eq!(o.status.code(), Some(8), "{}", text(&o));
    assert!(text(&o).contains("reserve-gpu"), "{}", text(&o));
    assert!(text(&o).contains("quarantined"), "{}", text(&o));
    ok(cli(&d, None, &["destroy", &b]), "destroy b", &d);

    // A re-scrub that fails again keeps it.
    let o = cli(&d, None, &["gpu", "scrub", &slice]);
    assert_eq!(o.status.code(), Some(8), "{}", text(&o));
    // Without the forced failure, the re-scrub passes and lifts it.
    d.stop();
    std::env::remove_var(SIM_SCRUB_FAIL_ENV);
    d.start(None);
    let o = ok(cli(&d, None, &["gpu", "scrub", &slice]), "rescrub", &d);
    assert!(text(&o).contains("lifted"), "{}", text(&o));
    let c = daemon::unique("qc");
    ok(create(&d, &c, GPU), "create c", &d);
    // A tenant token may not list or scrub the quarantine.
    let tok = d.dir.path().join(format!("{c}.token"));
    let o = cli(&d, Some(&tok), &["gpu", "quarantine"]);
    assert_eq!(o.status.code(), Some(10), "{}", text(&o));
    ok(cli(&d, None, &["destroy", &c]), "destroy c", &d);
    d.stop();
}
