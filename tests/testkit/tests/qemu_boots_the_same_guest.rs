//! The very same guest file boots under QEMU's `-kernel` (through its PVH note), which is
//! what makes scripts/bench.sh's comparison fair. Skips without QEMU or /dev/kvm.

use std::process::Command;
use tenantvm_testkit::{guest, parse_report, require_kvm, GuestImage, Verdict};

#[test]
fn qemu_microvm_boots_the_pvh_guest() {
    require_kvm!("qemu_microvm_boots_the_pvh_guest");
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_err()
    {
        tenantvm_skip::skip!("qemu-system-x86_64 missing (scripts/setup.sh installs it)");
    }
    let kernel = guest(GuestImage::Elf).unwrap();
    let out = Command::new("timeout")
        .args([
            "120",
            "qemu-system-x86_64",
            "-M",
            "microvm",
            "-accel",
            "kvm",
            "-m",
            "64",
            "-nodefaults",
        ])
        .args([
            "-no-user-config",
            "-display",
            "none",
            "-serial",
            "stdio",
            "-no-reboot",
        ])
        .args([
            "-device",
            "isa-debug-exit,iobase=0xf4,iosize=1",
            "-append",
            "tvm.test=boot",
            "-kernel",
        ])
        .arg(&kernel)
        .output()
        .unwrap();
    let serial = String::from_utf8_lossy(&out.stdout);
    let report = parse_report(&serial, "boot").unwrap();
    assert_eq!(report.verdict, Verdict::Pass, "{serial}");
    assert_eq!(report.field("entry"), Some("pvh"), "{serial}");
    // isa-debug-exit: QEMU exits with (value << 1) | 1; the guest writes 0 after port 0x600.
    assert_eq!(
        out.status.code(),
        Some(1),
        "{serial}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
