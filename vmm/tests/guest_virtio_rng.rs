//! virtio-rng under real KVM: the test guest's driver receives random bytes (not all
//! equal) with an MSI-X interrupt.

use tenantvm_testkit::{exit, guest, require_kvm, GuestImage, Verdict, VmRun};

#[test]
fn guest_receives_random_bytes_with_an_interrupt() {
    require_kvm!("guest_receives_random_bytes_with_an_interrupt");
    let mut firsts = Vec::new();
    for _ in 0..2 {
        let out = VmRun::new(
            env!("CARGO_BIN_EXE_tenantvm-vmm"),
            guest(GuestImage::Elf).unwrap(),
        )
        .test("virtio-rng")
        .run()
        .unwrap();
        assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
        let report = out.report("virtio-rng").unwrap();
        assert_eq!(report.verdict, Verdict::Pass, "{}", out.describe());
        assert_eq!(report.field("bytes"), Some("64"));
        firsts.push(report.field("first").unwrap().to_string());
    }
    // Two VMs do not get the same bytes.
    assert_ne!(firsts[0], firsts[1]);
}

#[test]
fn rng_off_leaves_no_device() {
    require_kvm!("rng_off_leaves_no_device");
    let out = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("virtio-rng")
    .args(["--rng", "off"])
    .run()
    .unwrap();
    let report = out.report("virtio-rng").unwrap();
    assert_eq!(report.verdict, Verdict::Fail, "{}", out.describe());
}
