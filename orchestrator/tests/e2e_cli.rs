//! The `tenantvm` binary against a real tenantvmd: create from a TOML file, list/status with
//! --json, logs, destroy, and the documented exit status of each kind of failure. Skips
//! without root or /dev/kvm.

mod support;

use std::process::{Command, Output};

use support::cli::{tenantvm, text};
use support::daemon::{self, TestDaemon};

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited")
}

#[test]
fn cli_commands_work_and_failures_have_distinct_exit_statuses() {
    if daemon::should_skip("cli_commands_work_and_failures_have_distinct_exit_statuses") {
        return;
    }
    let mut d = TestDaemon::new();
    d.start(None);
    let admin = d.admin_token_file();
    let name = daemon::unique("cli");
    let spec = d.dir.path().join("t.toml");
    std::fs::write(
        &spec,
        format!("name = \"{name}\"\nmemory_mib = 32\n[image]\nname = \"idle\"\n"),
    )
    .unwrap();
    let tok = d.dir.path().join("t.token");

    let o = tenantvm(
        &d,
        &admin,
        &[
            "create",
            spec.to_str().unwrap(),
            "--token-out",
            tok.to_str().unwrap(),
        ],
    );
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(
        text(&o).contains("await-running"),
        "progress shows the steps: {}",
        text(&o)
    );

    let o = tenantvm(&d, &admin, &["list", "--json"]);
    assert_eq!(code(&o), 0);
    let list: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(list["tenants"][0]["state"], "running");

    let o = tenantvm(&d, &tok, &["status", &name, "--json"]);
    assert_eq!(code(&o), 0, "{}", text(&o));

    let o = tenantvm(&d, &admin, &["logs", &name, "--stream", "events"]);
    assert_eq!(code(&o), 0);
    assert!(text(&o).contains("provisioning -> running"));

    // Failures and their statuses.
    let o = tenantvm(&d, &admin, &["create", spec.to_str().unwrap()]);
    assert_eq!(code(&o), 6, "duplicate name: {}", text(&o));
    let o = tenantvm(
        &d,
        &admin,
        &["create", "--name", "../etc", "--image", "idle"],
    );
    assert_eq!(code(&o), 7, "path-like name: {}", text(&o));
    let bad = d.dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "name = \"x\"\nflavour = 1\n[image]\nname = \"idle\"\n",
    )
    .unwrap();
    let o = tenantvm(&d, &admin, &["create", bad.to_str().unwrap()]);
    assert_eq!(code(&o), 7, "unknown field: {}", text(&o));
    assert!(text(&o).contains("flavour"));
    let o = tenantvm(&d, &admin, &["status", "nobody"]);
    assert_eq!(code(&o), 5);
    let o = tenantvm(&d, &tok, &["create", "--name", "eve", "--image", "idle"]);
    assert_eq!(code(&o), 10, "tenant token creating: {}", text(&o));
    let forged = d.dir.path().join("forged.token");
    std::fs::write(&forged, format!("tvm_{}", "0".repeat(64))).unwrap();
    let o = tenantvm(&d, &forged, &["list"]);
    assert_eq!(code(&o), 4);
    let o = tenantvm(&d, &admin, &["start", &name]);
    assert_eq!(code(&o), 6, "start while running: {}", text(&o));
    let o = Command::new(env!("CARGO_BIN_EXE_tenantvm"))
        .args([
            "--socket",
            "/nonexistent/tvm.sock",
            "--token",
            "tvm_x",
            "list",
        ])
        .output()
        .unwrap();
    assert_eq!(code(&o), 3);
    let o = tenantvm(&d, &admin, &["frobnicate"]);
    assert_eq!(code(&o), 2);

    let o = tenantvm(&d, &admin, &["destroy", &name]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let o = tenantvm(&d, &admin, &["list"]);
    assert!(text(&o).contains("no tenants"));
    d.stop();
}

/// A daemon that cannot start says why on one line, each cause once: the store's error
/// prints its SQLite cause in its own message and returns it as its source too.
#[test]
fn a_daemon_that_cannot_start_names_each_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    // The store's file is a directory: SQLite cannot open it.
    std::fs::create_dir_all(state.join("state.db")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tenantvmd"))
        .arg("--state-dir")
        .arg(&state)
        .arg("--socket")
        .arg(dir.path().join("d.sock"))
        .arg("--image-dir")
        .arg(dir.path().join("img"))
        .env("TENANTVMD_KEK_FILE", dir.path().join("host-kek"))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "tenantvmd started over a broken store"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr
        .lines()
        .find(|l| l.starts_with("tenantvmd: "))
        .unwrap_or_else(|| panic!("no failure line: {stderr}"));
    let cause = "unable to open database file";
    assert!(line.contains("Cannot open the state store"), "{line}");
    assert_eq!(
        line.matches(cause).count(),
        1,
        "a cause printed twice: {line}"
    );
}
