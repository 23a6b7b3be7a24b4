//! Tenants: the spec, the lifecycle state machine, and the steps of create, start, stop
//! and destroy that the [`service::TenantService`] runs and records.

pub mod fault;
pub mod gpu;
pub mod host;
pub mod lifecycle;
pub mod logs;
pub mod service;
pub mod spec;
pub mod steps;

#[cfg(test)]
pub(crate) mod test_utils;
#[cfg(test)]
mod tests;
