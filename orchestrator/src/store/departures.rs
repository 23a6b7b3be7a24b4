//! The departure records and the GPU quarantine (schema version 2).
//!
//! A departure's receipt is built one step at a time: each departure step's record is written
//! here as soon as the step returns, so a daemon killed mid-departure resumes with the evidence
//! of the steps already done and appends exactly one complete receipt at the end.
//!
//! A GPU slice whose scrub did not verify is quarantined slot by slot; [`Store::reserve_gpu`]
//! never hands out a quarantined slot, and only a scrub that verifies lifts it.

use rusqlite::{params, OptionalExtension, TransactionBehavior};
use serde::{Deserialize, Serialize};

use super::{insert_event, now_ms, GpuPlacement, Store, StoreError};
use crate::receipt::{new_departure_id, Receipt, StepRecord};

/// A quarantined GPU slice: the placement whose scrub failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuarantinedSlice {
    /// The GPU.
    pub gpu: String,
    /// Its slots.
    pub slots: Vec<u32>,
    /// The placement label (`1g.18gb@3`, `whole`).
    pub label: String,
    /// Why it is quarantined.
    pub reason: String,
    /// Since when, ms since the epoch.
    pub since_ms: i64,
}

impl QuarantinedSlice {
    /// The slice as `tenantvm gpu scrub` names it: `<gpu>/<label>`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.gpu, self.label)
    }

    /// The placement it was.
    pub fn placement(&self) -> GpuPlacement {
        GpuPlacement {
            gpu: self.gpu.clone(),
            slots: self.slots.clone(),
            label: self.label.clone(),
        }
    }
}

fn corrupt(e: serde_json::Error) -> StoreError {
    StoreError::Corrupt(format!("departure receipt: {e}"))
}

impl Store {
    /// The tenant's departure receipt so far, starting one (with a fresh departure id) if none
    /// is recorded yet. Idempotent: a resumed departure gets the same id and records.
    pub fn begin_departure(&self, tenant_id: i64, tenant: &str) -> Result<Receipt, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let existing: Option<String> = tx
            .query_row(
                "SELECT receipt FROM departures WHERE tenant_id = ?1",
                [tenant_id],
                |r| r.get(0),
            )
            .optional()?;
        let receipt = match existing {
            Some(json) => serde_json::from_str(&json).map_err(corrupt)?,
            None => {
                let receipt = Receipt::begin(&new_departure_id(tenant), tenant);
                tx.execute(
                    "INSERT INTO departures (tenant_id, departure_id, receipt) VALUES (?1, ?2, ?3)",
                    params![
                        tenant_id,
                        receipt.departure_id,
                        serde_json::to_string(&receipt).map_err(corrupt)?
                    ],
                )?;
                insert_event(
                    &tx,
                    Some(tenant_id),
                    "departure",
                    &format!("departure {} begun", receipt.departure_id),
                )?;
                receipt
            }
        };
        tx.commit()?;
        Ok(receipt)
    }

    /// Adds (or replaces) one step's record in the tenant's departure receipt.
    pub fn record_departure_step(
        &self,
        tenant_id: i64,
        tenant: &str,
        step: StepRecord,
    ) -> Result<Receipt, StoreError> {
        let mut receipt = self.begin_departure(tenant_id, tenant)?;
        receipt.record(step);
        let conn = self.lock();
        conn.execute(
            "UPDATE departures SET receipt = ?2 WHERE tenant_id = ?1",
            params![tenant_id, serde_json::to_string(&receipt).map_err(corrupt)?],
        )?;
        Ok(receipt)
    }

    /// The tenant's departure receipt and whether it was appended to the audit log.
    pub fn departure(&self, tenant_id: i64) -> Result<Option<(Receipt, bool)>, StoreError> {
        let conn = self.lock();
        let row: Option<(String, Option<i64>)> = conn
            .query_row(
                "SELECT receipt, appended_ms FROM departures WHERE tenant_id = ?1",
                [tenant_id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        row.map(|(json, appended)| {
            Ok((
                serde_json::from_str(&json).map_err(corrupt)?,
                appended.is_some(),
            ))
        })
        .transpose()
    }

    /// Records that the receipt is in the audit log.
    pub fn departure_appended(&self, tenant_id: i64) -> Result<(), StoreError> {
        let conn = self.lock();
        conn.execute(
            "UPDATE departures SET appended_ms = COALESCE(appended_ms, ?2) WHERE tenant_id = ?1",
            params![tenant_id, now_ms()],
        )?;
        Ok(())
    }

    /// Quarantines every slot of `placement` (idempotent; the first reason is kept).
    pub fn quarantine_gpu(&self, placement: &GpuPlacement, reason: &str) -> Result<(), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        for slot in &placement.slots {
            tx.execute(
                "INSERT INTO gpu_quarantine (gpu, slot, placement, reason, since_ms) VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (gpu, slot) DO NOTHING",
                params![placement.gpu, slot, placement.label, reason, now_ms()],
            )?;
        }
        insert_event(
            &tx,
            None,
            "gpu",
            &format!(
                "quarantined {}/{}: {reason}",
                placement.gpu, placement.label
            ),
        )?;
        tx.commit()?;
        Ok(())
    }

    /// Lifts the quarantine of every slot of `placement` (after a scrub verified). Returns how
    /// many slots were released.
    pub fn lift_quarantine(&self, placement: &GpuPlacement) -> Result<usize, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut n = 0;
        for slot in &placement.slots {
            n += tx.execute(
                "DELETE FROM gpu_quarantine WHERE gpu = ?1 AND slot = ?2",
                params![placement.gpu, slot],
            )?;
        }
        if n > 0 {
            insert_event(
                &tx,
                None,
                "gpu",
                &format!("quarantine of {}/{} lifted", placement.gpu, placement.label),
            )?;
        }
        tx.commit()?;
        Ok(n)
    }

    /// Every quarantined slice, grouped by (GPU, placement label).
    pub fn quarantined(&self) -> Result<Vec<QuarantinedSlice>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
            "SELECT gpu, slot, placement, reason, since_ms FROM gpu_quarantine ORDER BY gpu, placement, slot",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, u32>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, i64>(4)?,
            ))
        })?;
        let mut out: Vec<QuarantinedSlice> = Vec::new();
        for row in rows {
            let (gpu, slot, label, reason, since_ms) = row?;
            match out.last_mut() {
                Some(q) if q.gpu == gpu && q.label == label => q.slots.push(slot),
                _ => out.push(QuarantinedSlice {
                    gpu,
                    slots: vec![slot],
                    label,
                    reason,
                    since_ms,
                }),
            }
        }
        Ok(out)
    }
}

