//! `tenantvm receipt show` and `tenantvm receipt verify`: clap arguments and run functions
//! (the CLI's subcommand enum flattens these).

use std::io::Write;
use std::path::PathBuf;

use super::log::{load_verifying_key, public_key_path};
use super::{AuditLog, LogEntry, ReceiptError, VerifyReport, DEFAULT_LOG, DEFAULT_SIGNING_KEY};
use crate::untrusted::one_line;

/// Arguments of `tenantvm receipt show`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReceiptShowArgs {
    /// The audit log to read.
    #[arg(long, env = "TENANTVM_AUDIT_LOG", default_value = DEFAULT_LOG)]
    pub log: PathBuf,
    /// Show only this tenant's receipts.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Show only this departure's receipt.
    #[arg(long)]
    pub departure: Option<String>,
    /// Print the entries as a JSON array instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `tenantvm receipt verify`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReceiptVerifyArgs {
    /// The audit log to verify.
    #[arg(long, env = "TENANTVM_AUDIT_LOG", default_value = DEFAULT_LOG)]
    pub log: PathBuf,
    /// The host's receipt public key (hex), written next to the signing key as `.pub`.
    #[arg(long, env = "TENANTVM_RECEIPT_PUBKEY")]
    pub public_key: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

fn write_err(e: std::io::Error) -> ReceiptError {
    ReceiptError::Io {
        action: "write",
        path: "standard output".to_string(),
        source: e,
    }
}

/// Prints the receipts selected by `args` to `out`; returns how many were shown. Parses but
/// does not verify (that is `tenantvm receipt verify`).
pub fn run_show(args: &ReceiptShowArgs, out: &mut dyn Write) -> Result<usize, ReceiptError> {
    let entries: Vec<LogEntry> = AuditLog::new(&args.log)
        .entries()?
        .into_iter()
        .filter(|e| args.tenant.as_ref().is_none_or(|t| *t == e.receipt.tenant))
        .filter(|e| {
            args.departure
                .as_ref()
                .is_none_or(|d| *d == e.receipt.departure_id)
        })
        .collect();
    if args.json {
        serde_json::to_writer_pretty(&mut *out, &entries)?;
        writeln!(out).map_err(write_err)?;
        return Ok(entries.len());
    }
    write_entries(&entries, out)?;
    if entries.is_empty() {
        writeln!(out, "no receipts in {}", args.log.display()).map_err(write_err)?;
    }
    Ok(entries.len())
}

/// Prints audit log entries as text, one block per receipt (what `receipt show` prints).
/// Every field is printed as one escaped line ([`one_line`]): methods, evidence and errors
/// quote guests, and a guest must never drive the operator's terminal or forge a line.
pub fn write_entries(entries: &[LogEntry], out: &mut dyn Write) -> Result<(), ReceiptError> {
    for entry in entries {
        let r = &entry.receipt;
        if let Some(v) = &r.verification {
            let verdicts: Vec<String> = v
                .checks
                .iter()
                .map(|(k, c)| format!("{}={}", one_line(k), one_line(c)))
                .collect();
            writeln!(
                out,
                "#{seq} verification {id}: {outcome} (appended {a})\n  {verdicts}\n  report {p} sha256 {h}",
                seq = entry.seq,
                id = one_line(&v.run_id),
                outcome = if v.passed { "passed" } else { "NOT passed" },
                a = one_line(&entry.appended_at),
                verdicts = verdicts.join(" "),
                p = one_line(&v.report_path),
                h = one_line(&v.report_sha256),
            )
            .map_err(write_err)?;
            continue;
        }
        let outcome = match (r.succeeded(), r.simulated()) {
            (false, _) => "FAILED",
            (true, true) => "completed (some steps simulated)",
            (true, false) => "completed",
        };
        writeln!(
            out,
            "#{seq} departure {d} of tenant {t}: {outcome}\n  {s} .. {f} (appended {a})",
            seq = entry.seq,
            d = one_line(&r.departure_id),
            t = one_line(&r.tenant),
            s = one_line(&r.started_at),
            f = one_line(&r.finished_at),
            a = one_line(&entry.appended_at),
        )
        .map_err(write_err)?;
        for step in &r.steps {
            let name = serde_json::to_value(step.step)?;
            let result = serde_json::to_value(step.result)?;
            let assurance = serde_json::to_value(step.assurance)?;
            writeln!(
                out,
                "  - {:<18} {:<8} {:<15} {}",
                name.as_str().unwrap_or_default(),
                result.as_str().unwrap_or_default(),
                assurance.as_str().unwrap_or_default(),
                one_line(&step.method)
            )
            .map_err(write_err)?;
            for (k, v) in &step.evidence {
                writeln!(out, "      {}: {}", one_line(k), one_line(v)).map_err(write_err)?;
            }
            if let Some(e) = &step.error {
                writeln!(out, "      error: {}", one_line(e)).map_err(write_err)?;
            }
        }
    }
    Ok(())
}

