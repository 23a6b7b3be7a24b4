//! Serial round trip: a line written to the VMM's stdin reaches the guest's COM1 receiver,
//! and the guest's transformed echo (upper-cased) comes back on stdout.

use std::time::Duration;
use tenantvm_testkit::{exit, guest, require_kvm, GuestImage, Verdict, VmRun};

#[test]
fn line_on_stdin_comes_back_transformed() {
    require_kvm!("line_on_stdin_comes_back_transformed");
    let mut vm = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("serial-echo")
    .spawn()
    .unwrap();
    vm.wait_for_serial("TVMTEST serial-echo READY", Duration::from_secs(60))
        .unwrap();
    vm.write_stdin(b"hello from the host 42\n").unwrap();
    let out = vm.wait().unwrap();
    let report = out
        .report("serial-echo")
        .unwrap_or_else(|e| panic!("{e}\n{}", out.describe()));
    assert_eq!(report.verdict, Verdict::Pass, "{}", out.describe());
    assert!(
        out.serial.contains("ECHO HELLO FROM THE HOST 42"),
        "{}",
        out.describe()
    );
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
}
