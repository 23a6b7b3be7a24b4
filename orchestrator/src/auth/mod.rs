//! Authentication: an admin token made at daemon init, and one token per tenant handed out
//! once at create. Only SHA-256 hashes are stored; tokens are 256 random bits, so a hash
//! lookup is safe, and the stored hash is compared again in constant time.

pub mod inference_key;

use std::path::{Path, PathBuf};

use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use thiserror::Error;

use crate::store::{Store, StoreError, TokenOwner};

/// Prefix of every token, so a leaked one is recognisable (secret scanners, logs).
pub const TOKEN_PREFIX: &str = "tvm_";
/// Name of the admin token file in the state directory.
pub const ADMIN_TOKEN_FILE: &str = "admin.token";

/// Why a request was not authenticated.
#[derive(Debug, Error)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    #[error("Missing token: send `Authorization: Bearer <token>` (the admin token is in <state-dir>/admin.token)")]
    Missing,
    /// The token is unknown or revoked.
    #[error("Invalid or revoked token")]
    Invalid,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The admin token file could not be written.
    #[error("Cannot write the admin token to {path}: {source}")]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The operator: sees and acts on every tenant.
    Admin,
    /// One tenant (row id): sees and acts on itself only.
    Tenant(i64),
}

impl Caller {
    /// Whether the caller may see the tenant with this row id.
    pub fn may_see(&self, tenant_id: i64) -> bool {
        match self {
            Caller::Admin => true,
            Caller::Tenant(id) => *id == tenant_id,
        }
    }
}

/// A fresh token: prefix + 64 hex digits (256 bits from the OS generator).
pub fn new_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{TOKEN_PREFIX}{}", hex::encode(bytes))
}

/// Hex SHA-256 of a token, as stored.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Compares two byte strings in time that depends only on their lengths (`subtle`).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

/// Resolves an `Authorization` header value to a caller.
pub fn authenticate(store: &Store, header: Option<&str>) -> Result<Caller, AuthError> {
    let token = header
        .and_then(|h| h.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or(AuthError::Missing)?;
    if !token.starts_with(TOKEN_PREFIX) || token.len() > 128 {
        return Err(AuthError::Invalid);
    }
    let hash = token_hash(token);
    match store.token_owner(&hash)? {
        Some((stored, owner)) if constant_time_eq(stored.as_bytes(), hash.as_bytes()) => {
            Ok(match owner {
                TokenOwner::Admin => Caller::Admin,
                TokenOwner::Tenant(id) => Caller::Tenant(id),
            })
        }
        _ => Err(AuthError::Invalid),
    }
}

/// Makes the admin token if the store has none: stores its hash and writes the token to
/// `<state_dir>/admin.token` through the one writer of secrets (atomic, mode 0600, never
/// through a symlink; a stale file there is replaced). Returns the file written.
pub fn ensure_admin_token(store: &Store, state_dir: &Path) -> Result<Option<PathBuf>, AuthError> {
    if store.has_admin_token()? {
        return Ok(None);
    }
    let token = new_token();
    let path = state_dir.join(ADMIN_TOKEN_FILE);
    crate::keys::write_secret(
        &path,
        format!("{token}\n").as_bytes(),
        crate::keys::Existing::Replace,
    )
    .map_err(|source| AuthError::TokenFile {
        path: path.clone(),
        source,
    })?;
    store.insert_token(&token_hash(&token), &TokenOwner::Admin)?;
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn tokens_are_random_and_prefixed() {
        let a = new_token();
        let b = new_token();
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX));
        assert_eq!(a.len(), TOKEN_PREFIX.len() + 64);
    }

    #[test]
    fn constant_time_eq_compares_bytes() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

    #[test]
    fn admin_token_is_written_0600_once_and_authenticates() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.db")).unwrap();
        let path = ensure_admin_token(&store, dir.path()).unwrap().unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(ensure_admin_token(&store, dir.path()).unwrap().is_none());
        let token = fs::read_to_string(&path).unwrap();
        let header = format!("Bearer {}", token.trim());
        assert_eq!(authenticate(&store, Some(&header)).unwrap(), Caller::Admin);
    }

    #[test]
    fn a_stale_world_readable_admin_token_file_is_replaced_0600() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join(ADMIN_TOKEN_FILE);
        fs::write(&stale, "tvm_stale\n").unwrap();
        fs::set_permissions(&stale, fs::Permissions::from_mode(0o644)).unwrap();
        let store = Store::open(&dir.path().join("s.db")).unwrap();
        let path = ensure_admin_token(&store, dir.path()).unwrap().unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_ne!(fs::read_to_string(&path).unwrap(), "tvm_stale\n");
    }

    #[test]
    fn unknown_missing_and_malformed_tokens_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.db")).unwrap();
        ensure_admin_token(&store, dir.path()).unwrap();
        assert!(matches!(
            authenticate(&store, None),
            Err(AuthError::Missing)
        ));
        assert!(matches!(
            authenticate(&store, Some("Basic x")),
            Err(AuthError::Missing)
        ));
        let fake = format!("Bearer {}", new_token());
        assert!(matches!(
            authenticate(&store, Some(&fake)),
            Err(AuthError::Invalid)
        ));
        assert!(matches!(
            authenticate(&store, Some("Bearer not-a-token")),
            Err(AuthError::Invalid)
        ));
    }

    #[test]
    fn tenant_callers_see_only_themselves() {
        assert!(Caller::Tenant(3).may_see(3));
        assert!(!Caller::Tenant(3).may_see(4));
        assert!(Caller::Admin.may_see(4));
    }
}