/// Verifies the log named by `args` and prints the result to `out`. Returns the report when
/// the log is intact, [`ReceiptError::VerifyFailed`] (after printing every problem) when not.
pub fn run_verify(
    args: &ReceiptVerifyArgs,
    out: &mut dyn Write,
) -> Result<VerifyReport, ReceiptError> {
    let key_path = args
        .public_key
        .clone()
        .unwrap_or_else(|| public_key_path(std::path::Path::new(DEFAULT_SIGNING_KEY)));
    let key = load_verifying_key(&key_path)?;
    let report = AuditLog::new(&args.log).verify(&key)?;
    if args.json {
        serde_json::to_writer_pretty(&mut *out, &report)?;
        writeln!(out).map_err(write_err)?;
    } else if report.is_intact() {
        writeln!(
            out,
            "{}: intact, {} entries, signed head at entry {}, last hash {}",
            args.log.display(),
            report.entries,
            report
                .head_seq
                .map_or_else(|| "-".to_string(), |s| s.to_string()),
            report.last_hash.as_deref().unwrap_or("-"),
        )
        .map_err(write_err)?;
    } else {
        writeln!(out, "{}: TAMPERED OR DAMAGED", args.log.display()).map_err(write_err)?;
        for p in &report.problems {
            writeln!(out, "  {}", one_line(&p.to_string())).map_err(write_err)?;
        }
    }
    if report.is_intact() {
        Ok(report)
    } else {
        Err(ReceiptError::VerifyFailed(report.problems.len()))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::receipt::test_util::receipt;
    use crate::receipt::ReceiptSigner;

    #[derive(Parser)]
    struct ShowCli {
        #[command(flatten)]
        args: ReceiptShowArgs,
    }

    #[derive(Parser)]
    struct VerifyCli {
        #[command(flatten)]
        args: ReceiptVerifyArgs,
    }

    fn setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("receipts.jsonl");
        let key = dir.path().join("signing.key");
        let signer = ReceiptSigner::load_or_create(&key).unwrap();
        let audit = AuditLog::new(&log);
        audit.append(&signer, &receipt("d1", "alice")).unwrap();
        audit.append(&signer, &receipt("d2", "bob")).unwrap();
        (dir, log, public_key_path(&key))
    }

    #[test]
    fn show_filters_by_tenant_and_prints_steps() {
        let (_dir, log, _) = setup();
        let cli = ShowCli::parse_from(["x", "--log", log.to_str().unwrap(), "--tenant", "bob"]);
        let mut out = Vec::new();
        assert_eq!(run_show(&cli.args, &mut out).unwrap(), 1);
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("departure d2 of tenant bob"), "{text}");
        assert!(
            text.contains("gpu-scrub") && text.contains("simulated"),
            "{text}"
        );
        assert!(!text.contains("alice"), "{text}");
    }

    #[test]
    fn show_json_is_an_array_of_entries() {
        let (_dir, log, _) = setup();
        let cli = ShowCli::parse_from(["x", "--log", log.to_str().unwrap(), "--json"]);
        let mut out = Vec::new();
        run_show(&cli.args, &mut out).unwrap();
        let entries: Vec<LogEntry> = serde_json::from_slice(&out).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[1].receipt.tenant, "bob");
    }

    #[test]
    fn verify_reports_intact_then_tampered() {
        let (_dir, log, public) = setup();
        let argv = [
            "x",
            "--log",
            log.to_str().unwrap(),
            "--public-key",
            public.to_str().unwrap(),
        ];
        let cli = VerifyCli::parse_from(argv);
        let mut out = Vec::new();
        run_verify(&cli.args, &mut out).unwrap();
        assert!(String::from_utf8_lossy(&out).contains("intact, 2 entries"));

        let text = std::fs::read_to_string(&log)
            .unwrap()
            .replace("alice", "alicf");
        std::fs::write(&log, text).unwrap();
        let mut out = Vec::new();
        let err = run_verify(&cli.args, &mut out).unwrap_err();
        assert!(
            matches!(err, ReceiptError::VerifyFailed(n) if n >= 2),
            "{err}"
        );
        assert!(String::from_utf8_lossy(&out).contains("bad signature"));
    }

    #[test]
    fn show_never_prints_guest_control_characters_or_forged_lines() {
        use crate::receipt::{Assurance, DepartureStep, StepRecord, StepResult};
        let mut r = receipt("d9", "mallory");
        r.steps.push(
            StepRecord::new(
                DepartureStep::AgentShutdown,
                "agent says \x1b]0;pwned\x07done",
                StepResult::Ok,
                Assurance::Unverified,
                "2026-01-02T03:04:05Z".into(),
                "2026-01-02T03:04:06Z".into(),
            )
            .with_evidence("agent_error", "\x1b[2J\ncrypto-shred ok verified\r\n")
            .failed("\u{9b}31mred\ncrypto-shred ok verified"),
        );
        let entry = LogEntry {
            seq: 0,
            prev_hash: "0".repeat(64),
            appended_at: "2026-01-02T03:04:07Z".into(),
            key_id: "k".into(),
            receipt: r,
            signature: String::new(),
        };
        let mut out = Vec::new();
        write_entries(&[entry], &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "control characters reached the terminal: {text:?}"
        );
        assert!(
            !text
                .lines()
                .any(|l| l.trim_start().starts_with("crypto-shred ok verified")),
            "a guest forged a line: {text}"
        );
    }

    #[test]
    fn verify_without_public_key_says_where_it_looked() {
        let (dir, log, _) = setup();
        let missing = dir.path().join("nope.pub");
        let cli = VerifyCli::parse_from([
            "x",
            "--log",
            log.to_str().unwrap(),
            "--public-key",
            missing.to_str().unwrap(),
        ]);
        let err = run_verify(&cli.args, &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("nope.pub"), "{err}");
    }
}
