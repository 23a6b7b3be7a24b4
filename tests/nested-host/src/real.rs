//! `TENANTVM_HOST=real`: the same scenarios run directly on this host (a real one with KVM
//! and an IOMMU), through the same runner and results lines as inside the outer guest. The
//! scenarios get the same NH_* variables, pointing at this repository's build.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::catalog::{Catalog, Scenario};
use crate::inputs::{check_kernel, kernel_dir, Inputs, KEYS, OPTIONAL_KEYS};
use crate::watch::{watch, Outcome, Progress, WatchConfig};
use crate::HarnessError;

/// Whether `TENANTVM_HOST=real` asks for a real-host run.
pub fn requested() -> bool {
    std::env::var("TENANTVM_HOST").is_ok_and(|v| v == "real")
}

/// Runs `scenarios` on this host; `work_dir` gets the results, the runner's output
/// (output.log, the "console") and each scenario's work folder.
pub fn run(
    work_dir: PathBuf,
    inputs: &Inputs,
    scenarios: &[Scenario],
    report: &mut dyn FnMut(&Progress),
) -> Result<Vec<Outcome>, HarnessError> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(HarnessError::Setup(
            "TENANTVM_HOST=real runs the scenarios as on a host: run it as root".into(),
        ));
    }
    let kdir = kernel_dir();
    check_kernel(&kdir)?;
    let setup = |e: std::io::Error| {
        HarnessError::Setup(format!("cannot prepare {}: {e}", work_dir.display()))
    };
    std::fs::create_dir_all(work_dir.join("work")).map_err(setup)?;
    std::fs::write(work_dir.join("results"), b"").map_err(setup)?;
    let output = std::fs::File::create(work_dir.join("output.log")).map_err(setup)?;
    let harness = crate::harness_dir();
    let mut cmd = Command::new("sh");
    cmd.arg(harness.join("run-scenarios.sh"))
        .arg(work_dir.join("results"))
        .args(scenarios.iter().map(|s| &s.name));
    for key in KEYS {
        cmd.env(key, inputs.get(key));
    }
    for key in OPTIONAL_KEYS {
        if !inputs.get(key).is_empty() {
            cmd.env(key, inputs.get(key));
        }
    }
    cmd.env("NH_HOST", "real")
        .env("NH_KERNEL_DIR", &kdir)
        .env("NH_SCENARIOS", Catalog::default_dir())
        .env("NH_LIB", harness.join("lib.sh"))
        .env("NH_WORK_ROOT", work_dir.join("work"))
        .stdin(Stdio::null())
        .stdout(output.try_clone().map_err(setup)?)
        .stderr(output);
    let mut child = cmd
        .spawn()
        .map_err(|e| HarnessError::Setup(format!("cannot start the scenario runner: {e}")))?;
    let cfg = WatchConfig {
        results: work_dir.join("results"),
        console: work_dir.join("output.log"),
        boot_timeout: Duration::from_secs(60),
        grace: Duration::from_secs(60),
        what: "the scenario runner",
        heartbeat: None,
    };
    let outcomes = watch(&mut child, scenarios, &cfg, report);
    let _ = child.wait();
    Ok(outcomes)
}
