//! tenantvm: one GPU host, several mutually untrusted tenants, one KVM VM each.
//!
//! The library behind the `tenantvm` CLI and the `tenantvmd` daemon: the HTTP API,
//! authentication, the tenant spec and lifecycle, the durable store and reconciliation
//! (control plane), and how VMs are run and jailed (runtime).

pub mod api;
pub mod auth;
pub mod backend;
mod channel_body;
pub mod cli;
pub mod client;
pub mod daemon;
pub mod disk;
pub mod domain;
pub mod fd_limit;
pub mod frontdoor;
pub mod gpu;
/// The jail (cgroups, the `tenantvm-jail` launcher, jail plans) is its own crate,
/// `tenantvm-jail`, with few dependencies since it runs as root; re-exported under its old
/// path.
pub use tenantvm_jail as jail;
pub mod keys;
pub mod logs;
pub mod metrics;
pub mod receipt;
pub mod reconcile;
pub mod store;
pub mod tenant;
#[cfg(test)]
mod test_support;
pub mod untrusted;
pub mod verify;
