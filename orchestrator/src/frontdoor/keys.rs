//! Inference keys: API keys for a tenant's clients at the front door. A key is
//! [`KEY_PREFIX`] and 64 hex digits (256 random bits); the store keeps only its SHA-256,
//! so a key is shown once, at creation. A key is good for its tenant's inference only:
//! the front door takes no admin or tenant token, and the admin API takes no inference
//! key, so a client application cannot stop or destroy its tenant. Keys are revoked at
//! departure (the receipt says so).

use rand::RngCore;
use sha2::{Digest, Sha256};

use super::OpenAiError;
use crate::auth::constant_time_eq;
use crate::domain::lifecycle::LifecycleState;
use crate::store::{Store, StoreError, TenantRecord};

/// How every inference key starts.
pub const KEY_PREFIX: &str = "tvk-";
/// Characters of a key kept for `tenantvm key list`.
pub const SHOWN_CHARS: usize = 12;

/// A new key: the key itself (shown once), its hash and its shown part.
#[derive(Debug)]
pub struct NewKey {
    /// The key, for the client.
    pub key: String,
    /// SHA-256 of the key, hex (what the store keeps).
    pub sha256: String,
    /// Its first [`SHOWN_CHARS`] characters.
    pub shown: String,
}

/// The SHA-256 (hex) of a key.
pub fn key_hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Makes a new random key.
pub fn new_key() -> NewKey {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let key = format!("{KEY_PREFIX}{}", hex::encode(bytes));
    NewKey {
        sha256: key_hash(&key),
        shown: key[..SHOWN_CHARS].to_string(),
        key,
    }
}

/// Makes a key for tenant `tenant_id` and records its hash; returns the key and its id.
pub fn create(store: &Store, tenant_id: i64) -> Result<(String, i64, String), StoreError> {
    let k = new_key();
    let id = store.insert_inference_key(tenant_id, &k.sha256, &k.shown)?;
    Ok((k.key, id, k.shown))
}

/// The live tenant of an `Authorization` header's inference key. No key, a malformed one,
/// an unknown or revoked one, and one whose tenant is gone all get the same answer.
pub fn authenticate(store: &Store, header: Option<&str>) -> Result<TenantRecord, OpenAiError> {
    let key = header
        .and_then(|h| h.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|k| k.starts_with(KEY_PREFIX) && k.len() <= 128)
        .ok_or_else(OpenAiError::invalid_key)?;
    let hash = key_hash(key);
    let store_failed =
        |e: StoreError| OpenAiError::from(crate::tenant::infer::InferError::Store(e));
    let Some((stored, tenant_id)) = store.inference_key_owner(&hash).map_err(store_failed)? else {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_random_prefixed_and_only_their_hash_is_kept() {
        let (a, b) = (new_key(), new_key());
        assert_ne!(a.key, b.key);
        assert!(a.key.starts_with(KEY_PREFIX));
        assert_eq!(a.key.len(), KEY_PREFIX.len() + 64);
        assert_eq!(a.sha256, key_hash(&a.key));
        assert!(!a.sha256.contains(&a.key[KEY_PREFIX.len()..]));
        assert!(a.key.starts_with(&a.shown) && a.shown.len() == SHOWN_CHARS);
    }
}
