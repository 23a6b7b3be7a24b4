//! tenantvm-agent-protocol: the control channel between the host and the guest agent
//! (tenantvm-agent, PID 1 of the guest image), shared by both sides.
//!
//! - [`frame`]: the `TVAG` framing, its size cap and an incremental decoder;
//! - [`message`]: the requests and replies, the disk key, the channel's port names;
//! - [`client`]: the host's synchronous client, with a deadline on every connect, read
//!   and write and an optional peer-uid check (`SO_PEERCRED`);
//! - [`gpu`]: the guest's view of its devices (`gpu-info`) and the caps on it;
//! - [`load`]: the bounded test loads `tenantvm verify` asks a guest to run;
//! - [`model`]: a model directory's manifest and the rule its paths follow;
//! - [`licence`]: the tenant's vGPU licence token and where the guest keeps it;
//! - [`image`]: opening a guest image set and verifying it against its manifest.
//!
//! The agent binary links this crate for [`frame`] and [`message`]; the orchestrator for
//! everything. Every public type is also re-exported here, so
//! `tenantvm_agent_protocol::{AgentClient, AgentEndpoint, DiskKey, ImageSet}` works.
//! Pure Rust with no C dependencies, so the agent stays a static binary.

mod channel;
pub mod client;
pub mod frame;
pub mod gpu;
pub mod image;
pub mod licence;
pub mod load;
pub mod message;
pub mod model;
pub mod mux;
mod secret_hex;

pub use client::{AgentClient, AgentClientError, AgentEndpoint, BringUp, InferBody};
pub use frame::{
    decode_body, encode_data, encode_frame, parse_header, read_frame, resync, skip_body,
    FrameDecoder, FrameError, FrameHeader, HEADER_LEN, MAGIC, MAX_BODY_LEN, MAX_DATA_LEN,
    PROTOCOL_VERSION,
};
pub use gpu::{
    GpuInfoError, GpuInfoReply, NvidiaSmi, PciFunction, SmiGpu, MAX_GPU_ROWS, MAX_PCI_DEVICES,
    NVIDIA_SMI_DEADLINE_SECS, NVIDIA_SMI_QUERY,
};
pub use image::{ImageSet, ImageSetError, SetKernel};
pub use licence::{
    LicenceError, LicenceToken, LICENCE_DIR, LICENCE_DIR_MODE, LICENCE_FILE, LICENCE_FILE_MODE,
    MAX_LICENCE_LEN,
};
pub use load::{
    LoadKind, LoadReport, LoadSpec, LoadSpecError, LoadState, MAX_LOAD_DISK_MIB,
    MAX_LOAD_GPU_BLOCKS, MAX_LOAD_GPU_MIB, MAX_LOAD_MEMORY_MIB, MAX_LOAD_SECONDS, MAX_LOAD_THREADS,
};
pub use message::{
    salvage_id, AgentFailure, DiskKey, DiskState, ErrorCode, HttpHead, HttpRequest, HttpResponse,
    KeyError, LogLine, ModelEntry, Outcome, PayloadState, Reply, Request, RequestFrame,
    ResponseFrame, ShutdownReport, StatusReply, AGENT_VSOCK_PORT, MAX_KEY_LEN, MIN_KEY_LEN,
    VIRTIO_SERIAL_PORT_NAME,
};
pub use model::{ManifestError, ModelFile, ModelManifest};
