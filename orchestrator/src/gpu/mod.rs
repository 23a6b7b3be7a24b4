//! The host side of the GPU: everything the daemon does with the host's GPUs, in one wing.
//! The tenant steps that drive it (`tenant/steps/gpu.rs`, `tenant/steps/device.rs`) are its
//! only callers in the tenant service; the GPU crate (`tenantvm_gpu`) below it knows the
//! cards, the placement rules and the routes.
//!
//! The map, leaves first (each module uses only those above it):
//! - [`types`]: the words every seam speaks: [`DeviceRecord`] (how a share reaches its VM,
//!   stored by the daemon), [`MigRestore`], [`DeviceResetOutcome`], [`AssignedGpu`];
//! - [`error`]: [`GpuError`], the wing's one error, with the cause underneath as its source;
//! - [`scrub`]: the CUDA memory scrub (`tenantvm gpu scrub-device`), its coverage rule and
//!   its outcome; [`scrub::departure`] runs it for a released placement;
//! - [`seam`]: the traits the steps call, one per purpose: [`Placement`], [`DeviceRoute`],
//!   [`Cleaning`], [`Describe`]; [`GpuHost`] is all four;
//! - [`backend`]: [`BackendPlanner`], the real host (a tenantvm-gpu backend, NVML or a
//!   simulated file, and the sysfs devices are handed over through), and the helpers its
//!   seams share;
//! - one file per seam over it: [`placement`], [`route`] (the route decided once, by
//!   `tenantvm_gpu::route::route_for`), [`scrub::departure`], [`describe`];
//! - [`none`]: [`NoGpus`], the host of a daemon without a GPU backend;
//! - [`card_lock`]: one lock per card, which the steps that change a card's host mode hold
//!   (through `StepCtx::hold_card`);
//! - [`guest_view`]: `tenantvm gpu-info`'s comparison of the assignment with what the guest
//!   sees.
//!
//! Adding a route is a change in this folder and in `tenantvm_gpu::route` (docs/gpu.md,
//! "Add a GPU route").

pub mod backend;
pub mod card_lock;
pub mod describe;
pub mod error;
pub mod guest_view;
pub mod none;
pub mod placement;
pub mod route;
pub mod scrub;
pub mod seam;
pub mod types;

pub use backend::{find_gpu, planner_from_arg, BackendPlanner};
pub use error::GpuError;
pub use none::NoGpus;
pub use seam::{Cleaning, Describe, DeviceRoute, GpuHost, Placement};
pub use types::{AssignedGpu, DeviceRecord, DeviceResetOutcome, MigRestore};
