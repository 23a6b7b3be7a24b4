//! `tenantvm-node`: the node agent of one tenantvm host (docs/kubernetes.md).
//!
//! Reaches the API server as `KUBECONFIG` (or the in-cluster service account) says, and
//! its tenantvmd over the admin API's Unix socket.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tenantvm_kube::node::{self, NodeConfig};

#[derive(Parser)]
#[command(
    name = "tenantvm-node",
    about = "Publishes a tenantvm host to Kubernetes and drives its tenantvmd"
)]
struct Args {
    /// The node's name (its TenantvmNode).
    #[arg(long, env = "TENANTVM_NODE")]
    node: String,
    /// tenantvmd's API socket.
    #[arg(long, default_value = "/run/tenantvm/tenantvmd.sock")]
    socket: PathBuf,
    /// File holding tenantvmd's admin token.
    #[arg(long, default_value = "/var/lib/tenantvm/admin.token")]
    token_file: PathBuf,
    /// tenantvmd's receipt public key (audit/receipt-signing.key.pub under its state dir).
    #[arg(
        long,
        default_value = "/var/lib/tenantvm/audit/receipt-signing.key.pub"
    )]
    receipt_key: PathBuf,
    /// The front door's URL clients reach this host's tenants at (tenantvmd --listen).
    #[arg(long)]
    endpoint: Option<String>,
    /// Seconds of the heartbeat lease (renewed every third).
    #[arg(long, default_value_t = 10)]
    lease_s: u64,
    /// Seconds one call to tenantvmd may take before it counts as wedged.
    #[arg(long, default_value_t = 10)]
    daemon_timeout_s: u64,
    /// Seconds between passes when nothing changes.
    #[arg(long, default_value_t = 5)]
    resync_s: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let token = match std::fs::read_to_string(&args.token_file) {
        Ok(t) => t.trim().to_string(),
        Err(e) => {
            eprintln!(
                "tenantvm-node: cannot read the admin token {}: {e}",
                args.token_file.display()
            );
            return ExitCode::FAILURE;
        }
    };
    let receipt_key = match tenantvm::receipt::load_verifying_key(&args.receipt_key) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("tenantvm-node: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cfg = NodeConfig {
        node: args.node,
        socket: args.socket,
        token,
        receipt_key,
        endpoint: args.endpoint,
        lease: Duration::from_secs(args.lease_s.max(3)),
        daemon_timeout: Duration::from_secs(args.daemon_timeout_s.max(1)),
        resync: Duration::from_secs(args.resync_s.max(1)),
    };
    tenantvm_kube::process::main_with_client("tenantvm-node", |client| node::run(client, cfg))
}
