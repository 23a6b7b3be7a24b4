//! One tenants file through both paths: `tenantvm plan` (the whole file at once) and the
//! daemon's create (each entry written as a tenant spec's `gpu = { ... }` table and created
//! through the service, in file order, on a SIMULATED host whose instances accumulate).
//! Both read the same request, size it the same way and give each tenant the same share.

use std::sync::Arc;

use tenantvm_gpu::backend::{self as gpu_backend, BackendSpec};
use tenantvm_gpu::plan::search::DEFAULT_NODE_BUDGET;
use tenantvm_gpu::plan::{self, HostGpu, Share, TenantsFile};

use crate::auth::Caller;
use crate::domain::lifecycle::LifecycleState;
use crate::domain::spec::TenantSpec;
use crate::gpu::BackendPlanner;
use crate::tenant::fault::FaultHook;
use crate::tenant::service::TenantCommand;
use crate::tenant::test_utils::Harness;

fn fixture(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(path)
}

/// A SIMULATED host of `count` empty H100s with MIG on.
fn sim_host(dir: &std::path::Path, count: u32) -> Arc<BackendPlanner> {
    let path = dir.join("sim-host.json");
    let gpus: Vec<String> = (0..count)
        .map(|i| {
            format!(
                r#"{{"index":{i},"model":"h100-80gb","pci_address":"0000:{:02x}:00.0","mig_enabled":true,"iommu_group":{}}}"#,
                0x18 + i,
                30 + i
            )
        })
        .collect();
    std::fs::write(&path, format!(r#"{{"gpus":[{}]}}"#, gpus.join(","))).unwrap();
    Arc::new(BackendPlanner::new(
        gpu_backend::open(&BackendSpec::Sim(path)).unwrap(),
    ))
}

fn share_kind(s: &Share) -> String {
    match s {
        Share::Mig { profile, .. } => profile.clone(),
        Share::WholeGpu { .. } => "whole".into(),
    }
}

#[test]
fn a_tenants_file_gets_the_same_shares_through_plan_and_through_create() {
    let file = TenantsFile::load(&fixture("tenants/mixed.toml")).unwrap();
    let model = tenantvm_gpu::mig::model_by_key("h100-80gb").unwrap();
    let host: Vec<HostGpu> = (0..4).map(|i| HostGpu::new(i, model)).collect();
    let report = plan::plan(&host, &file.tenants, DEFAULT_NODE_BUDGET).unwrap();
    assert!(report.fits, "{}", report.to_text());

    let h = Harness::new(FaultHook::default());
    let planner = sim_host(h.dir.path(), 4);
    let h = h.with_planner(planner.clone());
    for (entry, planned) in file.tenants.iter().zip(&report.tenants) {
        // Written as a tenant spec holds it: the tenants file's fields, unchanged.
        let table = toml::Value::try_from(&entry.request).unwrap();
        let text = format!(
            "name = \"{}\"\ngpu = {table}\n[image]\nname = \"hello\"\n",
            entry.name
        );
        let spec = TenantSpec::from_toml(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(spec.gpu, entry.request, "{text}");
        h.svc
            .execute(&Caller::Admin, TenantCommand::Create(spec))
            .unwrap_or_else(|e| panic!("{}: {e}", entry.name));
        h.svc.wait_idle();
        let t = h.svc.store().tenant(&entry.name).unwrap().unwrap();
        assert_eq!(
            t.state,
            LifecycleState::Running,
            "{}: {:?}",
            entry.name,
            t.error
        );
        let got = h.svc.store().gpu_placement(t.id).unwrap().unwrap();
        let kind = got.label.split('@').next().unwrap().to_string();
        let a = planned.assignment.as_ref().unwrap();
        assert_eq!(kind, share_kind(&a.share), "tenant {}", entry.name);
        assert!(
            got.gpu.starts_with("0000:"),
            "named by PCI address: {got:?}"
        );
    }
    // The same slices, made real on the simulated host; the whole GPU only in the ledger.
    let gpus = planner.backend().gpus().unwrap();
    let instances: usize = gpus.iter().map(|g| g.instances.len()).sum();
    let planned_slices = report
        .tenants
        .iter()
        .filter(|t| matches!(t.assignment.as_ref().unwrap().share, Share::Mig { .. }))
        .count();
    assert_eq!(instances, planned_slices);
}

#[test]
fn a_share_of_a_gpu_without_a_partition_is_refused_at_create_with_the_reason() {
    let h = Harness::new(FaultHook::default());
    let path = fixture("hosts/sim-whole-only.json");
    let copy = h.dir.path().join("whole-only.json");
    std::fs::copy(path, &copy).unwrap();
    let planner = Arc::new(BackendPlanner::new(
        gpu_backend::open(&BackendSpec::Sim(copy)).unwrap(),
    ));
    let h = h.with_planner(planner);
    let spec = TenantSpec::from_toml(
        "name = \"shared\"\ngpu = { profile = \"1g.10gb\" }\n[image]\nname = \"hello\"\n",
    )
    .unwrap();
    let err = h
        .svc
        .execute(&Caller::Admin, TenantCommand::Create(spec))
        .unwrap_err()
        .to_string();
    assert!(err.contains("can only be given whole"), "{err}");
    assert!(
        h.svc.store().tenant("shared").unwrap().is_none(),
        "nothing recorded"
    );
    let whole = TenantSpec::from_toml(
        "name = \"whole\"\ngpu = { whole_gpu = true }\n[image]\nname = \"hello\"\n",
    )
    .unwrap();
    h.svc
        .execute(&Caller::Admin, TenantCommand::Create(whole))
        .unwrap();
    h.svc.wait_idle();
    let t = h.svc.store().tenant("whole").unwrap().unwrap();
    assert_eq!(t.state, LifecycleState::Running, "{:?}", t.error);
    assert_eq!(
        h.svc.store().gpu_placement(t.id).unwrap().unwrap().label,
        "whole"
    );
}
