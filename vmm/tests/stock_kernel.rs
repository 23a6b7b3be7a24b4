//! Boots the stock Debian kernel (.cache/kernel/vmlinux, fetched by scripts/setup.sh) up to
//! its first serial lines, through both ELF entry points. Under the nested hypervisor here
//! the first line takes about 17 s on an idle machine (35 s on a busy one); each boot waits
//! up to 90 s and is then killed. The two boots run one at a time, so as not to compete
//! for the CPU.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(90);

/// Serialises the boots of this file.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
const FIRST_LINE: &str = "Linux version";

fn stock_vmlinux(test: &str) -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/kernel/vmlinux");
    if !path.exists() {
        let id = format!("{}::{test}", env!("CARGO_CRATE_NAME"));
        tenantvm_skip::record(
            &id,
            format!("{} is missing (run scripts/setup.sh)", path.display()),
        );
        return None;
    }
    common::kvm_available(test).then_some(path)
}

/// Boots `kernel` with `--boot boot` and returns the serial output once it shows
/// [`FIRST_LINE`], or everything seen when the timeout passed.
fn boot_to_first_line(kernel: &Path, boot: &str) -> (bool, String) {
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serial.log");
    let mut child = common::vmm()
        .args([
            "--kernel",
            kernel.to_str().unwrap(),
            "--memory-mib",
            "512",
            "--boot",
            boot,
        ])
        .args(["--cmdline", "console=ttyS0 earlyprintk=serial"])
        .arg(format!("--serial=file:{}", log.display()))
        .stdin(Stdio::null())
        .spawn()
        .expect("start tenantvm-vmm");
    let start = Instant::now();
    let mut seen = String::new();
    let found = loop {
        if let Ok(mut f) = std::fs::File::open(&log) {
            seen.clear();
            let mut bytes = Vec::new();
            let _ = f.read_to_end(&mut bytes);
            seen = String::from_utf8_lossy(&bytes).into_owned();
        }
        if seen.contains(FIRST_LINE) {
            break true;
        }
        if start.elapsed() > TIMEOUT {
            break false;
        }
        if let Ok(Some(status)) = child.try_wait() {
            seen.push_str(&format!("\n[VMM exited early: {status}]"));
            break seen.contains(FIRST_LINE);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = child.kill();
    let _ = child.wait();
    (found, seen)
}

#[test]
fn stock_vmlinux_prints_linux_version_through_pvh_entry() {
    let Some(kernel) = stock_vmlinux("stock_vmlinux_prints_linux_version_through_pvh_entry") else {
        return;
    };
    let (found, seen) = boot_to_first_line(&kernel, "pvh");
    assert!(
        found,
        "no {FIRST_LINE:?} within {TIMEOUT:?}; serial output:\n{seen}"
    );
}

#[test]
fn stock_vmlinux_prints_linux_version_through_64bit_entry() {
    let Some(kernel) = stock_vmlinux("stock_vmlinux_prints_linux_version_through_64bit_entry")
    else {
        return;
    };
    let (found, seen) = boot_to_first_line(&kernel, "linux");
    assert!(
        found,
        "no {FIRST_LINE:?} within {TIMEOUT:?}; serial output:\n{seen}"
    );
}
