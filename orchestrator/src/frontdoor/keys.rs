//! Inference keys: API keys for a tenant's clients at the front door. A key is
//! [`KEY_PREFIX`] and 64 hex digits (256 random bits); the store keeps only its SHA-256,
//! so a key is shown once, at creation. A key is good for its tenant's inference only:
//! the front door takes no admin or tenant token, and the admin API takes no inference
//! key, so a client application cannot stop or destroy its tenant. Keys are revoked at
//! departure (the receipt says so).

use super::OpenAiError;
use crate::auth::constant_time_eq;
use crate::auth::inference_key::{key_hash, KEY_PREFIX};
use crate::domain::lifecycle::LifecycleState;
use crate::store::{Store, StoreError, TenantRecord};

/// The live tenant of an `Authorization` header's inference key. No key, a malformed one,
/// an unknown or revoked one, and one whose tenant is gone all get the same answer.
pub fn authenticate(store: &Store, header: Option<&str>) -> Result<TenantRecord, OpenAiError> {
    let key = bearer_key(header)?;
    lookup(store, &key_hash(key))
}

/// The key of a `Bearer` header, if it has the shape of an inference key.
fn bearer_key(header: Option<&str>) -> Result<&str, OpenAiError> {
    header
        .and_then(|h| h.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|k| k.starts_with(KEY_PREFIX) && k.len() <= 128)
        .ok_or_else(OpenAiError::invalid_key)
}

fn store_failed(e: StoreError) -> OpenAiError {
    OpenAiError::from(crate::tenant::infer::InferError::Store(e))
}

/// The live tenant of a key's hash, from the store.
fn lookup(store: &Store, hash: &str) -> Result<TenantRecord, OpenAiError> {
    let Some((stored, tenant_id)) = store.inference_key_owner(hash).map_err(store_failed)? else {
        return Err(OpenAiError::invalid_key());
    };
    if !constant_time_eq(stored.as_bytes(), hash.as_bytes()) {
        return Err(OpenAiError::invalid_key());
    }
    let record = store.tenant_by_id(tenant_id).map_err(store_failed)?;
    if record.state == LifecycleState::Destroyed {
        return Err(OpenAiError::invalid_key());
    }
    Ok(record)
}

/// Most keys remembered by a [`KeyCache`] (it starts afresh when full).
pub const KEY_CACHE_ENTRIES: usize = 4096;

/// Remembers which tenant each recently used key belongs to, so a request on a known key
/// costs no key or tenant query. Every entry is good only under the store's
/// [`Store::change_stamp`] it was read under: any write to the store (a key revoked, a
/// tenant stopped, destroyed or changed) empties the cache before the next lookup, so a
/// revoked key stops working at once. Only live keys are remembered; an unknown key is
/// looked up every time.
#[derive(Debug, Default)]
pub struct KeyCache {
    inner: std::sync::Mutex<CacheInner>,
}

#[derive(Debug, Default)]
struct CacheInner {
    stamp: Option<(u64, i64)>,
    tenants: std::collections::HashMap<String, TenantRecord>,
}

impl KeyCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, CacheInner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// [`authenticate`], answered from the cache while the store has not changed.
    pub fn authenticate(
        &self,
        store: &Store,
        header: Option<&str>,
    ) -> Result<TenantRecord, OpenAiError> {
        let key = bearer_key(header)?;
        let hash = key_hash(key);
        let stamp = store.change_stamp().map_err(store_failed)?;
        {
            let mut inner = self.lock();
            if inner.stamp != Some(stamp) {
                inner.tenants.clear();
                inner.stamp = Some(stamp);
            } else if let Some(record) = inner.tenants.get(&hash) {
                return Ok(record.clone());
            }
        }
        let record = lookup(store, &hash)?;
        // Remembered only if nothing was written while it was read.
        if store.change_stamp().map_err(store_failed)? == stamp {
            let mut inner = self.lock();
            if inner.stamp == Some(stamp) {
                if inner.tenants.len() >= KEY_CACHE_ENTRIES {
                    inner.tenants.clear();
                }
                inner.tenants.insert(hash, record.clone());
            }
        }
        Ok(record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::inference_key::create;

    fn store_with_tenant() -> (tempfile::TempDir, Store, TenantRecord) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("state.db")).unwrap();
        let spec = crate::domain::spec::TenantSpec::from_toml(
            "name = \"cached\"\nmemory_mib = 32\n[image]\nname = \"idle\"\n",
        )
        .unwrap();
        let t = store
            .insert_tenant(&spec, crate::domain::GuestKind::Agent)
            .unwrap();
        (dir, store, t)
    }

    #[test]
    fn cached_keys_follow_every_store_change_at_once() {
        let (dir, store, t) = store_with_tenant();
        let cache = KeyCache::default();
        let (key, id, _) = create(&store, t.id).unwrap();
        let (other, other_id, _) = create(&store, t.id).unwrap();
        let (third, _, _) = create(&store, t.id).unwrap();
        let bearer = format!("Bearer {key}");
        assert_eq!(cache.authenticate(&store, Some(&bearer)).unwrap().id, t.id);
        // Answered from the cache (the same record), and bad keys are refused alike.
        assert_eq!(cache.authenticate(&store, Some(&bearer)).unwrap().id, t.id);
        assert_eq!(cache.lock().tenants.len(), 1);
        for bad in [None, Some("Bearer nope"), Some("Bearer tvk-0000")] {
            assert_eq!(
                cache.authenticate(&store, bad).unwrap_err().code,
                OpenAiError::invalid_key().code
            );
        }
        // A state change shows in the next answer (the cached record is not served stale).
        store
            .transition(t.id, LifecycleState::Provisioning, None, None)
            .unwrap();
        let seen = cache.authenticate(&store, Some(&bearer)).unwrap();
        assert_eq!(seen.state, LifecycleState::Provisioning);
        // A revoked key stops working on the very next request; the others still work.
        assert!(store.revoke_inference_key(t.id, id).unwrap());
        cache.authenticate(&store, Some(&bearer)).unwrap_err();
        let (other, third) = (format!("Bearer {other}"), format!("Bearer {third}"));
        cache.authenticate(&store, Some(&other)).unwrap();
        cache.authenticate(&store, Some(&third)).unwrap();
        // A revocation by another connection (another process) counts as much.
        let second = Store::open(&dir.path().join("state.db")).unwrap();
        assert!(second.revoke_inference_key(t.id, other_id).unwrap());
        cache.authenticate(&store, Some(&other)).unwrap_err();
        // A destroyed tenant's keys stop working at once.
        cache.authenticate(&store, Some(&third)).unwrap();
        for to in [
            LifecycleState::Failed,
            LifecycleState::Destroying,
            LifecycleState::Destroyed,
        ] {
            store.transition(t.id, to, None, None).unwrap();
        }
        cache.authenticate(&store, Some(&third)).unwrap_err();
    }
}
