//! The `tenantvm` command line: a thin client of tenantvmd's API (see [`crate::client`]).
//! The binary only parses arguments and calls [`run`].

mod gpu_info;
mod key;
mod model;
mod output;
mod payload;
mod progress;
mod top;
mod verify;

use progress::{logs, op, wait_for};

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::api::types::LogStream;
use crate::client::{Client, ClientError};
use crate::domain::spec::{GpuRequest, GuestImage, Quotas, TenantSpec};
use crate::domain::TenantName;

/// Exit statuses of `tenantvm` (docs/orchestrator.md lists them too).
pub mod exit {
    /// Success.
    pub const OK: u8 = 0;
    /// Any other failure (I/O, a bad answer).
    pub const OTHER: u8 = 1;
    /// Bad command line (clap's own status).
    pub const USAGE: u8 = 2;
    /// The daemon cannot be reached.
    pub const UNREACHABLE: u8 = 3;
    /// The token was refused (missing, unknown, revoked).
    pub const UNAUTHORIZED: u8 = 4;
    /// No such tenant (or not yours).
    pub const NOT_FOUND: u8 = 5;
    /// Conflict: the name is taken, the tenant is busy or in the wrong state.
    pub const CONFLICT: u8 = 6;
    /// The request was refused as invalid (spec, image, GPU request, size).
    pub const INVALID: u8 = 7;
    /// The operation ran and failed (the tenant is `failed`) or timed out.
    pub const OP_FAILED: u8 = 8;
    /// The daemon hit an internal error.
    pub const DAEMON_ERROR: u8 = 9;
    /// Forbidden: this token may not do that (e.g. a tenant token creating tenants).
    pub const FORBIDDEN: u8 = 10;
    /// `plan`: the tenants do not all fit on the host.
    pub const NO_FIT: u8 = 11;
    /// `host check`: at least one check failed.
    pub const HOST_CHECK_FAILED: u8 = 12;
    /// Over the tenant's request rate or concurrency (429): retry later.
    pub const QUOTA: u8 = 13;
    /// The tenant's disk has no room for it (507, `model push`).
    pub const NO_SPACE: u8 = 15;
    /// `gpu-info`: the guest's view of its GPU does not match what it was given.
    pub const GPU_MISMATCH: u8 = 16;
    /// Whoever read the output went away (`tenantvm ... | head`): the command stopped
    /// quietly, with the status of a command killed by SIGPIPE (128 + 13).
    pub const BROKEN_PIPE: u8 = 141;
}

const DEFAULT_SOCKET: &str = "/run/tenantvm/tenantvmd.sock";
const DEFAULT_TOKEN_FILE: &str = "/var/lib/tenantvm/admin.token";

