//! tenantvm: one GPU host, several mutually untrusted tenants, one KVM VM each.
//!
//! This crate holds the control plane (`tenantvmd` and the `tenantvm` CLI): the HTTP API,
//! authentication, the tenant spec and lifecycle, the durable store and reconciliation.

pub mod store;
pub mod tenant;
