//! Inference requests: `POST /v1/tenants/{name}/infer` forwarded through the tenant's
//! admission gate to its guest agent, which hands it to the payload's
//! `POST /v1/completions`. The body is never logged: it is the tenant's data. The answer is
//! returned only if it is a JSON object.

use std::time::{Duration, Instant};

use tenantvm_agent_protocol::{AgentClientError, HttpRequest};
use thiserror::Error;

use crate::domain::lifecycle::LifecycleState;
use crate::store::{StoreError, TenantRecord};
use crate::tenant::admission::{Admission, Permit, Refused};
use crate::tenant::context::{StepCtx, StepError, Tenant};
use crate::tenant::steps::guest;

/// Largest completion request forwarded to a guest (the API's own cap is larger).
pub const MAX_INFER_BODY: usize = 16 * 1024;
/// How long one inference may take in the guest.
pub const INFER_TIMEOUT: Duration = Duration::from_secs(120);

/// Why a request was not answered.
#[derive(Debug, Error)]
pub enum InferError {
    /// Over the tenant's request rate or concurrency.
    #[error(transparent)]
    Quota(#[from] Refused),
    /// The request itself is refused.
    #[error("Bad request: {0}")]
    BadRequest(String),
    /// The tenant is not running.
    #[error("Tenant {0:?} is not running; start it (`tenantvm start {0}`) and retry")]
    NotServing(String),
    /// The guest agent or its payload could not answer.
    #[error("The tenant's guest could not answer: {0}")]
    Unavailable(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// An inference request admitted by its tenant's gate: the tenant, and the permit that
/// keeps its place among the tenant's requests in flight until dropped.
#[derive(Debug)]
pub struct AdmittedInfer {
    /// The target tenant.
    tenant: TenantRecord,
    /// Its place in flight.
    permit: Permit,
}

/// Forwards an OpenAI-style completion request (a JSON object) to the tenant's payload and
/// returns its JSON answer: [`admit`], then [`forward`].
pub fn infer(
    ctx: &StepCtx<'_>,
    record: &TenantRecord,
    body: serde_json::Value,
) -> Result<serde_json::Value, InferError> {
    let admitted = admit(ctx, record.clone())?;
    forward(ctx, admitted, body)
}

/// The quota gate, first and without blocking: every request counts, whether or not it
/// would succeed, and a refused one costs nothing further. The permit is held until the
/// answer is back.
pub fn admit(ctx: &StepCtx<'_>, record: TenantRecord) -> Result<AdmittedInfer, InferError> {
    let permit = ctx.admission.admit(
        &Admission::key(record.id, &record.name),
        &record.name,
        &record.spec.quotas,
        Instant::now(),
    )?;
    Ok(AdmittedInfer {
        tenant: record,
        permit,
    })
}

/// Forwards an admitted completion request to the tenant's payload (blocks until the guest
/// answers or its deadline passes).
pub fn forward(
    ctx: &StepCtx<'_>,
    admitted: AdmittedInfer,
    body: serde_json::Value,
) -> Result<serde_json::Value, InferError> {
    let AdmittedInfer {
        tenant: record,
        permit: _permit,
    } = admitted;
    let record = &record;
    let t = Tenant::load(ctx, record).map_err(|e| match e {
        StepError::Store(e) => InferError::Store(e),
        other => InferError::Unavailable(other.to_string()),
    })?;
    if !t.has_agent() {
        return Err(InferError::BadRequest(format!(
            "tenant {:?} does not run a guest image with an inference server",
            t.name
        )));
    }
    if record.state != LifecycleState::Running {
        return Err(InferError::NotServing(t.name.to_string()));
    }
    if !body.is_object() {
        return Err(InferError::BadRequest(
            "send a JSON object such as {\"prompt\": \"...\", \"max_tokens\": 16}".into(),
        ));
    }
    let body = body.to_string();
    if body.len() > MAX_INFER_BODY {
        return Err(InferError::BadRequest(format!(
            "the completion request is {} bytes; at most {MAX_INFER_BODY} are forwarded",
            body.len()
        )));
    }
    let vm =
        t.vm.as_ref()
            .ok_or_else(|| InferError::NotServing(t.name.to_string()))?;
    let started = Instant::now();
    let unavailable = |e: AgentClientError| InferError::Unavailable(e.to_string());
    let mut agent = guest::connect(ctx.backend, vm, guest::CONNECT_TIMEOUT).map_err(unavailable)?;
    let answer = agent
        .infer(
            HttpRequest {
                method: "POST".into(),
                path: "/v1/completions".into(),
                headers: vec![("Content-Type".into(), "application/json".into())],
                body,
            },
            INFER_TIMEOUT,
        )
        .map_err(unavailable)?;
    tracing::info!(
        tenant = %t.name,
        status = answer.status,
        ms = started.elapsed().as_millis() as u64,
        "inference forwarded"
    );
    let json: serde_json::Value = serde_json::from_str(&answer.body).map_err(|_| {
        InferError::Unavailable(format!(
            "the payload answered status {} with a body that is not JSON",
            answer.status
        ))
    })?;
    if answer.status != 200 {
        return Err(InferError::Unavailable(format!(
            "the payload answered status {}: {}",
            answer.status,
            crate::logs::sanitize(
                &json["error"]["message"]
                    .as_str()
                    .or_else(|| json["error"].as_str())
                    .unwrap_or("no message")
                    .chars()
                    .take(200)
                    .collect::<String>()
            )
        )));
    }
    if !json.is_object() {
        return Err(InferError::Unavailable(
            "the payload's answer is not a JSON object".into(),
        ));
    }
    Ok(json)
}
