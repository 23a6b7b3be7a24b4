//! A pattern over all of guest RAM: the test guest writes and reads back every usable byte
//! of its memory map outside its own image, so RAM that is missing, mapped twice or not
//! retaining writes fails, and a memory map that under-reports RAM fails the byte count.
//!
//! This machine's nested KVM runs guest instructions slowly (about a minute for 128 MiB);
//! the 512 MiB run takes several minutes, so it runs only with TENANTVM_LONG_TESTS=1.

use std::time::Duration;
use tenantvm_testkit::{exit, guest, require_kvm, GuestImage, Verdict, VmRun};

/// The guest image, stacks and page tables take under 2 MiB; the legacy hole below 1 MiB
/// (0xa0000-0x100000) another 384 KiB.
const NOT_TESTED_AT_MOST: u64 = 4 << 20;

fn pattern_covers_all_ram(mib: u32) {
    let out = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("memory")
    .memory_mib(mib)
    .timeout(Duration::from_secs(60 + 3 * u64::from(mib)))
    .run()
    .unwrap();
    let report = out
        .report("memory")
        .unwrap_or_else(|e| panic!("{e}\n{}", out.describe()));
    assert_eq!(report.verdict, Verdict::Pass, "{}", out.describe());
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
    let bytes: u64 = report.field("bytes").unwrap().parse().unwrap();
    let ram = u64::from(mib) << 20;
    assert!(
        bytes <= ram,
        "tested {bytes} bytes of a {ram}-byte guest\n{}",
        out.describe()
    );
    assert!(
        bytes >= ram - NOT_TESTED_AT_MOST,
        "only {bytes} of {ram} bytes were usable RAM in the memory map\n{}",
        out.describe()
    );
    assert_eq!(
        report.field("skipped_unaligned"),
        Some("0"),
        "{}",
        out.describe()
    );
}

#[test]
fn pattern_covers_all_of_128_mib() {
    require_kvm!("pattern_covers_all_of_128_mib");
    pattern_covers_all_ram(128);
}

#[test]
fn pattern_covers_all_of_512_mib() {
    require_kvm!("pattern_covers_all_of_512_mib");
    if std::env::var_os("TENANTVM_LONG_TESTS").is_none() {
        eprintln!(
            "skipping pattern_covers_all_of_512_mib: takes minutes here; set TENANTVM_LONG_TESTS=1"
        );
        return;
    }
    pattern_covers_all_ram(512);
}
