//! The tenant's own models, through its guest agent onto its encrypted disk (the admin
//! token or the tenant's own):
//!
//! - `PUT /v1/tenants/{name}/models/{model}` with `Content-Length` and
//!   `X-Model-Sha256: <hex>`: the body is streamed to the agent as it arrives (never held
//!   whole), which stores it under a temporary name, checks size and hash, fsyncs and
//!   renames it (docs/guest-image.md, `model-push`); 201 when stored; with
//!   `X-Model-Layout: directory` the body is a model directory as one stream: a manifest
//!   line (`{"files": [{path, size, sha256}]}`) then the files' bytes in its order, stored
//!   as `<data>/models/NAME/` (`model-push-dir`), `X-Model-Sha256` the files' bytes';
//! - `GET /v1/tenants/{name}/models`: the stored models;
//! - `DELETE /v1/tenants/{name}/models/{model}`: removes one.
//!
//! Errors: the tenant not running or without an inference guest 409; a push to an agent
//! that has no stream of its own for it 409 (QEMU's virtio-serial port with an agent older
//! than the mux; vsock and a multiplexed port have one); a
//! bad name or hash 400; size or hash not matching 422; not enough room on the disk 507;
//! an unknown model 404; the guest not answering 502.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http_body_util::BodyExt;
use hyper::body::Bytes;
use serde::{Deserialize, Serialize};
use tenantvm_agent_protocol::{AgentClientError, ErrorCode, ModelEntry};

use super::lanes::{offload, Lane};
use super::{authorization, ApiError, ApiState};
use crate::auth::{self, Caller};
use crate::tenant::access::ServingTenant;
use crate::tenant::service::TenantService;

/// How long each agent answer (and each write of model data) may take.
const MODEL_CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// Pieces of a push buffered between the client and the guest.
const PUSH_PIPE: usize = 4;
/// Most bytes of a refused push read and dropped after the refusal is sent.
pub(super) const DRAIN_LIMIT: u64 = 64 << 20;
/// Longest a refused push's body is read and dropped after the refusal is sent.
const DRAIN_TIME: Duration = Duration::from_secs(10);
/// Longest a push's client may send nothing: the push then fails (408) and frees its
/// thread and its caller's request budget.
#[cfg(not(test))]
pub(super) const PUSH_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
#[cfg(test)]
pub(super) const PUSH_IDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest a refused push's client may send nothing before the drain gives up.
const DRAIN_IDLE_TIMEOUT: Duration = Duration::from_secs(2);

/// Answer of a push.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelStored {
    /// The tenant.
    pub tenant: String,
    /// The model's name.
    pub name: String,
    /// Bytes stored.
    pub bytes: u64,
    /// Their SHA-256 as the guest checked it.
    pub sha256: String,
}

/// Answer of a list.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelList {
    /// The tenant.
    pub tenant: String,
    /// Its models.
    pub models: Vec<ModelEntry>,
}

/// Answer of a removal.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelRemoved {
    /// The tenant.
    pub tenant: String,
    /// The model removed.
    pub name: String,
}

fn err(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::new(status, code, message)
}

pub(super) fn agent_error(e: AgentClientError) -> ApiError {
    let msg = crate::untrusted::one_line(&e.to_string());
    match &e {
        AgentClientError::Agent { failure, .. } => match failure.code {
            ErrorCode::NoSpace => err(StatusCode::INSUFFICIENT_STORAGE, "no_space", msg),
            ErrorCode::Mismatch => err(StatusCode::UNPROCESSABLE_ENTITY, "mismatch", msg),
            ErrorCode::NotFound => err(StatusCode::NOT_FOUND, "model_not_found", msg),
            ErrorCode::BadRequest => err(StatusCode::BAD_REQUEST, "bad_request", msg),
            ErrorCode::WrongState => err(StatusCode::CONFLICT, "invalid_state", msg),
            _ => err(StatusCode::BAD_GATEWAY, "guest_unavailable", msg),
        },
        _ => err(StatusCode::BAD_GATEWAY, "guest_unavailable", msg),
    }
}

/// The running tenant `name` with an agent, if `caller` may act on it
/// ([`TenantService::serving`]), for the model routes.
pub(super) fn serving(
    svc: &TenantService,
    caller: &Caller,
    name: &str,
) -> Result<ServingTenant, ApiError> {
    Ok(svc.serving(caller, name, "it has no models")?)
}

/// A connection to the agent of a tenant [`serving`] gave.
pub(super) fn connect(
    svc: &TenantService,
    t: &ServingTenant,
) -> Result<tenantvm_agent_protocol::AgentClient, ApiError> {
    svc.agent(t).map_err(agent_error)
}

