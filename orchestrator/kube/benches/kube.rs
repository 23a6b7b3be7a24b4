//! The Kubernetes tier's figures (scripts/bench-kube.sh; a benchmark, not a test): 100
//! tenants across 5 simulated hosts against a real API server.
//!
//! Peer, in the same run and on the same hosts: the same 100 tenants made and destroyed
//! directly through each host's admin API (what an operator scripting `tenantvm create` per
//! host would do). Then through Kubernetes: apply to all Running, delete to all gone; the
//! API server's request counters (by verb) over that, the operator leader's memory, and the
//! GPUs the placement used against the planner run once over all 5 hosts' GPUs with the
//! whole set (`tenantvm plan`'s batch search, which may reorder the tenants).

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kube::api::DeleteParams;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use support::cluster::{self, Cluster};
use support::host::{self, Host};
use support::{apply, eventually, phase, tenant, tenants, Operator};
use tenantvm_gpu::plan::{self, search::DEFAULT_NODE_BUDGET, GpuRequest, HostGpu};
use tenantvm_kube::crd::{condition, conditions, Tenant};

const HOSTS: usize = 5;

/// LIST requests the benchmark itself makes while it waits (subtracted from the figures).
static POLLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

async fn polled(admin: &Client) -> BTreeMap<String, Tenant> {
    POLLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tenants(admin).await
}
const GPUS_PER_HOST: usize = 4;

