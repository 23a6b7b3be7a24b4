//! Planning time on realistic hosts: 8 GPUs and dozens of tenants, fitting and not fitting,
//! empty and with existing instances. A plain benchmark (no harness): run with
//! `cargo bench -p tenantvm-gpu --bench plan`; it prints the median of several runs.

use std::time::{Duration, Instant};

use tenantvm_gpu::mig::{model_by_key, Layout};
use tenantvm_gpu::plan::search::{place, Demand, HostGpu, Request, DEFAULT_NODE_BUDGET};
use tenantvm_gpu::plan::GIB;

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
