//! Departure receipts and the signed, hash-chained audit log they are appended to.
//!
//! A [`Receipt`] is one JSON document per departure: the tenant, the times, and every step
//! with its method, result, assurance (`verified`, `simulated`, ...) and evidence (hashes,
//! byte counts). Receipts are appended to an [`AuditLog`]: JSON lines, each entry carrying the
//! SHA-256 of the previous line and an ed25519 signature by the host's receipt key, plus a
//! signed head file naming the last entry. [`AuditLog::verify`] detects any edited, removed
//! or reordered entry, including a truncated tail.

mod cli;
mod log;
mod time;

use std::collections::BTreeMap;
use std::io;

use serde::{Deserialize, Serialize};

use crate::untrusted::GuestLine;

pub use cli::{run_show, run_verify, write_entries, ReceiptShowArgs, ReceiptVerifyArgs};
pub use log::{AuditLog, ChainProblem, LogEntry, ReceiptSigner, VerifyReport, MAX_LINE};
pub use time::{now_rfc3339, rfc3339, rfc3339_from_millis};

/// Default audit log location.
pub const DEFAULT_LOG: &str = "/var/lib/tenantvm/audit/receipts.jsonl";
/// Default location of the host's receipt signing key (its public half sits next to it, `.pub`).
pub const DEFAULT_SIGNING_KEY: &str = "/var/lib/tenantvm/audit/receipt-signing.key";
/// The receipt format version.
pub const RECEIPT_VERSION: u32 = 1;
/// The most steps a receipt keeps (a departure has seven kinds).
pub const MAX_STEPS: usize = 32;
/// The most pieces of evidence a step's record keeps.
pub const MAX_EVIDENCE: usize = 64;
/// The evidence entry that counts the pieces a bounded record dropped.
const EVIDENCE_DROPPED: &str = "evidence_dropped";

/// Errors of receipts and the audit log.
#[derive(Debug, thiserror::Error)]
pub enum ReceiptError {
    /// A file could not be read or written.
    #[error("Cannot {action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: String,
        /// The I/O error.
        source: io::Error,
    },
    /// The signing key file was refused.
    #[error("Receipt signing key refused: {0}")]
    KeyFile(#[from] crate::keys::PrivateFileError),
    /// A key file holds something other than a key.
    #[error("File {path} is not an ed25519 {what}: {reason}; restore it from backup")]
    BadKey {
        /// The file.
        path: String,
        /// Which half.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The random number generator failed.
    #[error("The system random number generator failed: {0}")]
    Random(String),
    /// The log's last entry cannot be read, so nothing can be chained to it.
    #[error("The audit log {path} is damaged at line {line} ({reason}); run `tenantvm receipt verify` and restore it before appending")]
    Damaged {
        /// The log.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A receipt names another departure's id with different content.
    #[error("Departure {0} already has a different receipt in the audit log")]
    Conflict(String),
    /// Verification found problems.
    #[error("The audit log failed verification with {0} problem(s)")]
    VerifyFailed(usize),
    /// A receipt could not be serialized or parsed.
    #[error("Receipt JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// The departure steps, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DepartureStep {
    /// The tenant's gateway route is removed.
    GatewayRouteOff,
    /// The guest agent is asked to shut down (then killed after a timeout).
    AgentShutdown,
    /// VFIO reset of the device (secondary bus reset as fallback).
    DeviceReset,
    /// GPU memory zeroed and read back.
    GpuScrub,
    /// MIG compute and GPU instances destroyed, or the GPU's drivers restored.
    GpuRelease,
    /// Disk header destroyed, wrapped key deleted, image discarded and deleted.
    CryptoShred,
    /// The tenant's logs removed.
    LogsRemoved,
}

/// How a step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StepResult {
    /// It did what it should.
    Ok,
    /// It failed; `error` says why.
    Failed,
    /// Nothing to do (for example no GPU was attached).
    Skipped,
}

/// How much the step's effect was checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Assurance {
    /// The effect was checked on the real thing (read back, reopened, ...).
    Verified,
    /// A simulated backend ran the step: nothing real was checked.
    Simulated,
    /// The step ran but its effect was not checked.
    Unverified,
    /// There is nothing to check.
    NotApplicable,
}

impl Assurance {
    /// `Verified` when a check on the real thing passed, else `Unverified`.
    pub fn checked(passed: bool) -> Assurance {
        if passed {
            Assurance::Verified
        } else {
            Assurance::Unverified
        }
    }
}

