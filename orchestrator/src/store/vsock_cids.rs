//! Guest vsock context ids (schema version 6): the CID of each tenant whose agent is reached
//! over vhost-vsock, unique among the tenants recorded here (the `UNIQUE` column makes two
//! tenants holding one CID impossible), kept across stop and start, released at departure.
//! The kernel also refuses a CID another VM on the host holds (a VMM this daemon does not
//! run): the launch step then asks for another, naming the CIDs found busy.

use std::collections::BTreeSet;

use rusqlite::{params, OptionalExtension, TransactionBehavior};

use super::{now_ms, Store, StoreError};

/// The smallest guest CID (0-2 are the hypervisor, local and host addresses).
pub const FIRST_CID: u32 = 3;
/// The largest guest CID (`u32::MAX` is `VMADDR_CID_ANY`).
pub const LAST_CID: u32 = u32::MAX - 1;

impl Store {
    /// The CID the tenant holds, if any.
    pub fn vsock_cid(&self, tenant_id: i64) -> Result<Option<u32>, StoreError> {
        let conn = self.lock();
        let cid: Option<i64> = conn
            .query_row(
                "SELECT cid FROM vsock_cids WHERE tenant_id = ?1",
                [tenant_id],
                |r| r.get(0),
            )
            .optional()?;
        cid.map(|c| u32::try_from(c).map_err(|_| StoreError::Corrupt(format!("vsock CID {c}"))))
            .transpose()
    }

    /// Gives the tenant a CID: the one it holds unless that is in `busy` (found held by
    /// another VM on the host), else the lowest CID >= [`FIRST_CID`] that no other tenant
    /// holds and that is not in `busy`. Two concurrent callers never get the same CID.
    pub fn allocate_vsock_cid(
        &self,
        tenant_id: i64,
        busy: &BTreeSet<u32>,
    ) -> Result<u32, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let held: Option<i64> = tx
            .query_row(
                "SELECT cid FROM vsock_cids WHERE tenant_id = ?1",
                [tenant_id],
                |r| r.get(0),
            )
            .optional()?;
        if let Some(cid) = held {
            let cid =
                u32::try_from(cid).map_err(|_| StoreError::Corrupt(format!("vsock CID {cid}")))?;
            if !busy.contains(&cid) {
                return Ok(cid);
            }
        }
        let taken: BTreeSet<u32> = {
            let mut stmt = tx.prepare("SELECT cid FROM vsock_cids WHERE tenant_id != ?1")?;
            let rows = stmt.query_map([tenant_id], |r| r.get::<_, i64>(0))?;
            rows.filter_map(|c| u32::try_from(c.ok()?).ok()).collect()
        };
        let mut candidate = FIRST_CID;
        while taken.contains(&candidate) || busy.contains(&candidate) {
            if candidate == LAST_CID {
                return Err(StoreError::CidsExhausted);
            }
            candidate += 1;
        }
        tx.execute(
            "INSERT INTO vsock_cids (tenant_id, cid, created_ms) VALUES (?1, ?2, ?3)
             ON CONFLICT (tenant_id) DO UPDATE SET cid = ?2, created_ms = ?3",
            params![tenant_id, i64::from(candidate), now_ms()],
        )?;
        tx.commit()?;
        Ok(candidate)
    }

    /// Returns the tenant's CID to the pool. Idempotent.
    pub fn release_vsock_cid(&self, tenant_id: i64) -> Result<(), StoreError> {
        let conn = self.lock();
        conn.execute("DELETE FROM vsock_cids WHERE tenant_id = ?1", [tenant_id])?;
        Ok(())
    }
}
