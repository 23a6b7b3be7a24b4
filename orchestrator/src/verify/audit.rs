//! The report goes into the audit log beside the departure receipts: the full JSON report is
//! written next to the log (`<log dir>/verify/<run id>.json`, mode 0600), and an entry
//! carrying the verdicts and the report's SHA-256 is appended to the same hash-chained log,
//! signed with the same host key ([`crate::receipt::AuditLog::append`]), so `tenantvm
//! receipt verify` checks it with the rest and the hash ties the full report to it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::Report;
use crate::receipt::{
    AuditLog, LogEntry, Receipt, ReceiptError, ReceiptSigner, VerificationSummary, RECEIPT_VERSION,
};

/// Why the report could not be recorded.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// The signing key is not there: this is not the daemon's host, or its state lives
    /// elsewhere.
    #[error("no receipt signing key at {0}: run on the daemon's host as root, or pass --signing-key and --audit-log for its state directory")]
    NoSigningKey(PathBuf),
    /// The report could not be written.
    #[error("cannot write the report to {path}: {source}")]
    Write {
        /// Where.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The audit log refused the entry.
    #[error(transparent)]
    Log(#[from] ReceiptError),
}

/// Where the full report of `run_id` is kept beside the audit log `log`.
pub fn report_path(log: &Path, run_id: &str) -> PathBuf {
    log.parent()
        .unwrap_or(Path::new("."))
        .join("verify")
        .join(format!("{run_id}.json"))
}

/// Writes the report beside `log` and appends its signed entry; returns the entry.
pub fn record(report: &Report, log: &Path, signing_key: &Path) -> Result<LogEntry, AuditError> {
    if std::fs::symlink_metadata(signing_key).is_err() {
        return Err(AuditError::NoSigningKey(signing_key.to_path_buf()));
    }
    let signer = ReceiptSigner::load_or_create(signing_key)?;
    let json = serde_json::to_vec_pretty(report).map_err(ReceiptError::from)?;
    // Absolute, so the signed entry names the file wherever the log is read from.
    let path = std::path::absolute(report_path(log, &report.run_id)).map_err(|source| {
        AuditError::Write {
            path: report_path(log, &report.run_id),
            source,
        }
    })?;
    let write_err = |source| AuditError::Write {
        path: path.clone(),
        source,
    };
    if let Some(dir) = path.parent() {
        crate::keys::create_private_dir(dir).map_err(write_err)?;
    }
    crate::keys::write_private_atomic(&path, &json).map_err(write_err)?;
    let checks: BTreeMap<String, String> = report
        .checks
        .iter()
        .map(|c| {
            (
                c.check.key().to_string(),
                c.outcome.verdict.as_str().to_string(),
            )
        })
        .collect();
    let receipt = Receipt {
        version: RECEIPT_VERSION,
        departure_id: format!("verify-{}", report.run_id),
        tenant: format!("{}{}", super::probe::PROBE_PREFIX, report.run_id),
        started_at: report.started_at.clone(),
        finished_at: report.finished_at.clone(),
        steps: Vec::new(),
        verification: Some(VerificationSummary {
            run_id: report.run_id.clone(),
            passed: report.passed,
            checks,
            report_sha256: hex::encode(Sha256::digest(&json)),
            report_path: path.display().to_string(),
        }),
    };
    Ok(AuditLog::new(log).append(&signer, &receipt)?)
}
