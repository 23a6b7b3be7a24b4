//! Departure: the destroy steps that make a tenant's data unrecoverable, and its receipt.
//!
//! Destroy runs, in order: route-off, stop-vm (agent/VM shutdown), cleanup-jail,
//! device-reset, scrub-gpu, destroy-gpu-instance and release-gpu (MIG instance destroyed,
//! ledger released), crypto-shred, remove-files (logs), release-uid, revoke-tokens,
//! write-receipt. Each step's receipt record is persisted in the store as soon as the step
//! returns ([`crate::store::Store::record_departure_step`]); write-receipt appends the
//! receipt to the signed, hash-chained audit log, once per departure (the append is idempotent
//! per departure id, so a daemon killed around it still ends with exactly one receipt).
//!
//! A scrub that does not verify (or cannot run) quarantines the slice and the departure goes
//! on, so the tenant's disk is still shredded; the receipt records the scrub as failed and the
//! slice quarantined. `tenantvm gpu scrub <gpu>/<label>` re-runs the scrub ([`rescrub`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;

use crate::disk::{crypto_shred, KeyslotCost};
use crate::keys::{HostKek, KekSource, KeyError, KeyStore, DEFAULT_KEK_FILE};
use crate::receipt::{
    now_rfc3339, Assurance, AuditLog, DepartureStep, LogEntry, ReceiptError, ReceiptSigner,
    StepRecord, StepResult,
};
use crate::scrub::ScrubOutcome;
use crate::store::{GpuPlacement, QuarantinedSlice, TenantRecord};
use crate::tenant::disk_steps;
use crate::tenant::gpu_scrub::slice_id;
use crate::tenant::service::{TenantService, TenantServiceError};
use crate::tenant::steps::Step;

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

fn step_err(step: Step, message: impl std::fmt::Display) -> TenantServiceError {
    TenantServiceError::Step {
        step: step.name(),
        message: message.to_string(),
    }
}

/// The service's departure kit, its load failure as this step's error.
pub(crate) fn kit(
    svc: &TenantService,
    step: Step,
) -> Result<Arc<DepartureKit>, TenantServiceError> {
    svc.departure_kit().map_err(|e| step_err(step, e))
}

fn record(
    svc: &TenantService,
    t: &TenantRecord,
    rec: StepRecord,
) -> Result<(), TenantServiceError> {
    svc.store.record_departure_step(t.id, &t.name, rec)?;
    Ok(())
}

fn plain(
    step: DepartureStep,
    method: &str,
    result: StepResult,
    assurance: Assurance,
    started_at: &str,
) -> StepRecord {
    StepRecord::new(
        step,
        method,
        result,
        assurance,
        started_at.to_string(),
        now_rfc3339(),
    )
}

