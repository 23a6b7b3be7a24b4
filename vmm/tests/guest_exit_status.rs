//! How a guest ends decides the VMM's exit status: power-off 0, reset 3, triple fault 4,
//! pvpanic 5 (docs/vmm.md); a CPU exception in the guest is reported and ends as a crash.

use tenantvm_testkit::{exit, guest, require_kvm, GuestImage, Verdict, VmRun};

fn run(test: &str) -> tenantvm_testkit::RunOutcome {
    VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test(test)
    .run()
    .unwrap()
}

#[test]
fn power_off_exits_0() {
    require_kvm!("power_off_exits_0");
    let out = run("poweroff");
    assert_eq!(
        out.report("poweroff").unwrap().verdict,
        Verdict::Pass,
        "{}",
        out.describe()
    );
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
}

#[test]
fn i8042_reset_exits_3() {
    require_kvm!("i8042_reset_exits_3");
    let out = run("reset");
    assert_eq!(
        out.report("reset").unwrap().verdict,
        Verdict::Pass,
        "{}",
        out.describe()
    );
    assert_eq!(out.status, Some(exit::RESET), "{}", out.describe());
}

#[test]
fn triple_fault_exits_4() {
    require_kvm!("triple_fault_exits_4");
    let out = run("triple-fault");
    assert_eq!(
        out.report("triple-fault").unwrap().verdict,
        Verdict::Pass,
        "{}",
        out.describe()
    );
    assert_eq!(out.status, Some(exit::TRIPLE_FAULT), "{}", out.describe());
}

#[test]
fn pvpanic_exits_5() {
    require_kvm!("pvpanic_exits_5");
    let out = run("panic");
    assert_eq!(
        out.report("panic").unwrap().verdict,
        Verdict::Panic,
        "{}",
        out.describe()
    );
    assert_eq!(out.status, Some(exit::GUEST_PANIC), "{}", out.describe());
}

#[test]
fn unknown_test_name_is_reported_as_a_failure() {
    require_kvm!("unknown_test_name_is_reported_as_a_failure");
    let out = run("no-such-test");
    let report = out.report("no-such-test").unwrap();
    assert_eq!(report.verdict, Verdict::Fail, "{}", out.describe());
    assert!(report.detail.contains("Unknown test"), "{}", out.describe());
}

#[test]
fn cpu_exception_in_the_guest_is_reported_and_exits_5() {
    require_kvm!("cpu_exception_in_the_guest_is_reported_and_exits_5");
    let out = run("page-fault");
    let report = out.report("page-fault").unwrap();
    assert_eq!(report.verdict, Verdict::Panic, "{}", out.describe());
    assert!(
        report.detail.starts_with("CPU exception 14 (#PF)"),
        "{}",
        out.describe()
    );
    assert_eq!(
        report.field("cr2"),
        Some("0x1000000000"),
        "{}",
        out.describe()
    );
    assert_eq!(out.status, Some(exit::GUEST_PANIC), "{}", out.describe());
}
