//! Bad input to the VMM binary: each gets a clear message and its documented exit status
//! (docs/vmm.md), never a panic.

mod common;

use std::os::unix::net::UnixListener;

use common::{status_and_stderr, tiny_elf, vmm, write_file, HELLO_POWEROFF};

fn run(args: &[&str]) -> (Option<i32>, String) {
    let out = vmm().args(args).output().expect("run tenantvm-vmm");
    let (status, stderr) = status_and_stderr(&out);
    assert!(!stderr.contains("panicked"), "the VMM panicked: {stderr}");
    (status, stderr)
}

fn tiny_kernel(dir: &std::path::Path) -> String {
    write_file(dir, "tiny.elf", &tiny_elf(HELLO_POWEROFF, 0))
        .display()
        .to_string()
}

#[test]
fn missing_kernel_exits_10() {
    let (status, stderr) = run(&["--kernel", "/nonexistent/vmlinux"]);
    assert_eq!(status, Some(10), "{stderr}");
    assert!(
        stderr.contains("Cannot read kernel /nonexistent/vmlinux"),
        "{stderr}"
    );
}

#[test]
fn corrupt_kernel_exits_11() {
    let dir = tempfile::tempdir().unwrap();
    let garbage: Vec<u8> = (0..8192u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let path = write_file(dir.path(), "garbage", &garbage);
    let (status, stderr) = run(&["--kernel", path.to_str().unwrap()]);
    assert_eq!(status, Some(11), "{stderr}");
    assert!(
        stderr.contains("neither an ELF vmlinux nor a bzImage"),
        "{stderr}"
    );
}

#[test]
fn truncated_elf_kernel_exits_11() {
    let dir = tempfile::tempdir().unwrap();
    let mut elf = tiny_elf(HELLO_POWEROFF, 0);
    elf.truncate(0x800); // program header points past the end of the file
    let path = write_file(dir.path(), "truncated.elf", &elf);
    let (status, stderr) = run(&["--kernel", path.to_str().unwrap()]);
    assert_eq!(status, Some(11), "{stderr}");
    assert!(stderr.contains("ELF image is corrupt"), "{stderr}");
}

#[test]
fn initramfs_larger_than_guest_memory_exits_12() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let initramfs = dir.path().join("big.cpio");
    std::fs::File::create(&initramfs)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let (status, stderr) = run(&[
        "--kernel",
        &kernel,
        "--initramfs",
        initramfs.to_str().unwrap(),
        "--memory-mib",
        "32",
    ]);
    assert_eq!(status, Some(12), "{stderr}");
    assert!(stderr.contains("does not fit in guest memory"), "{stderr}");
}

#[test]
fn missing_initramfs_exits_12() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let (status, stderr) = run(&["--kernel", &kernel, "--initramfs", "/nonexistent/initrd"]);
    assert_eq!(status, Some(12), "{stderr}");
    assert!(stderr.contains("Cannot read initramfs"), "{stderr}");
}

#[test]
fn memory_too_small_for_kernel_exits_13() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(dir.path(), "fat.elf", &tiny_elf(HELLO_POWEROFF, 64 << 20));
    let (status, stderr) = run(&["--kernel", path.to_str().unwrap(), "--memory-mib", "16"]);
    assert_eq!(status, Some(13), "{stderr}");
    assert!(
        stderr.contains("too small for the kernel") && stderr.contains("--memory-mib"),
        "{stderr}"
    );
}

#[test]
fn zero_vcpus_exits_14() {
    let (status, stderr) = run(&["--kernel", "/nonexistent/vmlinux", "--vcpus", "0"]);
    assert_eq!(status, Some(14), "{stderr}");
    assert!(stderr.contains("at least one vCPU"), "{stderr}");
}

#[test]
fn more_vcpus_than_kvm_allows_exits_14() {
    if !common::kvm_available("more_vcpus_than_kvm_allows_exits_14") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let (status, stderr) = run(&["--kernel", &kernel, "--vcpus", "100000"]);
    assert_eq!(status, Some(14), "{stderr}");
    assert!(stderr.contains("at most"), "{stderr}");
}

