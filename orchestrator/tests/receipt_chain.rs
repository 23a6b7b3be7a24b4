//! Receipts through the real daemon and the CLI: every destroy appends one signed receipt;
//! `tenantvm receipt verify` accepts the log and detects an edited, a removed and a reordered
//! entry; `tenantvm receipt show` (through the API) shows the admin every receipt, a departed
//! tenant's revoked token its own receipt only, and a live tenant's token none of another's. Skips without root or /dev/kvm.

mod support;

use support::daemon::{self, TestDaemon};
use support::departure::{audit_log, cli, create, ok, receipts_of, text, verify};

#[test]
fn receipt_chain_tampering_is_detected_through_the_cli() {
    if daemon::should_skip("receipt_chain_tampering_is_detected_through_the_cli") {
        return;
    }
    let mut d = TestDaemon::new();
    d.start(None);
    let names: Vec<String> = (0..3).map(|i| daemon::unique(&format!("rc{i}"))).collect();
    for n in &names {
        ok(create(&d, n, ""), "create", &d);
        ok(cli(&d, None, &["destroy", n]), "destroy", &d);
        assert_eq!(receipts_of(&d, n).len(), 1, "{n}");
    }
    // A departed tenant's (revoked) token still reads its own receipt, and nothing else.
    let gone = d.dir.path().join(format!("{}.token", names[0]));
    let own = ok(
        cli(&d, Some(&gone), &["receipt", "show", "--json"]),
        "departed tenant's receipt",
        &d,
    );
    let list: serde_json::Value = serde_json::from_slice(&own.stdout).unwrap();
    assert_eq!(list["receipts"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list["receipts"][0]["receipt"]["tenant"], names[0].as_str());
    let o = cli(&d, Some(&gone), &["list"]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    let o = cli(&d, Some(&gone), &["receipt", "show", &names[1]]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    let v = ok(verify(&d), "verify", &d);
    assert!(text(&v).contains("intact, 3 entries"), "{}", text(&v));

    // Through the API: the admin sees all three; a live tenant's token sees none of them.
    let shown = ok(cli(&d, None, &["receipt", "show", "--json"]), "show", &d);
    let list: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(list["receipts"].as_array().unwrap().len(), 3);
    let one = ok(
        cli(&d, None, &["receipt", "show", &names[1], "--json"]),
        "show one",
        &d,
    );
    let list: serde_json::Value = serde_json::from_slice(&one.stdout).unwrap();
    assert_eq!(list["receipts"][0]["receipt"]["tenant"], names[1].as_str());
    let live = daemon::unique("rcl");
    ok(create(&d, &live, ""), "create live", &d);
    let tok = d.dir.path().join(format!("{live}.token"));
    let mine = ok(
        cli(&d, Some(&tok), &["receipt", "show", "--json"]),
        "tenant show",
        &d,
    );
    let list: serde_json::Value = serde_json::from_slice(&mine.stdout).unwrap();
    assert!(list["receipts"].as_array().unwrap().is_empty(), "{list}");
    let other = cli(&d, Some(&tok), &["receipt", "show", &names[0]]);
    assert_eq!(other.status.code(), Some(5), "{}", text(&other));

    let log = audit_log(&d);
    let original = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = original.lines().collect();
    let tampered = |content: String, what: &str| {
        std::fs::write(&log, content).unwrap();
        let o = verify(&d);
        assert_eq!(
            o.status.code(),
            Some(1),
            "{what} not detected: {}",
            text(&o)
        );
        assert!(text(&o).contains("TAMPERED"), "{what}: {}", text(&o));
    };
    // Edited: one receipt's tenant renamed.
    tampered(
        original.replacen(&names[1], &names[2], 1),
        "an edited entry",
    );
    // Removed: the middle entry.
    tampered(format!("{}\n{}\n", lines[0], lines[2]), "a removed entry");
    // Reordered: the last two swapped.
    tampered(
        format!("{}\n{}\n{}\n", lines[0], lines[2], lines[1]),
        "reordered entries",
    );
    // Truncated: the last entry dropped (the signed head still names it).
    tampered(format!("{}\n{}\n", lines[0], lines[1]), "a dropped tail");
    std::fs::write(&log, &original).unwrap();
    ok(verify(&d), "verify restored", &d);
    d.stop();
}

#[test]
fn a_failed_destroy_step_stays_destroying_and_destroy_again_resumes() {
    if daemon::should_skip("a_failed_destroy_step_stays_destroying_and_destroy_again_resumes") {
        return;
    }
    let mut d = TestDaemon::new();
    d.start(None);
    let name = daemon::unique("rf");
    ok(create(&d, &name, ""), "create", &d);
    // An audit log that cannot be opened (a directory in its place), so write-receipt fails.
    let log = audit_log(&d);
    std::fs::create_dir_all(&log).unwrap();
    let o = cli(&d, None, &["destroy", &name]);
    assert_eq!(o.status.code(), Some(8), "{}", text(&o));
    assert!(text(&o).contains("write-receipt"), "{}", text(&o));
    assert!(text(&o).contains("again to resume"), "{}", text(&o));
    let t = d.store().tenant(&name).unwrap().unwrap();
    assert_eq!(
        t.state,
        tenantvm::domain::lifecycle::LifecycleState::Destroying
    );
    // Fixed, destroy resumes the same departure and finishes it.
    std::fs::remove_dir(&log).unwrap();
    ok(cli(&d, None, &["destroy", &name]), "destroy again", &d);
    assert!(d.store().tenant(&name).unwrap().is_none());
    assert_eq!(receipts_of(&d, &name).len(), 1);
    ok(verify(&d), "verify", &d);
    d.stop();
}

#[test]
fn a_damaged_audit_log_never_blocks_later_departures() {
    if daemon::should_skip("a_damaged_audit_log_never_blocks_later_departures") {
        return;
    }
    let mut d = TestDaemon::new();
    d.start(None);
    let first = daemon::unique("dl0");
    ok(create(&d, &first, ""), "create", &d);
    ok(cli(&d, None, &["destroy", &first]), "destroy", &d);
    // The damage an unbounded writer once did: a line longer than any reader accepts.
    let log = audit_log(&d);
    let mut damaged = std::fs::read(&log).unwrap();
    damaged.extend_from_slice(&vec![b'x'; tenantvm::receipt::MAX_LINE + 1]);
    damaged.push(b'\n');
    std::fs::write(&log, &damaged).unwrap();
    // Receipts stay readable through the API...
    assert_eq!(receipts_of(&d, &first).len(), 1);
    // ...and the next departures complete, each with its receipt.
    for i in 1..3 {
        let name = daemon::unique(&format!("dl{i}"));
        ok(create(&d, &name, ""), "create", &d);
        ok(
            cli(&d, None, &["destroy", &name]),
            "destroy after damage",
            &d,
        );
        assert_eq!(receipts_of(&d, &name).len(), 1, "{name}");
    }
    // verify reports the set-aside log (kept byte for byte) and fails until it is moved.
    let o = verify(&d);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("set aside"), "{}", text(&o));
    let dir = log.parent().unwrap();
    let aside: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.contains(".damaged-") && !n.ends_with(".head")
        })
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(std::fs::read(&aside[0]).unwrap(), damaged);
    d.stop();
}
