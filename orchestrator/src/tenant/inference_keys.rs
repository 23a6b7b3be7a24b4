//! A tenant's inference keys (what its clients present at the front door), as service
//! operations: made, listed and revoked by the admin or the tenant itself, under the one
//! access rule ([`crate::tenant::access`]). A key is shown once, when it is made; the store
//! keeps its hash, and events name it by id and first characters only.

use crate::auth::Caller;
use crate::domain::lifecycle::LifecycleState;
use crate::store::InferenceKeyInfo;
use crate::tenant::service::TenantService;
use crate::tenant::service_error::TenantServiceError;

/// A key just made: the only time the key itself is seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewKey {
    /// The tenant.
    pub tenant: String,
    /// The key's id.
    pub id: i64,
    /// The key.
    pub key: String,
    /// Its first characters, as listings show them.
    pub shown: String,
}

impl TenantService {
    /// Makes a key for tenant `name`; refused while the tenant is being destroyed
    /// (departure revokes them all) or recovered.
    pub fn create_key(&self, caller: &Caller, name: &str) -> Result<NewKey, TenantServiceError> {
        let t = self.tenant_to_act(caller, name)?;
        if matches!(
            t.state,
            LifecycleState::Destroying | LifecycleState::Destroyed
        ) {
            return Err(TenantServiceError::Departing(name.to_string()));
        }
        let (key, id, shown) = crate::auth::inference_key::create(self.store(), t.id)?;
        // The event names the key by id and first characters, never the key.
        let _ = self.store().add_event(
            Some(t.id),
            "inference-key",
            &format!("inference key {id} ({shown}...) created"),
        );
        Ok(NewKey {
            tenant: t.name.to_string(),
            id,
            key,
            shown,
        })
    }

    /// Tenant `name`'s keys, oldest first, revoked ones too (never the keys themselves).
    pub fn keys(
        &self,
        caller: &Caller,
        name: &str,
    ) -> Result<(String, Vec<InferenceKeyInfo>), TenantServiceError> {
        let t = self.tenant_to_see(caller, name)?;
        Ok((t.name.to_string(), self.store().inference_keys(t.id)?))
    }

    /// Revokes tenant `name`'s live key `id`; returns the tenant's name.
    pub fn revoke_key(
        &self,
        caller: &Caller,
        name: &str,
        id: i64,
    ) -> Result<String, TenantServiceError> {
        let t = self.tenant_to_act(caller, name)?;
        if !self.store().revoke_inference_key(t.id, id)? {
            return Err(TenantServiceError::NoSuchKey {
                name: t.name.to_string(),
                id,
            });
        }
        let _ = self.store().add_event(
            Some(t.id),
            "inference-key",
            &format!("inference key {id} revoked"),
        );
        Ok(t.name.to_string())
    }
}
