//! The daemon's multiplexed agent channels: for a tenant reached over QEMU's one
//! virtio-serial port, one [`MuxChannel`] per running VM, shared by every request, each
//! request on a stream of its own (docs/guest-image.md, "Multiplexing the serial port").
//!
//! The first request on a VM's port offers the mux ([`negotiate`]); the agent's answer
//! decides. An agent without mux keeps the port plain: that request goes on over the plain
//! connection, one at a time, as before, and the next request offers again (a restarted
//! VM may run a newer image). A channel whose loop ended (the guest broke the rules, the
//! VM stopped) is forgotten and the next request opens a fresh one: a guest can break only
//! its own channel.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tenantvm_agent_protocol::mux::{negotiate, MuxChannel, MuxConfig, Negotiated};
use tenantvm_agent_protocol::{AgentClient, AgentClientError};

/// Most streams one tenant's channel carries at once: above any tenant's
/// `max_concurrency` (admission bounds inference to that) plus the lifecycle and model
/// requests that run beside it.
pub const MAX_STREAMS: usize = 64;

/// A channel with no stream for this long is closed (the next request negotiates a new
/// one), so QEMU's one-client chardev is free for other tools (`tenantvm verify` reaches
/// the agent directly) while the daemon is idle.
pub const IDLE: Duration = Duration::from_secs(2);

/// Which VM a channel belongs to: its port's socket and its process (a restarted VM is a
/// new channel).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChannelKey {
    /// The virtio-serial chardev socket.
    pub socket: PathBuf,
    /// The VM's pid.
    pub pid: i32,
    /// And its start time, so a recycled pid is a new VM.
    pub start_time_ticks: u64,
}

/// The channels of all tenants, by VM.
#[derive(Default)]
pub struct MuxChannels {
    channels: Mutex<HashMap<ChannelKey, Arc<MuxChannel>>>,
    /// Per VM, held while its channel is negotiated.
    negotiating: Mutex<HashMap<ChannelKey, Arc<Mutex<()>>>>,
}

/// The daemon's channels.
pub fn channels() -> &'static MuxChannels {
    static CHANNELS: OnceLock<MuxChannels> = OnceLock::new();
    CHANNELS.get_or_init(MuxChannels::default)
}

impl MuxChannels {
    fn live(&self, key: &ChannelKey) -> Option<Arc<MuxChannel>> {
        let mut map = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        match map.get(key) {
            Some(ch) if ch.ended().is_none() => Some(Arc::clone(ch)),
            Some(_) => {
                map.remove(key);
                None
            }
            None => None,
        }
    }

    /// Whether `key` has a live multiplexed channel now.
    pub fn is_multiplexed(&self, key: &ChannelKey) -> bool {
        self.live(key).is_some()
    }

    /// A client for one request to `key`'s agent: a stream of the VM's channel, opening
    /// (and negotiating) the channel first when there is none, with `connect` (which
    /// checks the socket's peer). An agent without mux: the plain connection.
    pub fn client(
        &self,
        key: &ChannelKey,
        connect: impl FnOnce() -> Result<AgentClient, AgentClientError>,
        timeout: Duration,
    ) -> Result<AgentClient, AgentClientError> {
        if let Some(ch) = self.live(key) {
            return stream_client(&ch);
        }
        // One negotiation per VM at a time, under that VM's own lock: others of the same
        // VM wait (bounded by the `timeout` of the one negotiating) and then find its
        // channel; other tenants never wait for it.
        let gate = {
            let mut gates = self.negotiating.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(gates.entry(key.clone()).or_default())
        };
        let _turn = gate.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ch) = self.live(key) {
            return stream_client(&ch);
        }
        let cfg = MuxConfig {
            max_streams: MAX_STREAMS,
            idle: Some(IDLE),
            ..MuxConfig::default()
        };
        match negotiate(connect()?, cfg, timeout)? {
            Negotiated::Mux(ch) => {
                let ch = Arc::new(ch);
                self.channels
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(key.clone(), Arc::clone(&ch));
                stream_client(&ch)
            }
            Negotiated::Plain(client) => Ok(client),
        }
    }

    /// Forgets the channels of VMs that are not in `keep` (their loops end).
    pub fn retain(&self, keep: impl Fn(&ChannelKey) -> bool) {
        let mut map = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|k, _| keep(k));
        let mut gates = self.negotiating.lock().unwrap_or_else(|p| p.into_inner());
        gates.retain(|k, _| keep(k));
    }
}

fn stream_client(ch: &MuxChannel) -> Result<AgentClient, AgentClientError> {
    ch.open_stream()
        .map(AgentClient::over_stream)
        .map_err(|e| AgentClientError::Io(std::io::Error::other(e.to_string())))
}
