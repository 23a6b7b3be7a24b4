//! Inference keys (the front door's API keys): each belongs to one tenant and is good for
//! that tenant's inference only. The store keeps the SHA-256 of each key, never the key;
//! `shown` is the key's first characters so that a person can tell keys apart in a list.

use rusqlite::{params, OptionalExtension};
use serde::{Deserialize, Serialize};

use super::{now_ms, Store, StoreError};

/// One inference key as listed (never the key itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InferenceKeyInfo {
    /// Its id (what `tenantvm key revoke` takes).
    pub id: i64,
    /// The key's first characters.
    pub shown: String,
    /// When it was made, ms since the epoch.
    pub created_ms: i64,
    /// When it was revoked, if it was.
    pub revoked_ms: Option<i64>,
}

impl Store {
    /// Records the hash of a new key of `tenant_id`; returns its id.
    pub fn insert_inference_key(
        &self,
        tenant_id: i64,
        sha256_hex: &str,
        shown: &str,
    ) -> Result<i64, StoreError> {
        let conn = self.lock();
        conn.execute(
            "INSERT INTO inference_keys (tenant_id, sha256, shown, created_ms) VALUES (?1, ?2, ?3, ?4)",
            params![tenant_id, sha256_hex, shown, now_ms()],
        )?;
        Ok(conn.last_insert_rowid())
    }

    /// The tenant of a live (unrevoked) key hash, with the stored hash for a constant-time
    /// comparison by the caller.
    pub fn inference_key_owner(
        &self,
        sha256_hex: &str,
    ) -> Result<Option<(String, i64)>, StoreError> {
        let conn = self.lock();
        Ok(conn
            .query_row(
                "SELECT sha256, tenant_id FROM inference_keys WHERE sha256 = ?1 AND revoked_ms IS NULL",
                [sha256_hex],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
    }

    /// A stamp that changes whenever anything in the database may have changed: rows
    /// written through this connection (SQLite's total change count) or commits by any
    /// other connection (`PRAGMA data_version`). The front door's key cache is good only
    /// while the stamp it was filled under is current, so a revoked key, a stopped or
    /// destroyed tenant, or a changed spec takes effect on the next request.
    pub fn change_stamp(&self) -> Result<(u64, i64), StoreError> {
        let conn = self.lock();
        let version: i64 = conn.query_row("PRAGMA data_version", [], |r| r.get(0))?;
        Ok((conn.total_changes(), version))
    }

    /// The keys of a tenant, oldest first, revoked ones included.
    pub fn inference_keys(&self, tenant_id: i64) -> Result<Vec<InferenceKeyInfo>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
            "SELECT id, shown, created_ms, revoked_ms FROM inference_keys WHERE tenant_id = ?1 ORDER BY id",
        )?;
        let rows = stmt.query_map([tenant_id], |r| {
            Ok(InferenceKeyInfo {
                id: r.get(0)?,
                shown: r.get(1)?,
                created_ms: r.get(2)?,
                revoked_ms: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Revokes key `id` of `tenant_id`; false when the tenant has no such live key.
    pub fn revoke_inference_key(&self, tenant_id: i64, id: i64) -> Result<bool, StoreError> {
        let conn = self.lock();
        let n = conn.execute(
            "UPDATE inference_keys SET revoked_ms = ?3 WHERE tenant_id = ?1 AND id = ?2 AND revoked_ms IS NULL",
            params![tenant_id, id, now_ms()],
        )?;
        Ok(n > 0)
    }

    /// Revokes every live key of a tenant (at departure); returns how many were live.
    pub fn revoke_tenant_inference_keys(&self, tenant_id: i64) -> Result<usize, StoreError> {
        let conn = self.lock();
        Ok(conn.execute(
            "UPDATE inference_keys SET revoked_ms = ?2 WHERE tenant_id = ?1 AND revoked_ms IS NULL",
            params![tenant_id, now_ms()],
        )?)
    }

    /// Live keys of a tenant (read back at departure to verify the revocation).
    pub fn live_inference_keys(&self, tenant_id: i64) -> Result<usize, StoreError> {
        let conn = self.lock();
        let n: i64 = conn.query_row(
            "SELECT COUNT(*) FROM inference_keys WHERE tenant_id = ?1 AND revoked_ms IS NULL",
            [tenant_id],
            |r| r.get(0),
        )?;
        Ok(usize::try_from(n).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::spec::TenantSpec;

    fn store_with_tenants() -> (tempfile::TempDir, Store, i64, i64) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.db")).unwrap();
        let mut ids = Vec::new();
        for name in ["a", "b"] {
            let spec =
                TenantSpec::from_toml(&format!("name = \"{name}\"\n[image]\nname = \"x\"\n"))
                    .unwrap();
            ids.push(
                store
                    .insert_tenant(&spec, crate::domain::GuestKind::Agent)
                    .unwrap()
                    .id,
            );
        }
        (dir, store, ids[0], ids[1])
    }

    #[test]
    fn keys_resolve_to_their_tenant_until_revoked_one_by_one_or_all() {
        let (_d, store, a, b) = store_with_tenants();
        let k1 = store.insert_inference_key(a, "h1", "tvk-11").unwrap();
        let k2 = store.insert_inference_key(a, "h2", "tvk-22").unwrap();
        store.insert_inference_key(b, "h3", "tvk-33").unwrap();
        assert_eq!(
            store.inference_key_owner("h1").unwrap(),
            Some(("h1".into(), a))
        );
        assert_eq!(
            store.inference_key_owner("h3").unwrap(),
            Some(("h3".into(), b))
        );
        assert_eq!(store.inference_key_owner("nope").unwrap(), None);
        // Another tenant cannot revoke a's key by its id.
        assert!(!store.revoke_inference_key(b, k1).unwrap());
        assert!(store.revoke_inference_key(a, k1).unwrap());
        assert!(!store.revoke_inference_key(a, k1).unwrap());
        assert_eq!(store.inference_key_owner("h1").unwrap(), None);
        let listed = store.inference_keys(a).unwrap();
        assert_eq!(listed.len(), 2);
        assert!(listed[0].revoked_ms.is_some() && listed[1].revoked_ms.is_none());
        assert_eq!(listed[1].id, k2);
        assert_eq!(store.revoke_tenant_inference_keys(a).unwrap(), 1);
        assert_eq!(store.live_inference_keys(a).unwrap(), 0);
        assert_eq!(store.live_inference_keys(b).unwrap(), 1);
        // The same hash cannot be stored twice.
        store.insert_inference_key(b, "h3", "x").unwrap_err();
    }
}
