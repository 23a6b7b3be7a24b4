//! tenantvm-agent: the guest agent (PID 1 of the guest initramfs), the control-channel
//! protocol it speaks, and the host-side client the orchestrator uses.
//!
//! Host side: [`protocol`], [`client`] and [`image`] (verify an image set, QEMU command). Guest side: [`init`], [`kmod`], [`reaper`],
//! [`disk`], [`agent`], [`server`]. [`http1`] is shared by the agent's forwarder and the
//! CI payload server.

pub mod agent;
pub mod client;
pub mod config;
pub mod disk;
pub mod http1;
pub mod image;
pub mod init;
pub mod kmod;
pub mod logbuf;
pub mod protocol;
pub mod reaper;
pub mod server;
