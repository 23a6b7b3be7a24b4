//! The control plane's benchmark (run by scripts/bench-orchestrator.sh): a real tenantvmd
//! with the idle guest under tenantvm-vmm on KVM. Measures create-to-running and destroy
//! latency for 1 tenant (median of several rounds) and for 20 created at once, tenants
//! brought up per second, the daemon's resident memory with 20 tenants running, and the
//! destroy of a VM whose VMM is SIGSTOPped (wedged) on each backend: tenantvm-vmm here,
//! and QEMU TCG (with the no_std test guest, when built) in a second daemon.
//! Latencies are seen by an API client polling every 2 ms, so they include the API.
//!
//! Isolation: the API latency of one tenant (its status, one request at a time) while
//! another tenant has its whole `max_concurrency` of inference requests hung on a guest
//! agent that never answers, against the same with no hung tenant, in alternating blocks.

#[path = "../tests/support/daemon.rs"]
#[allow(dead_code)]
mod daemon;
#[path = "../tests/support/peercred.rs"]
mod peercred;

use std::time::{Duration, Instant};

use tenantvm::client::Client;
use tenantvm::domain::lifecycle::LifecycleState;
use tenantvm::domain::spec::TenantSpec;

use daemon::TestDaemon;

const POLL: Duration = Duration::from_millis(2);

fn spec(name: &str) -> TenantSpec {
    spec_with(name, "idle", 32)
}

fn spec_with(name: &str, image: &str, memory_mib: u32) -> TenantSpec {
    TenantSpec::from_toml(&format!(
        "name = \"{name}\"\nmemory_mib = {memory_mib}\n[image]\nname = \"{image}\"\n"
    ))
    .unwrap()
}

async fn create_to_running(c: &Client, name: &str) -> Duration {
    run_spec(c, &spec(name)).await
}

async fn run_spec(c: &Client, spec: &TenantSpec) -> Duration {
    let name = spec.name.as_str();
    let t0 = Instant::now();
    c.create(spec).await.expect("create");
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

/// Creates a tenant from `spec`, waits until it runs, SIGSTOPs every process of its VM
/// (a wedged VMM: it accepts nothing and answers nothing) and times its destroy.
async fn destroy_stopped(c: &Client, spec: &TenantSpec) -> Duration {
    let name = spec.name.as_str();
    run_spec(c, spec).await;
    let pids = daemon::processes_in_cgroup_of(name);
    assert!(!pids.is_empty(), "{name}: no VM processes found");
    for pid in pids {
        // SAFETY: kill(2) with a pid read from the benchmark tenant's cgroup.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
    }
    let t0 = Instant::now();
    c.destroy(name).await.expect("destroy");
    while let Ok(t) = c.status(name).await {
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "{name}: destroy did not finish in 300 s (state {:?}, error {:?})",
            t.state,
            t.error
        );
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

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    ms(sorted[i.min(sorted.len() - 1)])
}

/// `n` status requests of `c` for `name`, one at a time: their latencies.
async fn status_latencies(c: &Client, name: &str, n: usize) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        c.status(name).await.expect("status");
        out.push(t0.elapsed());
    }
    out
}

/// The hung tenant's concurrency: its whole `max_concurrency`.
const HUNG: usize = 16;