/// Runs a departure step (one of the steps this module owns).
pub(crate) fn run_step(
    svc: &TenantService,
    t: &TenantRecord,
    step: Step,
) -> Result<(), TenantServiceError> {
    let started = now_rfc3339();
    match step {
        Step::RouteOff => {
            svc.store.begin_departure(t.id, &t.name)?;
            // The daemon's inference route is the only way to a guest's server: closing
            // the tenant's admission gate refuses every later request.
            let key = crate::tenant::agent_steps::admission_key(t);
            let in_flight = svc.admission.close(&key);
            // Checked, not assumed: a request now is refused. (After a daemon restart the
            // gate is new, and the tenant's destroying state refuses requests instead.)
            let refused = svc
                .admission
                .admit(&key, &t.name, &t.spec.quotas, std::time::Instant::now())
                .is_err();
            if !refused {
                return Err(step_err(step, "the inference route did not close"));
            }
            let rec = if crate::tenant::agent_steps::uses_agent(&svc.config, &t.spec) {
                plain(
                    DepartureStep::GatewayRouteOff,
                    &format!(
                        "inference route closed: later requests are refused; {in_flight} \
                         request(s) were in flight and end with the guest's shutdown"
                    ),
                    StepResult::Ok,
                    Assurance::Verified,
                    &started,
                )
            } else {
                plain(
                    DepartureStep::GatewayRouteOff,
                    "no inference server: the tenant runs no guest image, so it had no route",
                    StepResult::Skipped,
                    Assurance::NotApplicable,
                    &started,
                )
            };
            record(svc, t, rec)
        }
        Step::DeviceReset => {
            let rec = match svc.store.gpu_placement(t.id)? {
                None => plain(
                    DepartureStep::DeviceReset,
                    "no device: the tenant had no GPU",
                    StepResult::Skipped,
                    Assurance::NotApplicable,
                    &started,
                ),
                Some(p) => {
                    let out = svc.gpu.reset(&p).map_err(|e| step_err(step, e))?;
                    let mut rec = plain(
                        DepartureStep::DeviceReset,
                        &out.method,
                        out.result,
                        out.assurance,
                        &started,
                    );
                    rec.evidence = out.evidence;
                    rec
                }
            };
            record(svc, t, rec)
        }
        Step::ScrubGpu => {
            let rec = match svc.store.gpu_placement(t.id)? {
                None => plain(
                    DepartureStep::GpuScrub,
                    "no device: the tenant had no GPU",
                    StepResult::Skipped,
                    Assurance::NotApplicable,
                    &started,
                ),
                Some(p) => scrub_or_quarantine(svc, &p, &started)?,
            };
            record(svc, t, rec)
        }
        Step::CryptoShred => {
            let kit = kit(svc, step)?;
            let image = disk_steps::image_path(&svc.config, &t.name);
            let has_key = kit.keys.exists(&t.name).map_err(|e| step_err(step, e))?;
            let rec = if t.spec.disk_gib == 0 && !has_key && !image.exists() {
                plain(
                    DepartureStep::CryptoShred,
                    "no disk: the tenant had disk_gib = 0",
                    StepResult::Skipped,
                    Assurance::NotApplicable,
                    &started,
                )
            } else {
                let report = crypto_shred(&kit.keys, &t.name, &image)
                    .map_err(|e| step_err(step, crate::tenant::steps::error_chain(&e)))?;
                report.step_record(started, now_rfc3339())
            };
            record(svc, t, rec)
        }
        Step::WriteReceipt => {
            let kit = kit(svc, step)?;
            let receipt = svc.store.begin_departure(t.id, &t.name)?;
            let entry: LogEntry = kit
                .log
                .append(&kit.signer, &receipt)
                .map_err(|e| step_err(step, e))?;
            svc.store.departure_appended(t.id)?;
            svc.store.add_event(
                Some(t.id),
                "departure",
                &format!(
                    "receipt {} appended to the audit log as entry {}",
                    receipt.departure_id, entry.seq
                ),
            )?;
            Ok(())
        }
        other => Err(step_err(other, "not a departure step")),
    }
}

/// The receipt record of a control-plane step that is part of a departure (stop-vm,
/// destroy-gpu-instance, remove-files), after it ran. `error` is its failure, if any.
pub(crate) fn record_existing_step(
    svc: &TenantService,
    t: &TenantRecord,
    step: Step,
    started_at: &str,
    error: Option<&str>,
) -> Result<(), TenantServiceError> {
    let mut rec = match step {
        Step::StopVm if crate::tenant::agent_steps::uses_agent(&svc.config, &t.spec) => {
            match crate::tenant::agent_steps::shutdown_record(svc, t, started_at) {
                Some(rec) => rec,
                None => return Ok(()),
            }
        }
        Step::StopVm => plain(
            DepartureStep::AgentShutdown,
            "VM shutdown through the VMM control socket, SIGKILL after 500 ms; the guest runs no agent (not a guest image set)",
            StepResult::Ok,
            Assurance::Unverified,
            started_at,
        ),
        Step::DestroyGpuInstance => match svc.store.gpu_placement(t.id)? {
            None => plain(
                DepartureStep::GpuRelease,
                "no device: the tenant had no GPU",
                StepResult::Skipped,
                Assurance::NotApplicable,
                started_at,
            ),
            Some(p) => plain(
                DepartureStep::GpuRelease,
                if p.label.contains('@') {
                    "MIG compute and GPU instance destroyed, found again by GPU, profile and start"
                } else {
                    "whole GPU released (no MIG instance)"
                },
                StepResult::Ok,
                Assurance::Verified,
                started_at,
            )
            .with_evidence("slice", slice_id(&p)),
        },
        Step::RemoveFiles => {
            let dir = svc.config.tenant_dir(&t.name);
            plain(
                DepartureStep::LogsRemoved,
                "tenant directory removed: serial, VMM and event logs, sockets, jail root",
                StepResult::Ok,
                if dir.exists() {
                    Assurance::Unverified
                } else {
                    Assurance::Verified
                },
                started_at,
            )
            .with_evidence("directory_absent", !dir.exists())
        }
        _ => return Ok(()),
    };
    if let Some(e) = error {
        rec = rec.failed(e);
    }
    record(svc, t, rec)
}

