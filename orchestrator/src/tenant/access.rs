//! Who may touch which tenant, and in which state: the one preamble that every tenant
//! route runs, the API's and the front door's, so that the rule has one home.
//!
//! - **Seeing** a tenant ([`Need::See`]): the caller is the admin or the tenant itself.
//!   Anyone else is told there is no such tenant ([`TenantServiceError::NotFound`]),
//!   whether or not it exists, so a tenant token cannot probe for other tenants' names.
//! - **Acting** on it ([`Need::Act`]): seeing it, and the tenant is not being recovered
//!   after a daemon restart ([`TenantServiceError::Recovering`]): while recovery checks
//!   its VM and resumes its operation, only reads answer. Lifecycle commands (stop, start,
//!   destroy) also take the tenant's busy guard (`TenantService::mark_busy`), which
//!   refuses a second operation and a recovering tenant alike.
//! - **Using its guest** ([`TenantService::serving`]): acting on it, and it runs a guest
//!   image with an agent ([`TenantServiceError::NoAgent`]) and is running
//!   ([`TenantServiceError::NotServing`]).
//!
//! The front door authenticates with a tenant's inference key, so it sees only that
//! tenant; it still asks [`TenantService::admit_front_door`], which holds the recovery
//! guard and the tenant's admission gate.

use tenantvm_agent_protocol::{AgentClient, AgentClientError};

use crate::auth::Caller;
use crate::domain::lifecycle::LifecycleState;
use crate::domain::TenantName;
use crate::gpu::AssignedGpu;
use crate::store::TenantRecord;
use crate::tenant::context::Tenant;
use crate::tenant::infer::{AdmittedInfer, InferError};
use crate::tenant::service::TenantService;
use crate::tenant::service_error::TenantServiceError;
use crate::tenant::steps::guest;

/// What a route needs of the tenant it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// To read it (its status, log, keys): the caller may see it.
    See,
    /// To change it or reach its guest: the caller may see it and it is not being
    /// recovered.
    Act,
}

/// A running tenant whose guest has an agent, ready for a call to it.
#[derive(Debug)]
pub struct ServingTenant {
    /// The tenant's facts (its VM among them).
    pub tenant: Tenant,
    /// Whether its agent gives each request a stream of its own (vsock, or a multiplexed
    /// virtio-serial port): a model push needs one.
    pub streams_per_request: bool,
}

impl TenantService {
    /// The live tenant `name` if `caller` may use it for `need`; otherwise why not.
    pub fn tenant_for(
        &self,
        caller: &Caller,
        name: &str,
        need: Need,
    ) -> Result<TenantRecord, TenantServiceError> {
        let not_found = || TenantServiceError::NotFound(name.to_string());
        if TenantName::check(name).is_err() {
            return Err(not_found());
        }
        let record = match self.store().tenant(name)? {
            Some(t) if caller.may_see(t.id) => t,
            _ => return Err(not_found()),
        };
        if need == Need::Act && self.is_recovering(name) {
            return Err(TenantServiceError::Recovering(name.to_string()));
        }
        Ok(record)
    }

    /// The live tenant `name` if `caller` may see it ([`Need::See`]).
    pub fn tenant_to_see(
        &self,
        caller: &Caller,
        name: &str,
    ) -> Result<TenantRecord, TenantServiceError> {
        self.tenant_for(caller, name, Need::See)
    }

    /// The live tenant `name` if `caller` may act on it ([`Need::Act`]).
    pub fn tenant_to_act(
        &self,
        caller: &Caller,
        name: &str,
    ) -> Result<TenantRecord, TenantServiceError> {
        self.tenant_for(caller, name, Need::Act)
    }

    /// The running tenant `name`, with an agent, if `caller` may act on it; `without_agent`
    /// says what the caller cannot have when the tenant runs no guest image with an agent
    /// (for example "it has no models").
    pub fn serving(
        &self,
        caller: &Caller,
        name: &str,
        without_agent: &'static str,
    ) -> Result<ServingTenant, TenantServiceError> {
        let record = self.tenant_for(caller, name, Need::Act)?;
        let ctx = self.ctx();
        let tenant = Tenant::load(&ctx, &record)
            .map_err(|e| TenantServiceError::AgentUnavailable(e.to_string()))?;
        if !tenant.has_agent() {
            return Err(TenantServiceError::NoAgent {
                name: name.to_string(),
                without: without_agent,
            });
        }
        let Some(vm) = tenant
            .vm
            .as_ref()
            .filter(|_| record.state == LifecycleState::Running)
        else {
            return Err(TenantServiceError::NotServing(name.to_string()));
        };
        let streams_per_request =
            guest::streams_per_request(ctx.backend, vm, guest::CONNECT_TIMEOUT);
        Ok(ServingTenant {
            tenant,
            streams_per_request,
        })
    }

    /// A connection to the guest agent of a tenant that [`TenantService::serving`] gave.
    pub fn agent(&self, serving: &ServingTenant) -> Result<AgentClient, AgentClientError> {
        let vm = serving.tenant.vm.as_ref().ok_or_else(|| {
            AgentClientError::Io(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "the tenant has no VM",
            ))
        })?;
        guest::connect(self.ctx().backend, vm, guest::CONNECT_TIMEOUT)
    }

    /// Records an event in the tenant's log about what a caller did to its guest (a model
    /// stored, the payload restarted). An event that cannot be written is dropped: the
    /// guest's change has happened either way.
    pub fn record_event(&self, serving: &ServingTenant, kind: &str, message: &str) {
        if let Err(e) = self
            .store()
            .add_event(Some(serving.tenant.id), kind, message)
        {
            tracing::warn!(tenant = %serving.tenant.name, error = %e, "event not recorded");
        }
    }

    /// What the host assigned to the tenant's guest as its GPU, if anything.
    pub fn assigned_gpu(
        &self,
        serving: &ServingTenant,
    ) -> Result<Option<AssignedGpu>, TenantServiceError> {
        Ok(crate::tenant::steps::device::assigned(
            &self.ctx(),
            &serving.tenant,
        )?)
    }

    /// Admits a front-door request of the tenant `record` (already authenticated by one
    /// of its inference keys): refused while the tenant is being recovered, then held to
    /// its request rate and concurrency.
    pub fn admit_front_door(&self, record: TenantRecord) -> Result<AdmittedInfer, InferError> {
        if self.is_recovering(record.name.as_str()) {
            return Err(InferError::Recovering(record.name.to_string()));
        }
        crate::tenant::infer::admit(&self.ctx(), record)
    }
}
