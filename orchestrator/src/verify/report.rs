//! The report of a verification run: a table for the terminal and JSON for files, auditors
//! and the audit log ([`super::audit`]).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::checks::threat::ThreatModel;
use super::{CheckId, CheckResult, Verdict};

/// The report format's version.
pub const REPORT_VERSION: u32 = 1;

/// One verification run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// [`REPORT_VERSION`].
    pub version: u32,
    /// The run's id (its probe tenants are `tvm-verify-<run id>-*`).
    pub run_id: String,
    /// RFC 3339 UTC start.
    pub started_at: String,
    /// RFC 3339 UTC end.
    pub finished_at: String,
    /// The daemon's version and backend, as its health check said.
    pub daemon: String,
    /// Seed of the randomised parts (rerun with `--seed` to repeat the order).
    pub seed: u64,
    /// The operator's threat model, when one was given and readable.
    pub threat_model: Option<ThreatModel>,
    /// The checks selected.
    pub selected: Vec<CheckId>,
    /// Their results, in order.
    pub checks: Vec<CheckResult>,
    /// What the sweep of earlier runs' probe tenants found.
    pub sweep: Vec<String>,
    /// Whether every selected check passed.
    pub passed: bool,
}

impl Report {
    /// Whether the run passed: no selected check failed or was inconclusive, and at least
    /// one passed. A not-applicable check is no pass: the headline names it
    /// ([`Report::headline`]).
    pub fn all_passed(checks: &[CheckResult]) -> bool {
        checks.iter().any(|c| c.outcome.verdict == Verdict::Pass)
            && checks
                .iter()
                .all(|c| matches!(c.outcome.verdict, Verdict::Pass | Verdict::NotApplicable))
    }

    /// The run's one-line verdict: passed or not, the counts, and the checks that were not
    /// applicable (judged nothing), named, so a pass never hides them.
    pub fn headline(&self) -> String {
        let counts = |v: Verdict| {
            self.checks
                .iter()
                .filter(|c| c.outcome.verdict == v)
                .count()
        };
        let mut line = format!(
            "{}: {} pass, {} fail, {} inconclusive",
            if self.passed { "PASSED" } else { "NOT PASSED" },
            counts(Verdict::Pass),
            counts(Verdict::Fail),
            counts(Verdict::Inconclusive)
        );
        let not_applicable: Vec<String> = self
            .checks
            .iter()
            .filter(|c| c.outcome.verdict == Verdict::NotApplicable)
            .map(|c| format!("{} {}", c.number, c.check.key()))
            .collect();
        if !not_applicable.is_empty() {
            let _ = write!(
                line,
                ", {} not applicable (NOT CHECKED: {}; nothing on this host for them to judge, see their findings)",
                not_applicable.len(),
                not_applicable.join(", ")
            );
        }
        line
    }

    /// The report as a table: one row per check, then each check's evidence and findings.
    /// Every string is escaped to one line (findings may quote guests).
    pub fn to_table(&self) -> String {
        let one = crate::untrusted::one_line;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "tenantvm verify run {} ({} .. {}), daemon {}",
            self.run_id,
            self.started_at,
            self.finished_at,
            one(&self.daemon)
        );
        let _ = writeln!(s, "{}", self.headline());
        let _ = writeln!(
            s,
            "{:>3}  {:<22} {:<14} {:>9}  title",
            "#", "check", "verdict", "time"
        );
        for c in &self.checks {
            let _ = writeln!(
                s,
                "{:>3}  {:<22} {:<14} {:>7.1}s  {}",
                c.number,
                c.check.key(),
                c.outcome.verdict.as_str().to_uppercase(),
                c.elapsed_ms as f64 / 1e3,
                c.title
            );
        }
        for c in &self.checks {
            let _ = writeln!(
                s,
                "\n[{}] {}: {}",
                c.number,
                c.check.key(),
                c.outcome.verdict.as_str()
            );
            for m in &c.outcome.evidence {
                let _ = writeln!(
                    s,
                    "    {} = {} {}",
                    one(&m.name),
                    fmt_value(m.value),
                    one(&m.unit)
                );
            }
            for f in &c.outcome.findings {
                let _ = writeln!(s, "    - {}", one(f));
            }
        }
        if !self.sweep.is_empty() {
            let _ = writeln!(s, "\nprobe sweep:");
            for l in &self.sweep {
                let _ = writeln!(s, "    - {}", one(l));
            }
        }
        let _ = writeln!(s, "\n{}", self.headline());
        s
    }
}

fn fmt_value(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else if v != 0.0 && (v.abs() < 1e-3 || v.abs() >= 1e9) {
        format!("{v:.3e}")
    } else {
        format!("{v:.3}")
    }
}
