//! The command-line seam: clap argument structs and run functions for `tenantvm plan` and
//! `tenantvm host check`. The `tenantvm` binary flattens these into its subcommands.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use thiserror::Error;

use crate::backend::{self, BackendError, BackendSpec};
use crate::check::{self, CheckResult, Status};
use crate::host::fake::FakeHost;
use crate::host::Sysfs;
use crate::mig::{self, MigDatabaseError};
use crate::migparted::{MigPartedConfig, MigPartedError};
use crate::plan::{self, HostGpu, PlanError, PlanReport, TenantsFile, TenantsFileError};

/// Errors of the GPU subcommands.
#[derive(Debug, Error)]
pub enum GpuCliError {
    /// Bad combination of flags.
    #[error("{0}")]
    Usage(String),
    /// Tenants file.
    #[error(transparent)]
    Tenants(#[from] TenantsFileError),
    /// Planning.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// GPU backend.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// Profile database.
    #[error(transparent)]
    Database(#[from] MigDatabaseError),
    /// mig-parted config.
    #[error(transparent)]
    MigParted(#[from] MigPartedError),
    /// Reading or writing a file, or the output.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> GpuCliError {
    let what = what.into();
    move |source| GpuCliError::Io { what, source }
}

/// `tenantvm plan`: size the tenants and place them on a host.
#[derive(Debug, Clone, Args)]
pub struct PlanArgs {
    /// Tenants file (TOML, or JSON when it ends in .json).
    #[arg(long, short = 't')]
    pub tenants: PathBuf,
    /// Plan on N GPUs of this model instead of the live host (a100-40gb, a100-80gb,
    /// h100-80gb, h100-nvl, h200, rtx-pro-6000).
    #[arg(long, conflicts_with = "gpu_backend")]
    pub gpu: Option<String>,
    /// How many GPUs of `--gpu`.
    #[arg(long, default_value_t = 1, requires = "gpu")]
    pub count: u32,
    /// Where the host comes from: `nvml` (the live host, the default) or `sim:FILE` (a
    /// simulated host, for demos and tests).
    #[arg(long)]
    pub gpu_backend: Option<String>,
    /// A mig-parted v1 config taken as the GPUs' current instances.
    #[arg(long)]
    pub mig_config: Option<PathBuf>,
    /// The label to use from `--mig-config`.
    #[arg(long, default_value = "tenantvm", requires = "mig_config")]
    pub mig_config_label: String,
    /// Write the planned state as a mig-parted v1 config (label `tenantvm`).
    #[arg(long)]
    pub write_mig_config: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Most search nodes before the planner gives up.
    #[arg(long, default_value_t = plan::search::DEFAULT_NODE_BUDGET)]
    pub search_budget: u64,
}

/// Builds the host the plan runs on.
pub fn plan_host(args: &PlanArgs) -> Result<Vec<HostGpu>, GpuCliError> {
    let mut gpus = if let Some(model) = &args.gpu {
        let m = mig::model_by_key(model)?;
        if args.count == 0 || args.count > 64 {
            return Err(GpuCliError::Usage(
                "--count must be between 1 and 64".into(),
            ));
        }
        (0..args.count)
            .map(|index| HostGpu::new(index, m))
            .collect()
    } else {
        let spec: BackendSpec = args.gpu_backend.as_deref().unwrap_or("nvml").parse()?;
        let b = backend::open(&spec)?;
        backend::host_gpus(&b.gpus()?)?
    };
    if let Some(path) = &args.mig_config {
        let text =
            std::fs::read_to_string(path).map_err(io(format!("Cannot read {}", path.display())))?;
        MigPartedConfig::parse(&text)?.apply_to(&args.mig_config_label, &mut gpus)?;
    }
    Ok(gpus)
}

/// Runs `tenantvm plan`, writing the report to `out`. The caller exits non-zero when
/// `fits` is false.
pub fn run_plan(args: &PlanArgs, out: &mut dyn Write) -> Result<PlanReport, GpuCliError> {
    let tenants = TenantsFile::load(&args.tenants)?;
    let gpus = plan_host(args)?;
    let report = plan::plan(&gpus, &tenants.tenants, args.search_budget)?;
    if let Some(path) = &args.write_mig_config {
        let assignments: Vec<_> = report
            .tenants
            .iter()
            .filter_map(|t| t.assignment.clone())
            .collect();
        let yaml = MigPartedConfig::from_state("tenantvm", &gpus, &assignments).to_yaml()?;
        std::fs::write(path, yaml).map_err(io(format!("Cannot write {}", path.display())))?;
    }
    let text = if args.json {
        serde_json::to_string_pretty(&report).expect("the report serialises") + "\n"
    } else {
        report.to_text()
    };
    out.write_all(text.as_bytes())
        .map_err(io("Cannot write the report"))?;
    Ok(report)
}

/// `tenantvm host check`: the preflight.
#[derive(Debug, Clone, Args)]
pub struct HostCheckArgs {
    /// Root under which /sys, /proc and /dev are read.
    #[arg(long, default_value = "/")]
    pub root: PathBuf,
    /// Check a FAKE host built from this description (tests/fixtures/hosts/*.sysfs.json)
    /// instead of the real one: for demos.
    #[arg(long, conflicts_with = "root")]
    pub fake_host: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Runs `tenantvm host check`, writing the results to `out`. The caller exits non-zero when
/// any result is a fail.
pub fn run_host_check(
    args: &HostCheckArgs,
    out: &mut dyn Write,
) -> Result<Vec<CheckResult>, GpuCliError> {
    let fake;
    let sysfs = match &args.fake_host {
        Some(spec_path) => {
            let spec = FakeHost::load_spec(spec_path)
                .map_err(io(format!("Cannot load {}", spec_path.display())))?;
            fake = FakeHost::build(&spec).map_err(io("Cannot build the fake host tree"))?;
            fake.sysfs()
        }
        None => Sysfs::new(&args.root),
    };
    let results = check::host_check(&sysfs);
    let mut text = if args.json {
        serde_json::to_string_pretty(&results).expect("the results serialise") + "\n"
    } else {
        check::to_text(&results)
    };
    if !args.json && args.fake_host.is_some() {
        text.insert_str(0, "(FAKE host tree, not this machine)\n");
    }
    out.write_all(text.as_bytes())
        .map_err(io("Cannot write the results"))?;
    Ok(results)
}

/// Whether the check results allow tenantvm to run (no fail).
pub fn host_ok(results: &[CheckResult]) -> bool {
    results.iter().all(|r| r.status != Status::Fail)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Plan {
        #[command(flatten)]
        args: PlanArgs,
    }

    #[derive(Parser)]
    struct Check {
        #[command(flatten)]
        args: HostCheckArgs,
    }

    #[test]
    fn plan_flags_parse_and_conflict_as_documented() {
        let p = Plan::try_parse_from([
            "plan",
            "-t",
            "t.toml",
            "--gpu",
            "h100-80gb",
            "--count",
            "8",
            "--json",
        ])
        .unwrap();
        assert_eq!(
            (p.args.gpu.as_deref(), p.args.count, p.args.json),
            (Some("h100-80gb"), 8, true)
        );
        assert_eq!(p.args.mig_config_label, "tenantvm");
        let p =
            Plan::try_parse_from(["plan", "--tenants", "t.toml", "--gpu-backend", "sim:h.json"])
                .unwrap();
        assert_eq!(p.args.gpu_backend.as_deref(), Some("sim:h.json"));
        assert!(Plan::try_parse_from([
            "plan",
            "-t",
            "t",
            "--gpu",
            "h200",
            "--gpu-backend",
            "nvml"
        ])
        .is_err());
        assert!(
            Plan::try_parse_from(["plan", "-t", "t", "--count", "2"]).is_err(),
            "--count needs --gpu"
        );
        assert!(
            Plan::try_parse_from(["plan"]).is_err(),
            "--tenants is required"
        );
    }

    #[test]
    fn host_check_flags_parse() {
        let c = Check::try_parse_from(["check", "--json"]).unwrap();
        assert_eq!(c.args.root, PathBuf::from("/"));
        assert!(Check::try_parse_from(["check", "--root", "/x", "--fake-host", "f.json"]).is_err());
    }

    #[test]
    fn zero_gpus_is_a_usage_error() {
        let p =
            Plan::try_parse_from(["plan", "-t", "t.toml", "--gpu", "h100-80gb", "--count", "0"])
                .unwrap();
        let e = plan_host(&p.args).unwrap_err();
        assert!(e.to_string().contains("--count"), "{e}");
    }
}
