//! `tenantvmd`: initialises the state directory, serves the API on a Unix socket, and
//! recovers (reconciles the host with the store) in the background while it answers, until
//! SIGTERM or SIGINT. VMs keep running across daemon restarts; the next start adopts them.
//! A signal stops the daemon within a few seconds whatever its operations are waiting on:
//! they are told to give up, and those that do not in time are left as a crash would leave
//! them (every step is recorded and idempotent), to resume at the next start.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use tokio::net::UnixListener;

use crate::backend::{
    runner::sibling_binary, QemuAccel, QemuBackend, RuntimeConfig, VmBackend, VmmBackend,
};
use crate::domain::lifecycle::LifecycleState;
use crate::reconcile::{self, ReconcileOptions};
use crate::store::Store;
use crate::tenant::host::{GpuPlanner, NoGpus};
use crate::tenant::service::{ServiceConfig, TenantService};

/// Which backend runs the VMs.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum BackendArg {
    /// tenantvm-vmm under KVM (the default).
    Vmm,
    /// QEMU with KVM.
    QemuKvm,
    /// QEMU with software emulation (no KVM needed; slow).
    QemuTcg,
}

/// tenantvmd: the tenantvm daemon.
///
/// On first start it creates the state directory (mode 0700) and an admin token in
/// <state-dir>/admin.token (mode 0600), which the `tenantvm` CLI reads. On every start it
/// serves the API (docs/api/openapi.yaml) on --socket and, meanwhile, recovers: finishes or
/// rolls back operations a crash interrupted, adopts VMs that still run, and releases leaked
/// cgroups, files, uids and GPU reservations (`tenantvm status` shows tenants not yet
/// recovered as recovering). SIGTERM or SIGINT stop it within a few seconds.
#[derive(Debug, Parser)]
#[command(name = "tenantvmd", version, verbatim_doc_comment)]
pub struct DaemonArgs {
    /// State directory: the SQLite store, the admin token, tenant directories.
    #[arg(long, env = "TENANTVMD_STATE_DIR", default_value = "/var/lib/tenantvm")]
    pub state_dir: PathBuf,
    /// The API socket (created mode 0600; its directory is created if missing).
    #[arg(
        long,
        env = "TENANTVMD_SOCKET",
        default_value = "/run/tenantvm/tenantvmd.sock"
    )]
    pub socket: PathBuf,
    /// How VMs run.
    #[arg(long, value_enum, default_value_t = BackendArg::Vmm)]
    pub backend: BackendArg,
    /// GPU backend: `none`, `nvml`, or `sim:FILE` (a simulated host described in FILE).
    #[arg(long, default_value = "none")]
    pub gpu_backend: String,
    /// Directory of named guest images: <dir>/<name>/kernel (+ initramfs, cmdline).
    #[arg(long)]
    pub image_dir: Option<PathBuf>,
    /// The tenantvm-vmm binary (default: next to tenantvmd).
    #[arg(long)]
    pub vmm_binary: Option<PathBuf>,
    /// The QEMU binary for --backend qemu-*.
    #[arg(long, default_value = "/usr/bin/qemu-system-x86_64")]
    pub qemu_binary: PathBuf,
    /// Uids handed to tenants, FIRST:COUNT (gid = uid).
    #[arg(long, default_value = "200000:65536", value_parser = parse_uid_range)]
    pub uid_range: (u32, u32),
    /// Seconds `stop` waits for a clean guest shutdown before killing.
    #[arg(long, default_value_t = 5)]
    pub stop_grace_s: u64,
    /// Seconds create/start wait for the VM to report running.
    #[arg(long, default_value_t = 30)]
    pub boot_timeout_s: u64,
    /// Seconds a guest-image tenant's agent may take to answer after boot, and its payload
    /// to become ready (software emulation boots a Linux guest in 30-60 s).
    #[arg(long, default_value_t = 300)]
    pub agent_timeout_s: u64,
    /// The host key-encryption key file (created 0600 at first start; ignored when the
    /// systemd credential `tenantvm-kek` is present).
    #[arg(long, env = "TENANTVMD_KEK_FILE", default_value = crate::keys::DEFAULT_KEK_FILE)]
    pub kek_file: PathBuf,
    /// Argon2id cost of new disks' keyslot: `production` (256 MiB, 4 passes, 4 lanes) or
    /// `test` (the minimum; tests and demos only).
    #[arg(long, env = "TENANTVMD_KEYSLOT_COST", value_enum, default_value_t = KeyslotCostArg::Production)]
    pub keyslot_cost: KeyslotCostArg,
    /// Leave tenant cgroups this daemon never recorded alone (for hosts, like test machines,
    /// where several daemons share one cgroup tree).
    #[arg(long)]
    pub keep_unknown_cgroups: bool,
}

