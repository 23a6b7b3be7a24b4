//! `GET /v1/tenants/{name}/gpu`: the GPU a tenant's guest reports (its guest agent's
//! `gpu-info`: PCI functions and `nvidia-smi`'s GPUs) beside the share the daemon assigned
//! to it, and the findings of comparing them ([`crate::gpu::guest_view`]). The admin token
//! or the tenant's own (it reads only the tenant's own guest and assignment).
//!
//! Errors: the tenant not running or without a guest agent 409; an agent older than
//! `gpu-info` 409 `agent_unsupported`; the guest not answering, or answering outside the
//! protocol's caps, 502.

use std::time::Duration;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use tenantvm_agent_protocol::{AgentClientError, GpuInfoReply, NVIDIA_SMI_DEADLINE_SECS};

use super::lanes::{offload, Lane};
use super::models::{agent_error, connect};
use super::{authorization, ApiError, ApiState};
use crate::auth;
use crate::gpu::guest_view::{self as gpu_info, Finding, FindingLevel};
use crate::gpu::AssignedGpu;

/// How long the agent may take: nvidia-smi's deadline and some.
const GPU_INFO_TIMEOUT: Duration = Duration::from_secs(NVIDIA_SMI_DEADLINE_SECS + 10);

/// The answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GpuInfoView {
    /// The tenant.
    pub tenant: String,
    /// What the daemon assigned (absent: no GPU share).
    pub assigned: Option<AssignedGpu>,
    /// What the guest reports (guest-controlled; checked against the protocol's caps).
    pub guest: GpuInfoReply,
    /// The comparison, mismatches first.
    pub findings: Vec<Finding>,
    /// No finding is a mismatch.
    pub matches: bool,
}

/// `GET /v1/tenants/{name}/gpu`.
pub(super) async fn get(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = super::tenant_name(name)?;
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    let view = offload(permit, move || -> Result<GpuInfoView, ApiError> {
        let t = svc.serving(
            &caller,
            &name,
            "it has no guest agent to report its devices",
        )?;
        let assigned = svc.assigned_gpu(&t)?;
        let guest = connect(&svc, &t)?
            .gpu_info(GPU_INFO_TIMEOUT)
            .map_err(|e| match e {
                AgentClientError::Unsupported { .. } => ApiError::new(
                    StatusCode::CONFLICT,
                    "agent_unsupported",
                    format!("Tenant {name:?}: {e}"),
                ),
                other => agent_error(other),
            })?;
        let mut findings = gpu_info::compare(assigned.as_ref(), &guest);
        findings.sort_by_key(|f| f.level != FindingLevel::Mismatch);
        let matches = findings.iter().all(|f| f.level != FindingLevel::Mismatch);
        Ok(GpuInfoView {
            tenant: t.tenant.name.to_string(),
            assigned,
            guest,
            findings,
            matches,
        })
    })
    .await??;
    Ok((StatusCode::OK, Json(view)).into_response())
}
