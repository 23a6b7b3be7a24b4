//! tenantvm-vmm: one tenant's virtual machine monitor.
//!
//! One VM per process (as Firecracker does): KVM with the in-kernel irqchip and PIT, guest
//! memory through vm-memory, one thread per vCPU, legacy devices on the port bus, and a
//! control socket served from the main thread's epoll loop. docs/vmm.md is the contract.

pub mod acpi;
pub mod api;
pub mod boot;
pub mod device_manager;
pub mod exit;
pub mod lifecycle;
pub mod pci;
pub mod report;
pub mod seccomp;
pub mod terminal;
pub mod vstate;

pub use exit::ExitReason;
pub use lifecycle::{run, StartError};
