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
use tracing_subscriber::fmt::MakeWriter;

use crate::backend::qemu::{AgentTransport, VHOST_VSOCK_DEV};
use crate::backend::{
    runner::sibling_binary, QemuAccel, QemuBackend, RuntimeConfig, VmBackend, VmmBackend,
};
use crate::domain::lifecycle::LifecycleState;
use crate::gpu::{GpuHost, NoGpus};
use crate::reconcile::{self, ReconcileOptions};
use crate::store::Store;
use crate::tenant::service::{ServiceConfig, TenantService};
use crate::untrusted::LineSafeWriter;

/// The daemon's own log (stderr): one record per line whatever a record quotes. Guest text
/// reaches log fields (agent versions, guest errors); every record goes through
/// [`LineSafeWriter`], so a newline or escape sequence in a field is written escaped and can
/// neither forge a line nor drive a terminal. No ANSI colours (they would be escaped too).
pub fn log_subscriber<M>(make_writer: M) -> impl tracing::Subscriber + Send + Sync
where
    M: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TENANTVMD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(false)
        .with_writer(LineSafe(make_writer))
        .finish()
}

/// A [`MakeWriter`] whose writers keep each record on one line ([`LineSafeWriter`]).
struct LineSafe<M>(M);

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for LineSafe<M> {
    type Writer = LineSafeWriter<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        LineSafeWriter::new(self.0.make_writer())
    }
}

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

/// How the QEMU backends reach guest agents.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum AgentTransportArg {
    /// vhost-vsock where /dev/vhost-vsock opens, else virtio-serial (the default).
    Auto,
    /// vhost-vsock; the daemon refuses to start without /dev/vhost-vsock.
    VhostVsock,
    /// One virtio-serial port per VM, even where vhost-vsock exists.
    VirtioSerial,
}

/// tenantvmd: the tenantvm daemon.
///
/// On first start it creates the state directory (mode 0700) and an admin token in
/// `<state-dir>/admin.token` (mode 0600), which the `tenantvm` CLI reads. On every start it
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
    /// The root the sysfs that GPU devices are bound and handed to VMs through lies under.
    /// Default: `/` with `nvml`; none with `sim:FILE` (a simulated host hands over no
    /// device). With `sim:FILE`, `/` hands over the real devices at the simulated GPUs' PCI
    /// addresses (the nested test host passes QEMU's edu through as a whole card this way).
    #[arg(long, value_name = "ROOT")]
    pub gpu_sysfs_root: Option<PathBuf>,
    /// Directory of named guest images: `<dir>/<name>/kernel` (+ initramfs, cmdline).
    #[arg(long)]
    pub image_dir: Option<PathBuf>,
    /// The tenantvm-vmm binary (default: next to tenantvmd).
    #[arg(long)]
    pub vmm_binary: Option<PathBuf>,
    /// The QEMU binary for --backend qemu-*.
    #[arg(long, default_value = "/usr/bin/qemu-system-x86_64")]
    pub qemu_binary: PathBuf,
    /// How --backend qemu-* reaches guest agents: vhost-vsock (AF_VSOCK, one connection per
    /// request; needs /dev/vhost-vsock) or one virtio-serial port; auto picks vhost-vsock
    /// where /dev/vhost-vsock opens. `GET /v1/health` says which is in use.
    #[arg(long, value_enum, default_value = "auto")]
    pub qemu_agent_transport: AgentTransportArg,
    /// Uids handed to tenants, FIRST:COUNT (gid = uid).
    #[arg(long, default_value = "200000:65536", value_parser = parse_uid_range)]
    pub uid_range: (u32, u32),
    /// Seconds `stop` waits for a clean guest shutdown before killing.
    #[arg(long, default_value_t = 5)]
    pub stop_grace_s: u64,
    /// Seconds create/start wait for the VM to report running.
    #[arg(long, default_value_t = 30)]
    pub boot_timeout_s: u64,
    /// Seconds a newly launched VMM may take to answer on its control socket before it is
    /// killed and the launch fails (plus 10 s per GiB of guest RAM when devices are passed
    /// through, for pinning it). Raise it on a heavily loaded or emulated host (the nested
    /// test host uses 60).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub launch_timeout_s: u64,
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
    /// No longer needed, accepted and ignored: each daemon keeps its tenants' cgroups in a
    /// subtree of its own (`tenantvm/<hash of the state dir>/`), so its sweep of unknown
    /// cgroups never reaches another daemon's.
    #[arg(long, hide = true)]
    pub keep_unknown_cgroups: bool,
    /// Memory (MiB) kept for the host itself: tenants may reserve the rest of MemTotal,
    /// each its guest memory plus the VMM's overhead.
    #[arg(long, default_value_t = crate::tenant::admission::DEFAULT_HOST_RESERVED_MIB)]
    pub host_reserved_memory_mib: u64,
    /// Let tenants reserve up to RATIO times the memory left for them (1 = no overcommit,
    /// the default: a create the host cannot hold is refused).
    #[arg(long, value_name = "RATIO", default_value_t = 1.0, value_parser = parse_overcommit)]
    pub memory_overcommit: f64,
    /// Let tenants reserve up to RATIO vCPUs per host CPU (1 = no overcommit, the default).
    #[arg(long, value_name = "RATIO", default_value_t = 1.0, value_parser = parse_overcommit)]
    pub vcpu_overcommit: f64,
    /// Serve tenants' clients (the OpenAI-compatible front door, docs/frontdoor.md) on this
    /// TCP address, with TLS; needs --tls-cert and --tls-key.
    #[arg(long, value_name = "ADDR:PORT", requires_all = ["tls_cert", "tls_key"])]
    pub listen: Option<std::net::SocketAddr>,
    /// The front door's certificate chain (PEM).
    #[arg(long, value_name = "FILE", requires = "listen")]
    pub tls_cert: Option<PathBuf>,
    /// The front door's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "listen")]
    pub tls_key: Option<PathBuf>,
}

