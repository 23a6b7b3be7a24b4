//! Every vCPU comes up: the test guest reads the MP table, starts each AP with
//! INIT-SIPI-SIPI and collects the APIC id each AP reads from its own local APIC.

use tenantvm_testkit::{exit, guest, require_kvm, GuestImage, Verdict, VmRun};

fn every_vcpu_reports(vcpus: u32) {
    let out = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("smp")
    .vcpus(vcpus)
    .run()
    .unwrap();
    let report = out
        .report("smp")
        .unwrap_or_else(|e| panic!("{e}\n{}", out.describe()));
    assert_eq!(report.verdict, Verdict::Pass, "{}", out.describe());
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
    assert_eq!(
        report.field("cpus"),
        Some(vcpus.to_string().as_str()),
        "{}",
        out.describe()
    );
    let ids: Vec<String> = (0..vcpus).map(|i| i.to_string()).collect();
    assert_eq!(
        report.field("apic_ids"),
        Some(ids.join(",").as_str()),
        "{}",
        out.describe()
    );
}

#[test]
fn one_vcpu_comes_up() {
    require_kvm!("one_vcpu_comes_up");
    every_vcpu_reports(1);
}

#[test]
fn two_vcpus_come_up() {
    require_kvm!("two_vcpus_come_up");
    every_vcpu_reports(2);
}

#[test]
fn four_vcpus_come_up() {
    require_kvm!("four_vcpus_come_up");
    every_vcpu_reports(4);
}