/// The 100 tenants: (name, tier, GPU request).
fn workload() -> Vec<(String, &'static str, serde_json::Value)> {
    let mut out = Vec::new();
    for i in 0..100 {
        let (tier, gpu) = match i % 10 {
            0 | 5 => ("slice", json!({"profile": "1g.10gb"})),
            1 => ("slice", json!({"profile": "2g.20gb"})),
            2 => ("slice", json!({"profile": "3g.40gb"})),
            3 => ("card", json!({})),
            _ => ("slice", json!({})),
        };
        out.push((format!("t{i:03}"), tier, gpu));
    }
    out
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// `apiserver_request_total` summed by verb.
async fn requests_by_verb(admin: &Client) -> BTreeMap<String, f64> {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = admin.request_text(req).await.unwrap_or_default();
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let verb = line
            .split("verb=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or("?");
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        *out.entry(verb.to_string()).or_insert(0.0) += value;
    }
    out
}

fn main() {
    if let Some(why) = cluster::skip_reason().or_else(host::skip_reason) {
        eprintln!("SKIP bench-kube: {why}");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run());
}

async fn run() {
    let cluster = Cluster::start();
    let admin = cluster.client("admin").await;
    cluster.install(&admin).await;
    cluster.client_namespace(&admin, "bench").await;
    let names = ["node-a", "node-b", "node-c", "node-d", "node-e"];
    let mut hosts = Vec::new();
    for (i, name) in names.iter().enumerate().take(HOSTS) {
        let pcis: Vec<String> = (0..GPUS_PER_HOST)
            .map(|g| format!("0000:{:02x}:00.0", 0x10 * (i + 1) + g))
            .collect();
        let gpus: Vec<(&str, &str)> = pcis.iter().map(|p| ("h100-80gb", p.as_str())).collect();
        hosts.push(Host::start(
            name,
            &gpus,
            &cluster.kubeconfig(name),
            i as u32,
        ));
    }
    let work = workload();

    // Through Kubernetes.
    let operator = Operator::start(
        "bench-op",
        &cluster.kubeconfig("operator"),
        cluster.dir.path(),
        &[],
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = requests_by_verb(&admin).await;
    POLLS.store(0, std::sync::atomic::Ordering::Relaxed);
    let t2 = Instant::now();
    for (name, tier, gpu) in &work {
        apply(&admin, &tenant("bench", name, tier, gpu.clone()))
            .await
            .unwrap();
    }
    let counted =
        |ts: &BTreeMap<String, Tenant>, p: &str| ts.values().filter(|t| phase(t) == p).count();
    let ok = eventually(Duration::from_secs(900), || {
        let admin = admin.clone();
        async move {
            let ts = polled(&admin).await;
            let refused = ts
                .values()
                .filter(|t| {
                    phase(t) == "Pending"
                        && t.status.as_ref().is_some_and(|s| {
                            condition::get(&s.conditions, conditions::PLACED).is_some()
                        })
                })
                .count();
            ts.len() == 100 && counted(&ts, "Running") + refused == 100
        }
    })
    .await;
    assert!(ok, "not all Running:\n{}", support::describe(&admin).await);
    let kube_up = t2.elapsed();
    let ts = tenants(&admin).await;
    let running = counted(&ts, "Running");
    let placed: BTreeMap<String, String> = ts
        .values()
        .filter(|t| phase(t) == "Running")
        .filter_map(|t| Some((t.name_any(), t.status.as_ref()?.node.clone()?)))
        .collect();
    let op_rss = operator
        .pid()
        .map(|p| (rss_kib(p, "VmRSS:"), rss_kib(p, "VmHWM:")))
        .unwrap_or_default();

    // Placement quality: GPUs holding a share, against the planner once over everything.
    let mut used: BTreeSet<String> = BTreeSet::new();
    for t in ts.values() {
        if let Some(g) = t.status.as_ref().and_then(|s| s.gpu.as_ref()) {
            used.insert(format!(
                "{}/{}",
                t.status.as_ref().unwrap().node.clone().unwrap_or_default(),
                g.gpu
            ));
        }
    }
    let h100 = tenantvm_gpu::mig::model_by_key("h100-80gb").unwrap();
    let all_gpus: Vec<HostGpu> = (0..(HOSTS * GPUS_PER_HOST) as u32)
        .map(|i| HostGpu::new(i, h100))
        .collect();
    let specs: Vec<plan::TenantSpec> = work
        .iter()
        .filter_map(|(name, tier, gpu)| {
            let mut req: GpuRequest = serde_json::from_value(gpu.clone()).unwrap();
            if *tier == "card" {
                req.whole_gpu = true;
            }
            req.wants_gpu().then(|| plan::TenantSpec::new(name, req))
        })
        .collect();
    let once = plan::plan(&all_gpus, &specs, DEFAULT_NODE_BUDGET).unwrap();
    let once_used: BTreeSet<u32> = once
        .tenants
        .iter()
        .filter_map(|t| t.assignment.as_ref().map(|a| a.gpu))
        .collect();

    // Delete to all gone.
    let t3 = Instant::now();
    let api: Api<Tenant> = Api::namespaced(admin.clone(), "bench");
    for t in ts.values() {
        api.delete(&t.name_any(), &DeleteParams::default())
            .await
            .unwrap();
    }
    let ok = eventually(Duration::from_secs(900), || {
        let admin = admin.clone();
        async move { polled(&admin).await.is_empty() }
    })
    .await;
    assert!(ok, "not all gone:\n{}", support::describe(&admin).await);
    let kube_down = t3.elapsed();
    let after = requests_by_verb(&admin).await;
    // The listing of `ts` and the deletes are the benchmark's too.
    let own_lists = POLLS.load(std::sync::atomic::Ordering::Relaxed) as f64 + 1.0;

    // The peer: the same tenants on the same hosts as Kubernetes placed them, made and
    // destroyed straight through each host's admin API.
    let t0 = Instant::now();
    let mut made = Vec::new();
    for (i, (name, tier, gpu)) in work.iter().enumerate() {
        let Some(node) = placed.get(name) else {
            continue;
        };
        let h = hosts.iter().position(|h| &h.name == node).unwrap();
        let mut t = tenant("bench", name, tier, gpu.clone());
        t.metadata.uid = Some(format!("{i:08x}-0000-4000-8000-000000000000"));
        let spec = tenantvm_kube::hostspec::host_spec(&t).unwrap();
        hosts[h].admin().create(&spec).await.unwrap();
        made.push((h, spec.name.to_string()));
    }
    let direct_made = made.len();
    let ok = eventually(Duration::from_secs(600), || {
        let hosts = &hosts;
        let made = &made;
        async move {
            for (h, n) in made {
                match hosts[*h].admin().status(n).await {
                    Ok(v) if v.state == tenantvm::domain::LifecycleState::Running => {}
                    _ => return false,
                }
            }
            true
        }
    })
    .await;
    assert!(ok, "the direct creates did not all run");
    let direct_up = t0.elapsed();
    let t1 = Instant::now();
    for (h, n) in &made {
        hosts[*h].admin().destroy(n).await.unwrap();
    }
    let ok = eventually(Duration::from_secs(600), || {
        let hosts = &hosts;
        async move {
            for h in hosts {
                if !h.admin().list().await.is_ok_and(|l| l.tenants.is_empty()) {
                    return false;
                }
            }
            true
        }
    })
    .await;
    assert!(ok, "the direct destroys did not all finish");
    let direct_down = t1.elapsed();

    let calls: BTreeMap<&String, f64> = after
        .iter()
        .map(|(v, n)| (v, n - before.get(v).copied().unwrap_or(0.0)))
        .filter(|(_, n)| *n > 0.0)
        .collect();
    let total: f64 = calls.values().sum();

    println!(
        "== bench-kube: {} tenants, {HOSTS} hosts x {GPUS_PER_HOST} H100 (simulated), idle guests",
        work.len()
    );
    println!(
        "direct (peer):  {direct_made} made: all Running in {:.1} s, all destroyed in {:.1} s",
        direct_up.as_secs_f64(),
        direct_down.as_secs_f64()
    );
    println!(
        "kubernetes:     {running} Running in {:.1} s ({:.2}x the peer), all gone in {:.1} s ({:.2}x the peer)",
        kube_up.as_secs_f64(),
        kube_up.as_secs_f64() / direct_up.as_secs_f64(),
        kube_down.as_secs_f64(),
        kube_down.as_secs_f64() / direct_down.as_secs_f64()
    );
    let own = own_lists + 2.0 * work.len() as f64; // its LISTs, and its POST and DELETE per tenant
    println!(
        "API requests (apply to gone): {total:.0} by every client = {calls:?}; less the benchmark's own {own:.0} (LIST polls, one POST and one DELETE per tenant): {:.0}, {:.1} per tenant",
        total - own,
        (total - own) / work.len() as f64
    );
    for t in ts.values().filter(|t| phase(t) == "Pending") {
        let why = t
            .status
            .as_ref()
            .and_then(|s| condition::get(&s.conditions, conditions::PLACED))
            .map(|c| c.message.clone())
            .unwrap_or_default();
        println!("pending: {} ({:?}): {why}", t.name_any(), t.spec.gpu);
    }
    println!(
        "operator memory: VmRSS {} KiB, VmHWM {} KiB",
        op_rss.0, op_rss.1
    );
    println!(
        "placement: {} GPUs hold a share (one tenant at a time, pack) vs {} with the planner once over the whole set (fits: {})",
        used.len(),
        once_used.len(),
        once.fits
    );
    drop(operator);
}
