use super::*;
use crate::receipt::test_util::receipt;

struct Fixture {
    _dir: tempfile::TempDir,
    log: AuditLog,
    signer: ReceiptSigner,
    path: PathBuf,
}

/// A log with three receipts appended.
fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit").join("receipts.jsonl");
    let signer =
        ReceiptSigner::load_or_create(&dir.path().join("audit").join("signing.key")).unwrap();
    let log = AuditLog::new(&path);
    for (d, t) in [("d1", "alice"), ("d2", "bob"), ("d3", "carol")] {
        log.append(&signer, &receipt(d, t)).unwrap();
    }
    Fixture {
        _dir: dir,
        log,
        signer,
        path,
    }
}

fn lines(path: &Path) -> Vec<String> {
    fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn write_lines(path: &Path, lines: &[String]) {
    let mut text = lines.join("\n");
    if !lines.is_empty() {
        text.push('\n');
    }
    fs::write(path, text).unwrap();
}

fn problems(f: &Fixture) -> Vec<ChainProblem> {
    f.log.verify(&f.signer.verifying_key()).unwrap().problems
}

#[test]
fn intact_log_verifies() {
    let f = fixture();
    let report = f.log.verify(&f.signer.verifying_key()).unwrap();
    assert!(report.is_intact(), "{:?}", report.problems);
    assert_eq!(report.entries, 3);
    assert_eq!(report.head_seq, Some(2));
    let entries = f.log.entries().unwrap();
    assert_eq!(entries[0].prev_hash, GENESIS);
    assert_eq!(
        entries[1].prev_hash,
        hex::encode(Sha256::digest(lines(&f.path)[0].as_bytes()))
    );
}

#[test]
fn edited_entry_is_detected() {
    let f = fixture();
    let mut l = lines(&f.path);
    let mut entry: LogEntry = serde_json::from_str(&l[1]).unwrap();
    entry.receipt.tenant = "mallory".to_string();
    l[1] = serde_json::to_string(&entry).unwrap();
    write_lines(&f.path, &l);
    let p = problems(&f);
    assert!(
        p.contains(&ChainProblem::BadSignature { line: 2, seq: 1 }),
        "{p:?}"
    );
    assert!(
        p.contains(&ChainProblem::BrokenChain { line: 3, seq: 2 }),
        "{p:?}"
    );
}

#[test]
fn edited_last_entry_is_detected_through_the_head() {
    let f = fixture();
    let mut l = lines(&f.path);
    l[2] = l[2].replace("carol", "carl");
    write_lines(&f.path, &l);
    let p = problems(&f);
    assert!(
        p.contains(&ChainProblem::BadSignature { line: 3, seq: 2 }),
        "{p:?}"
    );
    assert!(p.contains(&ChainProblem::HeadMismatch { seq: 2 }), "{p:?}");
}

#[test]
fn whitespace_edit_is_detected() {
    let f = fixture();
    let mut l = lines(&f.path);
    l[0] = l[0].replacen(":", ": ", 1);
    write_lines(&f.path, &l);
    let p = problems(&f);
    assert!(p.contains(&ChainProblem::NotCanonical { line: 1 }), "{p:?}");
}

#[test]
fn removed_middle_entry_is_detected() {
    let f = fixture();
    let mut l = lines(&f.path);
    l.remove(1);
    write_lines(&f.path, &l);
    let p = problems(&f);
    assert!(
        p.contains(&ChainProblem::WrongSequence {
            line: 2,
            expected: 1,
            found: 2
        }),
        "{p:?}"
    );
    assert!(
        p.contains(&ChainProblem::BrokenChain { line: 2, seq: 2 }),
        "{p:?}"
    );
}

#[test]
fn removed_first_entry_is_detected() {
    let f = fixture();
    let mut l = lines(&f.path);
    l.remove(0);
    write_lines(&f.path, &l);
    let p = problems(&f);
    assert!(
        p.contains(&ChainProblem::BrokenChain { line: 1, seq: 1 }),
        "{p:?}"
    );
}

#[test]
fn removed_last_entry_is_detected() {
    let f = fixture();
    let mut l = lines(&f.path);
    l.pop();
    write_lines(&f.path, &l);
    let p = problems(&f);
    assert_eq!(
        p,
        vec![ChainProblem::Truncated {
            head_seq: 2,
            entries: 2
        }]
    );
}

#[test]
fn emptied_log_is_detected() {
    let f = fixture();
    write_lines(&f.path, &[]);
    let p = problems(&f);
    assert_eq!(
        p,
        vec![ChainProblem::Truncated {
            head_seq: 2,
            entries: 0
        }]
    );
}

#[test]
fn reordered_entries_are_detected() {
    let f = fixture();
    let mut l = lines(&f.path);
    l.swap(1, 2);
    write_lines(&f.path, &l);
    let p = problems(&f);
    assert!(
        p.contains(&ChainProblem::WrongSequence {
            line: 2,
            expected: 1,
            found: 2
        }),
        "{p:?}"
    );
    assert!(
        p.contains(&ChainProblem::BrokenChain { line: 3, seq: 1 }),
        "{p:?}"
    );
}

#[test]
fn forged_head_is_detected() {
    let f = fixture();
    let head_path = f.log.head_path();
    let mut head: Head = serde_json::from_slice(&fs::read(&head_path).unwrap()).unwrap();
    head.seq = 1;
    fs::write(&head_path, serde_json::to_vec(&head).unwrap()).unwrap();
    assert_eq!(problems(&f), vec![ChainProblem::HeadInvalid]);
    fs::remove_file(&head_path).unwrap();
    assert_eq!(problems(&f), vec![ChainProblem::HeadMissing]);
}

#[test]
fn another_key_does_not_verify() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let other = ReceiptSigner::load_or_create(&dir.path().join("k")).unwrap();
    let report = f.log.verify(&other.verifying_key()).unwrap();
    assert_eq!(
        report
            .problems
            .iter()
            .filter(|p| matches!(p, ChainProblem::BadSignature { .. }))
            .count(),
        3
    );
    assert!(report.problems.contains(&ChainProblem::HeadInvalid));
}

