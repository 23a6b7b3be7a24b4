//! Check 1: the threat model is written down. The operator's statement (`--threat-model
//! FILE`) of who the tenants are and what they must not learn about each other is read,
//! hashed and recorded in the report; missing, empty or a few words only: fail.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::verify::{Check, CheckId, Ctx, HostError, Outcome, Verdict};

/// Fewest words a threat model must have to count as written down.
pub const MIN_WORDS: usize = 20;
/// Largest threat model file read.
pub const MAX_BYTES: u64 = 64 * 1024;

/// The threat model as recorded in the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThreatModel {
    /// The file it was read from.
    pub path: String,
    /// SHA-256 of its bytes (hex).
    pub sha256: String,
    /// Words.
    pub words: usize,
    /// Its text (control characters escaped).
    pub text: String,
}

/// Reads the threat model, or says why it does not count.
pub fn load(path: Option<&std::path::Path>) -> Result<ThreatModel, String> {
    let path = path.ok_or(
        "no threat model given: write down who the tenants are and what they must not learn about each other, and pass it with --threat-model FILE",
    )?;
    let meta = std::fs::metadata(path)
        .map_err(|e| format!("cannot read the threat model {}: {e}", path.display()))?;
    if meta.len() > MAX_BYTES {
        return Err(format!(
            "the threat model {} has {} bytes; keep it under {MAX_BYTES}",
            path.display(),
            meta.len()
        ));
    }
    let bytes = std::fs::read(path)
        .map_err(|e| format!("cannot read the threat model {}: {e}", path.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    let words = text.split_whitespace().count();
    if words < MIN_WORDS {
        return Err(format!(
            "the threat model {} has {words} words; it must say who the tenants are and what they must not learn about each other (at least {MIN_WORDS} words)",
            path.display()
        ));
    }
    Ok(ThreatModel {
        path: path.display().to_string(),
        sha256: hex::encode(Sha256::digest(&bytes)),
        words,
        text: crate::untrusted::multi_line(&text),
    })
}

/// Check 1.
pub struct ThreatModelCheck;

impl Check for ThreatModelCheck {
    fn id(&self) -> CheckId {
        CheckId::ThreatModel
    }

    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError> {
        Ok(match load(ctx.config.threat_model.as_deref()) {
            Ok(tm) => Outcome::new(Verdict::Pass)
                .measure("threat_model_words", tm.words as f64, "count")
                .finding(format!(
                    "{} recorded in the report (sha256 {})",
                    tm.path, tm.sha256
                )),
            Err(why) => Outcome::new(Verdict::Fail).finding(why),
        })
    }
}