#[test]
fn config_with_unknown_field_exits_2_and_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_file(dir.path(), "vm.json", br#"{"kernel":"/k","memory_gib":4}"#);
    let (status, stderr) = run(&["--config", config.to_str().unwrap()]);
    assert_eq!(status, Some(2), "{stderr}");
    assert!(stderr.contains("unknown field `memory_gib`"), "{stderr}");
}

#[test]
fn config_with_wrong_type_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_file(dir.path(), "vm.json", br#"{"kernel":"/k","vcpus":"two"}"#);
    let (status, stderr) = run(&["--config", config.to_str().unwrap()]);
    assert_eq!(status, Some(2), "{stderr}");
    assert!(stderr.contains("invalid type"), "{stderr}");
}

#[test]
fn unknown_flag_and_bad_serial_exit_2() {
    let (status, stderr) = run(&["--kernel", "/k", "--frobnicate"]);
    assert_eq!(status, Some(2), "{stderr}");
    let (status, stderr) = run(&["--kernel", "/k", "--serial", "tty"]);
    assert_eq!(status, Some(2), "{stderr}");
    assert!(stderr.contains("stdout, none or file:PATH"), "{stderr}");
}

#[test]
fn busy_control_socket_exits_15() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let sock = dir.path().join("api.sock");
    let _live = UnixListener::bind(&sock).unwrap();
    let (status, stderr) = run(&["--kernel", &kernel, "--api-sock", sock.to_str().unwrap()]);
    assert_eq!(status, Some(15), "{stderr}");
    assert!(stderr.contains("is busy"), "{stderr}");
    assert!(sock.exists(), "the live socket must be left alone");
}

#[test]
fn unwritable_control_socket_path_exits_15() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let (status, stderr) = run(&[
        "--kernel",
        &kernel,
        "--api-sock",
        "/nonexistent/dir/api.sock",
    ]);
    assert_eq!(status, Some(15), "{stderr}");
    assert!(stderr.contains("Cannot create control socket"), "{stderr}");
}

#[test]
fn unopenable_serial_file_exits_17() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let (status, stderr) = run(&["--kernel", &kernel, "--serial", "file:/nonexistent/dir/log"]);
    assert_eq!(status, Some(17), "{stderr}");
    assert!(
        stderr.contains("Cannot open serial output file"),
        "{stderr}"
    );
}

/// Runs the VMM in a private mount namespace where `/dev` is `setup`'s doing (needs root
/// and unshare(1)); returns None, after saying why, when that is not possible here.
fn run_with_private_dev(setup: &str, kernel: &str) -> Option<(Option<i32>, String)> {
    let probe = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "true"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        tenantvm_skip::record_skip!("needs root and unshare(1) for a private mount namespace");
        return None;
    }
    let script = format!("{setup} && exec \"$0\" --kernel \"$1\" --serial none");
    let out = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .arg(env!("CARGO_BIN_EXE_tenantvm-vmm"))
        .arg(kernel)
        .output()
        .unwrap();
    Some(status_and_stderr(&out))
}

#[test]
fn missing_dev_kvm_exits_16() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let Some((status, stderr)) = run_with_private_dev("mount -t tmpfs none /dev", &kernel) else {
        return;
    };
    assert_eq!(status, Some(16), "{stderr}");
    assert!(stderr.contains("Cannot open /dev/kvm"), "{stderr}");
}

#[test]
fn dev_kvm_that_is_not_kvm_exits_16() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = tiny_kernel(dir.path());
    let fake = write_file(dir.path(), "not-kvm", b"");
    if !std::path::Path::new("/dev/kvm").exists() {
        tenantvm_skip::skip!("no /dev/kvm to cover");
    }
    let setup = format!("mount --bind {} /dev/kvm", fake.display());
    let Some((status, stderr)) = run_with_private_dev(&setup, &kernel) else {
        return;
    };
    assert_eq!(status, Some(16), "{stderr}");
    assert!(stderr.contains("/dev/kvm"), "{stderr}");
}