fn parse_overcommit(s: &str) -> Result<f64, String> {
    let r: f64 = s
        .parse()
        .map_err(|_| format!("expected a ratio such as 1.5, got {s:?}"))?;
    if !(1.0..=100.0).contains(&r) {
        return Err(format!(
            "the ratio must be between 1 (no overcommit) and 100, got {r}"
        ));
    }
    Ok(r)
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

/// The VM runtime, its cgroups scoped to this daemon's subtree
/// (`tenantvm/<hash of the state dir>/`, see [`crate::jail::cgroup::daemon_subtree`]).
fn runtime_config(state_dir: &Path) -> anyhow::Result<RuntimeConfig> {
    let mut config = RuntimeConfig::detect().context("Cannot set up the VM runtime")?;
    config.cgroups = config
        .cgroups
        .for_state_dir(state_dir)
        .context("Cannot name this daemon's cgroup subtree")?;
    Ok(config)
}

fn make_backend(args: &DaemonArgs) -> anyhow::Result<Arc<dyn VmBackend>> {
    let mut config = runtime_config(&args.state_dir)?;
    config.ready_timeout = Duration::from_secs(args.launch_timeout_s);
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
            qemu_agent_transport(args.qemu_agent_transport)?,
            config,
        )),
        BackendArg::QemuTcg => Arc::new(QemuBackend::new(
            args.qemu_binary.clone(),
            QemuAccel::Tcg,
            qemu_agent_transport(args.qemu_agent_transport)?,
            config,
        )),
    })
}

