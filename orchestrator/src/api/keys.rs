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
use crate::store::InferenceKeyInfo;
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
    pub keys: Vec<KeyView>,
}

/// Answer of `DELETE /v1/tenants/{name}/keys/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KeyRevoked {
    /// The tenant.
    pub tenant: String,
    /// The key revoked.
    pub id: i64,
}

/// One key as listed (never the key itself).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KeyView {
    /// Its id (what `tenantvm key revoke` takes).
    pub id: i64,
    /// The key's first characters.
    pub shown: String,
    /// When it was made, ms since the epoch.
    pub created_ms: i64,
    /// When it was revoked, if it was.
    pub revoked_ms: Option<i64>,
}

impl From<InferenceKeyInfo> for KeyView {
    fn from(k: InferenceKeyInfo) -> Self {
        KeyView {
            id: k.id,
            shown: k.shown,
            created_ms: k.created_ms,
            revoked_ms: k.revoked_ms,
        }
    }
}

/// Authenticates, takes a place on the caller's lane and runs `work` on a thread of its own.
async fn as_caller<T: Send + 'static>(
    api: &ApiState,
    headers: &HeaderMap,
    work: impl FnOnce(&TenantService, &Caller) -> Result<T, TenantServiceError> + Send + 'static,
) -> Result<T, ApiError> {
    let caller = auth::authenticate(api.svc.store(), authorization(headers))?;
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    Ok(offload(permit, move || work(&svc, &caller)).await??)
}

/// `POST /v1/tenants/{name}/keys`.
pub(super) async fn create(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = tenant_name(name)?;
    let k = as_caller(&api, &headers, move |svc, caller| {
        svc.create_key(caller, &name)
    })
    .await?;
    let created = KeyCreated {
        tenant: k.tenant,
        id: k.id,
        key: k.key,
        shown: k.shown,
    };
    Ok((StatusCode::CREATED, Json(created)).into_response())
}

/// `GET /v1/tenants/{name}/keys`.
pub(super) async fn list(
    State(api): State<ApiState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = tenant_name(name)?;
    let (tenant, keys) =
        as_caller(&api, &headers, move |svc, caller| svc.keys(caller, &name)).await?;
    let list = KeyList {
        tenant,
        keys: keys.into_iter().map(KeyView::from).collect(),
    };
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
    let tenant = as_caller(&api, &headers, move |svc, caller| {
        svc.revoke_key(caller, &name, id)
    })
    .await?;
    Ok((StatusCode::OK, Json(KeyRevoked { tenant, id })).into_response())
}
