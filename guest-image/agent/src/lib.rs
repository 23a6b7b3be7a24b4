//! tenantvm-agent: the guest agent, PID 1 of the guest initramfs.
//!
//! [`init`] mounts the early file systems, [`kmod`] loads the kernel modules, [`reaper`]
//! reaps every child, [`disk`] opens and mounts the encrypted data disk, [`agent`] holds
//! the state behind the requests, [`payload`] supervises the payload (restarts with a
//! back-off, its capped log) and [`confine`] runs it in its own root as an unprivileged
//! user where the image says so, and [`server`] serves the control
//! channel. The channel's framing and messages, and the host-side client, live in the
//! `tenantvm-agent-protocol` crate that the orchestrator shares. [`http1`] is shared by
//! the agent's forwarder and the CI payload server. [`models`] stores the tenant's own
//! models on its disk. [`load`] runs the bounded test loads of `tenantvm verify` ([`cuda`]
//! loads the CUDA driver for its GPU memory load, [`cuda_compute`] runs its GPU compute load). [`gpu`] reports the guest's devices
//! (`gpu-info`). [`licence`] installs the tenant's vGPU licence token.

pub mod agent;
mod answer;
pub mod config;
pub mod confine;
pub mod cuda;
pub mod cuda_compute;
pub mod disk;
pub mod gpu;
pub mod http1;
pub mod init;
pub mod kmod;
pub mod licence;
pub mod load;
pub mod logbuf;
pub mod models;
pub mod payload;
pub mod payload_pool;
pub mod reaper;
pub mod server;
