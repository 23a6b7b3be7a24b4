//! Shared fixtures for the image tests: locating tools, building the image set, and a
//! QEMU guest that is killed when dropped.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tenantvm_agent_protocol::{ImageSet, VIRTIO_SERIAL_PORT_NAME};
use tenantvm_vmm_api::{BlockConfig, QemuAccel, QemuCommand, SerialPort};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Whether `tool` is on PATH.
pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The reason the image cannot be built here, if any.
pub fn image_build_blocker() -> Option<String> {
    let kernel = repo_root().join(".cache/kernel/vmlinuz");
    if !kernel.exists() {
        return Some(format!(
            "{} is missing (run scripts/setup.sh)",
            kernel.display()
        ));
    }
    for tool in [
        "cpio",
        "depmod",
        "busybox",
        "cryptsetup",
        "mke2fs",
        "python3",
    ] {
        if !have(tool) {
            return Some(format!("{tool} is not installed (run scripts/setup.sh)"));
        }
    }
    None
}

/// Runs guest-image/build.sh into `out` with a fixed SOURCE_DATE_EPOCH; returns the
/// wall-clock time it took.
pub fn build_image(out: &Path, epoch: &str) -> Duration {
    let start = Instant::now();
    let status = Command::new(repo_root().join("guest-image/build.sh"))
        .arg(out)
        .env("SOURCE_DATE_EPOCH", epoch)
        .status()
        .expect("running guest-image/build.sh");
    assert!(status.success(), "guest-image/build.sh failed: {status}");
    start.elapsed()
}

/// The image set the end-to-end tests boot: `TENANTVM_GUEST_IMAGE` if set, else built
/// into target/guest-image-test.
pub fn image_set() -> PathBuf {
    if let Some(dir) = std::env::var_os("TENANTVM_GUEST_IMAGE") {
        return PathBuf::from(dir);
    }
    let out = repo_root().join("target/guest-image-test");
    let took = build_image(&out, "1700000000");
    eprintln!("image build took {:.1} s", took.as_secs_f64());
    out
}

/// A QEMU process, killed on drop.
pub struct Qemu {
    /// The process.
    pub child: Child,
}

impl Qemu {
    /// Waits up to `timeout` for QEMU to exit; returns its success.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<bool> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status.success());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    }
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Boots the image set under TCG with the agent's virtio-serial port on `sock` and
/// `disk` as the first virtio-blk device; the serial console goes to `console`.
pub fn boot_tcg(image: &Path, disk: &Path, sock: &Path, console: &Path) -> Qemu {
    boot(image, disk, sock, console, false)
}

/// [`boot_tcg`], or under KVM with the host CPU model when `kvm` is set. The image set is
/// verified against its manifest first.
pub fn boot(image: &Path, disk: &Path, sock: &Path, console: &Path, kvm: bool) -> Qemu {
    let set = ImageSet::open(image).unwrap_or_else(|e| panic!("{e}"));
    let (accel, memory_mib, vcpus) = if kvm {
        (QemuAccel::Kvm, 1024, 2)
    } else {
        (QemuAccel::Tcg, 512, 1)
    };
    // The same command line the orchestrator's QEMU backend runs, with host paths.
    let args = QemuCommand {
        name: "agent-e2e".into(),
        accel,
        vcpus,
        memory_mib,
        kernel: set.dir.join("vmlinuz"),
        initramfs: Some(set.dir.join("initramfs.cpio.gz")),
        cmdline: set.cmdline.clone(),
        serial_log: console.to_path_buf(),
        agent_port: Some(SerialPort {
            socket: sock.to_path_buf(),
            name: VIRTIO_SERIAL_PORT_NAME.into(),
        }),
        qmp_socket: None,
        vhost_vsock: None,
        hugepages: None,
        disks: vec![BlockConfig {
            path: disk.to_path_buf(),
            read_only: false,
            id: None,
            rate_limit: None,
        }],
    }
    .args();
    let child = Command::new("qemu-system-x86_64")
        .args(args)
        .stdin(Stdio::null())
        .spawn()
        .expect("starting qemu-system-x86_64");
    Qemu { child }
}