/// tenantvm: run untrusted tenants in their own KVM VMs on this host.
///
/// Talks to the tenantvmd daemon over its Unix socket. Start the daemon first
/// (`tenantvmd --state-dir /var/lib/tenantvm`); it writes the admin token to
/// `<state-dir>/admin.token`, which this tool reads by default.
///
/// Examples:
///   tenantvm create alice.toml            # spec from a TOML file (see docs/orchestrator.md)
///   tenantvm create --name bob --image hello --memory-mib 64
///   tenantvm list
///   tenantvm logs alice --follow
///   tenantvm destroy bob
///
///   tenantvm plan -t tenants.toml --gpu h100-80gb --count 2   # GPU sizing, no daemon needed
///   tenantvm host check                                       # host preflight
///
/// Exit statuses: 0 ok, 1 other error, 2 usage, 3 daemon unreachable, 4 token refused,
/// 5 no such tenant, 6 conflict (name taken, busy, wrong state), 7 invalid request,
/// 8 operation failed, 9 daemon error, 10 forbidden, 11 plan does not fit,
/// 12 host check failed, 13 over the tenant's request rate or concurrency (retry later),
/// 14 `verify`: a check failed or was inconclusive, 15 no room on the tenant's disk (`model push`),
/// 16 `gpu-info`: the guest's view of its GPU does not match its assignment,
/// 141 the reader of the output went away (`| head`), quietly.
#[derive(Debug, Parser)]
#[command(name = "tenantvm", version, verbatim_doc_comment)]
pub struct Cli {
    /// The daemon's socket.
    #[arg(long, global = true, env = "TENANTVM_SOCKET", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// API token (admin or tenant). Prefer --token-file: arguments are visible to other users.
    #[arg(long, global = true, env = "TENANTVM_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// File holding the token.
    #[arg(long, global = true, env = "TENANTVM_TOKEN_FILE", default_value = DEFAULT_TOKEN_FILE)]
    pub token_file: PathBuf,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a tenant from a TOML spec file or from flags, and wait until it runs.
    Create(CreateArgs),
    /// List tenants (a tenant token sees only its own).
    List(ReadArgs),
    /// Show a tenant: state, the steps of its current operation, uid, pid, GPU.
    Status {
        /// Tenant name.
        name: String,
        #[command(flatten)]
        read: ReadArgs,
    },
    /// Print a tenant's serial console, VMM log or lifecycle events.
    Logs(LogsArgs),
    /// Send a prompt to a tenant's inference server (a guest image's payload) and print
    /// the completion. Held to the tenant's requests_per_s and max_concurrency: over
    /// either, exit 13 with the time to retry after.
    Infer(InferArgs),
    /// Stop a tenant's VM (clean shutdown, killed after a grace period); keeps its resources.
    Stop(OpArgs),
    /// Boot a stopped tenant's VM again.
    Start(OpArgs),
    /// Destroy a tenant: stop its VM, reset and scrub its GPU, crypto-shred its disk, remove its
    /// logs, release its uid, cgroup and GPU share, revoke its token, and append a signed
    /// receipt to the audit log. If a step fails the tenant stays `destroying`; run destroy
    /// again to resume.
    Destroy(OpArgs),
    /// Departure receipts.
    #[command(subcommand)]
    Receipt(ReceiptCommand),
    /// GPU slices: the quarantine of slices whose scrub did not verify.
    #[command(subcommand)]
    Gpu(GpuCommand),
    /// Size tenants' GPU needs and place them on a host (live, simulated or hypothetical).
    /// Runs locally; needs no daemon.
    Plan(tenantvm_gpu::cli::PlanArgs),
    /// Inference keys for the front door: `key create|list|revoke TENANT`.
    #[command(subcommand)]
    Key(key::KeyCommand),
    /// A tenant's own models on its encrypted disk: `model push|list|rm TENANT`.
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// A tenant's inference server in its guest: `payload restart TENANT`.
    #[command(subcommand)]
    Payload(payload::PayloadCommand),
    /// Per-tenant metrics as a live table (admin: every tenant; a tenant token: its own).
    Top(top::TopArgs),
    // Its help is VerifyArgs' own (a man page: the checks, probes, report, exit statuses).
    Verify(Box<verify::VerifyArgs>),
    // Its help is GpuInfoArgs' own (what is compared, the tolerance, exit statuses).
    GpuInfo(gpu_info::GpuInfoArgs),
    /// Inspect this host.
    Host {
        /// What to do.
        #[command(subcommand)]
        command: HostCommand,
    },
}

