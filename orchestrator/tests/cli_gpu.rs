//! `tenantvm plan` and `tenantvm host check` run locally (no daemon, no token) through the
//! tenantvm-gpu seam, with their own exit statuses: 11 when the plan does not fit, 12 when
//! a host check fails. Uses the fixtures in tests/fixtures; needs no hardware.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

fn tenantvm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tenantvm"))
        // No daemon, no token file: these commands must not need them.
        .args([
            "--socket",
            "/nonexistent/sock",
            "--token-file",
            "/nonexistent/token",
        ])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn plan_exits_0_when_tenants_fit_and_11_when_they_do_not() {
    let tenants = fixture("tenants/mixed.toml");
    let t = tenants.to_str().unwrap();
    let fits = tenantvm(&["plan", "-t", t, "--gpu", "h100-80gb", "--count", "8"]);
    assert_eq!(
        fits.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&fits.stderr)
    );
    assert!(String::from_utf8_lossy(&fits.stdout).contains("placed"));
    let tight = tenantvm(&["plan", "-t", t, "--gpu", "h100-80gb", "--count", "1"]);
    assert_eq!(tight.status.code(), Some(11));
    let json = tenantvm(&[
        "plan",
        "-t",
        t,
        "--gpu",
        "h100-80gb",
        "--count",
        "8",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["fits"], true);
}

#[test]
fn plan_rejects_unknown_models_as_invalid() {
    let tenants = fixture("tenants/mixed.toml");
    let o = tenantvm(&["plan", "-t", tenants.to_str().unwrap(), "--gpu", "z9000"]);
    assert_eq!(
        o.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn host_check_on_a_fake_host_passes_without_a_daemon() {
    let host = fixture("hosts/h100x8.sysfs.json");
    let o = tenantvm(&["host", "check", "--fake-host", host.to_str().unwrap()]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("FAKE host"));
}
