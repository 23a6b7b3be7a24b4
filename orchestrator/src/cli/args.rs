//! The command line's grammar: [`Cli`] and its subcommands and arguments, with the
//! `--help` texts.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use super::{gpu_info, key, model, payload, top, verify};
use crate::api::types::LogStream;

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