/// `tenantvm receipt ...`.
#[derive(Debug, Subcommand)]
pub enum ReceiptCommand {
    /// Show departure receipts through the daemon (admin: all or TENANT's; a tenant token:
    /// its own).
    Show {
        /// Only this tenant's receipts.
        tenant: Option<String>,
        /// Print the audit log entries as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Verify the audit log's hash chain, signatures and head, reading the files directly
    /// (run on the host, as root). Exit status 1 when anything was edited, removed or
    /// reordered.
    Verify(crate::receipt::ReceiptVerifyArgs),
}

/// `tenantvm gpu ...`.
#[derive(Debug, Subcommand)]
pub enum GpuCommand {
    /// List quarantined GPU slices (admin).
    Quarantine {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Re-run the scrub of a quarantined slice, `<gpu>/<label>` as `gpu quarantine` lists it;
    /// the quarantine is lifted only if the scrub passes (admin).
    Scrub {
        /// The slice, e.g. `1/1g.18gb@0`.
        slice: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Scrub one CUDA device in this process (what the daemon runs as a child, with
    /// CUDA_VISIBLE_DEVICES set to the device's UUID).
    #[command(hide = true)]
    ScrubDevice(crate::gpu::scrub::ScrubArgs),
}

/// `tenantvm host` subcommands.
#[derive(Debug, Subcommand)]
pub enum HostCommand {
    /// Preflight: IOMMU, VFIO, KVM, cgroups, GPUs and their drivers. Runs locally.
    Check(tenantvm_gpu::cli::HostCheckArgs),
}

/// `tenantvm infer`.
#[derive(Debug, Args)]
pub struct InferArgs {
    /// Tenant name.
    pub name: String,
    /// The prompt.
    pub prompt: String,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// Sampling temperature (0 = greedy, deterministic).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Print the server's whole JSON answer.
    #[arg(long)]
    pub json: bool,
}

/// Flags of read commands.
#[derive(Debug, Args, Default)]
pub struct ReadArgs {
    /// Print JSON (the API's own body) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Flags of stop/start/destroy.
#[derive(Debug, Args)]
pub struct OpArgs {
    /// Tenant name.
    pub name: String,
    /// Return at once instead of waiting for the operation to finish.
    #[arg(long)]
    pub no_wait: bool,
    /// Give up waiting after this many seconds (exit 8).
    #[arg(long, default_value_t = 120)]
    pub timeout_s: u64,
    /// Print the final tenant as JSON.
    #[arg(long)]
    pub json: bool,
}

/// GPU request on the command line.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum GpuKind {
    /// No GPU.
    None,
    /// A whole GPU (needs --gpu-backend on the daemon).
    Whole,
    /// A MIG instance (give --mig-profile).
    Mig,
    /// Sized from a model preset (give --model).
    Model,
}

/// Flags of `create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// A TOML spec file (flags below are then not allowed). See docs/orchestrator.md.
    #[arg(conflicts_with_all = ["name", "image", "kernel"])]
    pub spec_file: Option<PathBuf>,
    /// Tenant name: 1-63 of a-z, 0-9, '-', starting with a letter or digit.
    #[arg(long)]
    pub name: Option<String>,
    /// vCPUs.
    #[arg(long, default_value_t = 1)]
    pub vcpus: u32,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    pub memory_mib: u32,
    /// Disk size in GiB (0: none).
    #[arg(long, default_value_t = 0)]
    pub disk_gib: u32,
    /// GPU share.
    #[arg(long, value_enum, default_value_t = GpuKind::None)]
    pub gpu: GpuKind,
    /// MIG profile for --gpu mig (e.g. 1g.10gb).
    #[arg(long)]
    pub mig_profile: Option<String>,
    /// Model preset for --gpu model (e.g. llama-3-8b).
    #[arg(long)]
    pub model: Option<String>,
    /// A named image from the daemon's --image-dir.
    #[arg(long, conflicts_with = "kernel")]
    pub image: Option<String>,
    /// Host path of a guest kernel (instead of --image).
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Host path of an initramfs.
    #[arg(long)]
    pub initramfs: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long)]
    pub cmdline: Option<String>,
    /// NVIDIA's client configuration token for the tenant's vGPU (a
    /// `client_configuration_token_*.tok` file): sent in the create request, sealed by the
    /// daemon, installed in the guest; never stored or shown. Works with a spec file too.
    #[arg(long, value_name = "FILE")]
    pub vgpu_licence: Option<PathBuf>,
    /// Write the tenant's token here (mode 0600) instead of printing it.
    #[arg(long)]
    pub token_out: Option<PathBuf>,
    /// Return once recorded instead of waiting until the VM runs.
    #[arg(long)]
    pub no_wait: bool,
    /// Give up waiting after this many seconds (exit 8).
    #[arg(long, default_value_t = 120)]
    pub timeout_s: u64,
    /// Print the API's answer as JSON (includes the token).
    #[arg(long)]
    pub json: bool,
}

/// Flags of `logs`.
#[derive(Debug, Args)]
pub struct LogsArgs {
    /// Tenant name.
    pub name: String,
    /// Which log.
    #[arg(long, value_enum, default_value_t = StreamArg::Serial)]
    pub stream: StreamArg,
    /// How many lines (or events) from the end.
    #[arg(long, default_value_t = 100)]
    pub tail: u64,
    /// Keep printing new output until interrupted.
    #[arg(long, short)]
    pub follow: bool,
    /// Print each chunk as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `--stream` values.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum StreamArg {
    /// The guest's serial console.
    Serial,
    /// The VMM's own log.
    Vmm,
    /// Lifecycle events.
    Events,
}

impl From<StreamArg> for LogStream {
    fn from(s: StreamArg) -> Self {
        match s {
            StreamArg::Serial => LogStream::Serial,
            StreamArg::Vmm => LogStream::Vmm,
            StreamArg::Events => LogStream::Events,
        }
    }
}

/// A failure with its exit status.
#[derive(Debug)]
pub struct CliFailure {
    /// Exit status.
    pub code: u8,
    /// What to print (nothing when empty).
    pub message: String,
}

impl CliFailure {
    /// The reader of the output went away: stop quietly.
    fn broken_pipe() -> Self {
        CliFailure {
            code: exit::BROKEN_PIPE,
            message: String::new(),
        }
    }
}

/// Whether `e` or one of its sources is a write to a pipe nobody reads any more.
fn is_broken_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::BrokenPipe {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

impl From<std::io::Error> for CliFailure {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return CliFailure::broken_pipe();
        }
        fail(exit::OTHER, format!("Cannot write the output: {e}"))
    }
}

