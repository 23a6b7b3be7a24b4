//! tenantvm-vmm: one tenant's virtual machine monitor.

pub mod acpi;
