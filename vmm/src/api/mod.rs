//! The VMM's outside interfaces: the JSON config file, the control socket and the one
//! command enum both the socket and the tests use. This layer only parses and produces
//! commands; the VM lifecycle code carries them out.

pub mod command;
pub mod config;
pub mod devices;
pub mod server;

pub use command::{VmCommand, VmResponse, VmState};
pub use config::{ConfigError, SerialConfig, VmConfig, VmConfigFile};
pub use devices::{parse_disk, parse_vsock, DeviceFlagError};
pub use server::{ApiError, ApiServer};
