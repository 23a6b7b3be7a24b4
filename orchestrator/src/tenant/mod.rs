//! Tenants: the spec, the lifecycle state machine, and the steps of create, start, stop
//! and destroy that the [`service::TenantService`] runs and records.

pub mod admission;
pub mod agent_steps;
pub mod departure;
pub mod disk_steps;
pub mod fault;
pub mod gpu;
pub mod gpu_scrub;
pub mod host;
pub mod logs;
pub mod service;
pub mod steps;
pub mod view;

#[cfg(test)]
mod departure_tests;
#[cfg(test)]
pub(crate) mod test_utils;
#[cfg(test)]
mod tests;

/// The spec and the state machine moved to [`crate::domain`] (the store uses them too); these
/// paths stay for code written against them.
pub use crate::domain::{lifecycle, spec};
