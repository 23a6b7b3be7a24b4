//! What the service answers about a tenant, in its own values (store rows and the facts
//! read beside them); the API projects them into its wire types (`api/project.rs`).

use crate::store::{GpuPlacement, StepRecord, TenantRecord};

/// One tenant as a caller may see it.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantStatus {
    /// Its row.
    pub record: TenantRecord,
    /// The steps of its current or last operation.
    pub steps: Vec<StepRecord>,
    /// Its uid, once allocated.
    pub uid: Option<u32>,
    /// Its VMM's pid, while one is recorded.
    pub pid: Option<i32>,
    /// The GPU share it holds.
    pub gpu: Option<GpuPlacement>,
    /// Whether the recovery after a daemon restart has not reached it yet.
    pub recovering: bool,
    /// How its guest agent is reached (`vhost-vsock (CID n)`, `virtio-serial`, ...).
    pub agent_channel: Option<String>,
    /// Its guest's vsock CID, if it has one.
    pub vsock_cid: Option<u32>,
}

/// A tenant just created, and its token (shown this once).
#[derive(Debug, Clone, PartialEq)]
pub struct Created {
    /// The tenant.
    pub tenant: TenantStatus,
    /// Its API token.
    pub token: String,
}
