//! The daemon's HTTP API on a Unix socket (axum). Handlers authenticate, then hand the
//! request to the [`TenantService`]: as one [`TenantCommand`], or as a service operation
//! (inference keys; a serving tenant for the routes that call its guest agent). Who may
//! touch which tenant, in which state, is the service's one rule
//! ([`crate::tenant::access`]); handlers own the wire (bodies, status codes) and write
//! nothing to the store. The contract is docs/api/openapi.yaml; tests check live responses
//! against it, and walk every route with another tenant's token (`access_tests.rs`).
//!
//! No caller can stall another ([`lanes`]): authentication and admission run first, on the
//! async threads, without blocking work; the blocking work then runs on a thread of the
//! request's own under the budget of whoever it waits for (the target tenant's admission
//! gate for inference, the caller's lane otherwise); the health check does no blocking work.

pub mod gpu_info;
pub mod host;
pub mod keys;
pub mod lanes;
pub mod load;
mod metrics;
pub mod models;
pub mod payload;
pub mod project;
pub mod types;

use std::sync::Arc;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::auth::{self, AuthError, Caller};
use crate::domain::spec::TenantSpec;
use crate::gpu::GpuError;
use crate::store::StoreError;
use crate::tenant::service::{CommandOutcome, TenantCommand, TenantService, TenantServiceError};
use lanes::{offload, Lane, LaneFull, Lanes, OffloadError};
use types::{ErrorBody, ErrorDetail, Health, LogQuery};

/// Largest request body accepted (a tenant spec is far smaller).
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Largest body the `infer` route reads: the largest `quotas.max_request_bytes` a spec may
/// set (each tenant's own limit is then held, as at the front door).
pub const INFER_BODY_LIMIT: usize = crate::domain::spec::MAX_REQUEST_BYTES_LIMIT as usize;

/// An error response: status, stable code, message.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    /// Seconds for a `Retry-After` header (429 answers).
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_string(),
                message: self.message,
            },
        };
        let mut response = (self.status, Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        match e {
            AuthError::Missing | AuthError::Invalid => {
                ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", e.to_string())
            }
            other => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                other.to_string(),
            ),
        }
    }
}

impl From<LaneFull> for ApiError {
    fn from(e: LaneFull) -> Self {
        let mut error = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_in_flight",
            e.to_string(),
        );
        error.retry_after = Some(1);
        error
    }
}

impl From<OffloadError> for ApiError {
    fn from(e: OffloadError) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
    }
}

