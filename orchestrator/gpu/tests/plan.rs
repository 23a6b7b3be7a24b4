//! `tenantvm plan` end to end through the CLI seam: fixture tenants files, a model host, a
//! simulated host and mig-parted configs in and out.

use std::path::PathBuf;

use tenantvm_gpu::cli::{run_plan, PlanArgs};
use tenantvm_gpu::plan::Share;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

fn args(tenants: &str) -> PlanArgs {
    PlanArgs {
        tenants: fixture(tenants),
        gpu: None,
        count: 1,
        gpu_backend: None,
        mig_config: None,
        mig_config_label: "tenantvm".into(),
        write_mig_config: None,
        json: false,
        search_budget: tenantvm_gpu::plan::search::DEFAULT_NODE_BUDGET,
    }
}

#[test]
fn mixed_tenants_fit_on_four_h100s_and_the_mig_config_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = args("tenants/mixed.toml");
    a.gpu = Some("h100-80gb".into());
    a.count = 4;
    a.write_mig_config = Some(dir.path().join("mig.yaml"));
    let mut out = Vec::new();
    let report = run_plan(&a, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(report.fits, "{text}");
    assert!(text.contains("acme-chat:"), "{text}");
    let whole = report
        .tenants
        .iter()
        .find(|t| t.name == "stark-whole")
        .unwrap();
    assert!(matches!(
        whole.assignment.as_ref().unwrap().share,
        Share::WholeGpu { .. }
    ));
    // The written config, read back as the current state, leaves no room for the same
    // tenants again on those GPUs.
    let mut again = args("tenants/mixed.toml");
    again.gpu = Some("h100-80gb".into());
    again.count = 4;
    again.mig_config = a.write_mig_config.clone();
    let second = run_plan(&again, &mut Vec::new()).unwrap();
    assert!(!second.fits);
}

#[test]
fn json_output_reports_the_breakdown() {
    let mut a = args("tenants/mixed.toml");
    a.gpu = Some("h100-80gb".into());
    a.count = 4;
    a.json = true;
    let mut out = Vec::new();
    run_plan(&a, &mut out).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["fits"], true);
    let acme = &v["tenants"][0];
    assert_eq!(acme["name"], "acme-chat");
    assert_eq!(acme["need"]["kv_per_token"], 131_072);
    assert!(acme["assignment"]["share"]["profile"].is_string());
}

#[test]
fn the_simulated_host_keeps_existing_instances() {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("host.json");
    std::fs::copy(fixture("hosts/sim-h100x8.json"), &host).unwrap();
    let mut a = args("tenants/mixed.toml");
    a.gpu_backend = Some(format!("sim:{}", host.display()));
    let report = run_plan(&a, &mut Vec::new()).unwrap();
    assert!(report.fits);
    for t in &report.tenants {
        let asg = t.assignment.as_ref().unwrap();
        assert_ne!(asg.gpu, 1, "GPU 1 is full (7g instance)");
        assert_ne!(asg.gpu, 7, "GPU 7 is passed through whole");
        if let (0, Share::Mig { start, size, .. }) = (asg.gpu, &asg.share) {
            assert!(
                *start + *size <= 4 && *start >= 1,
                "GPU 0 has 1g at 0 and 3g at 4: {asg:?}"
            );
        }
    }
}

#[test]
fn a_host_that_is_too_small_names_the_tenant_and_the_largest_share() {
    let mut a = args("tenants/too-big.json");
    a.gpu = Some("a100-80gb".into());
    a.count = 1;
    let mut out = Vec::new();
    let report = run_plan(&a, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(!report.fits);
    let nf = report.no_fit.unwrap();
    assert_eq!(nf.tenant, "a", "{text}");
    assert!(text.contains("does not fit: tenant `a`"), "{text}");
    assert!(
        text.contains("whole GPU"),
        "the largest share is the whole GPU: {text}"
    );
}

#[test]
fn bad_inputs_are_clear_errors() {
    let mut a = args("tenants/mixed.toml");
    a.gpu = Some("h300".into());
    let e = run_plan(&a, &mut Vec::new()).unwrap_err();
    assert!(e.to_string().contains("h100-80gb"), "{e}");
    let mut a = args("tenants/missing.toml");
    a.gpu = Some("h100-80gb".into());
    let e = run_plan(&a, &mut Vec::new()).unwrap_err();
    assert!(e.to_string().contains("Cannot read tenants file"), "{e}");
    let mut a = args("tenants/mixed.toml");
    a.gpu_backend = Some("cuda".into());
    let e = run_plan(&a, &mut Vec::new()).unwrap_err();
    assert!(e.to_string().contains("sim:FILE"), "{e}");
    let mut a = args("tenants/mixed.toml");
    a.gpu = Some("a100-40gb".into());
    let e = run_plan(&a, &mut Vec::new()).unwrap_err();
    assert!(
        e.to_string().contains("2g.20gb"),
        "the pinned profile is not an A100-40GB one: {e}"
    );
    assert_eq!(
        e.to_string().matches("3g.20gb").count(),
        1,
        "profiles listed once: {e}"
    );
}

#[test]
fn live_host_planning_uses_nvml_when_a_gpu_is_named() {
    if std::env::var("TENANTVM_TEST_GPU").is_err() {
        tenantvm_skip::skip!("TENANTVM_TEST_GPU is not set (an NVIDIA GPU index)");
    }
    let a = args("tenants/too-big.json");
    let mut out = Vec::new();
    let report = run_plan(&a, &mut out).expect("NVML host plans");
    eprintln!("{}", String::from_utf8_lossy(&out));
    assert_eq!(report.tenants.len(), 2);
}
