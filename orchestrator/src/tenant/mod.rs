//! Tenants: the spec, the lifecycle state machine, and the steps of create, start, stop
//! and destroy that the [`service::TenantService`] runs and records.

pub mod lifecycle;
pub mod spec;
