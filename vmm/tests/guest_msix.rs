//! MSI-X through KVM GSI routing and irqfds, checked by the test guest's local APIC: a
//! masked vector's completion only sets its PBA bit, unmasking delivers it, and an
//! unmasked vector interrupts at once.

use tenantvm_testkit::{exit, guest, require_kvm, GuestImage, Verdict, VmRun};

#[test]
fn masked_vector_pends_and_unmask_delivers() {
    require_kvm!("masked_vector_pends_and_unmask_delivers");
    let out = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("msix")
    .run()
    .unwrap();
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
    let report = out.report("msix").unwrap();
    assert_eq!(report.verdict, Verdict::Pass, "{}", out.describe());
    assert_eq!(report.field("masked_pending"), Some("1"));
    assert_eq!(report.field("irqs"), Some("2"), "{}", out.describe());
}