impl From<TenantServiceError> for ApiError {
    fn from(e: TenantServiceError) -> Self {
        use crate::tenant::admission::Refused;
        use TenantServiceError as E;
        if let E::QuotaExceeded(refused) = &e {
            let code = match refused {
                Refused::Rate { .. } => "rate_limited",
                Refused::Concurrency { .. } => "too_many_in_flight",
                Refused::Closed { .. } => {
                    return ApiError::new(StatusCode::CONFLICT, "invalid_state", e.to_string())
                }
            };
            let mut error = ApiError::new(StatusCode::TOO_MANY_REQUESTS, code, e.to_string());
            error.retry_after = Some(refused.retry_after_secs());
            return error;
        }
        let (status, code) = match &e {
            E::Spec(_) => (StatusCode::BAD_REQUEST, "invalid_spec"),
            E::Image(_) => (StatusCode::BAD_REQUEST, "invalid_image"),
            E::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            E::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
            E::Gpu(GpuError::NoGpuBackend) | E::Gpu(GpuError::Plan(_)) => {
                (StatusCode::BAD_REQUEST, "gpu_unavailable")
            }
            E::NotFound(_) | E::NoSuchKey { .. } => (StatusCode::NOT_FOUND, "not_found"),
            E::AdminOnly(_) => (StatusCode::FORBIDDEN, "forbidden"),
            E::Store(StoreError::DuplicateName(_)) => (StatusCode::CONFLICT, "name_taken"),
            E::Store(StoreError::Lifecycle(_)) | E::Lifecycle(_) => {
                (StatusCode::CONFLICT, "invalid_state")
            }
            E::Busy(_) | E::Recovering(_) => (StatusCode::CONFLICT, "busy"),
            E::Capacity(_) => (StatusCode::CONFLICT, "insufficient_capacity"),
            E::NotServing(_) | E::NoAgent { .. } | E::Departing(_) => {
                (StatusCode::CONFLICT, "invalid_state")
            }
            E::AgentUnavailable(_) => (StatusCode::BAD_GATEWAY, "guest_unavailable"),
            E::Rescrub(crate::tenant::departure::RescrubError::NotQuarantined(_)) => {
                (StatusCode::NOT_FOUND, "not_found")
            }
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        ApiError::new(status, code, e.to_string())
    }
}

/// A JSON body read as `T`, with every number that has no fraction (`27.0`) read as the
/// integer it is: the spec's `integer` (JSON Schema) admits such numbers, serde's integers
/// do not.
pub(super) fn typed<T: serde::de::DeserializeOwned>(
    value: serde_json::Value,
) -> Result<T, serde_json::Error> {
    serde_json::from_value(integral_numbers(value))
}

/// `value` with each integral float (finite, no fraction, in `i64` or `u64` range) made an
/// integer.
fn integral_numbers(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(f64::NAN);
            let whole = f.is_finite() && f.fract() == 0.0;
            // 2^64 and -2^63 are exact in f64; a cast within them is exact too.
            if whole && (0.0..2f64.powi(64)).contains(&f) {
                Value::from(f as u64)
            } else if whole && (-(2f64.powi(63))..0.0).contains(&f) {
                Value::from(f as i64)
            } else {
                Value::Number(n)
            }
        }
        Value::Array(a) => Value::Array(a.into_iter().map(integral_numbers).collect()),
        Value::Object(o) => Value::Object(
            o.into_iter()
                .map(|(k, v)| (k, integral_numbers(v)))
                .collect(),
        ),
        other => other,
    }
}

fn json_rejection(r: JsonRejection) -> ApiError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("Request body is larger than {MAX_BODY_BYTES} bytes"),
        );
    }
    if matches!(r, JsonRejection::MissingJsonContentType(_)) {
        return ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Send the tenant spec as JSON with `Content-Type: application/json`",
        );
    }
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_spec",
        format!(
            "Tenant spec is not valid JSON for this schema: {}",
            r.body_text()
        ),
    )
}

/// What the handlers share: the service and the in-flight budgets.
#[derive(Clone)]
pub struct ApiState {
    svc: TenantService,
    lanes: Arc<Lanes>,
}

fn authorization(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
}

/// Authenticates, takes a place on the caller's lane, and runs the command on a thread of
/// its own. Authentication is one indexed store read, done here on the async thread so
/// that it never waits behind anyone's blocking work.
async fn run(
    api: &ApiState,
    headers: &HeaderMap,
    command: TenantCommand,
) -> Result<CommandOutcome, ApiError> {
    let caller: Caller = auth::authenticate(api.svc.store(), authorization(headers))?;
    run_as(api, caller, command).await
}

/// [`run`] for a caller already authenticated (a handler with a body authenticates before
/// it looks at the body: a request without a good token gets 401 whatever it sent).
async fn run_as(
    api: &ApiState,
    caller: Caller,
    command: TenantCommand,
) -> Result<CommandOutcome, ApiError> {
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    offload(permit, move || svc.execute(&caller, command))
        .await?
        .map_err(ApiError::from)
}

