//! The model GPU passed through to the test guest under real KVM (test builds:
//! `--features test-model-gpu`): the guest enumerates it, sizes its BARs, uses BAR0
//! through the trapped path and BAR1/BAR3 through KVM memory slots (and moves BAR3),
//! counts MSI-X interrupts the model raises (a masked one pends until unmasked) and has the
//! model DMA into its RAM. The host checks, from the VMM's counters, that the mapped BAR
//! writes never exited and that no interrupt went through the VMM, and reads the resets
//! from the exit report.

#[cfg(not(feature = "test-model-gpu"))]
#[test]
fn model_gpu_in_the_test_guest() {
    tenantvm_skip::skip!("built without --features test-model-gpu (scripts/test.sh enables it)");
}

#[cfg(feature = "test-model-gpu")]
#[test]
fn model_gpu_in_the_test_guest() {
    use serde_json::json;
    use std::time::Duration;
    use tenantvm_testkit::{api_request, exit, guest, require_kvm, GuestImage, Verdict, VmRun};
    use tenantvm_vmm_api::{ExitReport, ResetOutcome};

    require_kvm!("model_gpu_in_the_test_guest");
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let report_path = dir.path().join("exit.json");
    let vm = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("vfio-model")
    .args([
        "--device".to_string(),
        "model-gpu".into(),
        "--api-sock".into(),
        sock.display().to_string(),
        "--exit-report".into(),
        report_path.display().to_string(),
    ])
    .spawn()
    .unwrap();
    vm.wait_for_serial("TVMTEST vfio-model HOLD", Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("{e}: {}", vm.serial()));
    let report = tenantvm_testkit::parse_report(&vm.serial(), "vfio-model").unwrap();
    let metrics = api_request(&sock, &json!({"command": "metrics"})).unwrap();
    api_request(&sock, &json!({"command": "shutdown"})).unwrap();
    let out = vm.wait().unwrap();
    assert_eq!(report.verdict, Verdict::Pass, "{}", out.describe());
    assert_eq!(out.status, Some(exit::SHUTDOWN), "{}", out.describe());
    assert_eq!(report.field("size1"), Some("0x2000000000"));
    assert_eq!(report.field("moved"), Some("1"));
    assert_eq!(report.field("masked_pending"), Some("1"));
    assert_eq!(report.field("dma"), Some("256"));
    let irqs: u64 = report.field("irqs").unwrap().parse().unwrap();
    assert!(irqs >= 4, "{}", report.detail);

    let m = &metrics["devices"];
    let trapped = m["vfio0"]["trapped_accesses"]
        .as_u64()
        .expect("vfio0 counters");
    // The guest wrote and read BAR1 2 x 1024 times through its mapping: had those exited,
    // the trapped count would exceed 2048. BAR0 registers and the MSI-X table stay trapped.
    assert!(
        trapped > 10 && trapped < 200,
        "trapped accesses {trapped}: {m}"
    );
    // The model's interrupts went eventfd -> KVM irqfd: the VMM delivered none itself.
    assert_eq!(m["vfio0.msix"]["delivered"], 0, "{m}");
    assert_eq!(m["vfio0"]["irq_errors"], 0, "{m}");
    assert_eq!(m["pci"]["bar_moves"], 1, "{m}");

    let exit: ExitReport =
        serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    assert_eq!(exit.status, exit::SHUTDOWN as u8);
    let flr = ResetOutcome::Reset {
        method: Some("flr".into()),
    };
    assert_eq!(exit.devices.len(), 1);
    assert_eq!(exit.devices[0].reset_at_attach, flr);
    assert_eq!(exit.devices[0].reset_at_detach, flr);
}
