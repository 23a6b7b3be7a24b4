//! Bounded test loads inside a tenant's guest, for `tenantvm verify` (the admin token
//! only; a tenant's token is refused with 403, and the front door has no such route):
//!
//! - `POST /v1/tenants/{name}/load` with a [`LoadSpec`] (`{"kind": "memory"|"cpu"|"disk"|"gpu-memory"|"gpu-compute",
//!   "amount": N, "seconds": S}`, capped by [`tenantvm_agent_protocol::load`]): the guest
//!   agent starts it and the answer (202) carries its pid in the guest;
//! - `GET /v1/tenants/{name}/load/{kind}`: the latest load of that kind, its state and
//!   numbers ([`LoadReport`]).
//!
//! Errors: out of the caps 400; one of that kind already running, or a disk load without
//! a mounted disk, 409; not enough room on the disk 507; the tenant not running or without
//! an agent 409; the guest not answering 502.

use std::time::Duration;

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use tenantvm_agent_protocol::{LoadKind, LoadReport, LoadSpec};

use super::lanes::{offload, Lane};
use super::models::{agent_error, connect, serving};
use super::{authorization, ApiError, ApiState};
use crate::auth::{self, Caller};
use crate::tenant::service::TenantServiceError;

/// How long the agent may take to answer a load request.
const LOAD_CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// Answer of a start.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LoadStarted {
    /// The tenant.
    pub tenant: String,
    /// What runs.
    pub spec: LoadSpec,
    /// The worker's pid in the guest.
    pub pid: u32,
}

/// Answer of a status read.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LoadStatus {
    /// The tenant.
    pub tenant: String,
    /// The latest load of the kind asked.
    pub report: LoadReport,
}

fn admin_only(caller: &Caller) -> Result<(), ApiError> {
    match caller {
        Caller::Admin => Ok(()),
        Caller::Tenant(_) => Err(TenantServiceError::AdminOnly("run test loads in a guest").into()),
    }
}

/// `POST /v1/tenants/{name}/load`.
pub(super) async fn start(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
    spec: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let name = super::tenant_name(name)?;
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    admin_only(&caller)?;
    let bad = |e: &dyn std::fmt::Display| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("Send a load as JSON: {{\"kind\": \"memory|cpu|disk|gpu-memory|gpu-compute\", \"amount\": N, \"seconds\": S}} ({e})"),
        )
    };
    let Json(spec) = spec.map_err(|e| bad(&e))?;
    let spec: LoadSpec = super::typed(spec).map_err(|e| bad(&e))?;
    spec.check()
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.to_string()))?;
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    let started = offload(permit, move || -> Result<LoadStarted, ApiError> {
        let t = serving(&svc, &caller, &name)?;
        let pid = connect(&svc, &t)?
            .load_start(spec, LOAD_CALL_TIMEOUT)
            .map_err(agent_error)?;
        Ok(LoadStarted {
            tenant: t.tenant.name.to_string(),
            spec,
            pid,
        })
    })
    .await??;
    tracing::info!(tenant = %started.tenant, kind = started.spec.kind.as_str(), amount = started.spec.amount, seconds = started.spec.seconds, "test load started");
    Ok((StatusCode::ACCEPTED, Json(started)).into_response())
}

/// `GET /v1/tenants/{name}/load/{kind}`.
pub(super) async fn status(
    State(api): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    let Ok(Path((name, kind))) = path else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "Give a tenant and a load kind (memory, cpu, disk, gpu-memory or gpu-compute)",
        ));
    };
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    admin_only(&caller)?;
    let kind = LoadKind::parse(&kind).ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "A load kind is memory, cpu, disk, gpu-memory or gpu-compute",
        )
    })?;
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    let status = offload(permit, move || -> Result<LoadStatus, ApiError> {
        let t = serving(&svc, &caller, &name)?;
        let report = connect(&svc, &t)?
            .load_status(kind, LOAD_CALL_TIMEOUT)
            .map_err(agent_error)?;
        Ok(LoadStatus {
            tenant: t.tenant.name.to_string(),
            report,
        })
    })
    .await??;
    Ok((StatusCode::OK, Json(status)).into_response())
}
