//! The departure's machinery outside its steps: the disk keys, the receipt signer and the
//! audit log ([`DepartureKit`], loaded once through [`Kit`]), what the re-scrub of a
//! quarantined GPU slice answers ([`RescrubOutcome`], [`RescrubError`]; it runs in
//! [`crate::tenant::steps::gpu::rescrub`]), and who may read receipts ([`receipt_caller`]).
//!
//! The departure's steps themselves are in [`crate::tenant::steps`]: each returns its
//! receipt record, the runner persists it in the store as soon as the step returns
//! ([`crate::store::Store::record_departure_step`]), and write-receipt appends the receipt to
//! the signed, hash-chained audit log once per departure (the append is idempotent per
//! departure id, so a daemon killed around it still ends with exactly one receipt).
//!
//! A scrub that does not verify (or cannot run) quarantines the slice and the departure goes
//! on, so the tenant's disk is still shredded; the receipt records the scrub as failed and the
//! slice quarantined. `tenantvm gpu scrub <gpu>/<label>` re-runs the scrub
//! ([`crate::tenant::steps::gpu::rescrub`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use thiserror::Error;

use crate::disk::KeyslotCost;
use crate::gpu::scrub::ScrubOutcome;
use crate::keys::{HostKek, KekSource, KeyError, KeyStore, DEFAULT_KEK_FILE};
use crate::receipt::{AuditLog, ReceiptError, ReceiptSigner};
use crate::store::StoreError;

/// Why the departure machinery could not be set up.
#[derive(Debug, Error)]
pub enum DepartureError {
    /// The host KEK or the key directory was refused.
    #[error("Disk keys: {0}")]
    Keys(#[from] KeyError),
    /// The receipt signing key or the audit log was refused.
    #[error("Receipts: {0}")]
    Receipts(#[from] ReceiptError),
}

/// Where the departure's keys and records live, and the keyslot cost of new disks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DepartureConfig {
    /// The host key-encryption key.
    pub kek: KekSource,
    /// Wrapped tenant keys.
    pub key_dir: PathBuf,
    /// The argon2id cost of new disks' keyslot.
    pub keyslot_cost: KeyslotCost,
    /// The hash-chained audit log of receipts.
    pub audit_log: PathBuf,
    /// The host's ed25519 receipt signing key (its public half next to it, `.pub`).
    pub signing_key: PathBuf,
}

impl DepartureConfig {
    /// Defaults: the KEK from the systemd credential or [`DEFAULT_KEK_FILE`], everything
    /// else under `state_dir` (`keys/`, `audit/receipts.jsonl`,
    /// `audit/receipt-signing.key`), production keyslot cost.
    pub fn under(state_dir: &Path) -> DepartureConfig {
        DepartureConfig {
            kek: KekSource::detect(Path::new(DEFAULT_KEK_FILE)),
            key_dir: state_dir.join("keys"),
            keyslot_cost: KeyslotCost::PRODUCTION,
            audit_log: state_dir.join("audit/receipts.jsonl"),
            signing_key: state_dir.join("audit/receipt-signing.key"),
        }
    }
}

/// The loaded departure machinery: key store (with the KEK), receipt signer, audit log.
#[derive(Debug)]
pub struct DepartureKit {
    /// Wrapped tenant keys.
    pub keys: KeyStore,
    /// Signs audit log entries.
    pub signer: ReceiptSigner,
    /// The audit log.
    pub log: AuditLog,
    /// Keyslot cost of new disks.
    pub cost: KeyslotCost,
}

impl DepartureKit {
    /// Loads (creating on first use) the KEK, the key directory and the signing key.
    pub fn open(cfg: &DepartureConfig) -> Result<DepartureKit, DepartureError> {
        let kek = HostKek::load(&cfg.kek)?;
        Ok(DepartureKit {
            keys: KeyStore::new(&cfg.key_dir, kek)?,
            signer: ReceiptSigner::load_or_create(&cfg.signing_key)?,
            log: AuditLog::new(&cfg.audit_log),
            cost: cfg.keyslot_cost,
        })
    }
}

/// The departure kit, loaded (and on first use created) when first needed: the daemon loads
/// it at start so that a bad KEK stops the daemon before it serves.
#[derive(Debug)]
pub struct Kit {
    config: DepartureConfig,
    loaded: Mutex<Option<Arc<DepartureKit>>>,
}

impl Kit {
    /// A kit that loads from `config` when first asked.
    pub fn new(config: DepartureConfig) -> Kit {
        Kit {
            config,
            loaded: Mutex::default(),
        }
    }

    /// The loaded kit.
    pub fn get(&self) -> Result<Arc<DepartureKit>, DepartureError> {
        let mut slot = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(kit) = slot.as_ref() {
            return Ok(kit.clone());
        }
        let kit = Arc::new(DepartureKit::open(&self.config)?);
        *slot = Some(kit.clone());
        Ok(kit)
    }
}

/// Why a re-scrub of a quarantined slice was refused.
#[derive(Debug, Error)]
pub enum RescrubError {
    /// No such quarantined slice.
    #[error("No quarantined GPU slice {0:?}; `tenantvm gpu quarantine` lists them")]
    NotQuarantined(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The planner failed (recreating the instance, scrubbing or destroying it).
    #[error("Scrub of {slice} could not run: {message}")]
    Failed {
        /// The slice.
        slice: String,
        /// Why.
        message: String,
    },
}

/// What a re-scrub found.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RescrubOutcome {
    /// The slice, `<gpu>/<label>`.
    pub slice: String,
    /// Whether the quarantine was lifted.
    pub lifted: bool,
    /// The scrub's outcome.
    pub scrub: ScrubOutcome,
}

/// The caller of a receipt request: any live token as usual, and also the revoked token of a
/// departed tenant (revoked at the end of its departure), which may read its own receipt only.
pub fn receipt_caller(
    store: &crate::store::Store,
    header: Option<&str>,
) -> Result<crate::auth::Caller, crate::auth::AuthError> {
    use crate::auth::{self, AuthError, Caller};
    match auth::authenticate(store, header) {
        Err(AuthError::Invalid) => {
            let token = header
                .and_then(|h| h.strip_prefix("Bearer "))
                .map(str::trim)
                .filter(|t| t.starts_with(auth::TOKEN_PREFIX) && t.len() <= 128)
                .ok_or(AuthError::Invalid)?;
            let hash = auth::token_hash(token);
            match store.departed_token_owner(&hash)? {
                Some((stored, id))
                    if auth::constant_time_eq(stored.as_bytes(), hash.as_bytes()) =>
                {
                    Ok(Caller::Tenant(id))
                }
                _ => Err(AuthError::Invalid),
            }
        }
        other => other,
    }
}
