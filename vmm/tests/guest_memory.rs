//! A pattern over all of guest RAM: the test guest writes and reads back every usable byte
//! of its memory map outside its own image, so RAM that is missing, mapped twice or not
//! retaining writes fails, and a memory map that under-reports RAM fails the byte count.
//!
//! This machine's nested KVM runs guest instructions slowly (about a minute for 128 MiB);
//! the 512 MiB run takes several minutes, so it runs only with TENANTVM_LONG_TESTS=1. Large
//! guests get the sparse test instead (one word per 2 MiB): RAM above 4 GiB and the 32-bit
//! hole (docs/vmm.md) are checked in seconds.

use std::time::Duration;
use tenantvm_testkit::{exit, guest, require_kvm, GuestImage, Verdict, VmRun};

/// The guest image, stacks and page tables take under 2 MiB; the legacy hole below 1 MiB
/// (0xa0000-0x100000) another 384 KiB.
const NOT_TESTED_AT_MOST: u64 = 4 << 20;

fn pattern_covers_all_ram(mib: u32) {
    pattern_covers_all_ram_with(mib, &[]);
}

fn pattern_covers_all_ram_with(mib: u32, args: &[&str]) {
    let out = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("memory")
    .memory_mib(mib)
    .args(args.iter().copied())
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
        tenantvm_skip::skip!("takes minutes here; set TENANTVM_LONG_TESTS=1");
    }
    pattern_covers_all_ram(512);
}

/// Free pages of the host's 2 MiB pool.
fn free_2m_pages() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Guest RAM on 2 MiB huge pages (`--hugepages 2M`): the pattern covers all of it, as on
/// ordinary pages. Needs 16 free pages in the host's pool (`echo 16 >
/// /proc/sys/vm/nr_hugepages` as root); skips otherwise.
#[test]
fn pattern_covers_all_of_32_mib_on_2m_huge_pages() {
    require_kvm!("pattern_covers_all_of_32_mib_on_2m_huge_pages");
    if free_2m_pages() < 16 {
        tenantvm_skip::skip!("fewer than 16 free 2 MiB huge pages; reserve them with echo 16 > /proc/sys/vm/nr_hugepages");
    }
    pattern_covers_all_ram_with(32, &["--hugepages", "2M"]);
}

/// The control: more huge pages than the host has is refused at start, saying so, before
/// the guest runs. It asks for 1 GiB pages, one more than the host's pool holds, so that
/// it never competes with the 2 MiB test beside it.
#[test]
fn a_guest_larger_than_the_free_huge_pages_is_refused_at_start() {
    require_kvm!("a_guest_larger_than_the_free_huge_pages_is_refused_at_start");
    let pool = std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0);
    let out = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("memory-sparse")
    .memory_mib((pool + 1) * 1024)
    .args(["--hugepages", "1G"])
    .run()
    .unwrap();
    assert_eq!(out.status, Some(1), "VMM error: {}", out.describe());
    assert!(out.stderr.contains("1G huge pages"), "{}", out.describe());
}

/// Runs `memory-sparse` on a `mib` guest and checks the map's extent and RAM total.
fn sparse_pattern_reaches(mib: u32, expected_top: u64) -> tenantvm_testkit::Report {
    let out = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("memory-sparse")
    .memory_mib(mib)
    .run()
    .unwrap();
    let report = out
        .report("memory-sparse")
        .unwrap_or_else(|e| panic!("{e}\n{}", out.describe()));
    assert_eq!(report.verdict, Verdict::Pass, "{}", out.describe());
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
    let ram: u64 = report.field("ram").unwrap().parse().unwrap();
    let size = u64::from(mib) << 20;
    assert!(
        ram <= size && ram >= size - NOT_TESTED_AT_MOST,
        "RAM {ram} of {size}\n{}",
        out.describe()
    );
    assert_eq!(
        report.field("top"),
        Some(format!("{expected_top:#x}").as_str()),
        "{}",
        out.describe()
    );
    report
}

#[test]
fn sparse_pattern_covers_a_guest_that_ends_at_the_32_bit_hole() {
    require_kvm!("sparse_pattern_covers_a_guest_that_ends_at_the_32_bit_hole");
    let report = sparse_pattern_reaches(3072, 0xc000_0000);
    assert_eq!(report.field("above_4g"), Some("0"));
}

#[test]
fn sparse_pattern_covers_ram_above_4_gib_past_the_hole() {
    require_kvm!("sparse_pattern_covers_ram_above_4_gib_past_the_hole");
    // 5 GiB: 3 GiB below the hole at 0xc000_0000, 2 GiB from 4 GiB up.
    let report = sparse_pattern_reaches(5120, 0x1_8000_0000);
    assert_eq!(report.field("above_4g"), Some("1024"));
}
