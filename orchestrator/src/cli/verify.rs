//! `tenantvm verify`: the isolation checklist against the live host (docs/verify.md).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{exit, fail, CliFailure};
use crate::verify::live::{LiveHost, LivePaths};
use crate::verify::probe::{new_run_id, Probes};
use crate::verify::report::REPORT_VERSION;
use crate::verify::{self, CheckId, HostError, Report, VerifyConfig};

/// Exit status of `verify` when a selected check failed or was inconclusive.
pub const NOT_PASSED: u8 = 14;
/// Exit status of `verify` interrupted by Ctrl-C (its probes destroyed, nothing recorded).
pub const INTERRUPTED: u8 = 130;

/// Run the pre-deployment isolation checklist against this host and its daemon.
///
/// Needs the admin token, and must run on the daemon's host as root: besides the API it
/// reads the tenants' cgroups, disk headers, wrapped keys, the state directory and /proc.
/// It creates short-lived probe tenants named tvm-verify-<run id>-<role> from
/// --probe-image (a named image: the n-gram server, or an engine's variant with
/// --probe-model), destroys them
/// whatever happens (and sweeps those a killed run left, as recorded in --ledger), and
/// never touches other tenants' data (it reads their cgroup limits, GPU slices and serving
/// configuration only).
///
/// The checks (numbers or names for --checks; all by default):
///    1 threat-model          the operator's threat model (--threat-model) is written down
///    2 mig-sku               every GPU tenants share is a MIG-capable SKU (--gpu-backend)
///    3 partition-arithmetic  every sized need fits its slice; the host holds them all
///    4 memory-partition      probe cgroups have a memory limit near their guest memory,
///                            a process overrunning one is killed, the other still serves;
///                            with GPU probes, GPU memory allocation stops at the slice
///    5 prefix-cache          timing test (one-sided KS, hit/miss pairs in random order)
///                            across two probes, after a positive control within one probe
///                            whose payload has its prefix cache on (--control-image)
///    6 batching              each tenant's engine read through its agent (llama-server's
///                            /props, the n-gram server's description); two probes shown
///                            by effect (a prompt cached in one engine only) to reach
///                            engines of their own
///    7 visibility            probe tokens refused on each other's logs and receipts; a
///                            marker prompt in no host file
///    8 noisy-neighbour       CPU quotas present and binding; victim p50/p99 idle vs.
///                            neighbour loaded
///    9 weights-at-rest       LUKS2 disks, per-tenant sealed keys, no plaintext marker
///   10 departure             nothing of a destroyed probe remains (with GPU probes: no MIG
///                            instance, reservation, VF type or vfio binding); its receipt
///                            verifies
///
/// Each check ends pass, fail or inconclusive, with its evidence as numbers. An
/// inconclusive check (the host could not be asked, a control did not detect) is never a
/// pass. The report is printed as a table (--json: as JSON), written to --report, kept
/// beside the audit log and appended to it as a signed entry (`tenantvm receipt verify`
/// checks it with the departure receipts).
///
/// Examples:
///   tenantvm verify --threat-model threat.md --probe-image ngram --control-image ngram-cache
///   tenantvm verify --checks 1,2,3 --gpu-backend nvml --threat-model threat.md
///   tenantvm verify --checks prefix-cache --samples 50 --probe-image ngram --report out.json
///   tenantvm verify --checks 5,6 --probe-image llama --probe-model tiny.gguf \
///                   --probe-memory-mib 1024 --prefix-words 40 --samples 10
///
/// Ctrl-C stops the run and destroys its probe tenants before exiting (130); a run killed
/// outright leaves them to the next run's sweep.
///
/// Exit statuses: 0 no selected check failed or was inconclusive and one passed (a
/// not-applicable check is named in the headline); 14 a check failed or was inconclusive,
/// or none passed;
/// 2 usage; 3 daemon unreachable; 7 invalid flags; 1 the report could not be recorded;
/// 130 interrupted.
#[derive(Debug, Clone, Args)]
#[command(verbatim_doc_comment)]
pub struct VerifyArgs {
    /// Checks to run: numbers or names, comma-separated (default: all ten).
    #[arg(long, value_name = "LIST")]
    pub checks: Option<String>,
    /// The threat model: who the tenants are and what they must not learn about each other.
    #[arg(long, value_name = "FILE")]
    pub threat_model: Option<PathBuf>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Named image (the daemon's --image-dir) the probe tenants run.
    #[arg(long, value_name = "NAME")]
    pub probe_image: Option<String>,
    /// A model file every probe serves (pushed onto its disk, its engine restarted), for a
    /// --probe-image whose engine needs one: the llama-cpp variant with a small GGUF
    /// (guest-image/variants/llama-cpp/make-test-model.py writes one). At most 1 GiB.
    #[arg(long, value_name = "FILE")]
    pub probe_model: Option<PathBuf>,
    /// Named image for the prefix-cache positive control (payload with --prefix-cache on);
    /// default: --probe-image.
    #[arg(long, value_name = "NAME")]
    pub control_image: Option<String>,
    /// Guest memory of each probe tenant, MiB.
    #[arg(long, default_value_t = 128)]
    pub probe_memory_mib: u32,
    /// How long a probe may take to start or to go, seconds.
    #[arg(long, default_value_t = 180)]
    pub probe_timeout_s: u64,
    /// Timing samples per arm for the prefix-cache test (the published audit uses 250).
    #[arg(long, default_value_t = 250)]
    pub samples: usize,
    /// Words in each prefix-cache probe prompt.
    #[arg(long, default_value_t = 3000)]
    pub prefix_words: usize,
    /// Significance level of the prefix-cache test.
    #[arg(long, default_value_t = 1e-3)]
    pub alpha: f64,
    /// Latency samples per phase for the noisy-neighbour check (its p99 needs a few
    /// hundred: with 40 the p99 is the slowest request, one outlier decides the ratio).
    #[arg(long, default_value_t = 200)]
    pub latency_samples: usize,
    /// Largest p99 latency ratio (neighbour loaded / idle) the noisy-neighbour check accepts,
    /// and the largest slowdown of a GPU slice's compute rate beside a saturated neighbour.
    #[arg(long, default_value_t = 3.0)]
    pub max_latency_ratio: f64,
    /// Seconds of each GPU compute-rate measurement of the noisy-neighbour check (1-30).
    #[arg(long, default_value_t = 5)]
    pub gpu_compute_seconds: u32,
    /// Most memory a tenant's cgroup may allow above its guest memory, MiB.
    #[arg(long, default_value_t = 512)]
    pub max_overhead_mib: u64,
    /// Seed of the prompts and of each hit/miss pair's order (recorded in the report; fresh when absent).
    #[arg(long)]
    pub seed: Option<u64>,
    /// The daemon's state directory.
    #[arg(long, env = "TENANTVMD_STATE_DIR", default_value = "/var/lib/tenantvm")]
    pub state_dir: PathBuf,
    /// The daemon's key-encryption key file (its `--kek-file`), read to unwrap the probes'
    /// disk keys for check 9's cross-key open; never created.
    #[arg(long, env = "TENANTVMD_KEK_FILE", default_value = crate::keys::DEFAULT_KEK_FILE)]
    pub kek_file: PathBuf,
    /// The cgroup filesystem root.
    #[arg(long, default_value = crate::jail::cgroup::DEFAULT_CGROUP_ROOT)]
    pub cgroup_root: PathBuf,
    /// Where the host's GPUs come from: `nvml` or `sim:FILE` (checks 2 and 3; without it
    /// they are inconclusive when tenants hold GPU shares).
    #[arg(long)]
    pub gpu_backend: Option<String>,
    /// Whether checks 4, 8 and 10 give their probes the smallest GPU slice the host can give
    /// (`auto`: when --gpu-backend shows GPUs; `off`: never, their GPU halves not run).
    #[arg(long, value_name = "auto|off", default_value = "auto")]
    pub gpu_probes: crate::verify::gpu_probe::GpuProbes,
    /// The root the host's sysfs is mounted under, where check 10 reads VF vGPU types and
    /// vfio-pci bindings (the daemon's --gpu-sysfs-root).
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub gpu_sysfs_root: PathBuf,
    /// More files or directories the plaintext marker scan reads (the daemon's log file).
    #[arg(long, value_name = "PATH")]
    pub scan: Vec<PathBuf>,
    /// The front door (checks 7 and 9), boxed: the flags are rarely given.
    #[command(flatten)]
    pub front: Box<FrontDoorArgs>,
    /// Ledger of probe tenants created (default: <state-dir>/verify/probes).
    #[arg(long, value_name = "FILE")]
    pub ledger: Option<PathBuf>,
    /// The audit log the signed entry is appended to (default:
    /// <state-dir>/audit/receipts.jsonl, where the daemon keeps it).
    #[arg(long, env = "TENANTVM_AUDIT_LOG")]
    pub audit_log: Option<PathBuf>,
    /// The host's receipt signing key (default: <state-dir>/audit/receipt-signing.key).
    #[arg(long)]
    pub signing_key: Option<PathBuf>,
}

impl VerifyArgs {
    /// The audit log and signing key: as given, else the daemon's, under `--state-dir`
    /// (`audit/receipts.jsonl`, `audit/receipt-signing.key`, as tenantvmd lays them out).
    fn audit_paths(&self) -> (PathBuf, PathBuf) {
        let audit = self.state_dir.join("audit");
        (
            self.audit_log
                .clone()
                .unwrap_or_else(|| audit.join("receipts.jsonl")),
            self.signing_key
                .clone()
                .unwrap_or_else(|| audit.join("receipt-signing.key")),
        )
    }

