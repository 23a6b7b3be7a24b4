//! virtio-blk under real KVM with the test guest's own PCI enumeration and virtio-pci
//! driver: the pattern the guest writes (and flushes) is in the host file, reads come
//! back, a read past the end fails, a read-only disk refuses writes and stays untouched,
//! and the requests interrupt through MSI-X.

use tenantvm_testkit::{exit, guest, require_kvm, GuestImage, Verdict, VmRun};

/// The byte the guest writes at disk offset `off` (tests/guests vtests.rs `pattern`).
fn pattern(off: u64) -> u8 {
    (off.wrapping_mul(31) ^ (off >> 9) ^ 0xa5) as u8
}

const DISK_BYTES: usize = 1 << 20;

fn run(disk: &std::path::Path, extra: &str) -> tenantvm_testkit::RunOutcome {
    VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("virtio-blk")
    .args([
        "--disk".to_string(),
        format!("path={}{extra}", disk.display()),
    ])
    .run()
    .unwrap()
}

#[test]
fn guest_writes_reach_the_host_file_and_read_back() {
    require_kvm!("guest_writes_reach_the_host_file_and_read_back");
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; DISK_BYTES]).unwrap();
    let out = run(&disk, ",id=tenant-root");
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
    let report = out.report("virtio-blk").unwrap();
    assert!((report.verdict == Verdict::Pass), "{}", out.describe());
    assert_eq!(report.field("sectors"), Some("2048"), "{}", out.describe());
    assert_eq!(report.field("readonly"), Some("0"));
    assert_eq!(report.field("id"), Some("tenant-root"));
    let irqs: u32 = report.field("irqs").unwrap().parse().unwrap();
    assert!(irqs >= 1, "{}", out.describe());

    let bytes = std::fs::read(&disk).unwrap();
    for off in 0..4096u64 {
        assert_eq!(bytes[off as usize], pattern(off), "byte {off}");
    }
    let last = DISK_BYTES as u64 - 512;
    for off in last..DISK_BYTES as u64 {
        assert_eq!(bytes[off as usize], pattern(off), "byte {off}");
    }
    // Nothing between the written ranges changed.
    assert!(bytes[4096..last as usize].iter().all(|&b| b == 0));
}

#[test]
fn read_only_disk_refuses_the_guest_write() {
    require_kvm!("read_only_disk_refuses_the_guest_write");
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("ro.img");
    std::fs::write(&disk, vec![0x11u8; DISK_BYTES]).unwrap();
    let out = run(&disk, ",readonly=on");
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
    let report = out.report("virtio-blk").unwrap();
    assert!((report.verdict == Verdict::Pass), "{}", out.describe());
    assert_eq!(report.field("readonly"), Some("1"), "{}", out.describe());
    assert!(std::fs::read(&disk).unwrap().iter().all(|&b| b == 0x11));
}

#[test]
fn guest_without_a_disk_reports_the_missing_device() {
    require_kvm!("guest_without_a_disk_reports_the_missing_device");
    let out = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("virtio-blk")
    .run()
    .unwrap();
    let report = out.report("virtio-blk").unwrap();
    assert!(report.verdict != Verdict::Pass, "{}", out.describe());
    assert!(
        out.serial.contains("No virtio device 1af4:1042"),
        "{}",
        out.describe()
    );
}

/// Runs `blk-bench` with `tvm.verify=1` on `disk` and returns its report fields.
fn bench(disk: &std::path::Path, params: &str) -> tenantvm_testkit::RunOutcome {
    VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .cmdline(&format!("tvm.test=blk-bench tvm.verify=1 {params}"))
    .args(["--disk".to_string(), format!("path={}", disk.display())])
    .run()
    .unwrap()
}

/// The worker signals completions while it still works and the driver refills the ring
/// meanwhile, without kicks when the device says it is busy: every request still lands
/// on its own block and every read returns its own block, whichever way the driver asks
/// for notifications (EVENT_IDX or the ring flags, interrupts or polling).
#[test]
fn pipelined_requests_keep_their_blocks_in_every_notification_mode() {
    require_kvm!("pipelined_requests_keep_their_blocks_in_every_notification_mode");
    const BS: u64 = 64 << 10;
    const BLOCKS: u64 = 64;
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("bench.img");
    for (event_idx, poll) in [(1, 0), (0, 0), (1, 1), (0, 1)] {
        let modes = format!("tvm.event_idx={event_idx} tvm.poll={poll} tvm.qd=8 tvm.bs={BS}");
        // Writes: each block gets its number in its first 8 bytes.
        std::fs::write(&disk, vec![0xeeu8; (2 * BLOCKS * BS) as usize]).unwrap();
        let out = bench(&disk, &format!("{modes} tvm.bench=seq-write tvm.mib=4"));
        let report = out.report("blk-bench").unwrap();
        assert!(
            report.verdict == Verdict::Pass,
            "{modes}: {}",
            out.describe()
        );
        assert_eq!(report.field("ops"), Some("64"), "{}", out.describe());
        let bytes = std::fs::read(&disk).unwrap();
        for block in 0..2 * BLOCKS {
            let at = (block * BS) as usize;
            let first = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
            let expected = if block < BLOCKS {
                block
            } else {
                0xeeee_eeee_eeee_eeee
            };
            assert_eq!(first, expected, "{modes}: block {block} after seq-write");
        }
        // Random reads: each must find its own block's number (the whole disk is
        // numbered first).
        let mut numbered = vec![0u8; (2 * BLOCKS * BS) as usize];
        for block in 0..2 * BLOCKS {
            let at = (block * BS) as usize;
            numbered[at..at + 8].copy_from_slice(&block.to_le_bytes());
        }
        std::fs::write(&disk, &numbered).unwrap();
        let out = bench(&disk, &format!("{modes} tvm.bench=rand-read tvm.mib=4"));
        let report = out.report("blk-bench").unwrap();
        assert!(
            report.verdict == Verdict::Pass,
            "{modes}: {}",
            out.describe()
        );
    }
}
