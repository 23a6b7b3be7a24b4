//! Benchmark: boot-to-ready of the guest image under QEMU (TCG by default, KVM with
//! `--kvm`), measured from QEMU's start to the agent's first `status` answer, then a
//! clean `shutdown`. Prints each run and the median.
//!
//! ```text
//! cargo run --release -p tenantvm-agent --example boot_to_ready -- IMAGE_DIR [RUNS] [--kvm]
//! ```

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tenantvm_agent_protocol::{AgentClient, AgentEndpoint};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let kvm = args.iter().any(|a| a == "--kvm");
    let rest: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let Some(image) = rest.first().map(PathBuf::from) else {
        bail!("usage: boot_to_ready IMAGE_DIR [RUNS] [--kvm]");
    };
    let runs: usize = rest
        .get(1)
        .map_or(Ok(3), |r| r.parse())
        .context("RUNS must be a number")?;
    let dir = tempfile::tempdir()?;
    let disk = dir.path().join("empty.img");
    std::fs::File::create(&disk)?.set_len(1 << 20)?;
    let mut times = Vec::new();
    for run in 1..=runs {
        let sock = dir.path().join(format!("agent{run}.sock"));
        let console = dir.path().join("console.log");
        let start = Instant::now();
        let mut vm = common::boot(&image, &disk, &sock, &console, kvm);
        let (mut agent, status) =
            AgentClient::wait_for_ready(&AgentEndpoint::Serial(sock), Duration::from_secs(600))
                .with_context(|| format!("run {run}: agent not ready"))?;
        let took = start.elapsed();
        agent.shutdown(Duration::from_secs(60))?;
        let clean = vm.wait_exit(Duration::from_secs(60)) == Some(true);
        println!(
            "run {run}: boot-to-ready {:.2} s (agent up {} ms before answering), clean power-off: {clean}",
            took.as_secs_f64(),
            status.uptime_ms
        );
        times.push(took.as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    println!(
        "median boot-to-ready over {runs} runs ({}): {:.2} s",
        if kvm { "KVM" } else { "TCG" },
        times[times.len() / 2]
    );
    Ok(())
}