/// Whether any slot of `cand` is quarantined (inside a reservation's transaction).
pub(super) fn any_quarantined(
    conn: &rusqlite::Connection,
    cand: &GpuPlacement,
) -> Result<bool, StoreError> {
    for slot in &cand.slots {
        let hit: Option<i64> = conn
            .query_row(
                "SELECT 1 FROM gpu_quarantine WHERE gpu = ?1 AND slot = ?2",
                params![cand.gpu, slot],
                |r| r.get(0),
            )
            .optional()?;
        if hit.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

impl Store {
    /// Sets (or clears) a tenant's error without a state change: a destroy that stopped at a
    /// failed step stays `destroying` with the error until it is resumed.
    pub fn set_tenant_error(&self, tenant_id: i64, error: Option<&str>) -> Result<(), StoreError> {
        // Errors quote guests: bounded, on one line (crate::untrusted).
        let error = error.map(crate::untrusted::one_line);
        let error = error.as_deref();
        let conn = self.lock();
        conn.execute(
            "UPDATE tenants SET error = ?2, updated_ms = ?3 WHERE id = ?1",
            params![tenant_id, error, now_ms()],
        )?;
        if let Some(e) = error {
            insert_event(&conn, Some(tenant_id), "error", e)?;
        }
        Ok(())
    }
}

impl Store {
    /// The tenant a token belonged to if it was revoked because that tenant departed (its
    /// row is `destroyed`), with the stored hash for a constant-time comparison. Such a token
    /// may still read its own receipt, and nothing else.
    pub fn departed_token_owner(
        &self,
        sha256_hex: &str,
    ) -> Result<Option<(String, i64)>, StoreError> {
        let conn = self.lock();
        Ok(conn
            .query_row(
                "SELECT k.sha256, k.tenant_id FROM tokens k JOIN tenants t ON t.id = k.tenant_id
                 WHERE k.sha256 = ?1 AND k.role = 'tenant' AND k.revoked_ms IS NOT NULL AND t.state = 'destroyed'",
                [sha256_hex],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
    }
}
