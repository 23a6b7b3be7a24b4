//! tenantvm-gpu: GPU inventory (NVML or a simulated host), the MIG profile database and
//! placement rules, which GPUs can be shared and which only given whole, the sizing
//! arithmetic and the exact placement search behind `tenantvm plan` and the daemon's
//! per-tenant placement, the mig-parted config format, host device work through sysfs (VFIO,
//! reset, SR-IOV, vGPU, mdev), the step functions that hand a share to a VM and give it back
//! ([`route`]), and the `tenantvm host check` preflight.

pub mod backend;
pub mod check;
pub mod cli;
pub mod host;
pub mod mig;
pub mod migparted;
pub mod plan;
pub mod route;