fn respond(status: StatusCode, outcome: CommandOutcome) -> Response {
    match outcome {
        CommandOutcome::Created(c) => (status, Json(project::created(c))).into_response(),
        CommandOutcome::Tenant(t) => (status, Json(project::tenant(t))).into_response(),
        CommandOutcome::Tenants(l) => (status, Json(project::tenants(l))).into_response(),
        CommandOutcome::Log(l) => (status, Json(project::log(l))).into_response(),
        CommandOutcome::Receipts(r) => {
            (status, Json(types::ReceiptList { receipts: r })).into_response()
        }
        CommandOutcome::Quarantine(q) => {
            let slices = q.into_iter().map(project::quarantined).collect();
            (status, Json(types::QuarantineList { slices })).into_response()
        }
        CommandOutcome::Rescrubbed(r) => (status, Json(r)).into_response(),
        CommandOutcome::Inferred(v) => (status, Json(v)).into_response(),
    }
}

/// Answers from the async thread after authentication: no blocking work, so no tenant's
/// load can delay it.
async fn health(State(api): State<ApiState>, headers: HeaderMap) -> Result<Response, ApiError> {
    auth::authenticate(api.svc.store(), authorization(&headers))?;
    Ok(Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        backend: api.svc.backend_name(),
        agent_transport: api.svc.agent_transport().into(),
        recovering: api.svc.recovering(),
    })
    .into_response())
}

async fn create(
    State(api): State<ApiState>,
    headers: HeaderMap,
    spec: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    let Json(spec) = spec.map_err(json_rejection)?;
    let spec: TenantSpec = typed(spec).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_spec",
            format!("Tenant spec is not valid JSON for this schema: {e}"),
        )
    })?;
    let out = run_as(&api, caller, TenantCommand::Create(spec)).await?;
    Ok(respond(StatusCode::ACCEPTED, out))
}

async fn list(State(api): State<ApiState>, headers: HeaderMap) -> Result<Response, ApiError> {
    Ok(respond(
        StatusCode::OK,
        run(&api, &headers, TenantCommand::List).await?,
    ))
}

async fn status(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = tenant_name(name)?;
    Ok(respond(
        StatusCode::OK,
        run(&api, &headers, TenantCommand::Status(name)).await?,
    ))
}

async fn destroy(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = tenant_name(name)?;
    let out = run(&api, &headers, TenantCommand::Destroy(name)).await?;
    Ok(respond(StatusCode::ACCEPTED, out))
}

async fn stop(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = tenant_name(name)?;
    let out = run(&api, &headers, TenantCommand::Stop(name)).await?;
    Ok(respond(StatusCode::ACCEPTED, out))
}

async fn start(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = tenant_name(name)?;
    let out = run(&api, &headers, TenantCommand::Start(name)).await?;
    Ok(respond(StatusCode::ACCEPTED, out))
}

async fn logs(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
    query: Result<Query<LogQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let name = tenant_name(name)?;
    let Query(query) = query.map_err(|r| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("Bad log query: {}", r.body_text()),
        )
    })?;
    Ok(respond(
        StatusCode::OK,
        run(&api, &headers, TenantCommand::Logs(name, query)).await?,
    ))
}

/// Forwards a completion request to the tenant's inference server (tenant token or admin).
/// The body is the tenant's data: it is never logged.
async fn infer(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let name = tenant_name(name)?;
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    let Json(body) = body.map_err(|r| match r.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("Request body is larger than {INFER_BODY_LIMIT} bytes, more than any tenant's quotas.max_request_bytes"),
        ),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Send the completion request as JSON with `Content-Type: application/json`",
        ),
        _ => ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "The completion request is not valid JSON; send {\"prompt\": \"...\", \"max_tokens\": 16}",
        ),
    })?;
    // Authenticated (above, before the body was looked at) and admitted (the tenant's
    // request rate and concurrency) here, before any blocking work; the guest's answer is
    // then awaited on a thread of this request's own, holding the tenant's admission permit.
    let admitted = api.svc.admit_infer(&caller, &name)?;
    let svc = api.svc.clone();
    let answer = offload((), move || svc.infer_admitted(admitted, body)).await??;
    Ok(respond(StatusCode::OK, CommandOutcome::Inferred(answer)))
}