/// The body of a push as a blocking reader, fed by the request's task.
struct PipeReader {
    rx: tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>,
    piece: Bytes,
}

impl Read for PipeReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.piece.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(piece)) => self.piece = piece,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.piece.len());
        out[..n].copy_from_slice(&self.piece.split_to(n));
        Ok(n)
    }
}

/// The header that says a push is a model directory (`directory`) rather than one file.
pub const LAYOUT_HEADER: &str = "x-model-layout";

/// Reads a directory push's manifest, its first line (at most
/// [`tenantvm_agent_protocol::model::MAX_MANIFEST_BYTES`]); returns the files and the
/// line's length with its newline.
fn read_manifest(
    r: &mut impl Read,
) -> Result<(Vec<tenantvm_agent_protocol::ModelFile>, u64), ApiError> {
    let limit = tenantvm_agent_protocol::model::MAX_MANIFEST_BYTES;
    let bad = |why: String| err(StatusCode::BAD_REQUEST, "bad_request", why);
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        match r.read(&mut byte) {
            Ok(0) => return Err(bad("The body ended before the manifest's line did".into())),
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) if line.len() >= limit => {
                return Err(bad(format!("The manifest is longer than {limit} bytes")))
            }
            Ok(_) => line.push(byte[0]),
            Err(e) => return Err(bad(format!("Reading the manifest: {e}"))),
        }
    }
    let manifest: tenantvm_agent_protocol::ModelManifest =
        serde_json::from_slice(&line).map_err(|e| {
            bad(format!(
                "The manifest is not {{\"files\": [{{path, size, sha256}}]}}: {e}"
            ))
        })?;
    Ok((manifest.files, line.len() as u64 + 1))
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// `PUT /v1/tenants/{name}/models/{model}`.
pub(super) async fn push(
    State(api): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Body,
) -> Result<Response, ApiError> {
    let Ok(Path((name, model))) = path else {
        return Err(err(
            StatusCode::NOT_FOUND,
            "not_found",
            "Give a tenant and a model name",
        ));
    };
    let size: u64 = header(&headers, "content-length")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            err(
                StatusCode::LENGTH_REQUIRED,
                "length_required",
                "Send the model with a Content-Length",
            )
        })?;
    let sha256 = header(&headers, "x-model-sha256")
        .map(str::to_ascii_lowercase)
        .ok_or_else(|| {
            err(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "Send the model's SHA-256 (hex) in X-Model-Sha256",
            )
        })?;
    let directory = match header(&headers, LAYOUT_HEADER) {
        None | Some("file") => false,
        Some("directory") => true,
        Some(other) => {
            return Err(err(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!(
                    "{LAYOUT_HEADER} must be file or directory, not {:?}",
                    crate::untrusted::one_line(other)
                ),
            ))
        }
    };
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    let (tx, rx) = tokio::sync::mpsc::channel(PUSH_PIPE);
    let tenant = name.clone();
    let work = offload(permit, move || -> Result<ModelStored, ApiError> {
        let t = serving(&svc, &caller, &name)?;
        if !t.streams_per_request {
            return Err(err(
                StatusCode::CONFLICT,
                "invalid_state",
                "Pushing a model needs a stream of its own to the guest (vsock, or a multiplexed virtio-serial port); this tenant's guest agent predates the mux and its QEMU virtio-serial channel has one for everything: rebuild its guest image",
            ));
        }
        let mut reader = PipeReader {
            rx,
            piece: Bytes::new(),
        };
        let (bytes, sha256) = if directory {
            // The manifest comes first, on a line of its own; the files' bytes follow.
            let (files, line) = read_manifest(&mut reader)?;
            let total = tenantvm_agent_protocol::model::check_files(&files).map_err(|e| {
                err(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("The model directory is refused: {e}"),
                )
            })?;
            if total.checked_add(line) != Some(size) {
                return Err(err(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("The manifest's files add up to {total} bytes, but the body holds {} after it", size.saturating_sub(line)),
                ));
            }
            connect(&svc, &t)?
                .model_push_dir(&model, &files, &sha256, &mut reader, MODEL_CALL_TIMEOUT)
                .map_err(|e| match e {
                    AgentClientError::Unsupported { .. } => err(
                        StatusCode::CONFLICT,
                        "agent_unsupported",
                        format!("Tenant {name:?}'s guest agent cannot store a model directory: {e}; rebuild its guest image"),
                    ),
                    other => agent_error(other),
                })?
        } else {
            connect(&svc, &t)?
                .model_push(&model, size, &sha256, &mut reader, MODEL_CALL_TIMEOUT)
                .map_err(agent_error)?
        };
        svc.record_event(
            &t,
            "model",
            &format!("model {model} stored ({bytes} bytes)"),
        );
        Ok(ModelStored {
            tenant: t.tenant.name.to_string(),
            name: model,
            bytes,
            sha256,
        })
    });
    // The body goes to the guest as it arrives; more than announced is cut off (the guest
    // then refuses the push), and a client that sends nothing for PUSH_IDLE_TIMEOUT fails it.
    // A push refused before its data (a bad name, no room, a stopped tenant) is answered at
    // once; the rest of its body is read and dropped meanwhile, up to a bound, so that the
    // client reads the refusal instead of a reset connection, and a client that sends no
    // body at all is answered too.
    let stalled = Arc::new(AtomicBool::new(false));
    let stalled_flag = stalled.clone();
    let pump = async move {
        let mut body = body;
        let mut seen = 0u64;
        let mut draining = false;
        let mut drain_started = None;
        loop {
            let idle = if draining {
                DRAIN_IDLE_TIMEOUT
            } else {
                PUSH_IDLE_TIMEOUT
            };
            let frame = match tokio::time::timeout(idle, body.frame()).await {
                Ok(Some(frame)) => frame,
                Ok(None) => return,
                Err(_) => {
                    if !draining {
                        stalled_flag.store(true, Ordering::Relaxed);
                        let _ = tx
                            .send(Err(std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                "the client sent nothing for too long",
                            )))
                            .await;
                    }
                    return;
                }
            };
            let piece = match frame {
                Ok(f) => match f.into_data() {
                    Ok(d) => d,
                    Err(_) => continue,
                },
                Err(e) => {
                    let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                    return;
                }
            };
            seen += piece.len() as u64;
            if draining {
                let started = *drain_started.get_or_insert_with(std::time::Instant::now);
                if seen > DRAIN_LIMIT || started.elapsed() > DRAIN_TIME {
                    return;
                }
                continue;
            }
            if seen > size {
                let _ = tx
                    .send(Err(std::io::Error::other("more bytes than Content-Length")))
                    .await;
                draining = true;
                continue;
            }
            if tx.send(Ok(piece)).await.is_err() {
                draining = true;
            }
        }
    };
    let pump = tokio::spawn(pump);
    let stored = match work.await {
        Ok(Err(_)) if stalled.load(Ordering::Relaxed) => {
            return Err(err(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                format!(
                    "The model's bytes stopped arriving for {} s; the push was abandoned and nothing was stored",
                    PUSH_IDLE_TIMEOUT.as_secs()
                ),
            ))
        }
        Ok(Err(e)) => {
            // Refused: answered now, the pump drains the rest meanwhile.
            drop(pump);
            return Err(e);
        }
        other => other,
    };
    let _ = pump.await;
    let stored = stored??;
    tracing::info!(tenant = %tenant, bytes = stored.bytes, "model stored");
    Ok((StatusCode::CREATED, Json(stored)).into_response())
}

