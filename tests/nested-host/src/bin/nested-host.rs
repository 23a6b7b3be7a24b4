//! The nested test host's command (scripts/nested-host.sh builds its inputs, then runs it).
//!
//! ```text
//! nested-host list [--json]
//! nested-host run [OPTIONS] SCENARIO|@SET...
//! ```
//! `run` prints `PASS name (seconds)`, `SKIP name: reason` or `FAIL name: reason` (with the
//! console's last lines) per scenario and exits 1 if any failed, 2 if the run could not start.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tenantvm_nested_host::{Catalog, Inputs, OuterConfig, RootFormat, Verdict};

#[derive(Parser)]
#[command(
    name = "nested-host",
    about = "Run tenantvm's nested-host scenarios in a QEMU TCG guest with KVM, an IOMMU and vfio (or on this host with TENANTVM_HOST=real)",
    after_help = "Scenarios are the scripts in tests/nested-host/scenarios/; docs/testing.md describes each. \
                  scripts/nested-host.sh builds the inputs first."
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// List the scenarios with their limits, sets and descriptions.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Boot the outer guest once and run the scenarios in it, in order.
    Run {
        /// Scenario names, or @SET for every scenario of a set (e.g. @ci).
        #[arg(required = true)]
        scenarios: Vec<String>,
        /// The inputs file from tests/nested-host/prepare.sh [default: target/nested-host/debug/inputs].
        #[arg(long)]
        inputs: Option<PathBuf>,
        /// Root file system packing: ext4 (faster to boot here) or initramfs.
        #[arg(long, default_value = "ext4")]
        format: RootFormat,
        /// Outer guest memory in MiB.
        #[arg(long, default_value_t = 3072)]
        memory_mib: u32,
        /// Outer guest vCPUs (more than one has frozen QEMU 7.2's TCG here; docs/testing.md).
        #[arg(long, default_value_t = 1)]
        vcpus: u32,
        /// Seconds the outer guest may take to start the first scenario.
        #[arg(long, default_value_t = 300)]
        boot_timeout: u64,
        /// Seconds beyond a scenario's limit before the outer guest counts as hung.
        #[arg(long, default_value_t = 120)]
        grace: u64,
        /// Seconds the outer guest's heartbeat may stay silent before it counts as frozen
        /// (its state is then saved and it is stopped).
        #[arg(long, default_value_t = 30)]
        heartbeat_silence: u64,
        /// Seconds between the host's nudges (a device interrupt on the heartbeat port that
        /// recovers an interrupt QEMU's TCG lost; docs/testing.md); 0: no nudges (to measure
        /// the freeze rate without them).
        #[arg(long, default_value_t = 1)]
        nudge_interval: u64,
        /// Boots of the outer guest allowed for one run: after a freeze, hang or crash the
        /// scenarios that had not started run in a fresh one (none is run twice).
        #[arg(long, default_value_t = 3)]
        max_boots: u32,
        /// An extra word for the outer kernel's command line (repeatable), for experiments,
        /// e.g. --append lapic=notscdeadline.
        #[arg(long = "append", value_name = "WORD")]
        append: Vec<String>,
        /// An extra QEMU argument (repeatable), for experiments, e.g.
        /// --qemu-arg=-icount --qemu-arg=shift=auto.
        #[arg(long = "qemu-arg", value_name = "ARG", allow_hyphen_values = true)]
        qemu_args: Vec<String>,
        /// Folder for the run's files (console.log, results) [default: target/nested-host/runs/PID].
        #[arg(long)]
        work_dir: Option<PathBuf>,
        /// Print the outcomes as JSON at the end.
        #[arg(long)]
        json: bool,
        /// Only check that the scenarios exist (an unknown one lists the known ones).
        #[arg(long)]
        check_names: bool,
    },
}

fn list(json: bool) -> Result<(), String> {
    let catalog = Catalog::load(&Catalog::default_dir()).map_err(|e| e.to_string())?;
    if json {
        let v: Vec<_> = catalog
            .all()
            .iter()
            .map(|s| {
                serde_json::json!({"name": s.name, "limit_s": s.limit_s, "sets": s.sets,
                                   "needs": s.needs, "description": s.description})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    println!(
        "{:<16} {:>7}  {:<14} description",
        "scenario", "limit", "sets"
    );
    for s in catalog.all() {
        println!(
            "{:<20} {:>5} s  {:<14} {}",
            s.name,
            s.limit_s,
            s.sets.join(","),
            s.description
        );
    }
    println!("\nrun: scripts/nested-host.sh SCENARIO... (or @SET, e.g. @ci)");
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::List { json } => list(json).map(|()| true),
        Cmd::Run {
            scenarios,
            inputs,
            format,
            memory_mib,
            vcpus,
            boot_timeout,
            grace,
            heartbeat_silence,
            nudge_interval,
            max_boots,
            append,
            qemu_args,
            work_dir,
            json,
            check_names,
        } => (|| {
            let catalog = Catalog::load(&Catalog::default_dir()).map_err(|e| e.to_string())?;
            let chosen = catalog.select(&scenarios).map_err(|e| e.to_string())?;
            if check_names {
                return Ok(true);
            }
            let inputs = Inputs::load(&inputs.unwrap_or_else(|| Inputs::default_path("debug")))
                .map_err(|e| e.to_string())?;
            let work_dir = work_dir.unwrap_or_else(tenantvm_nested_host::default_work_dir);
            let mut cfg = OuterConfig::new(work_dir.clone());
            cfg.format = format;
            cfg.memory_mib = memory_mib;
            cfg.vcpus = vcpus;
            cfg.boot_timeout = std::time::Duration::from_secs(boot_timeout);
            cfg.grace = std::time::Duration::from_secs(grace);
            cfg.heartbeat_silence = std::time::Duration::from_secs(heartbeat_silence);
            cfg.max_boots = max_boots;
            cfg.nudge =
                (nudge_interval > 0).then(|| std::time::Duration::from_secs(nudge_interval));
            cfg.extra_append = append;
            cfg.extra_qemu_args = qemu_args;
            let outcomes =
                tenantvm_nested_host::run(&cfg, &inputs, &chosen, &mut |p| println!("{p}"))
                    .map_err(|e| e.to_string())?;
            if json {
                let v: Vec<_> = outcomes
                    .iter()
                    .map(|o| {
                        let (verdict, reason) = match &o.verdict {
                            Verdict::Pass => ("pass", None),
                            Verdict::Skip { reason } => ("skip", Some(reason)),
                            Verdict::Fail { reason, .. } => ("fail", Some(reason)),
                        };
                        serde_json::json!({"name": o.name, "verdict": verdict,
                                           "seconds": o.seconds, "reason": reason})
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            }
            let failed = outcomes.iter().filter(|o| o.failed()).count();
            if failed > 0 {
                eprintln!(
                    "nested-host: {failed} of {} scenarios failed; the run's files are in {}",
                    outcomes.len(),
                    work_dir.display()
                );
            }
            Ok(failed == 0)
        })(),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("nested-host: {e}");
            ExitCode::from(2)
        }
    }
}
