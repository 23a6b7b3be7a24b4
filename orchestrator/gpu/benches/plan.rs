//! Planning time on realistic hosts: 8 GPUs and dozens of tenants, fitting and not fitting,
//! empty and with existing instances. A plain benchmark (no harness): run with
//! `cargo bench -p tenantvm-gpu --bench plan`; it prints the median of several runs.

use std::time::{Duration, Instant};

use tenantvm_gpu::backend::sim::SimBackend;
use tenantvm_gpu::backend::GpuBackend;
use tenantvm_gpu::mig::{model_by_key, Layout};
use tenantvm_gpu::plan::place::{place_on_host, place_tenant};
use tenantvm_gpu::plan::search::{place, Demand, HostGpu, Request, DEFAULT_NODE_BUDGET};
use tenantvm_gpu::plan::{GpuRequest, Share, GIB};

fn host(model: &str, n: u32, existing: bool) -> Vec<HostGpu> {
    let m = model_by_key(model).unwrap();
    (0..n)
        .map(|index| {
            let mut layout = Layout::empty();
            if existing && index % 2 == 0 {
                layout.place(m.profile("1g.10gb").unwrap(), 0).unwrap();
                layout.place(m.profile("2g.20gb").unwrap(), 4).unwrap();
            }
            HostGpu {
                layout,
                ..HostGpu::new(index, m)
            }
        })
        .collect()
}

/// A deterministic mix of tenant sizes (GiB) cycling through small, medium and large.
fn tenants(n: usize, sizes: &[u64]) -> Vec<Request> {
    (0..n)
        .map(|i| Request {
            name: format!("t{i}"),
            demand: Demand::Memory(sizes[(i * 7 + i / 3) % sizes.len()] * GIB),
        })
        .collect()
}

fn time(label: &str, gpus: &[HostGpu], reqs: &[Request]) {
    let mut samples: Vec<Duration> = Vec::new();
    let mut outcome = String::new();
    for _ in 0..7 {
        let t = Instant::now();
        let r = place(gpus, reqs, DEFAULT_NODE_BUDGET);
        samples.push(t.elapsed());
        outcome = match r {
            Ok(Some(s)) => format!("fits, cost {}, {} nodes", s.cost, s.nodes),
            Ok(None) => "does not fit".into(),
            Err(e) => format!("error: {e}"),
        };
    }
    samples.sort();
    println!(
        "{label:<58} median {:>10.3} ms   ({outcome})",
        samples[3].as_secs_f64() * 1e3
    );
}

fn main() {
    one_at_a_time();
    let sizes = [5, 9, 18, 35, 9, 5, 18];
    for n in [16, 32, 48, 56] {
        time(
            &format!("8 x h100-80gb, {n} tenants, empty"),
            &host("h100-80gb", 8, false),
            &tenants(n, &sizes),
        );
    }
    time(
        "8 x h100-80gb, 40 tenants, with existing instances",
        &host("h100-80gb", 8, true),
        &tenants(40, &sizes),
    );
    time(
        "8 x h100-80gb, 60 tenants (too many)",
        &host("h100-80gb", 8, false),
        &tenants(60, &sizes),
    );
    time(
        "8 x h200, 48 tenants",
        &host("h200", 8, false),
        &tenants(48, &[8, 17, 30, 60, 15]),
    );
    // Fragmentation, not capacity: each GPU holds 4g + 2g + 1g, so the ninth 1g has no start.
    let mut frag: Vec<Request> = Vec::new();
    for (p, n) in [("4g.40gb", 8), ("2g.20gb", 8), ("1g.10gb", 9)] {
        for k in 0..n {
            frag.push(Request {
                name: format!("{p}-{k}"),
                demand: Demand::Profile(p.into()),
            });
        }
    }
    time(
        "8 x h100-80gb, 8 x 4g + 8 x 2g + 9 x 1g (fragmented)",
        &host("h100-80gb", 8, false),
        &frag,
    );
    random_mixes();
    // Tight: 56 one-slice tenants exactly fill 8 GPUs' 1g starts.
    time(
        "8 x h100-80gb, 56 x 1g (exactly full)",
        &host("h100-80gb", 8, false),
        &tenants(56, &[9]),
    );
    time(
        "8 x h100-80gb, 57 x 1g (one too many)",
        &host("h100-80gb", 8, false),
        &tenants(57, &[9]),
    );
}

/// 200 random tenant mixes on 8 H100s (16-40 tenants needing 1-24 GiB each, around
/// as many units as the host has): the distribution of planning time and outcomes.
fn random_mixes() {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let gpus = host("h100-80gb", 8, false);
    let (mut times, mut fits, mut nofit, mut budget) = (Vec::new(), 0, 0, 0);
    let mut max_nodes = 0;
    for _ in 0..200 {
        let n = 16 + next(25) as usize;
        let reqs: Vec<Request> = (0..n)
            .map(|i| Request {
                name: format!("t{i}"),
                demand: Demand::Memory((1 + next(24)) * GIB),
            })
            .collect();
        let t = Instant::now();
        match place(&gpus, &reqs, DEFAULT_NODE_BUDGET) {
            Ok(Some(s)) => {
                fits += 1;
                max_nodes = max_nodes.max(s.nodes);
            }
            Ok(None) => nofit += 1,
            Err(_) => budget += 1,
        }
        times.push(t.elapsed());
    }
    times.sort();
    println!(
        "{:<58} median {:>10.3} ms, p99 {:.3} ms, max {:.3} ms ({fits} fit, {nofit} do not, {budget} over budget, max {max_nodes} nodes)",
        "8 x h100-80gb, 200 random mixes of 16-40 tenants",
        times[100].as_secs_f64() * 1e3,
        times[197].as_secs_f64() * 1e3,
        times[199].as_secs_f64() * 1e3,
    );
}