/// `--keyslot-cost`.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum KeyslotCostArg {
    /// 256 MiB, 4 passes, 4 lanes.
    Production,
    /// libcryptsetup's minimum: tests and demos only.
    Test,
}

fn parse_uid_range(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("expected FIRST:COUNT, got {s:?}"))?;
    let first: u32 = a.parse().map_err(|_| format!("bad first uid {a:?}"))?;
    let count: u32 = b.parse().map_err(|_| format!("bad count {b:?}"))?;
    if first < 1000 || count == 0 || first.checked_add(count).is_none() {
        return Err(
            "the range must start at 1000 or above, be non-empty and fit in 32 bits".into(),
        );
    }
    Ok((first, count))
}

fn make_state_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("Cannot create {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("Cannot make {} mode 0700", dir.display()))?;
    Ok(())
}

fn make_backend(args: &DaemonArgs) -> anyhow::Result<Arc<dyn VmBackend>> {
    let config = RuntimeConfig::detect().context("Cannot set up the VM runtime")?;
    Ok(match args.backend {
        BackendArg::Vmm => {
            let bin = match &args.vmm_binary {
                Some(b) => b.clone(),
                None => sibling_binary("tenantvm-vmm")?,
            };
            Arc::new(VmmBackend::new(bin, config))
        }
        BackendArg::QemuKvm => Arc::new(QemuBackend::new(
            args.qemu_binary.clone(),
            QemuAccel::Kvm,
            config,
        )),
        BackendArg::QemuTcg => Arc::new(QemuBackend::new(
            args.qemu_binary.clone(),
            QemuAccel::Tcg,
            config,
        )),
    })
}

fn make_gpu(spec: &str) -> anyhow::Result<Arc<dyn GpuPlanner>> {
    match spec {
        "none" => Ok(Arc::new(NoGpus)),
        other => crate::tenant::gpu::planner_from_arg(other),
    }
}

/// Arms the crash hook from `TENANTVM_TEST_CRASH_AT` (builds with the `test-hooks` feature,
/// for the crash-safety tests).
#[cfg(feature = "test-hooks")]
fn with_test_hooks(svc: TenantService) -> anyhow::Result<TenantService> {
    use crate::tenant::fault::{FaultHook, CRASH_ENV};
    let fault = FaultHook::from_env()?;
    if fault.is_armed() {
        tracing::warn!(
            "{CRASH_ENV} is set: this daemon will SIGKILL itself at a step boundary (tests only)"
        );
    }
    Ok(svc.with_fault_hook(fault))
}

/// Production builds have no crash hook.
#[cfg(not(feature = "test-hooks"))]
fn with_test_hooks(svc: TenantService) -> anyhow::Result<TenantService> {
    Ok(svc)
}

