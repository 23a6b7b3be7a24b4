//! `tenantvm host check` and placement agree on how each GPU can be used: both follow
//! `mig::decide`, run here against the same fixtures (the FAKE sysfs trees, and the SIMULATED
//! host that mirrors whole-only.sysfs.json).

mod common;

use tenantvm_gpu::backend::sim::SimBackend;
use tenantvm_gpu::backend::{host_gpus, GpuBackend};
use tenantvm_gpu::check::{gpu_facts, host_check, nvidia_gpus};
use tenantvm_gpu::host::fake::{FakeHost, FakeHostSpec};
use tenantvm_gpu::mig::{self, Layout, Sharing};
use tenantvm_gpu::plan::search::DEFAULT_NODE_BUDGET;
use tenantvm_gpu::plan::{place_tenant, GpuRequest, HostGpu, PlaceError, PlanError};

fn request_share(g: &HostGpu) -> GpuRequest {
    let profile = g
        .model
        .profiles
        .first()
        .map_or("1g.10gb", |p| p.name)
        .to_string();
    GpuRequest {
        profile: Some(profile),
        ..GpuRequest::default()
    }
}

fn whole() -> GpuRequest {
    GpuRequest {
        whole_gpu: true,
        ..GpuRequest::default()
    }
}

/// For every GPU of the tree: host check's verdict, and what placement does with a share
/// request and a whole request on that GPU alone.
fn agree(spec: &FakeHostSpec) -> Vec<(String, Sharing)> {
    let host = FakeHost::build(spec).unwrap();
    let s = host.sysfs();
    let results = host_check(&s);
    let mut out = Vec::new();
    for (index, d) in nvidia_gpus(&s).iter().enumerate() {
        let line = results
            .iter()
            .find(|r| r.name == format!("gpu {}", d.address))
            .unwrap();
        let said = line
            .sharing
            .clone()
            .expect("a GPU line carries its verdict");
        let class = mig::decide(&gpu_facts(&s, d));
        let g = HostGpu {
            index: index as u32,
            model: class.model,
            sharing: class.sharing,
            layout: Layout::empty(),
        };
        assert_eq!(g.sharing, said, "{}", d.address);
        let shared = place_tenant(
            std::slice::from_ref(&g),
            "t",
            &request_share(&g),
            DEFAULT_NODE_BUDGET,
        );
        match (&said, shared) {
            (Sharing::Mig, Ok(_)) => {}
            (Sharing::WholeOnly(w), Err(PlaceError::Plan(PlanError::NoPartition { why, .. }))) => {
                assert_eq!(why, w.explain());
                assert!(line.detail.contains(&w.explain()), "{}", line.detail);
            }
            (s, r) => panic!(
                "{}: host check says {s:?}, placement gives {r:?}",
                d.address
            ),
        }
        place_tenant(std::slice::from_ref(&g), "t", &whole(), DEFAULT_NODE_BUDGET)
            .unwrap_or_else(|e| panic!("{} can always be given whole: {e}", d.address));
        out.push((d.address.to_string(), said));
    }
    out
}

#[test]
fn hgx_h100_gpus_can_all_be_shared() {
    let v = agree(&FakeHost::h100x8_spec());
    assert_eq!(v.len(), 8);
    assert!(v.iter().all(|(_, s)| *s == Sharing::Mig));
}

#[test]
fn the_workstation_host_has_both_kinds() {
    let v = agree(&FakeHost::audio_host_spec());
    let kinds: Vec<bool> = v.iter().map(|(_, s)| s.can_share()).collect();
    // RTX PRO 6000 on R535 (MIG needs R575), L40S (no MIG), A100 with mdev types.
    assert_eq!(kinds, [false, false, true], "{v:?}");
}

#[test]
fn gpus_without_mig_or_without_a_vgpu_route_are_whole_only_on_both_views() {
    let v = agree(&FakeHost::whole_only_spec());
    assert_eq!(v.len(), 5);
    assert!(v.iter().all(|(_, s)| !s.can_share()), "{v:?}");
    // The simulated host of the same GPUs: the backend's view gives the same verdicts.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.json");
    std::fs::copy(common::fixture("hosts/sim-whole-only.json"), &path).unwrap();
    let sim = SimBackend::open(&path).unwrap();
    let infos = sim.gpus().unwrap();
    let planned = host_gpus(&infos).unwrap();
    let kind = |s: &Sharing| match s {
        Sharing::Mig => None,
        Sharing::WholeOnly(w) => Some(std::mem::discriminant(w)),
    };
    for (addr, said) in &v {
        let i = infos.iter().position(|g| &g.pci_address == addr).unwrap();
        // Same verdict and reason; the words of a missing vGPU route differ (sysfs names the
        // module, the simulated host says it has none).
        assert_eq!(kind(&planned[i].sharing), kind(said), "{addr}");
    }
    // The RTX 3090 the database does not know is given whole with NVML's memory.
    let unknown = &planned[3];
    assert_eq!(unknown.model.memory_mib, 24_576);
    let e = place_tenant(
        &planned,
        "t",
        &request_share(&planned[4]),
        DEFAULT_NODE_BUDGET,
    )
    .unwrap_err();
    assert!(e.to_string().contains("vGPU manager"), "{e}");
}
