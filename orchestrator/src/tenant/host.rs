//! The host-side seam the tenant service needs besides the VM backend and the GPU wing
//! ([`crate::gpu`]): cleaning up a tenant's jail and cgroups.

use std::path::{Path, PathBuf};

use crate::jail::{self, BlockIoLimit, BlockIoOutcome, Cgroups, JailError};

/// Tears down what the jail left on the host. Implemented for the real [`Cgroups`].
pub trait JailCleaner: Send + Sync {
    /// Kills every process in the tenant's cgroup and removes the cgroup and jail root.
    /// Idempotent.
    fn cleanup(&self, tenant: &str, tenant_dir: &Path) -> Result<(), JailError>;
    /// Tenants that have a cgroup on the host.
    fn list(&self) -> Result<Vec<String>, JailError>;
    /// Before the VM starts: limits the tenant cgroup's block I/O on the devices holding
    /// `disks` to `limit` (beside the VMM's own throttling).
    fn limit_block_io(
        &self,
        tenant: &str,
        disks: &[PathBuf],
        limit: BlockIoLimit,
    ) -> Result<Vec<BlockIoOutcome>, JailError>;
}

impl JailCleaner for Cgroups {
    fn cleanup(&self, tenant: &str, tenant_dir: &Path) -> Result<(), JailError> {
        jail::cleanup_tenant(self, tenant, tenant_dir)
    }

    fn limit_block_io(
        &self,
        tenant: &str,
        disks: &[PathBuf],
        limit: BlockIoLimit,
    ) -> Result<Vec<BlockIoOutcome>, JailError> {
        Cgroups::limit_block_io(self, tenant, disks, limit)
    }

    fn list(&self) -> Result<Vec<String>, JailError> {
        jail::list_tenant_cgroups(self)
    }
}
