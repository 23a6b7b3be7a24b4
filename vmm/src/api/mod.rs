//! The VMM's outside interfaces: the JSON config file, the control socket and the one
//! command enum both the socket and the tests use. The wire types are the contract shared
//! with the orchestrator (tenantvm-vmm-api); this layer validates, serves and parses, and
//! the VM lifecycle code carries the commands out.

pub mod config;
pub mod devices;
pub mod server;

pub use config::{ConfigError, VmConfig};
pub use devices::{parse_disk, parse_vsock, DeviceFlagError};
pub use server::{ApiError, ApiServer};
pub use tenantvm_vmm_api::control::{parse_request, VmCommand, VmResponse, VmState};
pub use tenantvm_vmm_api::{SerialConfig, VmConfigFile};
