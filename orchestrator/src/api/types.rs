//! The API's request and response bodies, shared by the daemon and the CLI.
//! docs/api/openapi.yaml describes the same shapes; the API tests check them against it.

use serde::{Deserialize, Serialize};

use crate::store::{EventRecord, GpuPlacement, StepRecord};
use crate::tenant::lifecycle::LifecycleState;
use crate::tenant::spec::TenantSpec;

/// A tenant as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantView {
    /// Tenant name.
    pub name: String,
    /// Lifecycle state.
    pub state: LifecycleState,
    /// Operation in progress or last run (`create`, `start`, `stop`, `destroy`).
    pub op: Option<String>,
    /// Why the tenant failed, if it did.
    pub error: Option<String>,
    /// The steps of that operation so far.
    pub steps: Vec<StepRecord>,
    /// The spec it was created with.
    pub spec: TenantSpec,
    /// The uid/gid its VMM runs as.
    pub uid: Option<u32>,
    /// Host pid of its VMM (jail launcher).
    pub pid: Option<i32>,
    /// Its GPU reservation.
    pub gpu: Option<GpuPlacement>,
    /// Creation time, ms since the epoch.
    pub created_ms: i64,
    /// Last state change, ms since the epoch.
    pub updated_ms: i64,
}

/// `GET /v1/tenants`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantList {
    /// Tenants visible to the caller, oldest first.
    pub tenants: Vec<TenantView>,
}

/// `POST /v1/tenants` (202).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateResponse {
    /// The tenant, now provisioning.
    pub tenant: TenantView,
    /// The tenant's token. Shown once: only its SHA-256 is stored.
    pub token: String,
}

/// Which log a `GET /v1/tenants/{name}/logs` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogStream {
    /// The guest's serial console.
    #[default]
    Serial,
    /// The VMM's own log.
    Vmm,
    /// Lifecycle events from the store.
    Events,
}

/// Query of `GET /v1/tenants/{name}/logs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct LogQuery {
    /// Which log.
    #[serde(default)]
    pub stream: LogStream,
    /// Byte offset (serial, vmm) or event id (events) to read after; absent = the tail.
    pub offset: Option<u64>,
    /// Most bytes (or events) to return; capped at 1 MiB.
    pub limit: Option<u64>,
}

/// A piece of a log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogChunk {
    /// Which log.
    pub stream: LogStream,
    /// Where this chunk starts.
    pub offset: u64,
    /// Pass as `offset` to continue (follow).
    pub next_offset: u64,
    /// The text (guest output decoded as UTF-8, invalid bytes replaced). Guest-controlled:
    /// clients must not pass it raw to a terminal.
    pub data: String,
    /// Events, for the `events` stream.
    pub events: Vec<EventRecord>,
}

/// `GET /v1/health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Health {
    /// Always `ok`.
    pub status: String,
    /// Daemon version.
    pub version: String,
    /// Backend in use.
    pub backend: String,
}

/// Every error response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorDetail {
    /// Stable machine-readable code (`invalid_spec`, `not_found`, ...).
    pub code: String,
    /// What happened and what to do.
    pub message: String,
}