#[test]
fn append_is_idempotent_per_departure() {
    let f = fixture();
    let again = f.log.append(&f.signer, &receipt("d2", "bob")).unwrap();
    assert_eq!(again.seq, 1);
    assert_eq!(lines(&f.path).len(), 3);
    let err = f.log.append(&f.signer, &receipt("d2", "eve")).unwrap_err();
    assert!(matches!(err, ReceiptError::Conflict(_)), "{err}");
}

#[test]
fn torn_tail_is_reported_then_repaired_by_the_next_append() {
    let f = fixture();
    let mut data = fs::read(&f.path).unwrap();
    data.extend_from_slice(b"{\"seq\":3,\"prev_h");
    fs::write(&f.path, &data).unwrap();
    assert_eq!(problems(&f), vec![ChainProblem::TornTail { line: 4 }]);
    let entry = f.log.append(&f.signer, &receipt("d4", "dave")).unwrap();
    assert_eq!(entry.seq, 3);
    assert!(problems(&f).is_empty());
}

#[test]
fn append_after_a_crash_before_the_head_update_catches_up() {
    let f = fixture();
    // Roll the head back one entry, as if the crash hit between the append and the head write.
    let l = lines(&f.path);
    let hash = hex::encode(Sha256::digest(l[1].as_bytes()));
    f.log.write_head(&f.signer, 1, &hash).unwrap();
    assert!(
        problems(&f).is_empty(),
        "an entry after the head is accepted when signed"
    );
    let again = f.log.append(&f.signer, &receipt("d3", "carol")).unwrap();
    assert_eq!(again.seq, 2);
    let report = f.log.verify(&f.signer.verifying_key()).unwrap();
    assert_eq!(report.head_seq, Some(2));
}

#[test]
fn append_never_chains_onto_a_tampered_log() {
    let f = fixture();
    let mut l = lines(&f.path);
    l.remove(1);
    write_lines(&f.path, &l);
    let entry = f.log.append(&f.signer, &receipt("d4", "dave")).unwrap();
    // A new chain, not one that would launder the removal.
    assert_eq!((entry.seq, entry.prev_hash.as_str()), (0, GENESIS));
    let report = f.log.verify(&f.signer.verifying_key()).unwrap();
    assert_eq!(report.entries, 1);
    assert_eq!(
        report.problems,
        vec![ChainProblem::SetAside {
            path: report.set_aside[0].clone()
        }]
    );
    // The set-aside log still shows what was done to it.
    let old = AuditLog::new(&report.set_aside[0])
        .verify(&f.signer.verifying_key())
        .unwrap();
    assert!(
        old.problems
            .iter()
            .any(|p| matches!(p, ChainProblem::WrongSequence { .. })),
        "{:?}",
        old.problems
    );
}

#[test]
fn signing_key_is_private_and_stable() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("signing.key");
    let a = ReceiptSigner::load_or_create(&path).unwrap();
    let b = ReceiptSigner::load_or_create(&path).unwrap();
    assert_eq!(a.key_id(), b.key_id());
    assert_eq!(
        fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let public = load_verifying_key(&public_key_path(&path)).unwrap();
    assert_eq!(public, a.verifying_key());
    assert!(!format!("{a:?}").contains(&hex::encode(a.key.to_bytes())));
}

#[test]
fn garbage_public_key_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k.pub");
    fs::write(&path, "not hex\n").unwrap();
    assert!(matches!(
        load_verifying_key(&path),
        Err(ReceiptError::BadKey { .. })
    ));
}

