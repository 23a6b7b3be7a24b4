//! Inference keys' material: a key is [`KEY_PREFIX`] and 64 hex digits (256 random bits);
//! the store keeps only its SHA-256, so a key is shown once, when it is made. The front
//! door authenticates with them ([`crate::frontdoor::keys`]); the service makes and revokes
//! them ([`crate::tenant::inference_keys`]).

use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::store::{Store, StoreError};

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