/// Calm's status latency with and without `hung`'s whole concurrency hung: (free, hung).
async fn isolation(
    d: &TestDaemon,
    rounds: usize,
    samples: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    let admin = d.admin();
    // hung boots the idle guest from an image of its own, which is marked as a guest image
    // (manifest.json) once it runs: its inference requests then go to an agent channel.
    let img = d.dir.path().join("img");
    std::fs::create_dir_all(img.join("agentless")).unwrap();
    for f in ["kernel", "cmdline"] {
        std::fs::copy(img.join("idle").join(f), img.join("agentless").join(f)).unwrap();
    }
    let spec = |name: &str, image: &str| {
        TenantSpec::from_toml(&format!(
            "name = \"{name}\"\nmemory_mib = 32\n[image]\nname = \"{image}\"\n\
             [quotas]\nmax_concurrency = {HUNG}\nrequests_per_s = 100000\n"
        ))
        .unwrap()
    };
    let calm = admin.create(&spec("calm", "idle")).await.unwrap().token;
    let hung = admin
        .create(&spec("hung", "agentless"))
        .await
        .unwrap()
        .token;
    for name in ["calm", "hung"] {
        while admin.status(name).await.unwrap().state != LifecycleState::Running {
            tokio::time::sleep(POLL).await;
        }
    }
    std::fs::write(img.join("agentless/manifest.json"), "{}").unwrap();
    let hung_uid = admin.status("hung").await.unwrap().uid.unwrap();
    let sock = d.state_dir().join("tenants/hung/run/agent.sock");
    let calm_client = d.client(&calm);
    let prompt = serde_json::json!({"prompt": "x", "max_tokens": 1});
    let mut free = Vec::new();
    let mut held = Vec::new();
    for _ in 0..rounds {
        free.extend(status_latencies(&calm_client, "calm", samples).await);
        // An agent that never accepts: every request waits for its answer.
        let _ = std::fs::remove_file(&sock);
        let listener = peercred::listen_as(&sock, hung_uid).expect("listen as hung's uid");
        let requests: Vec<_> = (0..HUNG)
            .map(|_| {
                let c = d.client(&hung);
                let body = prompt.clone();
                tokio::spawn(async move { c.infer("hung", &body).await })
            })
            .collect();
        // Let the sixteen reach the guest; then all of hung's concurrency is taken, which a
        // seventeenth request, refused at once, shows. (Were it admitted instead, it would
        // hang with them: it is given up on after a while.)
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Some(done) = requests.iter().position(|r| r.is_finished()) {
            panic!("hung's request {done} ended early instead of hanging");
        }
        let probe = d.client(&hung);
        match tokio::time::timeout(Duration::from_secs(5), probe.infer("hung", &prompt)).await {
            Ok(Err(e)) if e.status().map(|s| s.as_u16()) == Some(429) => {}
            Ok(other) => panic!("hung's extra request was not refused: {other:?}"),
            Err(_) => {
                panic!("hung's extra request was admitted: its {HUNG} were not all in flight")
            }
        }
        held.extend(status_latencies(&calm_client, "calm", samples).await);
        drop(listener);
        for r in requests {
            let _ = r.await;
        }
    }
    std::fs::remove_file(img.join("agentless/manifest.json")).unwrap();
    for name in ["calm", "hung"] {
        destroy(&admin, name).await;
    }
    (free, held)
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
    let only_isolation = std::env::var_os("TENANTVM_BENCH_ONLY_ISOLATION").is_some();
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
        if only_isolation {
            return;
        }
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
        let stopped = destroy_stopped(&c, &spec("bench-stopped-vmm")).await;
        println!(
            "{:<44} {:>9.1}",
            "destroy, SIGSTOPped tenantvm-vmm (ms)",
            ms(stopped)
        );
    });
    let samples: usize = std::env::var("TENANTVM_BENCH_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    // Many short alternating blocks: both conditions see the same background load.
    let blocks: usize = std::env::var("TENANTVM_BENCH_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let (mut free, mut held) = rt.block_on(isolation(&d, blocks, samples));
    free.sort();
    held.sort();
    let (f50, f99) = (percentile(&free, 0.5), percentile(&free, 0.99));
    let (h50, h99) = (percentile(&held, 0.5), percentile(&held, 0.99));
    println!();
    println!(
        "API latency of one tenant (its status, {} requests each, {blocks} alternating blocks)",
        free.len()
    );
    println!("{:<44} {:>9} {:>9}", "", "p50 ms", "p99 ms");
    println!("{:<44} {f50:>9.3} {f99:>9.3}", "no tenant hung");
    println!(
        "{:<44} {h50:>9.3} {h99:>9.3}",
        format!("another tenant's {HUNG} requests hung")
    );
    println!(
        "{:<44} {:>9.2} {:>9.2}",
        "ratio hung / free (goal: within 1.10)",
        h50 / f50,
        h99 / f99
    );
    d.stop();

    // QEMU in its own daemon: the test guest under TCG (QEMU boots its PVH note).
    if daemon::test_guest().is_none() {
        println!("destroy, SIGSTOPped QEMU: skipped (run scripts/build-test-guests.sh)");
        return;
    }
    let mut q = TestDaemon::new().with_args(&["--backend", "qemu-tcg"]);
    q.start(None);
    let c = q.admin();
    rt.block_on(async {
        let stopped = destroy_stopped(&c, &spec_with("bench-stopped-qemu", "testguest", 64)).await;
        println!(
            "{:<44} {:>9.1}",
            "destroy, SIGSTOPped QEMU TCG (ms)",
            ms(stopped)
        );
    });
    q.stop();
}
