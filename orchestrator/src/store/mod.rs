//! Durable state in SQLite (WAL): tenants, operations and their steps, resources held,
//! the GPU reservation ledger, events and token hashes. Nothing important lives only in
//! memory: the daemon can be killed at any instant and [`crate::reconcile`] picks up from here.
//!
//! Each [`Store`] is one connection. The daemon shares one behind a mutex; tests open several
//! on the same file to race them. Writes that must not interleave (uid allocation, GPU
//! reservation, state transitions) run in `BEGIN IMMEDIATE` transactions.

mod departures;
mod gpu_devices;
mod gpu_ledger;
mod inference_keys;
mod migrations;
mod vsock_cids;

pub use departures::QuarantinedSlice;
pub use gpu_devices::GpuDeviceRow;
pub use gpu_ledger::GpuPlacement;
pub use inference_keys::InferenceKeyInfo;
pub use vsock_cids::{FIRST_CID, LAST_CID};

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::domain::lifecycle::{LifecycleError, LifecycleState};
use crate::domain::spec::TenantSpec;
use crate::domain::{GuestKind, TenantName};

/// Store failures.
#[derive(Debug, Error)]
pub enum StoreError {
    /// SQLite said no.
    #[error("Database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// A stored JSON column did not decode.
    #[error("Corrupt record in the store: {0}")]
    Corrupt(String),
    /// A live tenant already has this name.
    #[error("A tenant named {0:?} already exists; pick another name or destroy it first")]
    DuplicateName(String),
    /// No live tenant has this name.
    #[error("No tenant named {0:?}")]
    NoSuchTenant(String),
    /// A state change was refused.
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
    /// Every uid of the configured range is taken.
    #[error("No free uid left in {0}..{1}; destroy tenants or widen --uid-range")]
    UidsExhausted(u32, u32),
    /// Every guest vsock CID is taken (by tenants or by other VMs on the host).
    #[error("No free vsock CID left; destroy tenants or free CIDs held by other VMs on this host")]
    CidsExhausted,
    /// The schema is newer than this binary.
    #[error("Store schema version {0} is newer than this tenantvmd understands ({1}); upgrade tenantvmd")]
    SchemaTooNew(i64, usize),
}

/// What kind of host resource a [`ResourceRecord`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResourceKind {
    /// A VMM process; key `pid:start_ticks`, detail the backend's `RunningVm` JSON.
    Process,
    /// A cgroup; key the tenant's cgroup name.
    Cgroup,
    /// A file or directory; key its absolute path.
    File,
    /// A uid (and the gid of the same number).
    Uid,
}

impl ResourceKind {
    fn as_str(self) -> &'static str {
        match self {
            ResourceKind::Process => "process",
            ResourceKind::Cgroup => "cgroup",
            ResourceKind::File => "file",
            ResourceKind::Uid => "uid",
        }
    }

    fn parse(s: &str) -> Result<Self, StoreError> {
        Ok(match s {
            "process" => ResourceKind::Process,
            "cgroup" => ResourceKind::Cgroup,
            "file" => ResourceKind::File,
            "uid" => ResourceKind::Uid,
            other => return Err(StoreError::Corrupt(format!("resource kind {other:?}"))),
        })
    }
}

/// A tenant row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantRecord {
    /// Row id.
    pub id: i64,
    /// Tenant name.
    pub name: TenantName,
    /// Lifecycle state.
    pub state: LifecycleState,
    /// The spec it was created with.
    pub spec: TenantSpec,
    /// What runs in its guest, decided at create; `None` for a row written before this was
    /// stored (schema version 3), until the daemon decides and stores it.
    pub guest: Option<GuestKind>,
    /// The operation in progress or last run (`create`, `start`, `stop`, `destroy`).
    pub op: Option<String>,
    /// Row id of that operation.
    pub op_id: Option<i64>,
    /// Last error, if the tenant failed.
    pub error: Option<String>,
    /// Creation time, ms since the epoch.
    pub created_ms: i64,
    /// Last change, ms since the epoch.
    pub updated_ms: i64,
}

