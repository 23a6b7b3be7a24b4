//! Tests of per-tenant placement.

use super::*;
use crate::mig::{model_by_key, Sharing, WholeOnly};
use crate::plan::search::DEFAULT_NODE_BUDGET;
use crate::plan::GIB;

fn host(model: &str, n: u32) -> Vec<HostGpu> {
    let m = model_by_key(model).unwrap();
    (0..n).map(|i| HostGpu::new(i, m)).collect()
}

fn put(g: &mut HostGpu, profile: &str, start: u32) {
    let p = g.model.profile(profile).unwrap();
    g.layout.place(p, start).unwrap();
}

fn profile(name: &str) -> GpuRequest {
    GpuRequest {
        profile: Some(name.into()),
        ..GpuRequest::default()
    }
}

fn whole() -> GpuRequest {
    GpuRequest {
        whole_gpu: true,
        ..GpuRequest::default()
    }
}

fn model(name: &str, context: u64, concurrency: u64) -> GpuRequest {
    GpuRequest {
        model: Some(name.into()),
        context: Some(context),
        concurrency: Some(concurrency),
        ..GpuRequest::default()
    }
}

fn mig(p: &Placement) -> (&str, u32) {
    match &p.share {
        Share::Mig { profile, start, .. } => (profile.as_str(), *start),
        Share::WholeGpu { .. } => ("whole", 0),
    }
}

#[test]
fn a_small_instance_goes_where_it_blocks_the_least() {
    let mut h = host("h100-80gb", 2);
    let a = place_tenant(&h, "a", &profile("1g.10gb"), DEFAULT_NODE_BUDGET).unwrap();
    // Slot 4 keeps 4g@0 and slots 5-7 usable; slot 0 would block the 4g, slot 6 strand slot 7.
    assert_eq!((a.gpu, mig(&a)), (0, ("1g.10gb", 4)));
    assert_eq!(a.slots, vec![4]);
    assert_eq!(a.label(), "1g.10gb@4");
    put(&mut h[0], "1g.10gb", 4);
    let b = place_tenant(&h, "b", &profile("1g.10gb"), DEFAULT_NODE_BUDGET).unwrap();
    assert_eq!(
        (b.gpu, mig(&b)),
        (0, ("1g.10gb", 5)),
        "packs onto the GPU in use, keeping GPU 1 free to give whole"
    );
}

#[test]
fn a_model_request_gets_the_cheapest_profile_that_holds_it() {
    let h = host("h100-80gb", 1);
    // 8B, 8k × 4: 19.96 GiB, more than the "20 GB" profiles hold.
    let p = place_tenant(&h, "a", &model("llama-3-8b", 8192, 4), DEFAULT_NODE_BUDGET).unwrap();
    assert_eq!(mig(&p).0, "3g.40gb");
    assert!(p.need.unwrap().total > 19 * GIB);
    assert_eq!(p.cost, 60);
}

#[test]
fn gpus_with_mig_off_and_taken_profiles_are_not_refusals() {
    // GPU 0: seven 1g instances (the 1g profile at its maximum count, slot 7 left); GPU 1
    // empty. A first-fit over the smallest profile's free starts on MIG-enabled GPUs refused
    // this; the planner places on GPU 1 whatever its MIG mode (host preparation turns MIG on).
    let mut h = host("h100-80gb", 2);
    for s in 0..7 {
        put(&mut h[0], "1g.10gb", s);
    }
    let p = place_tenant(&h, "a", &model("mistral-7b", 4096, 1), DEFAULT_NODE_BUDGET).unwrap();
    assert_eq!((p.gpu, mig(&p).0), (1, "1g.20gb"), "14.9 GiB: a 1g.20gb");
    let w = place_tenant(&h, "w", &whole(), DEFAULT_NODE_BUDGET).unwrap();
    assert_eq!((w.gpu, mig(&w).0), (1, "whole"));
    assert_eq!(w.slots, (0..8).collect::<Vec<_>>());
}