/// Binds the socket, refusing to steal one a live daemon answers on.
async fn bind(socket: &Path) -> anyhow::Result<UnixListener> {
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("Cannot create {}", parent.display()))?;
    }
    if socket.exists() {
        if tokio::net::UnixStream::connect(socket).await.is_ok() {
            bail!(
                "Another tenantvmd answers on {}; stop it or pick another --socket",
                socket.display()
            );
        }
        std::fs::remove_file(socket)
            .with_context(|| format!("Cannot remove stale {}", socket.display()))?;
    }
    let listener = UnixListener::bind(socket)
        .with_context(|| format!("Cannot listen on {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// How long in-flight API requests get to finish after a stop signal.
const DRAIN_REQUESTS: Duration = Duration::from_secs(2);
/// How long running operations get to reach a point where they can stop.
const DRAIN_OPERATIONS: Duration = Duration::from_secs(2);

/// Runs the daemon until a signal stops it.
pub async fn run(args: DaemonArgs) -> anyhow::Result<()> {
    // Watched from the start: a signal during start-up stops the daemon the same way.
    let mut stop_signal = Box::pin(shutdown_signal()?);
    // Unwrapped disk keys pass through this process (create-disk, crypto-shred): no core
    // dumps and no ptrace by non-root users of the same uid.
    // SAFETY: prctl(PR_SET_DUMPABLE, 0) only changes this process's dumpable flag.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "cannot disable core dumps; set LimitCORE=0 in the unit"
        );
    }
    make_state_dir(&args.state_dir)?;
    let store = Arc::new(
        Store::open(&args.state_dir.join("state.db")).context("Cannot open the state store")?,
    );
    if let Some(path) = crate::auth::ensure_admin_token(&store, &args.state_dir)? {
        println!(
            "tenantvmd: admin token written to {} (mode 0600)",
            path.display()
        );
    }
    let backend = make_backend(&args)?;
    let cgroups = RuntimeConfig::detect()?.cgroups;
    let mut cfg = ServiceConfig::new(args.state_dir.clone());
    cfg.image_dir = args.image_dir.clone();
    cfg.uid_first = args.uid_range.0;
    cfg.uid_count = args.uid_range.1;
    cfg.stop_grace = Duration::from_secs(args.stop_grace_s);
    cfg.boot_timeout = Duration::from_secs(args.boot_timeout_s);
    cfg.agent_timeout = Duration::from_secs(args.agent_timeout_s);
    cfg.departure.kek = crate::keys::KekSource::detect(&args.kek_file);
    cfg.departure.keyslot_cost = match args.keyslot_cost {
        KeyslotCostArg::Production => crate::disk::KeyslotCost::PRODUCTION,
        KeyslotCostArg::Test => crate::disk::KeyslotCost::TEST,
    };
    let svc = TenantService::new(
        store,
        backend,
        Arc::new(cgroups),
        make_gpu(&args.gpu_backend)?,
        cfg,
    );
    let svc = with_test_hooks(svc)?;

    // The host KEK and the receipt signing key exist from initialisation on.
    svc.departure_kit()
        .context("Cannot set up disk keys and receipts")?;

    let listener = bind(&args.socket).await?;
    // Every live tenant is marked as recovering before the first request is served; the
    // recovery itself runs in the background, each tenant on its own thread.
    let plan = reconcile::plan(&svc).context("Cannot start recovery")?;
    let opts = ReconcileOptions {
        sweep_unknown_cgroups: !args.keep_unknown_cgroups,
    };
    let rsvc = svc.clone();
    svc.track(std::thread::spawn(move || {
        match reconcile::recover(&rsvc, plan, &opts) {
            Ok(report) => tracing::info!(?report, "recovered"),
            Err(e) => tracing::error!(error = %e, "recovery failed"),
        }
    }));

    println!("tenantvmd: serving on {}", args.socket.display());
    let housekeeper = tokio::spawn(housekeeping(svc.clone()));
    let app = crate::api::router(svc.clone());
    let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
    let mut server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = drain_rx.await;
            })
            .await
    });
    let served = tokio::select! {
        () = &mut stop_signal => None,
        ended = &mut server => Some(ended),
    };
    // Stopping: operations give up at their next wait; new connections are refused.
    svc.request_stop();
    housekeeper.abort();
    let served = match served {
        Some(ended) => ended,
        None => {
            let _ = drain_tx.send(());
            match tokio::time::timeout(DRAIN_REQUESTS, &mut server).await {
                Ok(ended) => ended,
                Err(_) => {
                    tracing::warn!(
                        "requests still in flight after {DRAIN_REQUESTS:?}; stopping without them"
                    );
                    server.abort();
                    Ok(Ok(()))
                }
            }
        }
    };
    let wsvc = svc.clone();
    let idle = tokio::task::spawn_blocking(move || wsvc.wait_idle_for(DRAIN_OPERATIONS)).await?;
    if !idle {
        tracing::warn!("operations still waiting on a guest or VMM after {DRAIN_OPERATIONS:?}; they resume at the next start");
    }
    let _ = std::fs::remove_file(&args.socket);
    served
        .context("API server task failed")?
        .context("API server failed")?;
    println!("tenantvmd: stopped (VMs keep running and are adopted at the next start)");
    Ok(())
}

/// Resolves at SIGTERM or SIGINT.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("Cannot watch SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("Cannot watch SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Every 2 s: notices VMs that ended on their own, and keeps running tenants' logs under
/// their caps.
async fn housekeeping(svc: TenantService) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tick.tick().await;
        let s = svc.clone();
        let _ = tokio::task::spawn_blocking(move || {
            match s.check_vms() {
                Ok(marked) if !marked.is_empty() => {
                    tracing::warn!(?marked, "tenants whose VM ended on its own are now failed")
                }
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e, "VM check failed"),
            }
            let root = s.config().state_dir.join("tenants");
            for t in s.store().list_tenants(false).unwrap_or_default() {
                if t.state != LifecycleState::Running {
                    continue;
                }
                let logs = crate::logs::TenantLogs::open(
                    &root,
                    &t.name,
                    crate::logs::LogPolicy::default(),
                );
                if let Err(e) = logs.and_then(|l| l.enforce_caps()) {
                    tracing::warn!(tenant = %t.name, error = %e, "log rotation failed");
                }
            }
        })
        .await;
    }
}
