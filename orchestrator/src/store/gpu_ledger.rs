//! The GPU ledger: which tenant holds which slots of which GPU. The `(gpu, slot)` primary
//! key of `gpu_reservations` makes a double booking impossible even across connections;
//! quarantined slots (departures.rs) are never handed out.

use rusqlite::{params, Connection, TransactionBehavior};
use serde::{Deserialize, Serialize};

use super::{departures, insert_event, now_ms, Store, StoreError};

/// A GPU placement: a set of slots on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPlacement {
    /// GPU identifier (UUID or PCI address).
    pub gpu: String,
    /// The slots (MIG memory slices; all of them for a whole GPU) it occupies.
    pub slots: Vec<u32>,
    /// What it is, for display (`whole`, `1g.10gb@0`, ...).
    pub label: String,
}

impl Store {
    /// Reserves the first of `candidates` whose slots are all free, atomically, and returns
    /// it; returns the tenant's existing placement if it already holds one, and None if every
    /// candidate is taken. The `(gpu, slot)` primary key makes a double booking impossible
    /// even across connections.
    pub fn reserve_gpu(
        &self,
        tenant_id: i64,
        candidates: &[GpuPlacement],
    ) -> Result<Option<GpuPlacement>, StoreError> {
        let mut conn = self.lock();
        let mut tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        if let Some(existing) = placement_of(&tx, tenant_id)? {
            return Ok(Some(existing));
        }
        for cand in candidates {
            // A quarantined slot (its last scrub did not verify) is never handed out.
            if departures::any_quarantined(&tx, cand)? {
                continue;
            }
            let sp = tx.savepoint()?;
            let mut ok = true;
            for slot in &cand.slots {
                let r = sp.execute(
                    "INSERT INTO gpu_reservations (gpu, slot, tenant_id, placement, created_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
                    params![cand.gpu, slot, tenant_id, cand.label, now_ms()],
                );
                match r {
                    Ok(_) => {}
                    Err(rusqlite::Error::SqliteFailure(e, _))
                        if e.code == rusqlite::ErrorCode::ConstraintViolation =>
                    {
                        ok = false;
                        break;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if ok {
                sp.commit()?;
                insert_event(
                    &tx,
                    Some(tenant_id),
                    "gpu",
                    &format!("reserved {} on {}", cand.label, cand.gpu),
                )?;
                tx.commit()?;
                return Ok(Some(cand.clone()));
            }
            // Dropping the savepoint rolls back this candidate's partial inserts.
        }
        Ok(None)
    }

    /// The placement a tenant holds, if any.
    pub fn gpu_placement(&self, tenant_id: i64) -> Result<Option<GpuPlacement>, StoreError> {
        let conn = self.lock();
        placement_of(&conn, tenant_id)
    }

    /// Releases every slot a tenant holds. Idempotent.
    pub fn release_gpu(&self, tenant_id: i64) -> Result<usize, StoreError> {
        let conn = self.lock();
        Ok(conn.execute(
            "DELETE FROM gpu_reservations WHERE tenant_id = ?1",
            [tenant_id],
        )?)
    }

    /// The placements the ledger holds, one per tenant (GPU and label; slots included).
    pub fn gpu_placements(&self) -> Result<Vec<GpuPlacement>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
            "SELECT gpu, slot, placement, tenant_id FROM gpu_reservations ORDER BY tenant_id, gpu, slot",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, u32>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, i64>(3)?,
            ))
        })?;
        let mut out: Vec<(i64, GpuPlacement)> = Vec::new();
        for row in rows {
            let (gpu, slot, label, tenant) = row?;
            match out.last_mut() {
                Some((t, p)) if *t == tenant && p.gpu == gpu && p.label == label => {
                    p.slots.push(slot);
                }
                _ => out.push((
                    tenant,
                    GpuPlacement {
                        gpu,
                        slots: vec![slot],
                        label,
                    },
                )),
            }
        }
        Ok(out.into_iter().map(|(_, p)| p).collect())
    }

    /// Every reservation: (gpu, slot, tenant id).
    pub fn gpu_reservations(&self) -> Result<Vec<(String, u32, i64)>, StoreError> {
        let conn = self.lock();
        let mut stmt =
            conn.prepare("SELECT gpu, slot, tenant_id FROM gpu_reservations ORDER BY gpu, slot")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

fn placement_of(conn: &Connection, tenant_id: i64) -> Result<Option<GpuPlacement>, StoreError> {
    let mut stmt = conn.prepare(
        "SELECT gpu, slot, placement FROM gpu_reservations WHERE tenant_id = ?1 ORDER BY slot",
    )?;
    let rows = stmt.query_map([tenant_id], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, u32>(1)?,
            r.get::<_, String>(2)?,
        ))
    })?;
    let mut placement: Option<GpuPlacement> = None;
    for row in rows {
        let (gpu, slot, label) = row?;
        match &mut placement {
            Some(p) => p.slots.push(slot),
            None => {
                placement = Some(GpuPlacement {
                    gpu,
                    slots: vec![slot],
                    label,
                });
            }
        }
    }
    Ok(placement)
}
