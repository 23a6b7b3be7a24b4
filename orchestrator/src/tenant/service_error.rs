//! Why a tenant command failed ([`TenantServiceError`]), and how the errors of the parts
//! the service calls (inference admission, log reads) become one.

use thiserror::Error;

use crate::domain::lifecycle::LifecycleError;
use crate::domain::spec::TenantSpecError;
use crate::gpu::GpuError;
use crate::store::StoreError;
use crate::tenant::context::StepError;
use crate::tenant::departure::DepartureError;
use crate::tenant::infer::InferError;

/// Why a command failed.
#[derive(Debug, Error)]
pub enum TenantServiceError {
    /// The spec was refused.
    #[error(transparent)]
    Spec(#[from] TenantSpecError),
    /// The store failed or refused (duplicate name, ...).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// No such tenant, or not one the caller may see (the two are indistinguishable).
    #[error("No tenant named {0:?} (check `tenantvm list`)")]
    NotFound(String),
    /// Only the admin token may do this.
    #[error("Only the admin token may {0}")]
    AdminOnly(&'static str),
    /// Another operation on this tenant is in progress.
    #[error("Tenant {0:?} is busy with another operation; wait for it (`tenantvm status {0}`) and retry")]
    Busy(String),
    /// The daemon has restarted and not yet checked this tenant (or resumed its operation).
    #[error("Tenant {0:?} is being recovered after a daemon restart; wait until `tenantvm status {0}` no longer says recovering, and retry")]
    Recovering(String),
    /// The state machine refused the command.
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
    /// The guest image cannot be found.
    #[error("Guest image: {0}")]
    Image(String),
    /// A step failed.
    #[error("Step {step} failed: {message}")]
    Step {
        /// The step.
        step: &'static str,
        /// Why.
        message: String,
    },
    /// The GPU planner refused.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// Reading a log failed.
    #[error("Cannot read the log: {0}")]
    Log(String),
    /// A request parameter is out of range.
    #[error("Bad request: {0}")]
    BadRequest(String),
    /// A request body is larger than the tenant's `quotas.max_request_bytes`.
    #[error("The request is {bytes} bytes; the tenant's quotas.max_request_bytes is {limit}: send a smaller one, or raise the quota")]
    TooLarge {
        /// The body's size.
        bytes: usize,
        /// The tenant's limit.
        limit: u32,
    },
    /// A re-scrub of a quarantined GPU slice was refused or could not run.
    #[error(transparent)]
    Rescrub(#[from] crate::tenant::departure::RescrubError),
    /// The tenant is not running, so its guest cannot serve requests.
    #[error("Tenant {0:?} is not running; start it (`tenantvm start {0}`) and retry")]
    NotServing(String),
    /// The departure machinery (disk keys, receipts) could not be loaded.
    #[error(transparent)]
    Departure(#[from] DepartureError),
    /// The tenant is over its request rate or concurrency quota.
    #[error(transparent)]
    QuotaExceeded(#[from] crate::tenant::admission::Refused),
    /// The host cannot hold the tenant (memory or vCPUs, after the other tenants).
    #[error(transparent)]
    Capacity(#[from] crate::tenant::admission::CapacityError),
    /// The guest agent or its payload could not answer.
    #[error("The tenant's guest could not answer: {0}")]
    AgentUnavailable(String),
    /// The tenant is being destroyed: it gets no new inference keys.
    #[error("Tenant {0:?} is being destroyed; it gets no new keys")]
    Departing(String),
    /// The tenant has no live inference key by that id.
    #[error("Tenant {name:?} has no live key {id}; see `tenantvm key list {name}`")]
    NoSuchKey {
        /// The tenant.
        name: String,
        /// The id asked for.
        id: i64,
    },
    /// The tenant runs no guest image with an agent, so what needs one cannot be had.
    #[error("Tenant {name:?} runs no guest image with an inference server: {without}")]
    NoAgent {
        /// The tenant.
        name: String,
        /// What the caller cannot have (for example "it has no models").
        without: &'static str,
    },
    /// A step's error outside an operation (a VM check, reconciliation).
    #[error("{0}")]
    Host(#[from] StepError),
    /// Reading the audit log failed.
    #[error(transparent)]
    Receipt(#[from] crate::receipt::ReceiptError),
}

impl From<InferError> for TenantServiceError {
    fn from(e: InferError) -> Self {
        match e {
            InferError::Quota(r) => TenantServiceError::QuotaExceeded(r),
            InferError::BadRequest(m) => TenantServiceError::BadRequest(m),
            InferError::TooLarge { bytes, limit } => TenantServiceError::TooLarge { bytes, limit },
            InferError::NotServing(n) => TenantServiceError::NotServing(n),
            InferError::Unavailable(m) => TenantServiceError::AgentUnavailable(m),
            InferError::Store(e) => TenantServiceError::Store(e),
            InferError::Recovering(n) => TenantServiceError::Recovering(n),
        }
    }
}

impl From<crate::tenant::logs::LogReadError> for TenantServiceError {
    fn from(e: crate::tenant::logs::LogReadError) -> Self {
        use crate::tenant::logs::LogReadError as E;
        match e {
            E::BadRequest(m) => TenantServiceError::BadRequest(m),
            E::Log(m) => TenantServiceError::Log(m),
            E::Store(e) => TenantServiceError::Store(e),
        }
    }
}
