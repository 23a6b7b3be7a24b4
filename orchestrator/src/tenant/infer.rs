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
    /// The request is larger than the tenant's `quotas.max_request_bytes`.
    #[error("The request is {bytes} bytes; the tenant's quotas.max_request_bytes is {limit}")]
    TooLarge {
        /// The request's size (its JSON, as forwarded).
        bytes: usize,
        /// The tenant's limit.
        limit: u32,
    },
    /// The tenant is not running.
    #[error("Tenant {0:?} is not running; start it (`tenantvm start {0}`) and retry")]
    NotServing(String),
    /// The guest agent or its payload could not answer.
    #[error("The tenant's guest could not answer: {0}")]
    Unavailable(String),
    /// The daemon has restarted and is still checking this tenant.
    #[error("Tenant {0:?} is being recovered after a daemon restart; retry in a few seconds")]
    Recovering(String),
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

/// Refuses a request larger than the tenant's `quotas.max_request_bytes`: the front door's
/// limit, held on the API's `infer` route too.
pub fn check_size(record: &TenantRecord, bytes: usize) -> Result<(), InferError> {
    let limit = record.spec.quotas.max_request_bytes;
    if u64::try_from(bytes).unwrap_or(u64::MAX) > u64::from(limit) {
        return Err(InferError::TooLarge { bytes, limit });
    }
    Ok(())
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
    if !body.is_object() {
        return Err(InferError::BadRequest(
            "send a JSON object such as {\"prompt\": \"...\", \"max_tokens\": 16}".into(),
        ));
    }
    let body = body.to_string();
    check_size(record, body.len())?;
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

/// An HTTP request for the tenant's payload, as the front door forwards it: an
/// OpenAI-style route (`/v1/completions`, `/v1/chat/completions`, `/v1/models`) and its
/// body, already authenticated, admitted and size-checked by the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadRequest {
    /// `GET` or `POST`.
    pub method: String,
    /// Origin-form target, e.g. `/v1/chat/completions`.
    pub path: String,
    /// The request's `Content-Type` and `Accept` headers (nothing else is forwarded).
    pub headers: Vec<(String, String)>,
    /// The body as the client sent it.
    pub body: Vec<u8>,
}

/// The payload's answer: status and headers as soon as the payload sent them, and the body
/// as a reader that yields it as the payload produces it (server-sent events for
/// `stream: true`). Dropping it closes the request's stream to the guest.
pub struct PayloadResponse {
    /// Status code.
    pub status: u16,
    /// The payload's response headers (`Content-Type` matters: `text/event-stream` for
    /// streams).
    pub headers: Vec<(String, String)>,
    /// The body. Every read is bounded by the request's deadline.
    pub body: Box<dyn std::io::Read + Send>,
    /// The tenant's place among its requests in flight, held until the body is dropped.
    _permit: Option<Permit>,
}

impl std::fmt::Debug for PayloadResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadResponse")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

/// How long a streamed answer may go without a byte from the guest.
pub const STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a streamed answer may take in all.
pub const STREAM_TIMEOUT: Duration = Duration::from_secs(300);

/// Forwards an admitted request to the tenant's payload and returns its answer as it
/// arrives (blocks until the payload's status line, or the deadline).
///
/// On a socket channel (tenantvm-vmm's hybrid vsock) each request has a connection of its
/// own ([`AgentClient::infer_stream`](tenantvm_agent_protocol::AgentClient::infer_stream)),
/// so requests run concurrently up to the tenant's `max_concurrency`, and the body is
/// yielded as the payload produces it: every read waits at most [`STREAM_IDLE_TIMEOUT`],
/// none past [`STREAM_TIMEOUT`], and the daemon holds at most one data frame
/// ([`tenantvm_agent_protocol::MAX_DATA_LEN`]) of it at a time. On QEMU's virtio-serial
/// port (one channel for everything) the answer comes buffered, whole, in one frame.
pub fn forward_http(
    ctx: &StepCtx<'_>,
    admitted: AdmittedInfer,
    request: PayloadRequest,
) -> Result<PayloadResponse, InferError> {
    let AdmittedInfer {
        tenant: record,
        permit,
    } = admitted;
    let t = Tenant::load(ctx, &record).map_err(|e| match e {
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
    let vm =
        t.vm.as_ref()
            .ok_or_else(|| InferError::NotServing(t.name.to_string()))?;
    let body = String::from_utf8(request.body)
        .map_err(|_| InferError::BadRequest("the request body is not UTF-8".into()))?;
    let http = HttpRequest {
        method: request.method,
        path: request.path,
        headers: request.headers,
        body,
    };
    let unavailable = |e: AgentClientError| InferError::Unavailable(e.to_string());
    let streams = guest::streams_per_request(ctx.backend, vm, guest::CONNECT_TIMEOUT);
    let mut agent =
        guest::connect_pipelined(ctx.backend, vm, guest::CONNECT_TIMEOUT).map_err(unavailable)?;
    if streams {
        let (head, body) = agent
            .infer_stream(http, STREAM_IDLE_TIMEOUT, Instant::now() + STREAM_TIMEOUT)
            .map_err(unavailable)?;
        return Ok(PayloadResponse {
            status: head.status,
            headers: head.headers,
            body: Box::new(body),
            _permit: Some(permit),
        });
    }
    let answer = agent.infer(http, INFER_TIMEOUT).map_err(unavailable)?;
    Ok(PayloadResponse {
        status: answer.status,
        headers: answer.headers,
        body: Box::new(std::io::Cursor::new(answer.body.into_bytes())),
        _permit: Some(permit),
    })
}
