//! tenantvm: one GPU host, several untrusted tenants, one KVM VM each.

pub mod disk;
pub mod keys;
pub mod receipt;
pub mod scrub;
