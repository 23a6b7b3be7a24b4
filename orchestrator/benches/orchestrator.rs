//! The control plane's benchmark (run by scripts/bench-orchestrator.sh): a real tenantvmd
//! with the idle guest under tenantvm-vmm on KVM. Measures create-to-running and destroy
//! latency for 1 tenant (median of several rounds) and for 20 created at once, tenants
//! brought up per second, and the daemon's resident memory with 20 tenants running.
//! Latencies are seen by an API client polling every 2 ms, so they include the API.

#[path = "../tests/support/daemon.rs"]
#[allow(dead_code)]
mod daemon;

use std::time::{Duration, Instant};

use tenantvm::client::Client;
use tenantvm::domain::lifecycle::LifecycleState;
use tenantvm::domain::spec::TenantSpec;

use daemon::TestDaemon;

const POLL: Duration = Duration::from_millis(2);

fn spec(name: &str) -> TenantSpec {
    TenantSpec::from_toml(&format!(
        "name = \"{name}\"\nmemory_mib = 32\n[image]\nname = \"idle\"\n"
    ))
    .unwrap()
}

async fn create_to_running(c: &Client, name: &str) -> Duration {
    let t0 = Instant::now();
    c.create(&spec(name)).await.expect("create");
    loop {
        let t = c.status(name).await.expect("status");
        match t.state {
            LifecycleState::Running => return t0.elapsed(),
            LifecycleState::Failed => panic!("{name} failed: {:?}", t.error),
            _ => tokio::time::sleep(POLL).await,
        }
    }
}

async fn destroy(c: &Client, name: &str) -> Duration {
    let t0 = Instant::now();
    c.destroy(name).await.expect("destroy");
    while c.status(name).await.is_ok() {
        tokio::time::sleep(POLL).await;
    }
    t0.elapsed()
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn stats(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort();
    let p50 = v[v.len() / 2];
    let max = *v.last().unwrap();
    let min = v[0];
    (ms(min), ms(p50), ms(max))
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("orchestrator: bench");
        return;
    }
    if daemon::should_skip("bench orchestrator") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let rounds: usize = std::env::var("TENANTVM_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let many: usize = std::env::var("TENANTVM_BENCH_TENANTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let mut d = TestDaemon::new();
    d.start(None);
    let pid = d.pid().expect("daemon pid");
    let c = d.admin();
    rt.block_on(async {
        let rss_idle = rss_kib(pid);
        // One tenant at a time.
        let mut up = Vec::new();
        let mut down = Vec::new();
        for i in 0..rounds {
            let name = format!("bench-one-{i}");
            up.push(create_to_running(&c, &name).await);
            down.push(destroy(&c, &name).await);
        }
        let (up_min, up_p50, up_max) = stats(up);
        let (down_min, down_p50, down_max) = stats(down);

        // Many at once.
        let t0 = Instant::now();
        let handles: Vec<_> = (0..many)
            .map(|i| {
                let c = c.clone();
                tokio::spawn(async move { create_to_running(&c, &format!("bench-many-{i}")).await })
            })
            .collect();
        let mut many_up = Vec::new();
        for h in handles {
            many_up.push(h.await.unwrap());
        }
        let all_up = t0.elapsed();
        let rss_many = rss_kib(pid);
        let t1 = Instant::now();
        let handles: Vec<_> = (0..many)
            .map(|i| {
                let c = c.clone();
                tokio::spawn(async move { destroy(&c, &format!("bench-many-{i}")).await })
            })
            .collect();
        let mut many_down = Vec::new();
        for h in handles {
            many_down.push(h.await.unwrap());
        }
        let all_down = t1.elapsed();
        let (mu_min, mu_p50, mu_max) = stats(many_up);
        let (md_min, md_p50, md_max) = stats(many_down);

        println!(
            "tenantvm orchestrator benchmark (idle guest, tenantvm-vmm on KVM, {rounds} rounds)"
        );
        println!("{:<44} {:>9} {:>9} {:>9}", "", "min ms", "p50 ms", "max ms");
        println!(
            "{:<44} {up_min:>9.1} {up_p50:>9.1} {up_max:>9.1}",
            "create-to-running, 1 tenant"
        );
        println!(
            "{:<44} {down_min:>9.1} {down_p50:>9.1} {down_max:>9.1}",
            "destroy, 1 tenant"
        );
        println!(
            "{:<44} {mu_min:>9.1} {mu_p50:>9.1} {mu_max:>9.1}",
            format!("create-to-running, {many} at once (each)")
        );
        println!(
            "{:<44} {md_min:>9.1} {md_p50:>9.1} {md_max:>9.1}",
            format!("destroy, {many} at once (each)")
        );
        println!(
            "{:<44} {:>9.1}",
            format!("all {many} running after (ms)"),
            ms(all_up)
        );
        println!(
            "{:<44} {:>9.1}",
            format!("all {many} destroyed after (ms)"),
            ms(all_down)
        );
        println!(
            "{:<44} {:>9.1}",
            "tenants brought up per second",
            many as f64 / all_up.as_secs_f64()
        );
        println!("{:<44} {:>9}", "daemon RSS idle (KiB)", rss_idle);
        println!(
            "{:<44} {:>9}",
            format!("daemon RSS with {many} tenants (KiB)"),
            rss_many
        );
    });
    d.stop();
}
