//! Tenants: the service that runs their commands, and the steps of create, start, stop and
//! destroy.
//!
//! Layering (each module uses only those below it):
//! - [`service`]: commands from the API, authorisation, busy guards, worker threads (its
//!   errors in [`service_error`]);
//! - [`runner`]: runs an operation's steps, records each, persists receipt records;
//! - [`steps`]: the flat table of steps, by concern (`vm`, `gpu`, `disk`, `guest`,
//!   `departure`), each given only a [`context::StepCtx`] and a [`context::Tenant`];
//! - [`context`], [`config`], [`image`], [`infer`], [`departure`], [`admission`], [`host`],
//!   [`gpu`], [`gpu_scrub`], [`gpu_info`], [`logs`], [`view`]: what steps and the service
//!   share.
//!
//! The spec and the lifecycle state machine are in [`crate::domain`].

pub mod access;
pub mod admission;
pub mod agent_mux;
pub mod card_lock;
pub mod config;
pub mod context;
pub mod departure;
#[cfg(any(test, feature = "test-hooks"))]
pub mod fault;
// These two are being moved on another branch: their six `assert!(r.is_ok()/is_err())`
// are left to that move rather than edited under it.
#[allow(clippy::assertions_on_result_states)]
pub mod gpu;
pub mod gpu_device;
pub mod gpu_info;
// See `gpu` above.
#[allow(clippy::assertions_on_result_states)]
pub mod gpu_scrub;
pub mod host;
pub mod image;
pub mod infer;
pub mod inference_keys;
pub mod logs;
pub mod runner;
pub mod service;
pub mod service_error;
pub mod steps;
pub mod usage;
pub mod view;

#[cfg(test)]
mod departure_tests;
#[cfg(test)]
mod device_tests;
#[cfg(test)]
mod licence_tests;
#[cfg(test)]
mod plan_tests;
#[cfg(test)]
pub(crate) mod test_utils;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod vsock_tests;

/// The spec and the state machine moved to [`crate::domain`] (the store uses them too); these
/// paths stay for code written against them.
pub use crate::domain::{lifecycle, spec};
