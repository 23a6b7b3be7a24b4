//! One tenants file through both paths: `tenantvm plan` (the whole file at once) and the
//! daemon's per-tenant placement (each entry written as a tenant spec's `gpu = { ... }` table,
//! placed one at a time in file order on a SIMULATED host whose instances accumulate). Both
//! must read the same request, size it the same way and give every tenant the same share.

mod common;

use serde::Deserialize;
use tenantvm_gpu::backend::sim::SimBackend;
use tenantvm_gpu::backend::GpuBackend;
use tenantvm_gpu::plan::place::place_on_host;
use tenantvm_gpu::plan::search::DEFAULT_NODE_BUDGET;
use tenantvm_gpu::plan::{self, GpuRequest, HostGpu, Share, TenantsFile};

/// The shape of the orchestrator's tenant spec, as far as the GPU goes.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    name: String,
    #[serde(default)]
    gpu: GpuRequest,
}

fn kind(s: &Share) -> String {
    match s {
        Share::Mig { profile, .. } => profile.clone(),
        Share::WholeGpu { .. } => "whole".into(),
    }
}

#[test]
fn the_mixed_tenants_file_gets_the_same_shares_through_plan_and_through_create() {
    let file = TenantsFile::load(&common::fixture("tenants/mixed.toml")).unwrap();
    let model = tenantvm_gpu::mig::model_by_key("h100-80gb").unwrap();
    let host: Vec<HostGpu> = (0..4).map(|i| HostGpu::new(i, model)).collect();
    let report = plan::plan(&host, &file.tenants, DEFAULT_NODE_BUDGET).unwrap();
    assert!(report.fits, "{}", report.to_text());

    // The same host as a simulated one: four empty H100s with MIG on.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.json");
    let gpus: Vec<String> = (0..4)
        .map(|i| {
            format!(
                r#"{{"index":{i},"model":"h100-80gb","pci_address":"0000:{:02x}:00.0","mig_enabled":true}}"#,
                0x18 + i
            )
        })
        .collect();
    std::fs::write(&path, format!(r#"{{"gpus":[{}]}}"#, gpus.join(","))).unwrap();
    let sim = SimBackend::open(&path).unwrap();

    let mut held = Vec::new();
    let mut per_tenant_cost = 0;
    for (entry, planned) in file.tenants.iter().zip(&report.tenants) {
        // Written as a tenant spec would hold it.
        let table = toml::Value::try_from(&entry.request).unwrap();
        let spec_text = format!("name = \"{}\"\ngpu = {table}\n", entry.name);
        let spec: Spec = toml::from_str(&spec_text).unwrap_or_else(|e| panic!("{spec_text}: {e}"));
        assert_eq!(spec.gpu, entry.request, "{spec_text}");

        let p = place_on_host(
            &sim.gpus().unwrap(),
            &held,
            &spec.name,
            &spec.gpu,
            DEFAULT_NODE_BUDGET,
        )
        .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
        let a = planned.assignment.as_ref().unwrap();
        assert_eq!(kind(&p.share), kind(&a.share), "tenant {}", spec.name);
        assert_eq!(p.need, planned.need, "tenant {}", spec.name);
        per_tenant_cost += p.cost;
        // Made real as the daemon would: a MIG instance, or the GPU held whole in the ledger.
        match &p.share {
            Share::Mig {
                profile_id, start, ..
            } => {
                sim.create_instance(p.gpu, *profile_id, *start).unwrap();
            }
            Share::WholeGpu { .. } => held.push(p.held()),
        }
    }
    assert_eq!(per_tenant_cost, report.cost, "the same units in all");
    let instances: usize = sim.gpus().unwrap().iter().map(|g| g.instances.len()).sum();
    assert_eq!(instances, 6, "six slices and one whole GPU");
}
