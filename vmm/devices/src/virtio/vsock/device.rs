//! The virtio-vsock device: configuration (the guest CID), the host listening socket,
//! activation.

use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::event_handler::VsockHandler;
use super::{VsockMetrics, QUEUE_SIZE};
use crate::virtio::{
    device_type, features, read_config_bytes, ActivateContext, ActivateError, DeviceSubscriber,
    VirtioDevice,
};

/// The vsock device of a VM (config file and command line): part of the VMM's contract,
/// defined in tenantvm-vmm-api.
pub use tenantvm_vmm_api::VsockConfig;

/// Why the vsock device could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The CID is reserved or too large.
    #[error("Guest CID {0} is invalid: use a value from 3 to 4294967294")]
    Cid(u64),
    /// A live socket already answers at the path.
    #[error("Vsock socket {0} is in use by another process")]
    Busy(PathBuf),
    /// The path exists and is not a socket.
    #[error("Vsock socket path {0} exists and is not a socket; remove it or pick another path")]
    NotASocket(PathBuf),
    /// Binding failed.
    #[error("Cannot listen on vsock socket {path}: {source}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
}

/// A virtio-vsock device.
pub struct Vsock {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: Arc<UnixListener>,
    config: [u8; 8],
    metrics: Arc<VsockMetrics>,
    queue_sizes: [u16; 3],
}

fn bind(path: &Path) -> Result<UnixListener, VsockError> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(VsockError::NotASocket(path.to_path_buf()));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(VsockError::Busy(path.to_path_buf()));
        }
        // A stale socket from a VMM that is gone.
        let _ = std::fs::remove_file(path);
    }
    let bind_error = |source| VsockError::Bind {
        path: path.to_path_buf(),
        source,
    };
    let listener = UnixListener::bind(path).map_err(bind_error)?;
    listener.set_nonblocking(true).map_err(bind_error)?;
    Ok(listener)
}

impl Vsock {
    /// Validates the CID and starts listening on the socket.
    pub fn new(config: &VsockConfig) -> Result<Self, VsockError> {
        use tenantvm_vmm_api::config::{MAX_GUEST_CID, MIN_GUEST_CID};
        if !(MIN_GUEST_CID..=MAX_GUEST_CID).contains(&config.guest_cid) {
            return Err(VsockError::Cid(config.guest_cid));
        }
        let listener = bind(&config.uds_path)?;
        Ok(Self {
            guest_cid: config.guest_cid,
            uds_path: config.uds_path.clone(),
            listener: Arc::new(listener),
            config: config.guest_cid.to_le_bytes(),
            metrics: Arc::default(),
            queue_sizes: [QUEUE_SIZE; 3],
        })
    }

    /// The device's counters.
    pub fn metrics(&self) -> Arc<VsockMetrics> {
        self.metrics.clone()
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        device_type::VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn avail_features(&self) -> u64 {
        features::VERSION_1 | features::RING_INDIRECT_DESC
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(&mut self, ctx: ActivateContext) -> Result<DeviceSubscriber, ActivateError> {
        let got = ctx.queues.len().min(ctx.queue_events.len());
        if got != 3 {
            return Err(ActivateError::QueueCount { needed: 3, got });
        }
        Ok(Arc::new(Mutex::new(VsockHandler::new(
            ctx.mem,
            ctx.queues,
            ctx.queue_events,
            ctx.interrupt,
            self.guest_cid,
            self.listener.clone(),
            self.uds_path.clone(),
            self.metrics.clone(),
        ))))
    }

    fn reset(&mut self) {}
}

impl Drop for Vsock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.uds_path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &Path, cid: u64) -> VsockConfig {
        VsockConfig {
            guest_cid: cid,
            uds_path: dir.join("v.sock"),
        }
    }

    #[test]
    fn reserved_cids_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for cid in [0, 1, 2, u64::from(u32::MAX), u64::MAX] {
            assert!(matches!(
                Vsock::new(&cfg(dir.path(), cid)),
                Err(VsockError::Cid(_))
            ));
        }
    }

    #[test]
    fn live_socket_is_busy_and_stale_socket_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let first = Vsock::new(&cfg(dir.path(), 3)).unwrap();
        assert!(matches!(
            Vsock::new(&cfg(dir.path(), 4)),
            Err(VsockError::Busy(_))
        ));
        // Leave a stale socket file behind: a listener that is gone.
        std::mem::forget(first);
        let stale = dir.path().join("stale.sock");
        tenantvm_testkit::stale_unix_socket(&stale);
        let config = VsockConfig {
            guest_cid: 5,
            uds_path: stale,
        };
        Vsock::new(&config).unwrap();
    }

    #[test]
    fn regular_file_at_path_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("v.sock"), b"x").unwrap();
        assert!(matches!(
            Vsock::new(&cfg(dir.path(), 3)),
            Err(VsockError::NotASocket(_))
        ));
    }

    #[test]
    fn config_space_holds_the_cid() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Vsock::new(&cfg(dir.path(), 0x1234)).unwrap();
        let mut data = [0u8; 8];
        dev.read_config(0, &mut data);
        assert_eq!(u64::from_le_bytes(data), 0x1234);
        assert_eq!(dev.queue_max_sizes().len(), 3);
    }
}
