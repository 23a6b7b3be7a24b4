//! tenantvm on Kubernetes (docs/kubernetes.md): a `Tenant` resource per tenant, placed
//! across GPU hosts by the exact planner, departed through its finalizer.
//!
//! - [`crd`]: the `Tenant` and `TenantvmNode` resources, generated from Rust types.
//! - [`hostspec`], [`naming`]: a `Tenant` as its host takes it (the daemon's own spec and
//!   validation).
//! - [`placement`]: where a tenant goes (pure; the planner of `tenantvm plan` and of every
//!   tenantvmd, over every node).
//! - [`operator`]: `tenantvm-operator`: places tenants, writes the binding, marks tenants of
//!   lost nodes; never touches a host; one leader at a time ([`lease`]).
//! - [`node`]: `tenantvm-node`: one per host; publishes the host's inventory, drives its
//!   tenantvmd through the admin API, runs the departure before the finalizer goes.

pub mod crd;
pub mod hostspec;
pub mod kubeio;
pub mod lease;
pub mod naming;
pub mod node;
pub mod operator;
pub mod placement;
pub mod process;
#[cfg(test)]
mod test_support;