/// One departure step as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepRecord {
    /// Which step.
    pub step: DepartureStep,
    /// How it was done, e.g. `cuMemsetD8 + full read-back` or `simulated`.
    pub method: String,
    /// How it ended.
    pub result: StepResult,
    /// How much was checked.
    pub assurance: Assurance,
    /// RFC 3339 UTC start time.
    pub started_at: String,
    /// RFC 3339 UTC end time.
    pub finished_at: String,
    /// Evidence as named strings: hashes, byte counts, device ids.
    pub evidence: BTreeMap<String, String>,
    /// The error, when `result` is `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One departure's receipt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    /// Format version ([`RECEIPT_VERSION`]).
    pub version: u32,
    /// Unique id of this departure; appending the same id twice is a no-op.
    pub departure_id: String,
    /// The tenant that left.
    pub tenant: String,
    /// RFC 3339 UTC time the departure began.
    pub started_at: String,
    /// RFC 3339 UTC time the last step ended.
    pub finished_at: String,
    /// The steps in the order they ran.
    pub steps: Vec<StepRecord>,
    /// Set when this entry records an isolation verification run (`tenantvm verify`)
    /// instead of a departure: then `steps` is empty and `tenant` names the run's probes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification: Option<VerificationSummary>,
}

/// What the audit log keeps of a `tenantvm verify` run: the verdicts, and the SHA-256 of
/// the full JSON report (kept next to the log), so the signature covers the report too.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerificationSummary {
    /// The run's id.
    pub run_id: String,
    /// Whether every selected check passed.
    pub passed: bool,
    /// Each selected check's verdict, by its name.
    pub checks: BTreeMap<String, String>,
    /// SHA-256 (hex) of the full JSON report.
    pub report_sha256: String,
    /// Where the full report was written.
    pub report_path: String,
}

impl StepRecord {
    /// This record with every string as a [`GuestLine`] of at most `field_bytes` (keys of
    /// evidence 128, times 64) and at most `max_evidence` pieces of evidence (the rest
    /// counted in an `evidence_dropped` entry).
    pub fn bounded(&self, field_bytes: usize, max_evidence: usize) -> StepRecord {
        let line = |s: &str, max: usize| GuestLine::bounded(s, max).into_string();
        let mut evidence: BTreeMap<String, String> = self
            .evidence
            .iter()
            .filter(|(k, _)| k.as_str() != EVIDENCE_DROPPED)
            .take(max_evidence)
            .map(|(k, v)| (line(k, 128), line(v, field_bytes)))
            .collect();
        let kept = self
            .evidence
            .keys()
            .filter(|k| k.as_str() != EVIDENCE_DROPPED)
            .count();
        // A record bounded before keeps the count it dropped then.
        let before: usize = self
            .evidence
            .get(EVIDENCE_DROPPED)
            .and_then(|v| v.split(' ').next()?.parse().ok())
            .unwrap_or(0);
        let dropped = kept.saturating_sub(max_evidence) + before;
        if dropped > 0 {
            evidence.insert(
                EVIDENCE_DROPPED.into(),
                format!("{dropped} more entries, over the receipt's limit"),
            );
        }
        StepRecord {
            step: self.step,
            method: line(&self.method, field_bytes),
            result: self.result,
            assurance: self.assurance,
            started_at: line(&self.started_at, 64),
            finished_at: line(&self.finished_at, 64),
            evidence,
            error: self.error.as_deref().map(|e| line(e, field_bytes)),
        }
    }

    /// A record without evidence, for steps whose outcome is a plain fact (route removed,
    /// agent stopped); add evidence with [`StepRecord::with_evidence`].
    pub fn new(
        step: DepartureStep,
        method: &str,
        result: StepResult,
        assurance: Assurance,
        started_at: String,
        finished_at: String,
    ) -> Self {
        StepRecord {
            step,
            method: method.to_string(),
            result,
            assurance,
            started_at,
            finished_at,
            evidence: BTreeMap::new(),
            error: None,
        }
    }

    /// Adds one piece of evidence.
    pub fn with_evidence(mut self, key: &str, value: impl ToString) -> Self {
        self.evidence.insert(key.to_string(), value.to_string());
        self
    }

    /// Marks the step failed with `error`.
    pub fn failed(mut self, error: impl ToString) -> Self {
        self.result = StepResult::Failed;
        self.error = Some(error.to_string());
        self
    }
}

/// A fresh departure id: the tenant, the start time in milliseconds, and a random suffix.
pub fn new_departure_id(tenant: &str) -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    let suffix: u32 = rand::random();
    format!("{tenant}-{ms}-{suffix:08x}")
}

impl Receipt {
    /// A receipt for a departure that starts now, with no steps yet.
    pub fn begin(departure_id: &str, tenant: &str) -> Self {
        let now = now_rfc3339();
        Receipt {
            version: RECEIPT_VERSION,
            departure_id: departure_id.to_string(),
            tenant: tenant.to_string(),
            started_at: now.clone(),
            finished_at: now,
            steps: Vec::new(),
            verification: None,
        }
    }

    /// Appends a step record (replacing an earlier record of the same step, which a resumed
    /// departure produces when it re-runs a step) and moves `finished_at` to its end. The
    /// record is bounded as the audit log would bound it ([`StepRecord::bounded`] with
    /// [`MAX_FIELD_BYTES`](crate::untrusted::MAX_FIELD_BYTES) and [`MAX_EVIDENCE`]), so that
    /// the stored receipt a departure rewrites at every step stays small whatever a guest
    /// answered.
    pub fn record(&mut self, step: StepRecord) {
        let step = step.bounded(crate::untrusted::MAX_FIELD_BYTES, MAX_EVIDENCE);
        self.finished_at.clone_from(&step.finished_at);
        self.steps.retain(|s| s.step != step.step);
        self.steps.push(step);
        self.steps.sort_by_key(|s| s.step);
    }

