//! Jails and quotas: each VMM runs as its own uid/gid, in new mount and pid namespaces,
//! chrooted into a directory holding only its tenant's files, with no capabilities, under
//! a per-tenant cgroup. See docs/jail.md.
//!
//! The daemon (`tenantvm`, re-exported there as `tenantvm::jail`) builds a [`JailPlan`]
//! and starts the root-run `tenantvm-jail` binary of this crate with it
//! ([`process::spawn_launcher`]), which carries it out ([`launcher`]). This crate is kept
//! to a few small dependencies (serde, nix, libc, sha2, hex, thiserror): no async runtime,
//! HTTP, TLS, database or GPU library reaches the program that runs as root; tests/deps.rs
//! fails if one does.

pub mod blkio;
pub mod cgroup;
pub mod devices;
pub mod error_chain;
pub mod launcher;
pub mod name;
pub mod plan;
pub mod process;

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

pub use blkio::{BlockIoLimit, BlockIoOutcome};
pub use cgroup::{CgroupHandle, CgroupLayout, Cgroups, ResourceLimits};
pub use devices::DeviceAllowance;
pub use error_chain::error_chain;
pub use name::{is_valid_tenant_name, MAX_TENANT_NAME};
pub use plan::{BindMount, JailPlan, JailRlimits, Seal};
pub use process::{ExitRecord, Launched};

/// Name of the jail root directory inside a tenant directory.
pub const JAIL_ROOT_DIR: &str = "root";

/// Errors of jail and cgroup operations.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// The tenant name cannot be used in paths and cgroup names.
    #[error("Invalid tenant name {0:?}: use 1 to 63 of a-z, 0-9 and '-', starting with a letter or digit")]
    InvalidTenantName(String),
    /// The limits cannot be applied.
    #[error("Invalid resource limits: {0}")]
    InvalidLimits(String),
    /// The identity cannot be used.
    #[error("Invalid jail identity: {0}")]
    InvalidIdentity(String),
    /// The jail plan cannot be carried out as given.
    #[error("Invalid jail plan: {0}")]
    InvalidPlan(String),
    /// A step of building the jail failed (in the launcher; the message lands in vmm.log).
    #[error("Jail setup step '{step}' failed")]
    Setup {
        /// The step.
        step: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The host has no usable cgroup hierarchy.
    #[error("No usable cgroup hierarchy: {0}")]
    CgroupUnavailable(String),
    /// Writing a cgroup control file failed.
    #[error("Cannot write {value:?} to {path} (is the controller mounted and are we root?)")]
    CgroupWrite {
        /// The control file.
        path: PathBuf,
        /// The value.
        value: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Processes survived SIGKILL for too long.
    #[error("Cgroup {path} still has processes {pids:?} after SIGKILL; check for processes stuck in the kernel (D state)")]
    CgroupBusy {
        /// The cgroup directory.
        path: PathBuf,
        /// The survivors.
        pids: Vec<i32>,
    },
    /// A file or directory could not be accessed.
    #[error("Cannot access {path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Checks a tenant name with the rule ([`is_valid_tenant_name`]; names reach paths and
/// cgroups); for the `&str` names this crate receives from callers and from directory
/// listings.
pub fn validate_tenant_name(name: &str) -> Result<(), JailError> {
    if is_valid_tenant_name(name) {
        Ok(())
    } else {
        Err(JailError::InvalidTenantName(name.to_string()))
    }
}

/// Idempotent teardown of a tenant's jail: SIGKILLs every process in the tenant's cgroup,
/// removes the cgroup(s), and removes the (empty) jail root under `tenant_dir`. The jail's
/// mounts live in the VM's private mount namespace and vanish with its last process.
/// Used by destroy and by reconcile; logs are left to the caller (`tenantvm::logs`).
pub fn cleanup_tenant(cgroups: &Cgroups, tenant: &str, tenant_dir: &Path) -> Result<(), JailError> {
    let handle = cgroups.handle(tenant)?;
    handle.destroy(reap_exited)?;
    let root = tenant_dir.join(JAIL_ROOT_DIR);
    match fs::remove_dir(&root) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(source) => Err(JailError::Io { path: root, source }),
    }
}

/// Tenants that have a cgroup under the `tenantvm` parent: reconcile compares them with
/// the store and cleans up the leaked ones.
pub fn list_tenant_cgroups(cgroups: &Cgroups) -> Result<Vec<String>, JailError> {
    cgroups.list_tenants()
}

/// Reaps those of `pids` that are exited children of this process (jail launchers the
/// daemon started and then killed), without blocking, so they do not linger as zombies.
/// Pids that are not our children are left alone (waitpid answers ECHILD); other children
/// of the daemon are never touched.
pub fn reap_exited(pids: &[i32]) {
    for &pid in pids {
        let mut status = 0;
        // SAFETY: waitpid on one positive pid with a valid out-pointer to a local and WNOHANG.
        unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    }
}