impl From<crate::receipt::ReceiptError> for CliFailure {
    fn from(e: crate::receipt::ReceiptError) -> Self {
        if is_broken_pipe(&e) {
            return CliFailure::broken_pipe();
        }
        fail(exit::OTHER, e.to_string())
    }
}

impl From<ClientError> for CliFailure {
    fn from(e: ClientError) -> Self {
        let code = match &e {
            ClientError::Connect { .. } => exit::UNREACHABLE,
            ClientError::Api { status, .. } | ClientError::Decode { status, .. } => {
                match status.as_u16() {
                    401 => exit::UNAUTHORIZED,
                    403 => exit::FORBIDDEN,
                    404 => exit::NOT_FOUND,
                    409 => exit::CONFLICT,
                    429 => exit::QUOTA,
                    400 | 411 | 413 | 415 | 422 => exit::INVALID,
                    507 => exit::NO_SPACE,
                    500..=599 => exit::DAEMON_ERROR,
                    _ => exit::OTHER,
                }
            }
            ClientError::Http(_) => exit::OTHER,
        };
        // The daemon's messages may quote guests (agent and payload errors): one line.
        CliFailure {
            code,
            message: crate::untrusted::one_line(&e.to_string()),
        }
    }
}

fn fail(code: u8, message: impl Into<String>) -> CliFailure {
    CliFailure {
        code,
        message: message.into(),
    }
}

/// Builds the spec of `create` from a file or the flags, with `--vgpu-licence`'s token.
pub fn spec_from_args(a: &CreateArgs) -> Result<TenantSpec, CliFailure> {
    let mut spec = base_spec(a)?;
    if let Some(path) = &a.vgpu_licence {
        let cap = crate::domain::licence::MAX_VGPU_LICENCE_BYTES as u64 + 1;
        let mut text = zeroize::Zeroizing::new(String::new());
        std::fs::File::open(path)
            .and_then(|f| {
                std::io::Read::read_to_string(&mut std::io::Read::take(f, cap), &mut text)
            })
            .map_err(|e| {
                fail(
                    exit::INVALID,
                    format!("Cannot read the vGPU licence token {}: {e}", path.display()),
                )
            })?;
        let licence = crate::domain::licence::VgpuLicence::new(&text)
            .map_err(|e| fail(exit::INVALID, format!("{}: {e}", path.display())))?;
        spec.vgpu_licence = Some(licence);
        spec.validate()
            .map_err(|e| fail(exit::INVALID, e.to_string()))?;
    }
    Ok(spec)
}