/// A model request of about `gib` GiB (a custom shape whose weights are that size in bf16).
fn sized(gib: u64) -> GpuRequest {
    GpuRequest {
        custom: Some(tenantvm_gpu::plan::sizing::ModelShape {
            params: gib * GIB / 2 - 600_000_000,
            layers: 16,
            kv_heads: 2,
            head_dim: 64,
        }),
        ..GpuRequest::default()
    }
}

/// Median of `runs` timings of `f`, with the outcome of the last run.
fn median<T>(runs: usize, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut samples = Vec::new();
    let mut out = None;
    for _ in 0..runs {
        let t = Instant::now();
        out = Some(f());
        samples.push(t.elapsed());
    }
    samples.sort();
    (samples[runs / 2], out.expect("runs > 0"))
}

/// 50 tenants on 8 H100s placed one at a time, as the daemon's `create` does: each sees the
/// instances of the ones before it, which cannot move. Timed on a planning host (layouts in
/// memory) and through the simulated backend (read the host file, place, create the
/// instance: the daemon's round trip), against the batch plan of the same 50 in the same run.
fn one_at_a_time() {
    for (label, sizes) in [
        ("fits", &[5u64, 9, 5, 18, 9][..]),
        (
            "overfull: the last ones are refused",
            &[5, 9, 18, 35, 9, 5, 18][..],
        ),
    ] {
        let reqs: Vec<GpuRequest> = (0..50).map(|i| sized(sizes[i % sizes.len()])).collect();
        let (t_mem, (placed, refused)) = median(5, || {
            let mut host = host("h100-80gb", 8, false);
            let (mut placed, mut refused) = (0, 0);
            for (i, r) in reqs.iter().enumerate() {
                match place_tenant(&host, &format!("t{i}"), r, DEFAULT_NODE_BUDGET) {
                    Ok(p) => {
                        placed += 1;
                        let g = host.iter_mut().find(|g| g.index == p.gpu).unwrap();
                        match p.share {
                            Share::Mig {
                                profile_id, start, ..
                            } => g
                                .layout
                                .place(g.model.profile_by_id(profile_id).unwrap(), start)
                                .unwrap(),
                            Share::WholeGpu { .. } => g.layout.whole = true,
                        }
                    }
                    Err(_) => refused += 1,
                }
            }
            (placed, refused)
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("host.json");
        let body: Vec<String> = (0..8)
            .map(|i| {
                format!(
                    r#"{{"index":{i},"model":"h100-80gb","pci_address":"0000:{:02x}:00.0","mig_enabled":true}}"#,
                    0x18 + i
                )
            })
            .collect();
        let (t_sim, sim_placed) = median(3, || {
            std::fs::write(&path, format!(r#"{{"gpus":[{}]}}"#, body.join(","))).unwrap();
            let sim = SimBackend::open(&path).unwrap();
            let mut placed = 0;
            for (i, r) in reqs.iter().enumerate() {
                let gpus = sim.gpus().unwrap();
                if let Ok(p) = place_on_host(&gpus, &[], &format!("t{i}"), r, DEFAULT_NODE_BUDGET) {
                    if let Share::Mig {
                        profile_id, start, ..
                    } = p.share
                    {
                        sim.create_instance(p.gpu, profile_id, start).unwrap();
                    }
                    placed += 1;
                }
            }
            placed
        });
        let batch: Vec<Request> = reqs
            .iter()
            .enumerate()
            .map(|(i, r)| Request {
                name: format!("t{i}"),
                demand: r.demand().unwrap(),
            })
            .collect();
        let (t_batch, fits) = median(5, || {
            matches!(
                place(&host("h100-80gb", 8, false), &batch, DEFAULT_NODE_BUDGET),
                Ok(Some(_))
            )
        });
        println!(
            "50 tenants one at a time on 8 x h100-80gb ({label}): {placed} placed, {refused} refused; \
             total {:.2} ms in memory, {:.1} ms through the simulated backend ({sim_placed} placed); \
             batch plan of the same 50: {:.2} ms ({}), ratio one-at-a-time/batch {:.1}",
            t_mem.as_secs_f64() * 1e3,
            t_sim.as_secs_f64() * 1e3,
            t_batch.as_secs_f64() * 1e3,
            if fits { "fits" } else { "does not fit" },
            t_mem.as_secs_f64() / t_batch.as_secs_f64().max(1e-9),
        );
    }
}
