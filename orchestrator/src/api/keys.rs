//! The API's inference-key routes, for the admin and the tenant's own token (an
//! inference key reaches none of them: the admin API takes tokens only):
//!
//! - `POST /v1/tenants/{name}/keys`: a new key, shown once (201);
//! - `GET /v1/tenants/{name}/keys`: its keys, by id and first characters, revoked ones too;
//! - `DELETE /v1/tenants/{name}/keys/{id}`: revokes one (404 if it has no such live key).
//!
//! A tenant that is being destroyed gets no new key (409): departure revokes them all.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use super::lanes::{offload, Lane};
use super::{authorization, tenant_name, ApiError, ApiState};
use crate::auth::{self, Caller};
use crate::domain::lifecycle::LifecycleState;
use crate::domain::TenantName;
use crate::store::{InferenceKeyInfo, TenantRecord};
use crate::tenant::service::{TenantService, TenantServiceError};

/// Answer of `POST /v1/tenants/{name}/keys`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KeyCreated {
    /// The tenant.
    pub tenant: String,
    /// The key's id.
    pub id: i64,
    /// The key itself: shown this once, only its hash is kept.
    pub key: String,
    /// Its first characters, as `key list` shows them.
    pub shown: String,
}

/// Answer of `GET /v1/tenants/{name}/keys`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KeyList {
    /// The tenant.
    pub tenant: String,
    /// Its keys, oldest first.
    pub keys: Vec<InferenceKeyInfo>,
}

/// Answer of `DELETE /v1/tenants/{name}/keys/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KeyRevoked {
    /// The tenant.
    pub tenant: String,
    /// The key revoked.
    pub id: i64,
}

fn not_found(name: &str) -> ApiError {
    TenantServiceError::NotFound(name.to_string()).into()
}

/// The live tenant `name` if `caller` may see it (NotFound otherwise, whether or not it
/// exists, as for every other tenant route).
fn visible(svc: &TenantService, caller: &Caller, name: &str) -> Result<TenantRecord, ApiError> {
    if TenantName::check(name).is_err() {
        return Err(not_found(name));
    }
    match svc.store().tenant(name).map_err(TenantServiceError::from)? {
        Some(t) if caller.may_see(t.id) => Ok(t),
        _ => Err(not_found(name)),
    }
}

/// Authenticates, takes a place on the caller's lane and runs `work` on a thread of its own.
async fn with_tenant<T: Send + 'static>(
    api: &ApiState,
    headers: &HeaderMap,
    name: String,
    work: impl FnOnce(&TenantService, TenantRecord) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let caller = auth::authenticate(api.svc.store(), authorization(headers))?;
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    offload(permit, move || {
        let record = visible(&svc, &caller, &name)?;
        work(&svc, record)
    })
    .await?
}

fn store_error(e: crate::store::StoreError) -> ApiError {
    TenantServiceError::from(e).into()
}

/// `POST /v1/tenants/{name}/keys`.
pub(super) async fn create(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = tenant_name(name)?;
    let created = with_tenant(&api, &headers, name, |svc, t| {
        if matches!(
            t.state,
            LifecycleState::Destroying | LifecycleState::Destroyed
        ) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "invalid_state",
                format!(
                    "Tenant {:?} is being destroyed; it gets no new keys",
                    t.name.as_str()
                ),
            ));
        }
        let (key, id, shown) =
            crate::frontdoor::keys::create(svc.store(), t.id).map_err(store_error)?;
        // The event names the key by id and first characters, never the key.
        let _ = svc.store().add_event(
            Some(t.id),
            "inference-key",
            &format!("inference key {id} ({shown}...) created"),
        );
        Ok(KeyCreated {
            tenant: t.name.to_string(),
            id,
            key,
            shown,
        })
    })
    .await?;
    Ok((StatusCode::CREATED, Json(created)).into_response())
}

/// `GET /v1/tenants/{name}/keys`.
pub(super) async fn list(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = tenant_name(name)?;
    let list = with_tenant(&api, &headers, name, |svc, t| {
        Ok(KeyList {
            tenant: t.name.to_string(),
            keys: svc.store().inference_keys(t.id).map_err(store_error)?,
        })
    })
    .await?;
    Ok((StatusCode::OK, Json(list)).into_response())
}

/// `DELETE /v1/tenants/{name}/keys/{id}`.
pub(super) async fn revoke(
    State(api): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<(String, i64)>, PathRejection>,
) -> Result<Response, ApiError> {
    let Ok(Path((name, id))) = path else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "No such key: give the tenant's name and a key id from `tenantvm key list`",
        ));
    };
    let revoked = with_tenant(&api, &headers, name, move |svc, t| {
        if !svc
            .store()
            .revoke_inference_key(t.id, id)
            .map_err(store_error)?
        {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!(
                    "Tenant {:?} has no live key {id}; see `tenantvm key list {}`",
                    t.name.as_str(),
                    t.name
                ),
            ));
        }
        let _ = svc.store().add_event(
            Some(t.id),
            "inference-key",
            &format!("inference key {id} revoked"),
        );
        Ok(KeyRevoked {
            tenant: t.name.to_string(),
            id,
        })
    })
    .await?;
    Ok((StatusCode::OK, Json(revoked)).into_response())
}
