//! `tenantvm host check` through the CLI seam, against the fake host descriptions.

use std::path::PathBuf;

use tenantvm_gpu::check::Status;
use tenantvm_gpu::cli::{host_ok, run_host_check, HostCheckArgs};

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hosts")
        .join(rel)
}

#[test]
fn fake_h100_host_has_no_failures_except_possibly_kvm() {
    let a = HostCheckArgs {
        root: "/".into(),
        fake_host: Some(fixture("h100x8.sysfs.json")),
        json: false,
    };
    let mut out = Vec::new();
    let r = run_host_check(&a, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.starts_with("(FAKE host tree"), "{text}");
    // dev/kvm in the tree links to this machine's /dev/kvm, which may be absent.
    let fails: Vec<_> = r
        .iter()
        .filter(|c| c.status == Status::Fail && c.name != "kvm")
        .collect();
    assert!(fails.is_empty(), "{text}");
    assert_eq!(
        host_ok(&r),
        r.iter().find(|c| c.name == "kvm").unwrap().status != Status::Fail
    );
}

#[test]
fn json_output_lists_every_check_with_status_and_fix() {
    let a = HostCheckArgs {
        root: "/".into(),
        fake_host: Some(fixture("gpu-audio.sysfs.json")),
        json: true,
    };
    let mut out = Vec::new();
    run_host_check(&a, &mut out).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let items = v.as_array().unwrap();
    let group = items
        .iter()
        .find(|c| c["name"] == "gpu 0000:03:00.0 group")
        .unwrap();
    assert_eq!(group["status"], "warn");
    assert!(group["fix"].as_str().unwrap().contains("slot"));
}

#[test]
fn an_empty_root_fails_and_a_missing_spec_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let a = HostCheckArgs {
        root: dir.path().into(),
        fake_host: None,
        json: false,
    };
    let r = run_host_check(&a, &mut Vec::new()).unwrap();
    assert!(!host_ok(&r));
    let a = HostCheckArgs {
        root: "/".into(),
        fake_host: Some(dir.path().join("nope.json")),
        json: false,
    };
    let e = run_host_check(&a, &mut Vec::new()).unwrap_err();
    assert!(e.to_string().contains("Cannot load"), "{e}");
}