/// `GET /v1/tenants/{name}/models`.
pub(super) async fn list(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = super::tenant_name(name)?;
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    let list = offload(permit, move || -> Result<ModelList, ApiError> {
        let t = serving(&svc, &caller, &name)?;
        let models = connect(&svc, &t)?
            .model_list(MODEL_CALL_TIMEOUT)
            .map_err(agent_error)?;
        Ok(ModelList {
            tenant: t.tenant.name.to_string(),
            models,
        })
    })
    .await??;
    Ok((StatusCode::OK, Json(list)).into_response())
}

/// `DELETE /v1/tenants/{name}/models/{model}`.
pub(super) async fn remove(
    State(api): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    let Ok(Path((name, model))) = path else {
        return Err(err(
            StatusCode::NOT_FOUND,
            "not_found",
            "Give a tenant and a model name",
        ));
    };
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    let done = offload(permit, move || -> Result<ModelRemoved, ApiError> {
        let t = serving(&svc, &caller, &name)?;
        connect(&svc, &t)?
            .model_remove(&model, MODEL_CALL_TIMEOUT)
            .map_err(agent_error)?;
        svc.record_event(&t, "model", &format!("model {model} removed"));
        Ok(ModelRemoved {
            tenant: t.tenant.name.to_string(),
            name: model,
        })
    })
    .await??;
    Ok((StatusCode::OK, Json(done)).into_response())
}
