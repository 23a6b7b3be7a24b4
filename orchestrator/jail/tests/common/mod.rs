//! Helpers of the jail's integration tests, shared with the orchestrator's runtime tests
//! (orchestrator/tests/support/runtime.rs includes this file: one copy).
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tenantvm_jail::{Cgroups, ResourceLimits};

/// Why the privileged tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (namespaces, cgroups, chroot)".into());
    }
    if let Err(e) = Cgroups::detect() {
        return Some(e.to_string());
    }
    None
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
            if let Err(e) = tenantvm_jail::cleanup_tenant(&cgroups, &self.tenant, &self.dir) {
                eprintln!("cleanup of {} failed: {e}", self.tenant);
            }
        }
    }
}
