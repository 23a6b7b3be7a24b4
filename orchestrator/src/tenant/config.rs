//! The settings of the tenant layer: where tenants live, which uids they get, how long each
//! wait on a VM or a guest may take, what the host gives tenants.

use std::path::PathBuf;
use std::time::Duration;

use crate::domain::TenantName;
use crate::tenant::admission::{HostCapacity, DEFAULT_HOST_RESERVED_MIB};
use crate::tenant::departure::DepartureConfig;

/// Settings of the service.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// The daemon's state directory; tenants live in `<state_dir>/tenants/<name>`.
    pub state_dir: PathBuf,
    /// Named images: `<image_dir>/<name>/kernel` (+ `initramfs`, `cmdline`).
    pub image_dir: Option<PathBuf>,
    /// First uid handed to tenants.
    pub uid_first: u32,
    /// How many uids from `uid_first`.
    pub uid_count: u32,
    /// How long `stop` waits for a clean guest shutdown before killing.
    pub stop_grace: Duration,
    /// How long the VMM gets to stop on its own during a destroy before it is killed.
    pub destroy_grace: Duration,
    /// How long `await-running` waits for the VM to report running.
    pub boot_timeout: Duration,
    /// Memory added to guest memory for the VMM itself, in MiB.
    pub vmm_overhead_mib: u64,
    /// Disk keys, keyslot cost, receipts.
    pub departure: DepartureConfig,
    /// How long a guest-image tenant's agent, and then its payload, may take to answer.
    pub agent_timeout: Duration,
    /// What the host gives tenants; creates beyond it are refused.
    pub capacity: HostCapacity,
}

impl ServiceConfig {
    /// Defaults under `state_dir`.
    pub fn new(state_dir: PathBuf) -> ServiceConfig {
        ServiceConfig {
            image_dir: None,
            uid_first: 200_000,
            uid_count: 65_536,
            stop_grace: Duration::from_secs(5),
            destroy_grace: Duration::from_millis(500),
            boot_timeout: Duration::from_secs(30),
            vmm_overhead_mib: 64,
            departure: DepartureConfig::under(&state_dir),
            agent_timeout: Duration::from_secs(300),
            capacity: HostCapacity::detect(DEFAULT_HOST_RESERVED_MIB).unwrap_or_else(|e| {
                // Nothing is admitted on a host whose size cannot be read.
                tracing::error!(error = %e, "cannot read this host's memory size");
                HostCapacity::fixed(0, 0)
            }),
            state_dir,
        }
    }

    /// Where tenant directories live.
    pub fn tenants_dir(&self) -> PathBuf {
        self.state_dir.join("tenants")
    }

    /// A tenant's directory. Takes a [`TenantName`] (or a `&str` a caller checked with its
    /// rule), so nothing outside the tenants directory can be named.
    pub fn tenant_dir(&self, name: &str) -> PathBuf {
        debug_assert!(TenantName::check(name).is_ok(), "{name:?}");
        self.tenants_dir().join(name)
    }
}
