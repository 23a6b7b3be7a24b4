//! tenantvm-vmm-api: the contract between tenantvm's orchestrator and the programs that run
//! its VMs, written once and used by both sides.
//!
//! - [`config`]: `tenantvm-vmm --config FILE`, the JSON description of a VM
//!   ([`VmConfigFile`]; unknown fields are refused). The VMM reads it; the orchestrator
//!   writes it.
//! - [`control`]: the VMM's control socket, newline-delimited JSON ([`VmCommand`] in,
//!   [`VmResponse`] out).
//! - [`devices`]: passed-through PCI devices (`--device vfio,path=...`), the VM's UUID,
//!   and the exit report saying how each device's resets went ([`ExitReport`]).
//! - [`exit`]: the VMM's exit statuses and what each means ([`ExitStatus`]).
//! - [`qemu`]: the QEMU command line ([`QemuCommand`]), for the orchestrator's QEMU
//!   backend and the guest image's own test.
//!
//! Types and pure functions only (serde): no I/O, no system dependencies. docs/vmm.md
//! describes the contract for people.

pub mod config;
pub mod control;
pub mod devices;
pub mod exit;
pub mod qemu;

pub use config::{
    BlockConfig, BootProtocol, HugePages, RateLimitConfig, SeccompMode, SerialConfig,
    SerialParseError, UnknownName, VmConfigFile, VsockConfig,
};
pub use control::{parse_request, VmCommand, VmResponse, VmState, MAX_LINE_BYTES};
pub use devices::{
    DeviceReport, ExitReport, PassthroughConfig, ResetOutcome, VfioIommuMode, VmUuid,
    MAX_PASSTHROUGH_DEVICES,
};
pub use exit::ExitStatus;
pub use qemu::{QemuAccel, QemuCommand, SerialPort, VhostVsock, MAX_GUEST_CID, MIN_GUEST_CID};