    /// Whether every step ended `ok` or `skipped`.
    pub fn succeeded(&self) -> bool {
        self.steps.iter().all(|s| s.result != StepResult::Failed)
    }

    /// Whether any step ran simulated (so nothing it claims about hardware was checked).
    pub fn simulated(&self) -> bool {
        self.steps
            .iter()
            .any(|s| s.assurance == Assurance::Simulated)
    }

    /// This receipt with every string a guest may have influenced (methods, evidence,
    /// errors, and the rest for good measure) as a [`GuestLine`] of at most `field_bytes`,
    /// at most [`MAX_STEPS`] steps and `max_evidence` pieces of evidence per step (the rest
    /// counted in an `evidence_dropped` entry). What the audit log writer signs and writes.
    pub fn bounded(&self, field_bytes: usize, max_evidence: usize) -> Receipt {
        let line = |s: &str, max: usize| GuestLine::bounded(s, max).into_string();
        Receipt {
            version: self.version,
            departure_id: line(&self.departure_id, 256),
            tenant: line(&self.tenant, 256),
            started_at: line(&self.started_at, 64),
            finished_at: line(&self.finished_at, 64),
            steps: self
                .steps
                .iter()
                .take(MAX_STEPS)
                .map(|s| s.bounded(field_bytes, max_evidence))
                .collect(),
            verification: self.verification.as_ref().map(|v| VerificationSummary {
                run_id: line(&v.run_id, 64),
                passed: v.passed,
                checks: v
                    .checks
                    .iter()
                    .take(max_evidence)
                    .map(|(k, c)| (line(k, 64), line(c, 64)))
                    .collect(),
                report_sha256: line(&v.report_sha256, 64),
                report_path: line(&v.report_path, field_bytes),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_replaces_a_re_run_step_and_keeps_departure_order() {
        let mut r = Receipt::begin(&new_departure_id("alice"), "alice");
        let t = |s: &str| s.to_string();
        r.record(StepRecord::new(
            DepartureStep::CryptoShred,
            "m",
            StepResult::Ok,
            Assurance::Verified,
            t("1"),
            t("2"),
        ));
        r.record(
            StepRecord::new(
                DepartureStep::GpuScrub,
                "m",
                StepResult::Ok,
                Assurance::Simulated,
                t("0"),
                t("1"),
            )
            .failed("first try failed"),
        );
        r.record(
            StepRecord::new(
                DepartureStep::GpuScrub,
                "m",
                StepResult::Ok,
                Assurance::Simulated,
                t("3"),
                t("4"),
            )
            .with_evidence("passed", true),
        );
        let steps: Vec<_> = r.steps.iter().map(|s| s.step).collect();
        assert_eq!(steps, [DepartureStep::GpuScrub, DepartureStep::CryptoShred]);
        assert!(r.succeeded() && r.simulated());
        assert_eq!(r.finished_at, "4");
        assert_eq!(r.steps[0].evidence["passed"], "true");
    }

    #[test]
    fn departure_ids_are_unique_and_name_the_tenant() {
        let a = new_departure_id("bob");
        assert!(a.starts_with("bob-"));
        assert_ne!(a, new_departure_id("bob"));
    }
}

#[cfg(test)]
pub(crate) mod test_util {
    use super::*;

    /// A receipt with two steps, for log tests.
    pub fn receipt(departure: &str, tenant: &str) -> Receipt {
        let mut evidence = BTreeMap::new();
        evidence.insert("header_sha256_after".to_string(), "ab".repeat(32));
        Receipt {
            version: RECEIPT_VERSION,
            departure_id: departure.to_string(),
            tenant: tenant.to_string(),
            started_at: "2026-01-02T03:04:05Z".to_string(),
            finished_at: "2026-01-02T03:04:09Z".to_string(),
            steps: vec![
                StepRecord {
                    step: DepartureStep::GpuScrub,
                    method: "simulated".to_string(),
                    result: StepResult::Ok,
                    assurance: Assurance::Simulated,
                    started_at: "2026-01-02T03:04:05Z".to_string(),
                    finished_at: "2026-01-02T03:04:06Z".to_string(),
                    evidence: BTreeMap::new(),
                    error: None,
                },
                StepRecord {
                    step: DepartureStep::CryptoShred,
                    method: "keyslots destroyed, header overwritten with random bytes".to_string(),
                    result: StepResult::Ok,
                    assurance: Assurance::Verified,
                    started_at: "2026-01-02T03:04:06Z".to_string(),
                    finished_at: "2026-01-02T03:04:09Z".to_string(),
                    evidence,
                    error: None,
                },
            ],
            verification: None,
        }
    }
}
