//! The API's request and response bodies, shared by the daemon and the CLI.
//! docs/api/openapi.yaml describes the same shapes; the API tests check them against it.
//!
//! These are wire types only: the store's rows are never sent as they are (`project.rs`
//! copies what the service answers into these), so the store's schema can change without
//! changing the API, and the API types do not depend on the store. The log reader's query
//! and position are the tenant layer's (`tenant::logs`), used here as they are.

use serde::{Deserialize, Serialize};

use crate::domain::lifecycle::LifecycleState;
use crate::domain::spec::TenantSpec;
// The log reader's query and position are the wire's too.
pub use crate::tenant::logs::{LogPosition, LogQuery, LogStream};

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
    pub steps: Vec<StepView>,
    /// The spec it was created with.
    pub spec: TenantSpec,
    /// The uid/gid its VMM runs as.
    pub uid: Option<u32>,
    /// Host pid of its VMM (jail launcher).
    pub pid: Option<i32>,
    /// Its GPU reservation.
    pub gpu: Option<GpuSlice>,
    /// Creation time, ms since the epoch.
    pub created_ms: i64,
    /// Last state change, ms since the epoch.
    pub updated_ms: i64,
    /// The daemon restarted and has not finished recovering this tenant yet (checking its
    /// VM, or resuming its interrupted operation): its state is the last one recorded, and
    /// commands on it are refused until recovery is done.
    #[serde(default)]
    pub recovering: bool,
    /// How the host reaches its guest agent while its VM runs: `vhost-vsock (CID 5)`,
    /// `virtio-serial` or `hybrid-vsock` (absent while no VM is recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_channel: Option<String>,
    /// The guest's vsock CID while its VM runs with vhost-vsock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_cid: Option<u32>,
    /// What runs in its guest: the agent (and so an inference engine) or a plain kernel;
    /// absent for a tenant recorded before this was stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<crate::domain::GuestKind>,
}

/// One step of a tenant's operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepView {
    /// Step name (`launch-vm`, ...).
    pub step: String,
    /// `started`, `done`, `skipped` (nothing to do for this tenant) or `failed`.
    pub status: String,
    /// Why it failed.
    pub error: Option<String>,
    /// When it started, ms since the epoch.
    pub started_ms: i64,
    /// When it ended.
    pub finished_ms: Option<i64>,
}

/// A GPU slice: a set of slots on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSlice {
    /// GPU identifier.
    pub gpu: String,
    /// The slots (MIG memory slices; all of them for a whole GPU) it occupies.
    pub slots: Vec<u32>,
    /// What it is (`whole`, `1g.10gb@0`, ...).
    pub label: String,
}

/// A lifecycle event of a tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventView {
    /// Monotonic id (pass as `offset` to read the events after it).
    pub id: i64,
    /// When, ms since the epoch.
    pub at_ms: i64,
    /// Short kind (`state`, `step`, `error`, ...).
    pub kind: String,
    /// Human-readable text.
    pub message: String,
}

/// A quarantined GPU slice: a placement whose scrub did not verify.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuarantinedSliceView {
    /// The GPU.
    pub gpu: String,
    /// Its slots.
    pub slots: Vec<u32>,
    /// The placement label (`1g.18gb@3`, `whole`).
    pub label: String,
    /// Why it is quarantined.
    pub reason: String,
    /// Since when, ms since the epoch.
    pub since_ms: i64,
}

impl QuarantinedSliceView {
    /// The slice as `tenantvm gpu scrub` names it: `<gpu>/<label>`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.gpu, self.label)
    }
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

/// A piece of a log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogChunk {
    /// Which log.
    pub stream: LogStream,
    /// Text, whole lines, control characters replaced (guest output is hostile).
    pub text: String,
    /// Pass as `generation`/`offset` to continue (follow).
    pub next: LogPosition,
    /// True when output was lost to rotation since the given cursor.
    pub skipped: bool,
    /// Events, for the `events` stream.
    pub events: Vec<EventView>,
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
    /// How the backend reaches guest agents: `vhost-vsock` (QEMU where `/dev/vhost-vsock`
    /// opens), `virtio-serial` (QEMU without it) or `hybrid-vsock` (tenantvm-vmm).
    #[serde(default)]
    pub agent_transport: String,
    /// The daemon's recovery after a restart is still going through tenants (the API
    /// answers meanwhile; tenants not yet recovered say `recovering`).
    #[serde(default)]
    pub recovering: bool,
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

/// `GET /v1/receipts` query.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiptQuery {
    /// Only this tenant's receipts (a tenant token always gets only its own).
    pub tenant: Option<String>,
}

/// `GET /v1/receipts` answer: audit log entries, oldest first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReceiptList {
    /// The entries (each holds its receipt, chain hash and signature).
    pub receipts: Vec<crate::receipt::LogEntry>,
}

/// `GET /v1/gpu/quarantine` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QuarantineList {
    /// Quarantined slices.
    pub slices: Vec<QuarantinedSliceView>,
}

/// `POST /v1/gpu/quarantine/scrub` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScrubRequest {
    /// The slice, `<gpu>/<label>` (as `GET /v1/gpu/quarantine` names it).
    pub slice: String,
}