/// One step of an operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Step name.
    pub step: String,
    /// `started`, `done` or `failed`.
    pub status: String,
    /// Why it failed.
    pub error: Option<String>,
    /// When it started, ms since the epoch.
    pub started_ms: i64,
    /// When it ended.
    pub finished_ms: Option<i64>,
}

/// A host resource a tenant holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceRecord {
    /// Owning tenant row id.
    pub tenant_id: i64,
    /// Kind.
    pub kind: ResourceKind,
    /// Unique key within the kind.
    pub key: String,
    /// Kind-specific JSON.
    pub detail: Option<String>,
}

/// A lifecycle event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventRecord {
    /// Monotonic id.
    pub id: i64,
    /// When, ms since the epoch.
    pub at_ms: i64,
    /// Short kind (`state`, `step`, `error`, ...).
    pub kind: String,
    /// Human-readable text.
    pub message: String,
}

/// Who a token belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenOwner {
    /// The operator.
    Admin,
    /// One tenant (row id).
    Tenant(i64),
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A connection to the state database.
pub struct Store {
    conn: Mutex<Connection>,
    path: std::path::PathBuf,
}

impl Store {
    /// Opens (creating if needed) the database at `path`, enables WAL and applies migrations.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(30))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let store = Store {
            conn: Mutex::new(conn),
            path: path.to_path_buf(),
        };
        store.migrate()?;
        Ok(store)
    }

    /// A second, read-only connection to the same database, for readers that must not wait
    /// behind this connection's lock (the front door's key lookups on the async threads): in
    /// WAL mode a reader never waits for a writer, and its [`Store::change_stamp`] still
    /// changes with every commit of this connection (`PRAGMA data_version`). Its writes
    /// fail.
    pub fn open_reader(&self) -> Result<Store, StoreError> {
        let conn = Connection::open_with_flags(
            &self.path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        // A reader waits only for a checkpoint's brief exclusive moments.
        conn.busy_timeout(Duration::from_secs(5))?;
        Ok(Store {
            conn: Mutex::new(conn),
            path: self.path.clone(),
        })
    }

    fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let version: i64 = tx.pragma_query_value(None, "user_version", |r| r.get(0))?;
        let known = migrations::MIGRATIONS.len();
        if version > known as i64 {
            return Err(StoreError::SchemaTooNew(version, known));
        }
        for (i, sql) in migrations::MIGRATIONS
            .iter()
            .enumerate()
            .skip(version as usize)
        {
            tx.execute_batch(sql)?;
            tx.pragma_update(None, "user_version", (i + 1) as i64)?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Runs `f` while holding this connection's lock, as a long write would (tests only).
    #[cfg(test)]
    pub(crate) fn while_locked<R>(&self, f: impl FnOnce() -> R) -> R {
        let _held = self.lock();
        f()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock leaves SQLite consistent (transactions roll back
        // on drop), so a poisoned mutex is still safe to use.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    // ---- tenants -------------------------------------------------------------------

    /// Records a new tenant in `pending`, with what runs in its guest. Fails if a live tenant
    /// has the name.
    pub fn insert_tenant(
        &self,
        spec: &TenantSpec,
        guest: GuestKind,
    ) -> Result<TenantRecord, StoreError> {
        let conn = self.lock();
        let spec_json =
            serde_json::to_string(spec).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let now = now_ms();
        let res = conn.execute(
            "INSERT INTO tenants (name, state, spec, guest, created_ms, updated_ms) VALUES (?1, 'pending', ?2, ?4, ?3, ?3)",
            params![spec.name.as_str(), spec_json, now, guest.as_str()],
        );
        match res {
            Ok(_) => {}
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::ConstraintViolation =>
            {
                return Err(StoreError::DuplicateName(spec.name.to_string()))
            }
            Err(e) => return Err(e.into()),
        }
        let id = conn.last_insert_rowid();
        insert_event(&conn, Some(id), "state", "pending: tenant recorded")?;
        drop(conn);
        self.tenant_by_id(id)
    }

    /// Stores what runs in a tenant's guest (for rows written before it was stored).
    pub fn set_guest(&self, tenant_id: i64, guest: GuestKind) -> Result<(), StoreError> {
        let conn = self.lock();
        conn.execute(
            "UPDATE tenants SET guest = ?2 WHERE id = ?1",
            params![tenant_id, guest.as_str()],
        )?;
        Ok(())
    }

    /// Clears a tenant's stored guest kind, as a row written before it was stored has it
    /// (tests only).
    #[cfg(test)]
    pub(crate) fn forget_guest(&self, tenant_id: i64) -> Result<(), StoreError> {
        let conn = self.lock();
        conn.execute(
            "UPDATE tenants SET guest = NULL WHERE id = ?1",
            params![tenant_id],
        )?;
        Ok(())
    }

    /// The live (not destroyed) tenant with this name.
    pub fn tenant(&self, name: &str) -> Result<Option<TenantRecord>, StoreError> {
        let conn = self.lock();
        conn.query_row(
            &format!("{TENANT_COLS} WHERE name = ?1 AND state != 'destroyed'"),
            [name],
            row_to_tenant,
        )
        .optional()?
        .transpose()
    }

    /// The tenant with this row id, whatever its state.
    pub fn tenant_by_id(&self, id: i64) -> Result<TenantRecord, StoreError> {
        let conn = self.lock();
        conn.query_row(&format!("{TENANT_COLS} WHERE id = ?1"), [id], row_to_tenant)?
    }

    /// All tenants, oldest first; destroyed ones only if asked.
    pub fn list_tenants(&self, include_destroyed: bool) -> Result<Vec<TenantRecord>, StoreError> {
        let conn = self.lock();
        let sql = if include_destroyed {
            format!("{TENANT_COLS} ORDER BY id")
        } else {
            format!("{TENANT_COLS} WHERE state != 'destroyed' ORDER BY id")
        };
        let mut stmt = conn.prepare(&sql)?;
        let rows = stmt.query_map([], row_to_tenant)?;
        rows.map(|r| r?).collect()
    }

    /// Moves a tenant to `to`, enforcing the state machine, and (when `op` is given) opens a
    /// new operation whose steps are recorded under the returned op id.
    pub fn transition(
        &self,
        tenant_id: i64,
        to: LifecycleState,
        op: Option<&str>,
        error: Option<&str>,
    ) -> Result<Option<i64>, StoreError> {
        // Errors quote guests: bounded, on one line (crate::untrusted).
        let error = error.map(crate::untrusted::one_line);
        let error = error.as_deref();
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let (from, prev_op): (String, Option<i64>) = tx.query_row(
            "SELECT state, op_id FROM tenants WHERE id = ?1",
            [tenant_id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        let from: LifecycleState = from.parse()?;
        from.check_transition(to)?;
        let now = now_ms();
        let mut op_id = None;
        if let Some(op) = op {
            if let Some(prev) = prev_op {
                tx.execute(
                    "UPDATE ops SET finished_ms = ?2, outcome = COALESCE(outcome, 'superseded') WHERE id = ?1 AND finished_ms IS NULL",
                    params![prev, now],
                )?;
            }
            tx.execute(
                "INSERT INTO ops (tenant_id, op, started_ms) VALUES (?1, ?2, ?3)",
                params![tenant_id, op, now],
            )?;
            op_id = Some(tx.last_insert_rowid());
            tx.execute(
                "UPDATE tenants SET op = ?2, op_id = ?3 WHERE id = ?1",
                params![tenant_id, op, op_id],
            )?;
        }
        if !to.is_transient() {
            tx.execute(
                "UPDATE ops SET finished_ms = ?2, outcome = ?3 WHERE id = (SELECT op_id FROM tenants WHERE id = ?1) AND finished_ms IS NULL",
                params![tenant_id, now, to.as_str()],
            )?;
        }
        tx.execute(
            "UPDATE tenants SET state = ?2, updated_ms = ?3, error = CASE WHEN ?2 = 'failed' THEN ?4 WHEN ?2 IN ('running', 'destroyed') THEN NULL ELSE error END WHERE id = ?1",
            params![tenant_id, to.as_str(), now, error],
        )?;
        let msg = match error {
            Some(e) => format!("{from} -> {to}: {e}"),
            None => format!("{from} -> {to}"),
        };
        insert_event(&tx, Some(tenant_id), "state", &msg)?;
        tx.commit()?;
        Ok(op_id)
    }

    // ---- steps ---------------------------------------------------------------------

    /// Records that `step` of operation `op_id` is about to run.
    pub fn step_started(&self, tenant_id: i64, op_id: i64, step: &str) -> Result<(), StoreError> {
        let conn = self.lock();
        conn.execute(
            "INSERT INTO steps (op_id, tenant_id, step, status, started_ms) VALUES (?1, ?2, ?3, 'started', ?4)
             ON CONFLICT (op_id, step) DO UPDATE SET status = 'started', error = NULL, started_ms = ?4, finished_ms = NULL",
            params![op_id, tenant_id, step, now_ms()],
        )?;
        Ok(())
    }

    /// Records that `step` finished, well (`error` None) or not.
    pub fn step_finished(
        &self,
        tenant_id: i64,
        op_id: i64,
        step: &str,
        error: Option<&str>,
    ) -> Result<(), StoreError> {
        self.step_ended(tenant_id, op_id, step, error, false)
    }

    /// Records that `step` finished with nothing to do for its tenant (`skipped`; it counts
    /// as done for a resumed operation).
    pub fn step_skipped(&self, tenant_id: i64, op_id: i64, step: &str) -> Result<(), StoreError> {
        self.step_ended(tenant_id, op_id, step, None, true)
    }

    fn step_ended(
        &self,
        tenant_id: i64,
        op_id: i64,
        step: &str,
        error: Option<&str>,
        skipped: bool,
    ) -> Result<(), StoreError> {
        // Errors quote guests: bounded, on one line (crate::untrusted).
        let error = error.map(crate::untrusted::one_line);
        let error = error.as_deref();
        let conn = self.lock();
        let status = match (error, skipped) {
            (Some(_), _) => "failed",
            (None, true) => "skipped",
            (None, false) => "done",
        };
        conn.execute(
            "UPDATE steps SET status = ?3, error = ?4, finished_ms = ?5 WHERE op_id = ?1 AND step = ?2",
            params![op_id, step, status, error, now_ms()],
        )?;
        let msg = match error {
            Some(e) => format!("{step} failed: {e}"),
            None => format!("{step} {status}"),
        };
        insert_event(&conn, Some(tenant_id), "step", &msg)?;
        Ok(())
    }

    /// The steps recorded for an operation, in the order they started.
    pub fn steps(&self, op_id: i64) -> Result<Vec<StepRecord>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
            "SELECT step, status, error, started_ms, finished_ms FROM steps WHERE op_id = ?1 ORDER BY id",
        )?;
        let rows = stmt.query_map([op_id], |r| {
            Ok(StepRecord {
                step: r.get(0)?,
                status: r.get(1)?,
                error: r.get(2)?,
                started_ms: r.get(3)?,
                finished_ms: r.get(4)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    // ---- resources -----------------------------------------------------------------

    /// Records a resource as held by a tenant. Idempotent for the same tenant.
    pub fn add_resource(
        &self,
        tenant_id: i64,
        kind: ResourceKind,
        key: &str,
        detail: Option<&str>,
    ) -> Result<(), StoreError> {
        let conn = self.lock();
        conn.execute(
            "INSERT INTO resources (tenant_id, kind, key, detail, created_ms) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (kind, key) DO UPDATE SET detail = ?4 WHERE tenant_id = ?1",
            params![tenant_id, kind.as_str(), key, detail, now_ms()],
        )?;
        Ok(())
    }

    /// Forgets a resource (after it was released on the host).
    pub fn remove_resource(&self, kind: ResourceKind, key: &str) -> Result<(), StoreError> {
        let conn = self.lock();
        conn.execute(
            "DELETE FROM resources WHERE kind = ?1 AND key = ?2",
            params![kind.as_str(), key],
        )?;
        Ok(())
    }

    /// Resources held, by one tenant or (None) by all.
    pub fn resources(&self, tenant_id: Option<i64>) -> Result<Vec<ResourceRecord>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
            "SELECT tenant_id, kind, key, detail FROM resources WHERE ?1 IS NULL OR tenant_id = ?1 ORDER BY id",
        )?;
        let rows = stmt.query_map([tenant_id], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get(2)?,
                r.get(3)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (tenant_id, kind, key, detail) = row?;
            out.push(ResourceRecord {
                tenant_id,
                kind: ResourceKind::parse(&kind)?,
                key,
                detail,
            });
        }
        Ok(out)
    }

    /// Gives the tenant a uid from `[first, first + count)`: the one it already holds, or the
    /// lowest free one. Two concurrent callers never get the same uid.
    pub fn allocate_uid(&self, tenant_id: i64, first: u32, count: u32) -> Result<u32, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let held: Option<String> = tx
            .query_row(
                "SELECT key FROM resources WHERE tenant_id = ?1 AND kind = 'uid'",
                [tenant_id],
                |r| r.get(0),
            )
            .optional()?;
        if let Some(key) = held {
            return key
                .parse()
                .map_err(|_| StoreError::Corrupt(format!("uid key {key:?}")));
        }
        let mut taken: Vec<u32> = {
            let mut stmt = tx.prepare("SELECT key FROM resources WHERE kind = 'uid'")?;
            let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
            rows.filter_map(|k| k.ok()?.parse().ok()).collect()
        };
        taken.sort_unstable();
        let end = first.saturating_add(count);
        let mut candidate = first;
        for uid in taken {
            if uid == candidate {
                candidate += 1;
            } else if uid > candidate {
                break;
            }
        }
        if candidate >= end {
            return Err(StoreError::UidsExhausted(first, end));
        }
        tx.execute(
            "INSERT INTO resources (tenant_id, kind, key, created_ms) VALUES (?1, 'uid', ?2, ?3)",
            params![tenant_id, candidate.to_string(), now_ms()],
        )?;
        tx.commit()?;
        Ok(candidate)
    }

    // ---- events --------------------------------------------------------------------

    /// Appends an event.
    pub fn add_event(
        &self,
        tenant_id: Option<i64>,
        kind: &str,
        message: &str,
    ) -> Result<(), StoreError> {
        let conn = self.lock();
        insert_event(&conn, tenant_id, kind, message)
    }

    /// A tenant's events after `after_id`, oldest first, at most `limit`.
    pub fn events(
        &self,
        tenant_id: i64,
        after_id: i64,
        limit: u32,
    ) -> Result<Vec<EventRecord>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
            "SELECT id, at_ms, kind, message FROM events WHERE tenant_id = ?1 AND id > ?2 ORDER BY id LIMIT ?3",
        )?;
        let rows = stmt.query_map(params![tenant_id, after_id, limit], |r| {
            Ok(EventRecord {
                id: r.get(0)?,
                at_ms: r.get(1)?,
                kind: r.get(2)?,
                message: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    // ---- tokens --------------------------------------------------------------------

    /// Stores the SHA-256 (hex) of a token for its owner.
    pub fn insert_token(&self, sha256_hex: &str, owner: &TokenOwner) -> Result<(), StoreError> {
        let conn = self.lock();
        let (role, tenant) = match owner {
            TokenOwner::Admin => ("admin", None),
            TokenOwner::Tenant(id) => ("tenant", Some(*id)),
        };
        conn.execute(
            "INSERT INTO tokens (sha256, role, tenant_id, created_ms) VALUES (?1, ?2, ?3, ?4)",
            params![sha256_hex, role, tenant, now_ms()],
        )?;
        Ok(())
    }

    /// The owner of a live (unrevoked) token hash, with the stored hash for a constant-time
    /// comparison by the caller.
    pub fn token_owner(
        &self,
        sha256_hex: &str,
    ) -> Result<Option<(String, TokenOwner)>, StoreError> {
        let conn = self.lock();
        conn.query_row(
            "SELECT sha256, role, tenant_id FROM tokens WHERE sha256 = ?1 AND revoked_ms IS NULL",
            [sha256_hex],
            |r| {
                let hash: String = r.get(0)?;
                let role: String = r.get(1)?;
                let tenant: Option<i64> = r.get(2)?;
                Ok((hash, role, tenant))
            },
        )
        .optional()?
        .map(|(hash, role, tenant)| match (role.as_str(), tenant) {
            ("admin", None) => Ok((hash, TokenOwner::Admin)),
            ("tenant", Some(id)) => Ok((hash, TokenOwner::Tenant(id))),
            _ => Err(StoreError::Corrupt(format!("token role {role:?}"))),
        })
        .transpose()
    }

    /// Whether an admin token exists.
    pub fn has_admin_token(&self) -> Result<bool, StoreError> {
        let conn = self.lock();
        let n: i64 = conn.query_row(
            "SELECT COUNT(*) FROM tokens WHERE role = 'admin' AND revoked_ms IS NULL",
            [],
            |r| r.get(0),
        )?;
        Ok(n > 0)
    }

    /// Revokes every token of a tenant (at destroy).
    pub fn revoke_tenant_tokens(&self, tenant_id: i64) -> Result<(), StoreError> {
        let conn = self.lock();
        conn.execute(
            "UPDATE tokens SET revoked_ms = ?2 WHERE tenant_id = ?1 AND revoked_ms IS NULL",
            params![tenant_id, now_ms()],
        )?;
        Ok(())
    }
}

const TENANT_COLS: &str =
    "SELECT id, name, state, spec, op, op_id, error, created_ms, updated_ms, guest FROM tenants";

fn row_to_tenant(r: &rusqlite::Row<'_>) -> rusqlite::Result<Result<TenantRecord, StoreError>> {
    let name: String = r.get(1)?;
    let state: String = r.get(2)?;
    let spec: String = r.get(3)?;
    let guest: Option<String> = r.get(9)?;
    let parsed = (|| {
        Ok(TenantRecord {
            id: r.get(0)?,
            name: TenantName::new(name).map_err(|e| StoreError::Corrupt(e.to_string()))?,
            state: state.parse()?,
            spec: serde_json::from_str(&spec).map_err(|e| StoreError::Corrupt(e.to_string()))?,
            op: r.get(4)?,
            op_id: r.get(5)?,
            error: r.get(6)?,
            created_ms: r.get(7)?,
            updated_ms: r.get(8)?,
            guest: guest
                .map(|g| g.parse::<GuestKind>())
                .transpose()
                .map_err(|e| StoreError::Corrupt(e.to_string()))?,
        })
    })();
    Ok(parsed)
}

/// The one writer of events: the message (which may quote a guest) is bounded and kept on
/// one line ([`crate::untrusted::GuestLine`]) whoever calls.
fn insert_event(
    conn: &Connection,
    tenant_id: Option<i64>,
    kind: &str,
    message: &str,
) -> Result<(), StoreError> {
    let message = crate::untrusted::GuestLine::new(message);
    let message = message.as_str();
    conn.execute(
        "INSERT INTO events (tenant_id, at_ms, kind, message) VALUES (?1, ?2, ?3, ?4)",
        params![tenant_id, now_ms(), kind, message],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests;
