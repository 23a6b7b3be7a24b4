//! `POST /v1/tenants/{name}/payload/restart` (the admin token or the tenant's own): the
//! guest agent stops the tenant's inference server and starts it again (e.g. to serve a
//! model just pushed: `tenantvm model push`, then `tenantvm payload restart`), then the
//! daemon waits until it answers its health check, at most `wait_s` seconds (body
//! `{"wait_s": N}`, default 600, at most 3600; 0: do not wait).
//!
//! Errors: the tenant not running or without a guest agent 409; an agent older than
//! `restart-payload` 409 `agent_unsupported`; the payload exited (e.g. a model the engine
//! refuses) or not ready in time 503 `payload_not_ready`, with its exit code and the hint
//! to read its log (`tenantvm logs TENANT`: the payload's lines are on the guest's console); the guest not answering 502.

use std::time::Duration;

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use tenantvm_agent_protocol::{AgentClientError, PayloadState};

use super::lanes::{offload, Lane};
use super::models::{agent_error, connect};
use super::{authorization, ApiError, ApiState};
use crate::auth;

/// How long the agent may take to stop the old process (its grace time) and start anew.
const RESTART_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Default and largest wait for readiness.
const DEFAULT_WAIT_S: u64 = 600;
/// The largest `wait_s`.
const MAX_WAIT_S: u64 = 3600;

/// The request body (optional).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RestartRequest {
    /// Seconds to wait for the payload to become ready (0: answer once it started).
    #[serde(default)]
    pub wait_s: Option<u64>,
}

/// The answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PayloadRestarted {
    /// The tenant.
    pub tenant: String,
    /// The new process's pid in the guest.
    pub pid: u32,
    /// Whether it answered its health check before the answer was sent.
    pub ready: bool,
    /// Seconds from the request to the answer.
    pub seconds: f64,
}

/// `POST /v1/tenants/{name}/payload/restart`.
pub(super) async fn restart(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let name = super::tenant_name(name)?;
    // Who asks comes first: an unauthenticated caller learns nothing about the body.
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    let bad = |e: &dyn std::fmt::Display| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("The body must be {{\"wait_s\": N}} or empty: {e}"),
        )
    };
    let req: RestartRequest = match body {
        Ok(Json(value)) => super::typed(value).map_err(|e| bad(&e))?,
        // No body at all is the default request.
        Err(JsonRejection::MissingJsonContentType(_)) => RestartRequest::default(),
        Err(e) => return Err(bad(&e)),
    };
    let wait = Duration::from_secs(req.wait_s.unwrap_or(DEFAULT_WAIT_S).min(MAX_WAIT_S));
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    let started = std::time::Instant::now();
    let done = offload(permit, move || -> Result<PayloadRestarted, ApiError> {
        let t = svc.serving(&caller, &name, "it has no inference server")?;
        let mut agent = connect(&svc, &t)?;
        let pid = agent
            .restart_payload(RESTART_CALL_TIMEOUT)
            .map_err(|e| match e {
                AgentClientError::Unsupported { .. } => ApiError::new(
                    StatusCode::CONFLICT,
                    "agent_unsupported",
                    format!("Tenant {name:?}: {e}; stop and start the tenant instead"),
                ),
                other => agent_error(other),
            })?;
        svc.record_event(&t, "payload", "payload restarted on request");
        let mut ready = false;
        if !wait.is_zero() {
            match agent.wait_payload_ready(wait) {
                Ok(()) => ready = true,
                Err(AgentClientError::PayloadNotReady { last, .. }) => {
                    let what = match last {
                        PayloadState::Exited {
                            code,
                            restart_in_ms,
                            ..
                        } => format!(
                            "it exited with code {code}{}",
                            restart_in_ms
                                .map(|ms| {
                                    format!(" (the agent restarts it in {:.1} s)", ms as f64 / 1000.0)
                                })
                                .unwrap_or_default()
                        ),
                        other => format!("it was not ready within {} s ({other:?})", wait.as_secs()),
                    };
                    return Err(ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "payload_not_ready",
                        format!(
                            "Tenant {name:?}'s inference server was restarted, but {what}; read why in its log: `tenantvm logs {name}`"
                        ),
                    ));
                }
                Err(e) => return Err(agent_error(e)),
            }
        }
        Ok(PayloadRestarted {
            tenant: t.tenant.name.to_string(),
            pid,
            ready,
            seconds: started.elapsed().as_secs_f64(),
        })
    })
    .await??;
    Ok((StatusCode::OK, Json(done)).into_response())
}