/// Scrubs a released placement. A scrub that did not pass, or could not run, quarantines the
/// slice; the returned record says so.
fn scrub_or_quarantine(
    svc: &TenantService,
    p: &GpuPlacement,
    started: &str,
) -> Result<StepRecord, TenantServiceError> {
    match svc.gpu.scrub(p) {
        Ok(outcome) => {
            let mut rec = outcome.step_record(started.to_string(), now_rfc3339());
            if outcome.passed {
                // A re-run after a crash may pass where the first run did not: a scrub that
                // verifies is what lifts a quarantine.
                svc.store.lift_quarantine(p)?;
            } else {
                svc.store
                    .quarantine_gpu(p, rec.error.as_deref().unwrap_or("scrub did not pass"))?;
            }
            rec.evidence
                .insert("quarantined".into(), (!outcome.passed).to_string());
            rec.evidence.insert("slice".into(), slice_id(p));
            Ok(rec)
        }
        Err(e) => {
            let why = format!("the scrub could not run: {e}");
            svc.store.quarantine_gpu(p, &why)?;
            Ok(plain(
                DepartureStep::GpuScrub,
                "not run",
                StepResult::Failed,
                Assurance::Unverified,
                started,
            )
            .with_evidence("quarantined", true)
            .with_evidence("slice", slice_id(p))
            .failed(why))
        }
    }
}

/// Why a re-scrub of a quarantined slice was refused.
#[derive(Debug, Error)]
pub enum RescrubError {
    /// No such quarantined slice.
    #[error("No quarantined GPU slice {0:?}; `tenantvm gpu quarantine` lists them")]
    NotQuarantined(String),
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

/// Re-runs the scrub of a quarantined slice (`<gpu>/<label>`): recreates its MIG instance,
/// scrubs it, destroys it again, and lifts the quarantine only if the scrub passed.
pub fn rescrub(svc: &TenantService, slice: &str) -> Result<RescrubOutcome, TenantServiceError> {
    let q: QuarantinedSlice = svc
        .store
        .quarantined()?
        .into_iter()
        .find(|q| q.id() == slice)
        .ok_or_else(|| RescrubError::NotQuarantined(slice.into()))?;
    let p = q.placement();
    let failed = |e: &dyn std::fmt::Display| {
        TenantServiceError::Rescrub(RescrubError::Failed {
            slice: slice.to_string(),
            message: e.to_string(),
        })
    };
    svc.gpu.materialize(&p).map_err(|e| failed(&e))?;
    let outcome = svc.gpu.scrub(&p);
    svc.gpu.release(&p).map_err(|e| failed(&e))?;
    let outcome = outcome.map_err(|e| failed(&e))?;
    let lifted = outcome.passed && svc.store.lift_quarantine(&p)? > 0;
    Ok(RescrubOutcome {
        slice: slice.to_string(),
        lifted,
        scrub: outcome,
    })
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