#[test]
fn the_single_placement_is_exact_on_generated_hosts() {
    // Against brute force: a placement exists iff one of all (GPU, option) does, and none is
    // cheaper than the one chosen.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let models = ["h100-80gb", "a100-40gb", "rtx-pro-6000", "l40s"];
    let (mut placed, mut refused) = (0, 0);
    for _ in 0..300 {
        let mut h: Vec<HostGpu> = (0..1 + next(3) as u32)
            .map(|i| HostGpu::new(i, model_by_key(models[next(4) as usize]).unwrap()))
            .collect();
        for g in &mut h {
            if g.model.has_mig() {
                for _ in 0..next(6) {
                    let p = &g.model.profiles[next(g.model.profiles.len() as u64) as usize];
                    let s = p.starts[next(p.starts.len() as u64) as usize];
                    let _ = g.layout.place(p, s);
                }
            } else if next(3) == 0 {
                g.layout.whole = true;
            }
        }
        let req = match next(4) {
            0 => whole(),
            _ => GpuRequest {
                custom: Some(crate::plan::sizing::ModelShape {
                    params: (1 + next(40)) * 1_000_000_000,
                    layers: 32,
                    kv_heads: 8,
                    head_dim: 128,
                }),
                ..GpuRequest::default()
            },
        };
        let demand = req.demand().unwrap();
        let mut best: Option<u32> = None;
        for g in &h {
            let (profiles, can_whole) = candidates(&demand, g);
            for pi in profiles {
                let p = &g.model.profiles[pi];
                for s in p.starts {
                    if g.layout.check(p, *s).is_ok() {
                        let c = profile_cost(g.model, p);
                        best = Some(best.map_or(c, |b: u32| b.min(c)));
                    }
                }
            }
            if can_whole && g.layout.can_take_whole() {
                best = Some(best.map_or(WHOLE, |b| b.min(WHOLE)));
            }
        }
        match place_tenant(&h, "t", &req, DEFAULT_NODE_BUDGET) {
            Ok(p) => {
                placed += 1;
                assert_eq!(Some(p.cost), best, "{h:?} {req:?}");
                let g = h.iter().find(|g| g.index == p.gpu).unwrap();
                let mut l = g.layout.clone();
                match &p.share {
                    Share::Mig {
                        profile_id, start, ..
                    } => l
                        .place(g.model.profile_by_id(*profile_id).unwrap(), *start)
                        .unwrap(),
                    Share::WholeGpu { .. } => assert!(l.can_take_whole()),
                }
            }
            Err(PlaceError::NoRoom { .. }) => {
                refused += 1;
                assert_eq!(best, None, "{h:?} {req:?}");
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        placed > 50 && refused > 20,
        "both outcomes: {placed} / {refused}"
    );
}

#[test]
fn refusals_say_whether_the_host_is_full_or_fragmented() {
    // 1g instances at 1, 3 and 5 leave five free slots, no four of them in a 3g's place.
    let mut h = host("h100-80gb", 1);
    for s in [1, 3, 5] {
        put(&mut h[0], "1g.10gb", s);
    }
    let e = place_tenant(&h, "big", &profile("3g.40gb"), DEFAULT_NODE_BUDGET).unwrap_err();
    let PlaceError::NoRoom {
        fragmentation,
        largest,
        ..
    } = &e
    else {
        panic!("{e}")
    };
    assert_eq!(*fragmentation, Fragmentation::OnGpu { gpu: 0 });
    assert!(e.to_string().contains("cannot move"), "{e}");
    assert!(
        matches!(largest, Some(Largest { share: Share::Mig { profile, .. }, .. }) if profile == "1g.20gb"),
        "{largest:?}"
    );
    // Seven 1g instances: full, whatever the layout.
    let mut h = host("h100-80gb", 1);
    for s in 0..7 {
        put(&mut h[0], "1g.10gb", s);
    }
    let e = place_tenant(&h, "more", &profile("1g.10gb"), DEFAULT_NODE_BUDGET).unwrap_err();
    assert!(
        matches!(
            &e,
            PlaceError::NoRoom {
                fragmentation: Fragmentation::Full,
                largest: None,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("full"), "{e}");
    // One 1g on each of two GPUs: a whole GPU would fit if both were on one GPU.
    let mut h = host("h100-80gb", 2);
    put(&mut h[0], "1g.10gb", 0);
    put(&mut h[1], "1g.10gb", 0);
    let e = place_tenant(&h, "w", &whole(), DEFAULT_NODE_BUDGET).unwrap_err();
    assert!(
        matches!(
            &e,
            PlaceError::NoRoom {
                fragmentation: Fragmentation::AcrossGpus,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn gpus_without_mig_are_given_whole_and_sharing_them_is_refused_with_the_reason() {
    let h = host("l40s", 2);
    assert_eq!(h[0].sharing, Sharing::WholeOnly(WholeOnly::NoMig));
    let e = place_tenant(&h, "a", &profile("1g.10gb"), DEFAULT_NODE_BUDGET).unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(e, PlaceError::Plan(PlanError::NoPartition { .. })),
        "{text}"
    );
    assert!(text.contains("no hardware partition"), "{text}");
    assert!(text.contains("whole_gpu = true"), "{text}");
    let w = place_tenant(&h, "w", &whole(), DEFAULT_NODE_BUDGET).unwrap();
    assert_eq!(mig(&w).0, "whole");
    assert_eq!(w.slots, vec![0]);
    // A sized model fits on a whole L40S (46 GiB).
    let m = place_tenant(&h, "m", &model("llama-3-8b", 8192, 4), DEFAULT_NODE_BUDGET).unwrap();
    assert_eq!(mig(&m).0, "whole");
    // With an H100 beside it, the model takes a slice of the H100, which costs less.
    let mut mixed = host("l40s", 1);
    mixed.push(HostGpu::new(1, model_by_key("h100-80gb").unwrap()));
    let m = place_tenant(
        &mixed,
        "m",
        &model("llama-3-8b", 8192, 4),
        DEFAULT_NODE_BUDGET,
    )
    .unwrap();
    assert_eq!((m.gpu, mig(&m).0), (1, "3g.40gb"));
}

#[test]
fn a_mig_gpu_without_a_vgpu_route_is_whole_only_with_that_reason() {
    let mut h = host("h100-80gb", 1);
    h[0].sharing = Sharing::WholeOnly(WholeOnly::NoVgpuRoute {
        missing: "NVIDIA's vGPU manager is not loaded".into(),
    });
    let e = place_tenant(&h, "a", &profile("3g.40gb"), DEFAULT_NODE_BUDGET).unwrap_err();
    assert!(e.to_string().contains("vGPU manager"), "{e}");
    let p = place_tenant(&h, "a", &model("mistral-7b", 4096, 1), DEFAULT_NODE_BUDGET).unwrap();
    assert_eq!(mig(&p).0, "whole");
}

#[test]
fn held_shares_are_folded_once_and_contradictions_are_reported() {
    use crate::backend::sim::SimBackend;
    use crate::backend::GpuBackend;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.json");
    std::fs::write(
        &path,
        r#"{"gpus":[{"index":0,"model":"h100-80gb","pci_address":"0000:18:00.0","mig_enabled":true,
            "instances":[{"gi_id":1,"profile":"3g.40gb","start":0}]},
            {"index":1,"model":"h100-80gb","pci_address":"0000:2a:00.0"}]}"#,
    )
    .unwrap();
    let gpus = SimBackend::open(&path).unwrap().gpus().unwrap();
    // The instance at 0 is also in the ledger; 3g@4 is reserved but not made yet; GPU 1 is
    // held whole.
    let held = vec![
        Held::from_label("0000:18:00.0", "3g.40gb@0").unwrap(),
        Held::from_label("0", "3g.40gb@4").unwrap(),
        Held::from_label("0000:2a:00.0", "whole").unwrap(),
    ];
    let e = place_on_host(&gpus, &held, "x", &profile("1g.10gb"), DEFAULT_NODE_BUDGET).unwrap_err();
    assert!(matches!(e, PlaceError::NoRoom { .. }), "{e}");
    let p = place_on_host(
        &gpus,
        &held[..2],
        "x",
        &profile("1g.10gb"),
        DEFAULT_NODE_BUDGET,
    )
    .unwrap();
    assert_eq!(p.gpu, 1);
    assert_eq!(p.pci_address.as_deref(), Some("0000:2a:00.0"));
    assert_eq!(p.held().gpu, "0000:2a:00.0");
    let bad = [Held::from_label("0", "4g.40gb@0").unwrap()];
    let e = place_on_host(&gpus, &bad, "x", &whole(), DEFAULT_NODE_BUDGET).unwrap_err();
    assert!(matches!(e, PlaceError::Inconsistent { .. }), "{e}");
    for label in ["", "3g.40gb@x", "@4", "half"] {
        assert!(Held::from_label("0", label).is_err(), "{label}");
    }
    // A whole reservation of a GPU the backend no longer lists (bound to vfio-pci) is fine.
    let gone = [Held::from_label("0000:99:00.0", "whole").unwrap()];
    place_on_host(&gpus, &gone, "x", &whole(), DEFAULT_NODE_BUDGET).unwrap();
}

#[test]
fn bad_requests_are_refused_before_placement() {
    let h = host("h100-80gb", 1);
    let e = place_tenant(&h, "a", &GpuRequest::default(), DEFAULT_NODE_BUDGET).unwrap_err();
    assert!(e.to_string().contains("say what it needs"), "{e}");
    let e = place_tenant(&h, "a", &profile("9g.900gb"), DEFAULT_NODE_BUDGET).unwrap_err();
    assert!(e.to_string().contains("3g.40gb"), "lists the profiles: {e}");
    assert!(matches!(
        place_tenant(&[], "a", &whole(), DEFAULT_NODE_BUDGET),
        Err(PlaceError::Plan(PlanError::NoGpus))
    ));
}
