//! tenantvm: one GPU host, several untrusted tenants, one KVM VM each.
//!
//! The library behind the `tenantvm` CLI and the `tenantvmd` daemon.

pub mod backend;
pub mod disk;
pub mod jail;
pub mod keys;
pub mod logs;
pub mod receipt;
pub mod scrub;
