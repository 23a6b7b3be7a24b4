//! `tenantvm-operator`: places `Tenant`s across tenantvm hosts (docs/kubernetes.md).
//!
//! Reaches the API server as `KUBECONFIG` (or the in-cluster service account) says.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tenantvm_kube::operator::{self, OperatorConfig};
use tenantvm_kube::placement::Policy;

#[derive(Parser)]
#[command(
    name = "tenantvm-operator",
    about = "Places tenantvm Tenants on nodes with the exact planner"
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// This replica's name in the leader lease (default: host name and pid).
    #[arg(long)]
    identity: Option<String>,
    /// pack: fill nodes before opening others; spread: keep the load even.
    #[arg(long, value_enum, default_value = "pack")]
    policy: Policy,
    /// Seconds a leader's lease lasts without renewal.
    #[arg(long, default_value_t = 15)]
    leader_lease_s: u64,
    /// Least seconds a node's heartbeat may go unrenewed before its tenants are NodeLost.
    #[arg(long, default_value_t = 20)]
    node_lost_after_s: u64,
    /// Seconds between passes when nothing changes.
    #[arg(long, default_value_t = 5)]
    resync_s: u64,
}

#[derive(Subcommand)]
enum Command {
    /// Print the CustomResourceDefinitions (orchestrator/kube/deploy/crds.yaml).
    Crds,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(Command::Crds) = args.command {
        print!("{}", tenantvm_kube::crd::crds_yaml());
        return ExitCode::SUCCESS;
    }
    let identity = args.identity.unwrap_or_else(|| {
        let host = hostname().unwrap_or_else(|| "operator".into());
        format!("{host}-{}", std::process::id())
    });
    let cfg = OperatorConfig {
        identity,
        policy: args.policy,
        leader_lease: Duration::from_secs(args.leader_lease_s.max(3)),
        node_lost_after: Duration::from_secs(args.node_lost_after_s),
        resync: Duration::from_secs(args.resync_s.max(1)),
    };
    tenantvm_kube::process::main_with_client("tenantvm-operator", |client| {
        operator::run(client, cfg)
    })
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}
