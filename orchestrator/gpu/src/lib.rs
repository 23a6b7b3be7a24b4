//! tenantvm-gpu: GPU inventory (NVML or a simulated host), the MIG profile database and
//! placement rules, the sizing arithmetic and placement search behind `tenantvm plan`, the
//! mig-parted config format, host device binding through sysfs (VFIO, SR-IOV, vGPU, mdev) and
//! the `tenantvm host check` preflight.

pub mod backend;
pub mod check;
pub mod cli;
pub mod host;
pub mod mig;
pub mod migparted;
pub mod plan;
