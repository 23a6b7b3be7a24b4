//! `GET /v1/metrics`: the per-tenant metrics in the Prometheus text format
//! ([`crate::metrics`]). The admin's token reads every tenant's series, a tenant's token its
//! own only (a tenant's clients read the same with an inference key at the front door's
//! `GET /metrics`). The VMs are sampled first, off the async runtime: all tenants at once for the admin
//! ([`crate::metrics::sample::sample_tenants`]), so one silent VMM costs the scrape at most
//! its deadline.

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::lanes::{offload, Lane};
use super::{authorization, ApiError, ApiState};
use crate::auth::{self, Caller};
use crate::tenant::service::TenantServiceError;

/// `GET /v1/metrics`.
pub(super) async fn metrics(
    State(api): State<ApiState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    let text = offload(permit, move || -> Result<String, ApiError> {
        let store_error = |e| ApiError::from(TenantServiceError::Store(e));
        match caller {
            Caller::Admin => {
                let tenants = svc.store().list_tenants(false).map_err(store_error)?;
                crate::metrics::sample::sample_tenants(&svc, &tenants);
                Ok(svc.metrics().render(None))
            }
            Caller::Tenant(id) => {
                let t = svc.store().tenant_by_id(id).map_err(store_error)?;
                crate::frontdoor::sample_vm(&svc, &t);
                Ok(svc.metrics().render(Some(t.name.as_str())))
            }
        }
    })
    .await??;
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        text,
    )
        .into_response())
}