/// The QEMU backends' agent transport: detected (`auto`), or as asked when the host has it.
fn qemu_agent_transport(arg: AgentTransportArg) -> anyhow::Result<AgentTransport> {
    let (detected, why_not) = AgentTransport::detect(std::path::Path::new(VHOST_VSOCK_DEV));
    Ok(match arg {
        AgentTransportArg::VirtioSerial => AgentTransport::VirtioSerial,
        AgentTransportArg::VhostVsock if detected != AgentTransport::VhostVsock => {
            anyhow::bail!(
                "--qemu-agent-transport vhost-vsock: {}",
                why_not.unwrap_or_default()
            )
        }
        AgentTransportArg::VhostVsock => AgentTransport::VhostVsock,
        AgentTransportArg::Auto => {
            match &why_not {
                Some(reason) => {
                    tracing::warn!(%reason, "QEMU guests' agents are reached over one virtio-serial port each");
                }
                None => tracing::info!("QEMU guests' agents are reached over vhost-vsock"),
            }
            detected
        }
    })
}

fn make_gpu(spec: &str, sysfs_root: Option<&Path>) -> anyhow::Result<Arc<dyn GpuHost>> {
    match (spec, sysfs_root) {
        ("none", Some(root)) => anyhow::bail!(
            "--gpu-sysfs-root {} needs a GPU backend: add --gpu-backend nvml or sim:FILE, or drop --gpu-sysfs-root",
            root.display()
        ),
        ("none", None) => Ok(Arc::new(NoGpus)),
        (other, root) => crate::gpu::planner_from_arg(other, root),
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

/// The daemon's async runtime: two worker threads, and a small blocking pool for the
/// daemon's own housekeeping and start-up work (the API does not use it: see
/// [`crate::api`]).
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // Start-up and housekeeping work only: API requests run on threads of their own
        // under per-caller budgets (api/lanes.rs), so no tenant can fill this pool.
        .max_blocking_threads(16)
        .enable_all()
        .build()
}

/// A line on standard output for whoever started the daemon; a closed stdout (`| head`)
/// must not stop the daemon, so write errors are ignored.
fn announce(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

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
    // Descriptors: the front door sizes its connections from what this leaves
    // (frontdoor::DoorLimits), keeping a reserve for the admin API, the store and launches.
    match crate::fd_limit::raise_soft_limit() {
        Ok(l) => tracing::info!(
            was = l.was,
            soft = l.soft,
            hard = l.hard,
            "file descriptors (RLIMIT_NOFILE)"
        ),
        Err(e) => tracing::warn!(error = %e, "cannot read RLIMIT_NOFILE"),
    }
    make_state_dir(&args.state_dir)?;
    let store = Arc::new(
        Store::open(&args.state_dir.join("state.db")).context("Cannot open the state store")?,
    );
    if let Some(path) = crate::auth::ensure_admin_token(&store, &args.state_dir)? {
        announce(&format!(
            "tenantvmd: admin token written to {} (mode 0600)",
            path.display()
        ));
    }
    let backend = make_backend(&args)?;
    let cgroups = runtime_config(&args.state_dir)?.cgroups;
    tracing::info!(subtree = %cgroups.subtree().display(), "tenant cgroups");
    let own_cgroups = cgroups.clone();
    let mut cfg = ServiceConfig::new(args.state_dir.clone());
    cfg.image_dir = args.image_dir.clone();
    cfg.uid_first = args.uid_range.0;
    cfg.uid_count = args.uid_range.1;
    cfg.stop_grace = Duration::from_secs(args.stop_grace_s);
    cfg.boot_timeout = Duration::from_secs(args.boot_timeout_s);
    cfg.agent_timeout = Duration::from_secs(args.agent_timeout_s);
    if args.backend == BackendArg::QemuTcg {
        // TCG's translation cache lives in the VMM beside guest RAM: the VM's cgroup and
        // the host's admission count it, or a guest that uses all its RAM loses its VM.
        cfg.vmm_overhead_mib += tenantvm_vmm_api::qemu::TCG_TRANSLATION_CACHE_MIB;
    }
    cfg.capacity = crate::tenant::admission::HostCapacity::detect(args.host_reserved_memory_mib)
        .context("Cannot read this host's size from /proc/meminfo")?
        .with_overcommit(args.memory_overcommit, args.vcpu_overcommit);
    tracing::info!(
        memory_mib = cfg.capacity.memory_mib,
        cpus = cfg.capacity.cpus,
        memory_overcommit = cfg.capacity.memory_overcommit,
        vcpu_overcommit = cfg.capacity.vcpu_overcommit,
        "capacity for tenants"
    );
    cfg.departure.kek = crate::keys::KekSource::detect(&args.kek_file);
    cfg.departure.keyslot_cost = match args.keyslot_cost {
        KeyslotCostArg::Production => crate::disk::KeyslotCost::PRODUCTION,
        KeyslotCostArg::Test => crate::disk::KeyslotCost::TEST,
    };
    let svc = TenantService::new(
        store,
        backend,
        Arc::new(cgroups),
        make_gpu(&args.gpu_backend, args.gpu_sysfs_root.as_deref())?,
        cfg,
    );
    let svc = with_test_hooks(svc)?;

    // The host KEK and the receipt signing key exist from initialisation on.
    svc.departure_kit()
        .context("Cannot set up disk keys and receipts")?;

    if args.keep_unknown_cgroups {
        tracing::warn!(
            "--keep-unknown-cgroups is ignored: this daemon's cgroup subtree is its own, so the sweep of unknown cgroups never reaches another daemon's"
        );
    }

    // The front door's certificate and port are checked before anything is served.
    let front_door = match (&args.listen, &args.tls_cert, &args.tls_key) {
        (Some(addr), Some(cert), Some(key)) => Some((
            crate::frontdoor::tls_config(cert, key)?,
            crate::frontdoor::bind(*addr).await?,
        )),
        _ => None,
    };
    let listener = bind(&args.socket).await?;
    // Every live tenant is marked as recovering before the first request is served; the
    // recovery itself runs in the background, each tenant on its own thread.
    let plan = reconcile::plan(&svc).context("Cannot start recovery")?;
    let opts = ReconcileOptions {
        sweep_unknown_cgroups: true,
    };
    let rsvc = svc.clone();
    svc.track(std::thread::spawn(move || {
        match reconcile::recover(&rsvc, plan, &opts) {
            Ok(report) => tracing::info!(?report, "recovered"),
            Err(e) => tracing::error!(error = %e, "recovery failed"),
        }
    }));

    announce(&format!("tenantvmd: serving on {}", args.socket.display()));
    let housekeeper = tokio::spawn(housekeeping(svc.clone()));
    let (door_stop_tx, door_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let door = front_door.map(|(tls, tcp)| {
        if let Ok(addr) = tcp.local_addr() {
            announce(&format!("tenantvmd: front door on https://{addr}"));
        }
        tokio::spawn(crate::frontdoor::serve(tcp, tls, svc.clone(), async move {
            let _ = door_stop_rx.await;
        }))
    });
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
    // The front door takes no new connections; requests in flight end with their guests'.
    let _ = door_stop_tx.send(());
    if let Some(door) = door {
        let _ = tokio::time::timeout(DRAIN_REQUESTS, door).await;
    }
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
    // A daemon that leaves no tenant's VM behind leaves no empty subtree behind either.
    if idle {
        for dir in own_cgroups.remove_subtree_if_empty() {
            tracing::info!(dir = %dir.display(), "removed this daemon's empty cgroup subtree");
        }
    }
    served
        .context("API server task failed")?
        .context("API server failed")?;
    announce("tenantvmd: stopped (VMs keep running and are adopted at the next start)");
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

/// Every 2 s: [`housekeeping_pass`] off the async threads.
async fn housekeeping(svc: TenantService) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tick.tick().await;
        let s = svc.clone();
        let _ = tokio::task::spawn_blocking(move || housekeeping_pass(&s)).await;
    }
}

/// Notices VMs that ended on their own, and keeps every tenant's logs under their caps,
/// whatever its state: a guest writes its console while it boots (create waits minutes for
/// an agent), while it stops, while it departs, and a VMM may outlive its tenant's
/// `running` state. A departing tenant's logs are only emptied in place when over their
/// caps (its departure stops the VM, then removes the logs): housekeeping never creates a
/// file there, so it cannot leave one behind that removal.
pub fn housekeeping_pass(svc: &TenantService) {
    match svc.check_vms() {
        Ok(marked) if !marked.is_empty() => {
            tracing::warn!(?marked, "tenants whose VM ended on its own are now failed");
        }
        Ok(_) => {}
        Err(e) => tracing::error!(error = %e, "VM check failed"),
    }
    let root = svc.config().tenants_dir();
    for t in svc.store().list_tenants(false).unwrap_or_default() {
        let logs =
            crate::logs::TenantLogs::existing(&root, &t.name, crate::logs::LogPolicy::default());
        let departing = t.state == LifecycleState::Destroying;
        // No directory: nothing provisioned yet, or already removed; no logs to cap.
        let capped = logs.and_then(|l| match l {
            None => Ok(()),
            Some(l) if departing => l.truncate_over_caps().map(|_| ()),
            Some(l) => l.enforce_caps(),
        });
        if let Err(e) = capped {
            tracing::warn!(tenant = %t.name, error = %e, "log rotation failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A log sink the test can read back.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_gpu_sysfs_root_without_a_gpu_backend_is_refused() {
        let err = make_gpu("none", Some(Path::new("/")))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("--gpu-sysfs-root") && err.contains("--gpu-backend"),
            "{err}"
        );
        make_gpu("none", None).unwrap();
        // A flag the parser knows, next to --gpu-backend.
        let args = DaemonArgs::try_parse_from([
            "tenantvmd",
            "--gpu-backend",
            "sim:host.json",
            "--gpu-sysfs-root",
            "/",
        ])
        .unwrap();
        assert_eq!(args.gpu_sysfs_root.as_deref(), Some(Path::new("/")));
    }

    #[test]
    fn the_launch_timeout_is_ten_seconds_unless_raised_and_never_zero() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["tenantvmd"];
            argv.extend_from_slice(extra);
            DaemonArgs::try_parse_from(argv)
        };
        assert_eq!(parse(&[]).unwrap().launch_timeout_s, 10);
        assert_eq!(
            parse(&["--launch-timeout-s", "60"])
                .unwrap()
                .launch_timeout_s,
            60
        );
        // A VMM killed before it could answer at all, or waited on for hours: refused.
        parse(&["--launch-timeout-s", "0"]).unwrap_err();
        parse(&["--launch-timeout-s", "86400"]).unwrap_err();
    }

    #[test]
    fn logs_are_capped_in_every_tenant_state_not_only_running() {
        use crate::auth::Caller;
        use crate::domain::spec::TenantSpec;
        use crate::logs::{LogKind, LogPolicy, TenantLogs, DEFAULT_MAX_BYTES};
        use crate::tenant::fault::FaultHook;
        use crate::tenant::service::TenantCommand;
        use crate::tenant::test_utils::Harness;
        let h = Harness::new(FaultHook::default());
        for name in ["booting", "stopped"] {
            let spec =
                TenantSpec::from_toml(&format!("name = \"{name}\"\n[image]\nname = \"hello\"\n"))
                    .unwrap();
            h.svc
                .execute(&Caller::Admin, TenantCommand::Create(spec))
                .unwrap();
        }
        h.svc.wait_idle();
        h.svc
            .execute(&Caller::Admin, TenantCommand::Stop("stopped".into()))
            .unwrap();
        h.svc.wait_idle();
        // A guest still booting (its create waits for the agent for minutes) or a VMM that
        // outlived a stop keeps writing its console.
        let booting = h.svc.store().tenant("booting").unwrap().unwrap();
        h.svc
            .store()
            .transition(booting.id, LifecycleState::Stopping, Some("stop"), None)
            .unwrap();
        h.svc
            .store()
            .transition(booting.id, LifecycleState::Stopped, None, None)
            .unwrap();
        h.svc
            .store()
            .transition(
                booting.id,
                LifecycleState::Provisioning,
                Some("start"),
                None,
            )
            .unwrap();
        let root = h.svc.config().state_dir.join("tenants");
        for name in ["booting", "stopped"] {
            let logs = TenantLogs::open(&root, name, LogPolicy::default()).unwrap();
            let mut serial = logs.open_append(LogKind::Serial).unwrap();
            use std::io::Write;
            serial
                .write_all(&vec![b'x'; DEFAULT_MAX_BYTES as usize + 4096])
                .unwrap();
        }
        housekeeping_pass(&h.svc);
        for name in ["booting", "stopped"] {
            let size = std::fs::metadata(root.join(name).join("serial.log"))
                .unwrap()
                .len();
            assert!(
                size < DEFAULT_MAX_BYTES,
                "{name}'s serial.log is {size} bytes, over its cap"
            );
        }
    }

    #[test]
    fn housekeeping_never_recreates_what_a_departure_removes() {
        use crate::auth::Caller;
        use crate::domain::spec::TenantSpec;
        use crate::tenant::fault::FaultHook;
        use crate::tenant::service::TenantCommand;
        use crate::tenant::test_utils::Harness;
        let h = Harness::new(FaultHook::default());
        let spec =
            TenantSpec::from_toml("name = \"leaving\"\n[image]\nname = \"hello\"\n").unwrap();
        h.svc
            .execute(&Caller::Admin, TenantCommand::Create(spec))
            .unwrap();
        h.svc.wait_idle();
        let t = h.svc.store().tenant("leaving").unwrap().unwrap();
        h.svc
            .store()
            .transition(t.id, LifecycleState::Destroying, Some("destroy"), None)
            .unwrap();
        let dir = h.svc.config().tenant_dir("leaving");
        // remove-files has emptied the directory: housekeeping must not refill it.
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                std::fs::remove_dir_all(&path).unwrap();
            } else {
                std::fs::remove_file(&path).unwrap();
            }
        }
        housekeeping_pass(&h.svc);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        // While it departs, a guest that floods its console is still held to the cap (in
        // place: nothing new is made).
        use crate::logs::DEFAULT_MAX_BYTES;
        std::fs::write(
            dir.join("serial.log"),
            vec![b'x'; DEFAULT_MAX_BYTES as usize + 4096],
        )
        .unwrap();
        housekeeping_pass(&h.svc);
        let size = std::fs::metadata(dir.join("serial.log")).unwrap().len();
        assert!(
            size < DEFAULT_MAX_BYTES,
            "serial.log is {size} bytes while departing"
        );
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_file(dir.join("serial.log")).unwrap();
        // Nor is a tenant's directory created by housekeeping.
        std::fs::remove_dir(&dir).unwrap();
        h.svc
            .store()
            .transition(t.id, LifecycleState::Failed, None, Some("x"))
            .unwrap();
        housekeeping_pass(&h.svc);
        assert!(!dir.exists());
    }

    #[test]
    fn guest_text_in_a_log_field_cannot_forge_a_daemon_log_line() {
        let sink = Captured::default();
        let writer = sink.clone();
        let subscriber = log_subscriber(move || writer.clone());
        tracing::subscriber::with_default(subscriber, || {
            let agent_version = "1.0\n2026-01-01T00:00:00Z  INFO crypto-shred ok verified\x1b[2K";
            tracing::info!(tenant = "mallory", agent = %agent_version, "guest agent ready");
            tracing::warn!(error = %"payload said:\r\nFORGED", "the guest agent did not shut down cleanly");
        });
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].contains("guest agent ready"), "{text}");
        assert!(!text.contains('\x1b') && !text.contains('\r'), "{text:?}");
        assert!(
            !lines
                .iter()
                .any(|l| l.contains("INFO crypto-shred") && !l.contains("agent=")),
            "{text}"
        );
    }
}