async fn receipts(
    State(api): State<ApiState>,
    headers: HeaderMap,
    query: Result<Query<types::ReceiptQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|r| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("Bad receipt query: {}", r.body_text()),
        )
    })?;
    if let Some(name) = &query.tenant {
        crate::domain::TenantName::check(name).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("Bad receipt query: `tenant` is not a tenant name: {e}"),
            )
        })?;
    }
    let caller =
        crate::tenant::departure::receipt_caller(api.svc.store(), authorization(&headers))?;
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    let out = offload(permit, move || {
        svc.execute(&caller, TenantCommand::Receipts(query.tenant))
    })
    .await??;
    Ok(respond(StatusCode::OK, out))
}

async fn quarantine(State(api): State<ApiState>, headers: HeaderMap) -> Result<Response, ApiError> {
    Ok(respond(
        StatusCode::OK,
        run(&api, &headers, TenantCommand::Quarantine).await?,
    ))
}

async fn rescrub(
    State(api): State<ApiState>,
    headers: HeaderMap,
    body: Result<Json<types::ScrubRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    let Json(body) = body.map_err(|r| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!(
                "Send {{\"slice\": \"<gpu>/<label>\"}} as JSON: {}",
                r.body_text()
            ),
        )
    })?;
    Ok(respond(
        StatusCode::OK,
        run_as(&api, caller, TenantCommand::Rescrub(body.slice)).await?,
    ))
}

/// A path segment that does not even decode names no tenant: answered like a missing one.
fn tenant_name(name: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    name.map(|Path(n)| n).map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "No such tenant (check `tenantvm list`)",
        )
    })
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "Method not allowed on this endpoint; see docs/api/openapi.yaml",
    )
}

async fn fallback() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "no_route",
        "No such endpoint; see docs/api/openapi.yaml",
    )
}

/// The API's routes over a service, with fresh in-flight budgets (build it once per server).
pub fn router(svc: TenantService) -> Router {
    let state = ApiState {
        svc,
        lanes: Arc::default(),
    };
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/tenants", get(list).post(create))
        .route("/v1/tenants/{name}", get(status).delete(destroy))
        .route("/v1/tenants/{name}/stop", post(stop))
        .route("/v1/tenants/{name}/start", post(start))
        .route("/v1/tenants/{name}/logs", get(logs))
        .route(
            "/v1/tenants/{name}/infer",
            // The tenant's own `quotas.max_request_bytes` applies once it is known.
            post(infer).layer(DefaultBodyLimit::max(INFER_BODY_LIMIT)),
        )
        .route(
            "/v1/tenants/{name}/keys",
            get(keys::list).post(keys::create),
        )
        .route(
            "/v1/tenants/{name}/keys/{id}",
            axum::routing::delete(keys::revoke),
        )
        .route("/v1/tenants/{name}/models", get(models::list))
        .route("/v1/tenants/{name}/payload/restart", post(payload::restart))
        .route("/v1/tenants/{name}/gpu", get(gpu_info::get))
        .route("/v1/tenants/{name}/load", post(load::start))
        .route("/v1/tenants/{name}/load/{kind}", get(load::status))
        .route(
            "/v1/tenants/{name}/models/{model}",
            axum::routing::put(models::push)
                .delete(models::remove)
                .layer(DefaultBodyLimit::disable()),
        )
        .route("/v1/host", get(host::get))
        .route("/v1/metrics", get(metrics::metrics))
        .route("/v1/receipts", get(receipts))
        .route("/v1/gpu/quarantine", get(quarantine))
        .route("/v1/gpu/quarantine/scrub", post(rescrub))
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

#[cfg(test)]
mod access_tests;
#[cfg(test)]
mod gpu_info_tests;
#[cfg(test)]
mod isolation_tests;
#[cfg(test)]
mod metrics_tests;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod payload_tests;
#[cfg(test)]
mod tests;