fn base_spec(a: &CreateArgs) -> Result<TenantSpec, CliFailure> {
    if let Some(path) = &a.spec_file {
        let text = std::fs::read_to_string(path).map_err(|e| {
            fail(
                exit::INVALID,
                format!("Cannot read {}: {e}", path.display()),
            )
        })?;
        return TenantSpec::from_toml(&text)
            .map_err(|e| fail(exit::INVALID, format!("{}: {e}", path.display())));
    }
    let name = a.name.clone().ok_or_else(|| {
        fail(
            exit::INVALID,
            "Give a spec file (tenantvm create alice.toml) or at least --name and --image/--kernel",
        )
    })?;
    let gpu = match a.gpu {
        GpuKind::None => GpuRequest::default(),
        GpuKind::Whole => GpuRequest {
            whole_gpu: true,
            ..Default::default()
        },
        GpuKind::Mig => GpuRequest {
            profile: Some(a.mig_profile.clone().ok_or_else(|| {
                fail(
                    exit::INVALID,
                    "--gpu mig needs --mig-profile (e.g. 1g.10gb)",
                )
            })?),
            ..Default::default()
        },
        GpuKind::Model => GpuRequest {
            model: Some(a.model.clone().ok_or_else(|| {
                fail(exit::INVALID, "--gpu model needs --model (e.g. llama-3-8b)")
            })?),
            ..Default::default()
        },
    };
    let name = TenantName::new(name).map_err(|e| fail(exit::INVALID, e.to_string()))?;
    let spec = TenantSpec {
        name,
        vcpus: a.vcpus,
        memory_mib: a.memory_mib,
        disk_gib: a.disk_gib,
        gpu,
        image: GuestImage {
            name: a.image.clone(),
            kernel: a.kernel.clone(),
            initramfs: a.initramfs.clone(),
            cmdline: a.cmdline.clone(),
        },
        quotas: Quotas::default(),
        hugepages: None,
        vgpu_licence: None,
    };
    spec.validate()
        .map_err(|e| fail(exit::INVALID, e.to_string()))?;
    Ok(spec)
}

fn read_token(cli: &Cli) -> Result<String, CliFailure> {
    if let Some(t) = &cli.token {
        return Ok(t.trim().to_string());
    }
    read_token_file(&cli.token_file)
}

fn read_token_file(path: &Path) -> Result<String, CliFailure> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| {
            fail(
                exit::UNAUTHORIZED,
                format!(
                    "Cannot read the token file {}: {e}. Pass --token-file (the daemon writes <state-dir>/admin.token) or set TENANTVM_TOKEN",
                    path.display()
                ),
            )
        })
}

/// Runs a parsed command line on standard output and error; returns the exit status.
pub async fn run(cli: Cli) -> u8 {
    run_with(cli, &mut std::io::stdout(), &mut std::io::stderr()).await
}

/// Runs a parsed command line, printing results to `out` and progress and errors to `err`;
/// returns the exit status. A closed `out` (or `err`) ends the command quietly with
/// [`exit::BROKEN_PIPE`].
pub async fn run_with(cli: Cli, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    match run_inner(cli, out, err).await {
        Ok(()) => exit::OK,
        Err(f) => {
            if !f.message.is_empty() {
                // Nothing more can be said if standard error is gone too.
                let _ = writeln!(err, "tenantvm: {}", f.message);
            }
            f.code
        }
    }
}

fn gpu_failure(e: tenantvm_gpu::cli::GpuCliError) -> CliFailure {
    use tenantvm_gpu::cli::GpuCliError as G;
    if is_broken_pipe(&e) {
        return CliFailure::broken_pipe();
    }
    let code = match e {
        G::Usage(_) | G::Tenants(_) | G::Database(_) | G::MigParted(_) => exit::INVALID,
        _ => exit::OTHER,
    };
    fail(code, e.to_string())
}

