//! Helpers shared by the runtime's integration tests (each test target includes this file).
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tenantvm::backend::ResourceLimits;
use tenantvm::jail::Cgroups;

/// Why the privileged tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (namespaces, cgroups, chroot)".into());
    }
    if let Err(e) = Cgroups::detect() {
        return Some(e.to_string());
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

/// Skips the calling test (printing why) when privileged tests cannot run here.
#[macro_export]
macro_rules! require_root {
    () => {
        if let Some(reason) = common::skip_reason() {
            tenantvm_skip::skip!("{reason}");
        }
    };
}

/// A unique tenant name for this test process and `tag` (the host is shared with other
/// test runs, so names must not collide).
pub fn tenant(tag: &str) -> String {
    format!("rt-{tag}-{}", std::process::id())
}

/// A uid/gid for tests, away from real users, unique per test process and `slot`.
pub fn test_uid(slot: u32) -> u32 {
    200_000 + (std::process::id() % 50_000) * 8 + slot
}

/// A fresh tenant directory (0700) under a tempdir.
pub fn tenant_dir(tmp: &tempfile::TempDir, tenant: &str) -> PathBuf {
    let dir = tmp.path().join(tenant);
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

/// Generous limits for tests that do not probe them.
pub fn roomy_limits() -> ResourceLimits {
    ResourceLimits {
        memory_bytes: 512 << 20,
        cpu_quota_us: 100_000,
        cpu_period_us: 100_000,
        pids_max: 64,
    }
}

/// Polls `f` every 20 ms until it returns Some, or panics after `timeout`.
pub fn wait_until<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The repository root (for .cache/kernel and tests/guests).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Removes a tenant's cgroup and jail root when dropped, so a failing test leaves nothing
/// behind on the shared host (cleanup is idempotent; tests may also clean up explicitly).
pub struct CleanupOnDrop {
    tenant: String,
    dir: PathBuf,
}

impl CleanupOnDrop {
    /// Guards `tenant` with directory `dir`.
    pub fn new(tenant: &str, dir: &Path) -> Self {
        Self {
            tenant: tenant.to_string(),
            dir: dir.to_path_buf(),
        }
    }
}

impl Drop for CleanupOnDrop {
    fn drop(&mut self) {
        if let Ok(cgroups) = Cgroups::detect() {
            if let Err(e) = tenantvm::jail::cleanup_tenant(&cgroups, &self.tenant, &self.dir) {
                eprintln!("cleanup of {} failed: {e}", self.tenant);
            }
        }
    }
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
