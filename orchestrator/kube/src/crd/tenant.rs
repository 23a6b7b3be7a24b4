//! The `Tenant` resource: one tenant of tenantvm, in its client's namespace.
//!
//! The spec is the tenant TOML's fields (docs/orchestrator.md, "Tenant spec") under the same
//! names and with the host's own types for the nested tables (`gpu` is the planner's
//! request, `image` and `quotas` the daemon's), plus the isolation `tier` and `stopped`. The
//! name is the tenant's name; the host knows it as `<name>-<8 hex of its uid>`
//! ([`crate::naming`]), so two namespaces may both have an `alice`.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tenantvm::domain::spec::{GpuRequest, GuestImage, Quotas};

use super::condition::Condition;
use super::schema;

/// How far a tenant is kept apart from others.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// A hardware partition of a card (a MIG-backed vGPU), or no GPU: shares the host and
    /// the card with other tenants.
    #[default]
    Slice,
    /// A whole GPU: shares the host, never the card.
    Card,
    /// A host of its own: no other tenant is placed on its host while it is there (the
    /// reference architecture's "separate machines").
    Host,
}

impl Tier {
    /// The tier's name as written in a spec.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Slice => "slice",
            Tier::Card => "card",
            Tier::Host => "host",
        }
    }
}

/// A tenant, as its client asks for it.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "tenantvm.dev",
    version = "v1alpha1",
    kind = "Tenant",
    plural = "tenants",
    shortname = "tvt",
    namespaced,
    status = "TenantStatus",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".status.node"}"#,
    printcolumn = r#"{"name":"GPU","type":"string","jsonPath":".status.gpu_summary"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct TenantSpec {
    /// Isolation tier: `slice` (a MIG-backed vGPU, or no GPU), `card` (a whole GPU) or
    /// `host` (no other tenant on its host).
    #[serde(default)]
    pub tier: Tier,
    /// Number of vCPUs.
    #[serde(default = "default_vcpus")]
    #[schemars(range(min = 1, max = 64))]
    pub vcpus: u32,
    /// Guest memory in MiB.
    #[serde(default = "default_memory_mib")]
    #[schemars(range(min = 16, max = 1048576))]
    pub memory_mib: u32,
    /// Size of the tenant's encrypted disk in GiB; 0 means no disk.
    #[serde(default)]
    #[schemars(range(max = 16384))]
    pub disk_gib: u32,
    /// The GPU share: the planner's request (`model` or `custom` sized with `dtype`,
    /// `kv_dtype`, `context`, `concurrency`, `overhead_gib`; or `profile`; or `whole_gpu`).
    /// Empty or absent: no GPU.
    #[serde(default, skip_serializing_if = "is_no_gpu")]
    #[schemars(schema_with = "schema::gpu_request")]
    pub gpu: GpuRequest,
    /// What the guest boots: a named image of the host's image directory, or host paths.
    #[schemars(schema_with = "schema::guest_image")]
    pub image: GuestImage,
    /// Per-tenant limits enforced by the front door and the VMM.
    #[serde(default)]
    #[schemars(schema_with = "schema::quotas")]
    pub quotas: Quotas,
    /// Huge pages for the guest's RAM: `2M`, `1G` or `off`; absent: the daemon decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["2M", "1G", "off"]))]
    pub hugepages: Option<String>,
    /// Keep the tenant stopped (its VM off, its disk and GPU share kept); false starts it
    /// again.
    #[serde(default)]
    pub stopped: bool,
}

fn is_no_gpu(gpu: &GpuRequest) -> bool {
    !gpu.wants_gpu()
}

fn default_vcpus() -> u32 {
    1
}

fn default_memory_mib() -> u32 {
    128
}

/// Where a tenant stands, as `kubectl get tenants` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Phase {
    /// Not placed yet: waiting for room, or refused (the `Placed` condition says why).
    Pending,
    /// Bound to a node; its node agent has not created it yet.
    Scheduled,
    /// Being created (or started) on its node.
    Provisioning,
    /// Its VM runs.
    Running,
    /// Being stopped.
    Stopping,
    /// Stopped on its node (`spec.stopped`).
    Stopped,
    /// Leaving: the departure runs on its node.
    Departing,
    /// An operation failed on its node (the `Ready` condition says why).
    Failed,
    /// Its node's lease expired: the node agent is gone; the tenant is not moved.
    NodeLost,
}

impl Phase {
    /// The phase's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "Pending",
            Phase::Scheduled => "Scheduled",
            Phase::Provisioning => "Provisioning",
            Phase::Running => "Running",
            Phase::Stopping => "Stopping",
            Phase::Stopped => "Stopped",
            Phase::Departing => "Departing",
            Phase::Failed => "Failed",
            Phase::NodeLost => "NodeLost",
        }
    }
}

/// What the departure's receipt says, copied before the finalizer goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ReceiptStatus {
    /// SHA-256 (hex) of the receipt's line in the host's signed audit log.
    pub digest: String,
    /// The departure's id.
    pub departure_id: String,
    /// When the last step ended (RFC 3339).
    pub finished_at: String,
    /// The steps and their results, in one line.
    pub summary: String,
    /// The signing key (hex) the receipt was checked against.
    pub key_id: String,
}

/// What the operator and the node agent report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TenantStatus {
    /// Where it stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// The node it is bound to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Its name on the host (`tenantvm list` there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_name: Option<String>,
    /// Its GPU share in one line (`<GPU> <profile>@<start>` or `<GPU> whole`); the
    /// operator's plan until the host reserved it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_summary: Option<String>,
    /// The share the host reserved (`<profile>@<start>` or `whole`) on `gpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuAssignment>,
    /// The front door clients reach it at, with the inference key of the tenant's Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The Secret (in the tenant's namespace) holding its API token and inference key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// Conditions: `Placed`, `Ready`, `TenantvmdReachable`, `NodeLost`, `Departed`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The departure's receipt, once verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt: Option<ReceiptStatus>,
}

/// A GPU share on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GpuAssignment {
    /// The GPU: its PCI address on the node.
    pub gpu: String,
    /// `<profile>@<start>` or `whole`.
    pub label: String,
    /// Reserved by the host (true), or only planned by the operator (false).
    pub reserved: bool,
}

impl GpuAssignment {
    /// `<GPU> <label>`.
    pub fn summary(&self) -> String {
        format!("{} {}", self.gpu, self.label)
    }
}
