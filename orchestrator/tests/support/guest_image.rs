//! The guest image set for the tests that boot a Linux guest under a live daemon: what the
//! build needs on this host, the set itself (`TENANTVM_GUEST_IMAGE`, or built once into
//! `target/guest-image-test` and reused), copying it into a daemon's image directory, and
//! the plaintext scan of a disk image.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// The repository's root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Whether `tool` is on the PATH.
pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Why an image set cannot be had here, if it cannot: without `TENANTVM_GUEST_IMAGE` the
/// build needs `.cache/kernel` and its tools; the test daemon needs python3 either way.
pub fn image_set_missing() -> Option<String> {
    if std::env::var_os("TENANTVM_GUEST_IMAGE").is_none() {
        if !repo_root().join(".cache/kernel/vmlinuz").is_file() {
            return Some(".cache/kernel/vmlinuz is missing (run scripts/setup.sh)".into());
        }
        for tool in ["cpio", "depmod", "busybox", "cryptsetup", "mke2fs"] {
            if !have(tool) {
                return Some(format!("{tool} is not installed (run scripts/setup.sh)"));
            }
        }
    }
    if !have("python3") {
        return Some("python3 is missing (the test daemon writes the idle guest)".into());
    }
    None
}

/// The image set to boot: `TENANTVM_GUEST_IMAGE`, or target/guest-image-test (built if it
/// is not there or fails its manifest check).
pub fn image_set() -> PathBuf {
    if let Some(dir) = std::env::var_os("TENANTVM_GUEST_IMAGE") {
        return PathBuf::from(dir);
    }
    let out = repo_root().join("target/guest-image-test");
    if tenantvm_agent_protocol::ImageSet::open(&out).is_ok() {
        eprintln!("reusing the image set in {}", out.display());
        return out;
    }
    let started = Instant::now();
    let status = Command::new(repo_root().join("guest-image/build.sh"))
        .arg(&out)
        .env("SOURCE_DATE_EPOCH", "1700000000")
        .status()
        .expect("running guest-image/build.sh");
    assert!(status.success(), "guest-image/build.sh failed: {status}");
    eprintln!("image build took {:.1} s", started.elapsed().as_secs_f64());
    out
}

/// Copies the boot files and manifest of `set` to `<image_dir>/<name>`: vmlinuz for QEMU,
/// vmlinux for tenantvm-vmm.
pub fn install_image(set: &Path, image_dir: &Path, name: &str) {
    let dst = image_dir.join(name);
    std::fs::create_dir_all(&dst).unwrap();
    for f in [
        "vmlinuz",
        "vmlinux",
        "initramfs.cpio.gz",
        "cmdline",
        "manifest.json",
    ] {
        std::fs::copy(set.join(f), dst.join(f))
            .unwrap_or_else(|e| panic!("{}: {e}", set.join(f).display()));
    }
}

/// Whether `file` holds `needle` anywhere (grep reads a sparse GiB in a second; a debug
/// build's byte loop would take minutes).
pub fn file_contains(file: &Path, needle: &str) -> bool {
    let status = Command::new("grep")
        .args(["-q", "-a", "-F", "--", needle])
        .arg(file)
        .status()
        .expect("running grep");
    match status.code() {
        Some(0) => true,
        Some(1) => false,
        _ => panic!("grep failed on {}: {status}", file.display()),
    }
}
