//! Helpers of the runtime's integration tests: jails, cgroups and VMs without a daemon.
//! The part the jail crate's own tests use is theirs (orchestrator/jail/tests/common),
//! included from there so that there is one copy.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "../../jail/tests/common/mod.rs"]
mod jail;

// Not every test target uses each of them.
#[allow(unused_imports)]
pub use jail::{roomy_limits, tenant, tenant_dir, test_uid, wait_until, CleanupOnDrop};

/// Why the privileged tests cannot run here, if they cannot: the jail's reasons, or the
/// launcher not built.
pub fn skip_reason() -> Option<String> {
    if let Some(reason) = jail::skip_reason() {
        return Some(reason);
    }
    if !jail_binary().exists() {
        return Some(format!(
            "{} is not built: run cargo build -p tenantvm-jail",
            jail_binary().display()
        ));
    }
    None
}

/// The `tenantvm-jail` launcher, next to the test binary's target directory as the daemon
/// finds it. It is a binary of its own crate (orchestrator/jail), so this package's tests
/// cannot name it with `CARGO_BIN_EXE_*`; scripts/test.sh builds every binary first.
pub fn jail_binary() -> PathBuf {
    tenantvm::backend::runner::sibling_binary("tenantvm-jail").unwrap()
}

/// Why /dev/kvm cannot be used here, if it cannot (the VM tests then skip).
pub fn kvm_unusable() -> Option<String> {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .err()
        .map(|e| format!("/dev/kvm is not usable ({e})"))
}

/// The repository root (for .cache/kernel and tests/guests).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// These tests boot jailed guests that keep a core busy (QEMU TCG; tenantvm-vmm);
/// tests that take this lock run one guest at a time, so that control sockets answer and
/// exits settle within their timeouts on a two-core machine (CI saw a QMP query time out,
/// and a state query race a guest's exit, with several at once).
pub fn one_guest_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// SIGSTOPs every process of a VM's cgroup: a wedged VMM that accepts nothing and answers
/// nothing (a compromised one could do the same).
pub fn freeze(cgroup: &tenantvm::jail::CgroupHandle) {
    let members = cgroup.members().unwrap();
    assert!(!members.is_empty(), "the VM has no processes to stop");
    for pid in members {
        // SAFETY: kill(2) with a pid read from the test VM's cgroup and a valid signal.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
    }
}

/// Runs `f` on its own thread and returns its result and how long it took; panics if it
/// has not returned after `limit` (so a hang fails the test instead of stalling the run).
pub fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> (T, Duration) {
    let (tx, rx) = std::sync::mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(value) => (value, started.elapsed()),
        Err(_) => panic!("{what} did not return within {limit:?}"),
    }
}