    fn config(&self) -> Result<VerifyConfig, CliFailure> {
        if !(self.alpha > 0.0 && self.alpha < 1.0) {
            return Err(fail(
                exit::INVALID,
                "--alpha must be between 0 and 1 (e.g. 0.001)",
            ));
        }
        if self.samples < 5 || self.samples > 100_000 {
            return Err(fail(
                exit::INVALID,
                "--samples must be between 5 and 100000",
            ));
        }
        let max_words = crate::verify::checks::prefix::MAX_PREFIX_WORDS;
        if self.prefix_words < 20 || self.prefix_words > max_words {
            return Err(fail(
                exit::INVALID,
                format!("--prefix-words must be between 20 and {max_words} (a probe prompt must fit the probe tenant's 1 MiB request limit)"),
            ));
        }
        if !(1..=30).contains(&self.gpu_compute_seconds) {
            return Err(fail(
                exit::INVALID,
                "--gpu-compute-seconds must be between 1 and 30",
            ));
        }
        if self.latency_samples < 2
            || self.max_latency_ratio.is_nan()
            || self.max_latency_ratio < 1.0
        {
            return Err(fail(
                exit::INVALID,
                "--latency-samples must be at least 2 and --max-latency-ratio at least 1",
            ));
        }
        Ok(VerifyConfig {
            threat_model: self.threat_model.clone(),
            probe_image: self.probe_image.clone(),
            control_image: self.control_image.clone(),
            probe_memory_mib: self.probe_memory_mib,
            max_overhead_mib: self.max_overhead_mib,
            samples_per_arm: self.samples,
            prefix_words: self.prefix_words,
            alpha: self.alpha,
            latency_samples: self.latency_samples,
            max_latency_ratio: self.max_latency_ratio,
            seed: self.seed,
            probe_timeout: Duration::from_secs(self.probe_timeout_s),
            gpu_probes: self.gpu_probes,
            gpu_compute_seconds: self.gpu_compute_seconds,
        })
    }
}

/// How the async side follows and stops the run: progress lines out, a cancel flag in.
struct RunControl {
    progress: tokio::sync::mpsc::UnboundedSender<String>,
    cancel: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

fn run_blocking(
    args: VerifyArgs,
    config: VerifyConfig,
    selection: Vec<CheckId>,
    socket: PathBuf,
    token: String,
    rt: tokio::runtime::Handle,
    control: RunControl,
) -> Result<Report, HostError> {
    let RunControl { progress, cancel } = control;
    let host = LiveHost::new(
        &token,
        rt,
        LivePaths {
            socket,
            state_dir: args.state_dir.clone(),
            cgroup_root: args.cgroup_root.clone(),
            gpu_backend: args.gpu_backend.clone(),
            gpu_sysfs_root: args.gpu_sysfs_root.clone(),
            scan_extra: args.scan.clone(),
            kek_file: args.kek_file.clone(),
        },
    );
    let host = match (args.front.front_door, &args.front.front_door_ca) {
        (Some(addr), Some(ca)) => host.with_front_door(crate::verify::door::FrontDoorTarget {
            addr,
            server_name: args.front.front_door_name.clone(),
            ca: ca.clone(),
        })?,
        _ => host,
    };
    let daemon = host.daemon()?;
    let started_at = crate::receipt::now_rfc3339();
    let run_id = new_run_id();
    let seed = config.seed.unwrap_or_else(rand::random);
    let ledger = args
        .ledger
        .clone()
        .unwrap_or_else(|| args.state_dir.join("verify").join("probes"));
    let probes = Probes::new(
        &host,
        &run_id,
        config.probe_image.clone(),
        config.probe_memory_mib,
        Some(ledger),
        config.probe_timeout,
    )
    .with_cancel(cancel)
    .with_model(
        args.probe_model
            .as_deref()
            .map(crate::verify::probe::ProbeModel::read)
            .transpose()?,
    );
    let mut sweep = probes
        .sweep()
        .unwrap_or_else(|e| vec![format!("the sweep of earlier probes failed: {e}")]);
    let mut checks = Vec::new();
    for id in &selection {
        if probes.cancelled() {
            break;
        }
        let _ = progress.send(format!("[{}] {} ...", id.number(), id.key()));
        let mut r = verify::run_checks(&host, &probes, &config, seed, &[*id]);
        if let Some(done) = r.first() {
            let _ = progress.send(format!(
                "[{}] {}: {} ({:.1} s)",
                id.number(),
                id.key(),
                done.outcome.verdict.as_str(),
                done.elapsed_ms as f64 / 1e3
            ));
        }
        checks.append(&mut r);
    }
    sweep.extend(
        probes
            .release_all()
            .into_iter()
            .map(|p| format!("cleanup: {p}")),
    );
    Ok(Report {
        version: REPORT_VERSION,
        run_id,
        started_at,
        finished_at: crate::receipt::now_rfc3339(),
        daemon,
        seed,
        threat_model: verify::checks::threat::load(config.threat_model.as_deref()).ok(),
        selected: selection,
        passed: Report::all_passed(&checks),
        checks,
        sweep,
    })
}

/// After Ctrl-C: destroys the probes the ledger names (the running checks' among them) on a
/// blocking thread of its own, within the probe timeout; returns what it did.
async fn interrupted_cleanup(args: &VerifyArgs, socket: PathBuf, token: String) -> Vec<String> {
    let rt = tokio::runtime::Handle::current();
    let args = args.clone();
    let job = tokio::task::spawn_blocking(move || {
        let host = LiveHost::new(
            &token,
            rt,
            LivePaths {
                socket,
                state_dir: args.state_dir.clone(),
                cgroup_root: args.cgroup_root.clone(),
                gpu_backend: None,
                gpu_sysfs_root: args.gpu_sysfs_root.clone(),
                scan_extra: Vec::new(),
                kek_file: args.kek_file.clone(),
            },
        );
        let ledger = args
            .ledger
            .clone()
            .unwrap_or_else(|| args.state_dir.join("verify").join("probes"));
        Probes::new(
            &host,
            "interrupt",
            None,
            0,
            Some(ledger),
            Duration::from_secs(args.probe_timeout_s),
        )
        .sweep_interrupted()
        .unwrap_or_else(|e| {
            vec![format!(
                "the cleanup failed: {e}; the next run sweeps the ledger"
            )]
        })
    });
    job.await.unwrap_or_else(|e| {
        vec![format!(
            "the cleanup stopped: {e}; the next run sweeps the ledger"
        )]
    })
}

/// Runs `tenantvm verify`.
pub(super) async fn run(
    args: &VerifyArgs,
    socket: PathBuf,
    token: String,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<(), CliFailure> {
    let config = args.config()?;
    let selection = match &args.checks {
        Some(list) => {
            verify::parse_selection(list).map_err(|e| fail(exit::INVALID, e.to_string()))?
        }
        None => CheckId::ALL.to_vec(),
    };
    let (socket_for_cleanup, token_for_cleanup) = (socket.clone(), token.clone());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let rt = tokio::runtime::Handle::current();
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let job = {
        let args = args.clone();
        let cancel = cancel.clone();
        tokio::task::spawn_blocking(move || {
            let control = RunControl {
                progress: tx,
                cancel,
            };
            run_blocking(args, config, selection, socket, token, rt, control)
        })
    };
    loop {
        tokio::select! {
            line = rx.recv() => match line {
                Some(line) => writeln!(err, "verify: {line}")?,
                None => break,
            },
            _ = tokio::signal::ctrl_c() => {
                // No new probe from here on; then the ledger's are destroyed.
                cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                writeln!(err, "verify: interrupted; destroying this run's probe tenants")?;
                let lines = interrupted_cleanup(args, socket_for_cleanup.clone(), token_for_cleanup.clone()).await;
                for l in lines {
                    writeln!(err, "verify: {}", crate::untrusted::one_line(&l))?;
                }
                return Err(fail(INTERRUPTED, "interrupted: no report was recorded"));
            }
        }
    }
    let report = job
        .await
        .map_err(|e| fail(exit::OTHER, format!("the verification run stopped: {e}")))?
        .map_err(|e| match e {
            HostError::Unreachable(m) => fail(exit::UNREACHABLE, m),
            HostError::Api {
                status: 401,
                message,
            } => fail(exit::UNAUTHORIZED, message),
            other => fail(exit::OTHER, other.to_string()),
        })?;
    let json = serde_json::to_string_pretty(&report)
        .map_err(|e| fail(exit::OTHER, format!("cannot encode the report: {e}")))?;
    if args.json {
        writeln!(out, "{json}")?;
    } else {
        write!(out, "{}", report.to_table())?;
    }
    if let Some(path) = &args.report {
        std::fs::write(path, format!("{json}\n")).map_err(|e| {
            fail(
                exit::OTHER,
                format!("Cannot write the report to {}: {e}", path.display()),
            )
        })?;
    }
    let (audit_log, signing_key) = args.audit_paths();
    let entry = verify::audit::record(&report, &audit_log, &signing_key).map_err(|e| {
        fail(
            exit::OTHER,
            format!("the report was not recorded in the audit log: {e}"),
        )
    })?;
    writeln!(
        err,
        "verify: report appended to {} as entry #{} (signed, key {})",
        audit_log.display(),
        entry.seq,
        entry.key_id
    )?;
    if report.passed {
        Ok(())
    } else {
        Err(fail(
            NOT_PASSED,
            "not every selected check passed (see the report above)",
        ))
    }
}

/// Where the daemon's front door is and how to trust it (`tenantvm verify`).
#[derive(Debug, Clone, clap::Args)]
pub struct FrontDoorArgs {
    /// The daemon's front door (its --listen address): checks 7 and 9 read probes' metrics
    /// and models there with inference keys, and send check 7's marker prompt through it.
    #[arg(long, value_name = "ADDR:PORT", requires = "front_door_ca")]
    pub front_door: Option<std::net::SocketAddr>,
    /// The CA (or self-signed certificate, PEM) the front door's certificate is trusted by.
    #[arg(long, value_name = "PEM", requires = "front_door")]
    pub front_door_ca: Option<PathBuf>,
    /// The name the front door's certificate is issued to.
    #[arg(long, value_name = "NAME", default_value = "localhost")]
    pub front_door_name: String,
}

#[cfg(test)]
mod tests {
    use super::super::{Cli, Command};
    use clap::Parser;

    #[test]
    fn flags_parse_and_bad_values_are_refused_locally() {
        let cli = Cli::try_parse_from([
            "tenantvm",
            "verify",
            "--checks",
            "1,5",
            "--samples",
            "50",
            "--probe-image",
            "ngram",
        ])
        .unwrap();
        let Command::Verify(a) = cli.command else {
            panic!()
        };
        let cfg = a.config().unwrap();
        assert_eq!(cfg.samples_per_arm, 50);
        assert_eq!(cfg.probe_image.as_deref(), Some("ngram"));
        use crate::verify::gpu_probe::GpuProbes;
        assert_eq!(
            cfg.gpu_probes,
            GpuProbes::Auto,
            "GPU probes default to auto"
        );
        let cli = Cli::try_parse_from(["tenantvm", "verify", "--gpu-probes", "off"]).unwrap();
        let Command::Verify(a) = cli.command else {
            panic!()
        };
        assert_eq!(a.config().unwrap().gpu_probes, GpuProbes::Off);
        Cli::try_parse_from(["tenantvm", "verify", "--gpu-probes", "sometimes"]).unwrap_err();
        for bad in [
            vec!["--alpha", "2"],
            vec!["--samples", "1"],
            vec!["--prefix-words", "3"],
            vec!["--prefix-words", "240001"],
            vec!["--max-latency-ratio", "0.5"],
        ] {
            let cli = Cli::try_parse_from(
                ["tenantvm", "verify"]
                    .into_iter()
                    .chain(bad.iter().copied()),
            )
            .unwrap();
            let Command::Verify(a) = cli.command else {
                panic!()
            };
            assert_eq!(
                a.config().unwrap_err().code,
                super::exit::INVALID,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_audit_log_and_signing_key_follow_the_state_dir_unless_given() {
        let parse = |extra: &[&str]| {
            let cli = Cli::try_parse_from(
                ["tenantvm", "verify", "--state-dir", "/srv/tvm"]
                    .into_iter()
                    .chain(extra.iter().copied()),
            )
            .unwrap();
            let Command::Verify(a) = cli.command else {
                panic!()
            };
            a.audit_paths()
        };
        let (log, key) = parse(&[]);
        assert_eq!(log, std::path::Path::new("/srv/tvm/audit/receipts.jsonl"));
        assert_eq!(
            key,
            std::path::Path::new("/srv/tvm/audit/receipt-signing.key")
        );
        let (log, key) = parse(&["--audit-log", "/a/log", "--signing-key", "/a/key"]);
        assert_eq!(log, std::path::Path::new("/a/log"));
        assert_eq!(key, std::path::Path::new("/a/key"));
    }
}