/// A receipt whose agent-shutdown record carries what a hostile guest agent sent back: a
/// 4 MiB error message and evidence full of terminal escapes and newlines.
fn hostile_receipt(departure: &str) -> Receipt {
    use crate::receipt::{Assurance, DepartureStep, StepRecord, StepResult};
    let mut r = receipt(departure, "mallory");
    r.steps.push(
        StepRecord::new(
            DepartureStep::AgentShutdown,
            "the guest agent did not answer shutdown",
            StepResult::Ok,
            Assurance::Unverified,
            "2026-01-02T03:04:05Z".into(),
            "2026-01-02T03:04:06Z".into(),
        )
        .with_evidence(
            "agent_error",
            format!("\x1b[2J{}\ncrypto-shred ok verified", "A".repeat(4 << 20)),
        )
        .failed("B".repeat(4 << 20)),
    );
    r
}

#[test]
fn a_huge_guest_message_is_bounded_and_the_log_stays_readable() {
    let f = fixture();
    let entry = f.log.append(&f.signer, &hostile_receipt("d4")).unwrap();
    let raw = lines(&f.path);
    assert!(
        raw[3].len() <= MAX_LINE,
        "a {} byte line was written; the reader refuses lines over {MAX_LINE}",
        raw[3].len()
    );
    let report = f.log.verify(&f.signer.verifying_key()).unwrap();
    assert!(report.is_intact(), "{:?}", report.problems);
    let entries = f.log.entries().unwrap();
    assert_eq!(entries.len(), 4);
    let step = entries[3]
        .receipt
        .steps
        .iter()
        .find(|s| s.step == crate::receipt::DepartureStep::AgentShutdown)
        .unwrap();
    let evidence = &step.evidence["agent_error"];
    assert!(
        evidence.len() <= crate::untrusted::MAX_FIELD_BYTES,
        "{}",
        evidence.len()
    );
    assert!(evidence.contains("truncated"), "the cut is marked");
    assert!(!evidence.contains('\x1b') && !evidence.contains('\n'));
    assert!(step.error.as_ref().unwrap().contains("truncated"));
    // What was signed is what was written: the appended entry is the bounded one.
    assert_eq!(entries[3], entry);
    // The next departure is not blocked.
    f.log.append(&f.signer, &receipt("d5", "erin")).unwrap();
    assert!(problems(&f).is_empty());
}

#[test]
fn a_damaged_entry_never_blocks_later_departures() {
    let f = fixture();
    let mut l = lines(&f.path);
    // The damage an unbounded writer once did: one line longer than the reader accepts.
    l[1] = format!("{{\"seq\":1,\"junk\":\"{}\"}}", "x".repeat(MAX_LINE + 10));
    write_lines(&f.path, &l);
    assert!(!problems(&f).is_empty());
    // Readers skip what they cannot parse instead of failing every request.
    let readable = f.log.entries().unwrap();
    assert_eq!(
        readable
            .iter()
            .map(|e| e.receipt.departure_id.as_str())
            .collect::<Vec<_>>(),
        ["d1", "d3"]
    );
    // The next departure's receipt is appended.
    let entry = f.log.append(&f.signer, &receipt("d4", "dave")).unwrap();
    assert_eq!(entry.receipt.departure_id, "d4");
    // ...to a fresh chain; the damaged log is kept, byte for byte, as evidence.
    let report = f.log.verify(&f.signer.verifying_key()).unwrap();
    assert_eq!(report.entries, 1);
    assert_eq!(report.set_aside.len(), 1, "{report:?}");
    assert_eq!(lines(&report.set_aside[0]), l);
    // The damaged log's entries stay readable, and appends stay idempotent across it.
    let all = f.log.entries().unwrap();
    assert_eq!(
        all.iter()
            .map(|e| e.receipt.departure_id.as_str())
            .collect::<Vec<_>>(),
        ["d1", "d3", "d4"]
    );
    let again = f.log.append(&f.signer, &receipt("d3", "carol")).unwrap();
    assert_eq!(again.receipt.departure_id, "d3");
    assert_eq!(f.log.verify(&f.signer.verifying_key()).unwrap().entries, 1);
}

#[test]
fn an_entry_read_through_the_api_checks_against_the_key_and_the_chain() {
    let f = fixture();
    let entries = f.log.entries().unwrap();
    let key = f.signer.verifying_key();
    assert!(entries.iter().all(|e| e.signed_by(&key)));
    // Its digest is what the next entry chains to.
    assert_eq!(entries[0].digest().unwrap(), entries[1].prev_hash);
    // Controls: an edited entry, or another key, does not check.
    let mut edited = entries[1].clone();
    edited.receipt.tenant = "mallory".into();
    assert!(!edited.signed_by(&key));
    let dir = tempfile::tempdir().unwrap();
    let other = ReceiptSigner::load_or_create(&dir.path().join("other.key")).unwrap();
    assert!(!entries[1].signed_by(&other.verifying_key()));
    assert_ne!(edited.digest().unwrap(), entries[1].digest().unwrap());
}