fn plan(args: &tenantvm_gpu::cli::PlanArgs, out: &mut dyn Write) -> Result<(), CliFailure> {
    let report = tenantvm_gpu::cli::run_plan(args, out).map_err(gpu_failure)?;
    if report.fits {
        Ok(())
    } else {
        Err(fail(
            exit::NO_FIT,
            "the tenants do not all fit (see the report above)",
        ))
    }
}

fn host_check(
    args: &tenantvm_gpu::cli::HostCheckArgs,
    out: &mut dyn Write,
) -> Result<(), CliFailure> {
    let results = tenantvm_gpu::cli::run_host_check(args, out).map_err(gpu_failure)?;
    if tenantvm_gpu::cli::host_ok(&results) {
        Ok(())
    } else {
        Err(fail(
            exit::HOST_CHECK_FAILED,
            "host check found failures (see above)",
        ))
    }
}

async fn run_inner(cli: Cli, out: &mut dyn Write, err: &mut dyn Write) -> Result<(), CliFailure> {
    // Commands that read local files only, and need no daemon or token.
    match &cli.command {
        Command::Receipt(ReceiptCommand::Verify(args)) => {
            return crate::receipt::run_verify(args, out)
                .map(|_| ())
                .map_err(CliFailure::from);
        }
        Command::Gpu(GpuCommand::ScrubDevice(args)) => {
            return crate::gpu::scrub::run_scrub(args, out)
                .map(|_| ())
                .map_err(|e| {
                    if is_broken_pipe(&e) {
                        CliFailure::broken_pipe()
                    } else {
                        fail(exit::OTHER, e.to_string())
                    }
                });
        }
        // GPU planning and the host preflight run locally, without the daemon or a token.
        Command::Plan(args) => return plan(args, out),
        Command::Host {
            command: HostCommand::Check(args),
        } => return host_check(args, out),
        Command::Verify(a) => {
            return verify::run(a, cli.socket.clone(), read_token(&cli)?, out, err).await
        }
        _ => {}
    }
    // Validate local input before looking for a token, so a bad spec says so first.
    let spec = match &cli.command {
        Command::Create(a) => Some(spec_from_args(a)?),
        _ => None,
    };
    // The new tenant's token exists once: where it goes is checked before it is made.
    if let Command::Create(a) = &cli.command {
        if let Some(path) = &a.token_out {
            crate::keys::check_secret_path(path).map_err(|e| {
                fail(
                    exit::INVALID,
                    format!(
                        "Cannot write the token to {}: {e}; nothing was created",
                        path.display()
                    ),
                )
            })?;
        }
    }
    let token = read_token(&cli)?;
    let client = Client::new(cli.socket.clone(), token.clone());
    match cli.command {
        Command::Create(a) => {
            let spec = spec.expect("parsed above");
            let created = client.create(&spec).await?;
            if let Some(path) = &a.token_out {
                if let Err(e) = output::write_secret(path, &created.token) {
                    // Never dropped: shown here, once, as without --token-out.
                    writeln!(
                        err,
                        "tenant {}: cannot write its token to {} ({e}); here it is (shown once; keep it secret):",
                        spec.name,
                        path.display()
                    )?;
                    writeln!(out, "{}", created.token)?;
                    return Err(fail(
                        exit::OTHER,
                        format!(
                            "tenant {} was created but its token could not be written to {}: it was printed instead",
                            spec.name,
                            path.display()
                        ),
                    ));
                }
            }
            if a.json {
                output::print_json(out, &created)?;
            } else {
                match &a.token_out {
                    Some(p) => writeln!(
                        err,
                        "tenant {}: token written to {}",
                        spec.name,
                        p.display()
                    )?,
                    None => {
                        writeln!(
                            err,
                            "tenant {}: its token (shown once; keep it secret):",
                            spec.name
                        )?;
                        writeln!(out, "{}", created.token)?;
                    }
                }
            }
            if !a.no_wait {
                let progress = (!a.json).then_some(&mut *err);
                wait_for(&client, &spec.name, "create", a.timeout_s, progress).await?;
            }
            Ok(())
        }
        Command::List(r) => {
            let list = client.list().await?;
            if r.json {
                output::print_json(out, &list)?;
            } else {
                output::print_table(out, &list.tenants)?;
            }
            Ok(())
        }
        Command::Status { name, read } => {
            let t = client.status(&name).await?;
            if read.json {
                output::print_json(out, &t)?;
            } else {
                output::print_status(out, &t)?;
            }
            Ok(())
        }
        Command::Logs(a) => logs(&client, a, out, err).await,
        Command::Infer(a) => {
            let answer = client
                .infer(
                    &a.name,
                    &serde_json::json!({
                        "prompt": a.prompt,
                        "max_tokens": a.max_tokens,
                        "temperature": a.temperature,
                    }),
                )
                .await?;
            if a.json {
                output::print_json(out, &answer)?;
            } else {
                let text = answer["choices"][0]["text"].as_str().ok_or_else(|| {
                    fail(
                        exit::OTHER,
                        "the inference server's answer has no choices[0].text; rerun with --json",
                    )
                })?;
                // Guest output is hostile: no terminal control characters.
                output::print_guest_text(out, text)?;
                writeln!(out)?;
            }
            Ok(())
        }
        Command::Key(k) => key::run(&client, k, out, err).await,
        Command::Top(a) => top::run(&client, a, out).await,
        Command::GpuInfo(a) => gpu_info::run(&client, a, out).await,
        Command::Model(m) => model::run(&client, &token, m, out).await,
        Command::Payload(p) => payload::run(&client, p, out).await,
        Command::Stop(a) => op(&client, a, "stop", out, err).await,
        Command::Start(a) => op(&client, a, "start", out, err).await,
        Command::Destroy(a) => op(&client, a, "destroy", out, err).await,
        Command::Receipt(ReceiptCommand::Show { tenant, json }) => {
            let list = client.receipts(tenant.as_deref()).await?;
            if json {
                output::print_json(out, &list)?;
            } else {
                output::print_receipts(out, &list.receipts)?;
            }
            Ok(())
        }
        Command::Gpu(GpuCommand::Quarantine { json }) => {
            let list = client.quarantine().await?;
            if json {
                output::print_json(out, &list)?;
            } else {
                output::print_quarantine(out, &list.slices)?;
            }
            Ok(())
        }
        Command::Gpu(GpuCommand::Scrub { slice, json }) => {
            let done = client.rescrub(&slice).await?;
            let shown = crate::untrusted::one_line(&done.slice);
            if json {
                output::print_json(out, &done)?;
            } else {
                writeln!(
                    out,
                    "{shown}: scrub {} ({:?}); quarantine {}",
                    if done.scrub.passed {
                        "passed"
                    } else {
                        "FAILED"
                    },
                    done.scrub.assurance,
                    if done.lifted { "lifted" } else { "kept" }
                )?;
            }
            if done.scrub.passed {
                Ok(())
            } else {
                Err(fail(
                    exit::OP_FAILED,
                    format!("the scrub of {shown} did not pass; the slice stays quarantined"),
                ))
            }
        }
        Command::Receipt(ReceiptCommand::Verify(_)) | Command::Gpu(GpuCommand::ScrubDevice(_)) => {
            Err(fail(exit::OTHER, "local command reached the client"))
        }
        Command::Plan(_) | Command::Host { .. } | Command::Verify(_) => Ok(()), // returned above
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("tenantvm").chain(args.iter().copied()))
    }

    #[test]
    fn create_flags_build_a_valid_spec() {
        let cli = parse(&[
            "create",
            "--name",
            "bob",
            "--image",
            "hello",
            "--gpu",
            "mig",
            "--mig-profile",
            "1g.10gb",
        ])
        .unwrap();
        let Command::Create(a) = cli.command else {
            panic!()
        };
        let spec = spec_from_args(&a).unwrap();
        assert_eq!(spec.name, "bob");
        assert_eq!(
            spec.gpu,
            GpuRequest {
                profile: Some("1g.10gb".into()),
                ..Default::default()
            }
        );
    }

    #[test]
    fn create_flags_are_checked_locally() {
        for args in [
            vec!["create", "--name", "../x", "--image", "hello"],
            vec!["create", "--name", "bob"],
            vec![
                "create", "--name", "bob", "--image", "hello", "--gpu", "mig",
            ],
            vec!["create", "--image", "hello"],
        ] {
            let cli = parse(&args).unwrap();
            let Command::Create(a) = cli.command else {
                panic!()
            };
            let err = spec_from_args(&a).unwrap_err();
            assert_eq!(err.code, exit::INVALID, "{args:?}: {}", err.message);
        }
    }

    #[test]
    fn a_vgpu_licence_file_goes_into_the_request_and_nowhere_into_messages() {
        let dir = tempfile::tempdir().unwrap();
        let tok = dir.path().join("client_configuration_token_01.tok");
        std::fs::write(&tok, "eyJ.cli-licence-secret.sig\n").unwrap();
        let tok_arg = tok.to_str().unwrap();
        let cli = parse(&[
            "create",
            "--name",
            "bob",
            "--image",
            "hello",
            "--gpu",
            "whole",
            "--vgpu-licence",
            tok_arg,
        ])
        .unwrap();
        let Command::Create(a) = cli.command else {
            panic!()
        };
        let spec = spec_from_args(&a).unwrap();
        let sent = serde_json::to_string(&spec).unwrap();
        assert!(
            sent.contains("cli-licence-secret"),
            "the request carries it"
        );
        assert!(!format!("{spec:?}").contains("cli-licence-secret"));
        // Without a GPU share, refused here, without quoting the token.
        let cli = parse(&[
            "create",
            "--name",
            "bob",
            "--image",
            "hello",
            "--vgpu-licence",
            tok_arg,
        ])
        .unwrap();
        let Command::Create(a) = cli.command else {
            panic!()
        };
        let err = spec_from_args(&a).unwrap_err();
        assert_eq!(err.code, exit::INVALID);
        assert!(err.message.contains("vgpu_licence"), "{}", err.message);
        assert!(!err.message.contains("cli-licence-secret"));
    }

    #[test]
    fn a_token_out_path_that_cannot_be_written_is_refused_before_anything_is_created() {
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let socket = dir.path().join("no-daemon.sock");
        let create = |token_out: &std::path::Path| -> (u8, String) {
            let cli = parse(&[
                "--socket",
                socket.to_str().unwrap(),
                "--token",
                "x",
                "create",
                "--name",
                "bob",
                "--image",
                "hello",
                "--token-out",
                token_out.to_str().unwrap(),
            ])
            .unwrap();
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let code = rt.block_on(run_with(cli, &mut out, &mut err));
            (code, String::from_utf8_lossy(&err).into_owned())
        };
        // No such directory: refused before the daemon is asked (there is none here).
        let (code, text) = create(&dir.path().join("missing/t.token"));
        assert_eq!(code, exit::INVALID, "{text}");
        assert!(text.contains("nothing was created"), "{text}");
        // A directory in the way, and a symbolic link, likewise.
        let (code, _) = create(dir.path());
        assert_eq!(code, exit::INVALID);
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("link")).unwrap();
        let (code, _) = create(&dir.path().join("link"));
        assert_eq!(code, exit::INVALID);
        // The control: a writable path goes on to the daemon (unreachable here), and the
        // check leaves nothing behind.
        let (code, text) = create(&dir.path().join("t.token"));
        assert_eq!(code, exit::UNREACHABLE, "{text}");
        let mut left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        left.sort();
        assert_eq!(left, ["link"]);
    }

    #[test]
    fn spec_file_and_flags_conflict() {
        parse(&["create", "a.toml", "--name", "x"]).unwrap_err();
    }

    #[test]
    fn http_statuses_map_to_distinct_exit_codes() {
        let codes: Vec<u8> = [401u16, 403, 404, 409, 400, 500]
            .iter()
            .map(|s| {
                CliFailure::from(ClientError::Api {
                    status: hyper::StatusCode::from_u16(*s).unwrap(),
                    code: String::new(),
                    message: String::new(),
                })
                .code
            })
            .collect();
        assert_eq!(codes, vec![4, 10, 5, 6, 7, 9]);
    }
}
