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
    negotiating: Mutex<HashMap<ChannelKey, Arc<Gate>>>,
}

/// One VM's negotiation: a turn at a time, and how the failed ones ended, so that the
/// requests that queued behind a negotiation that failed fail with it at once instead of
/// each trying (and timing out) in turn.
#[derive(Default)]
struct Gate {
    turn: Mutex<()>,
    /// Negotiations that failed so far, and why the last one did.
    failed: Mutex<(u64, String)>,
}

impl Gate {
    fn failures(&self) -> u64 {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).0
    }

    /// Why a negotiation failed since `seen` failures, if one did.
    fn failed_since(&self, seen: u64) -> Option<String> {
        let failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        (failed.0 > seen).then(|| failed.1.clone())
    }

    fn record_failure(&self, e: &AgentClientError) {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        failed.0 += 1;
        failed.1 = e.to_string();
    }
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
        // channel, or fail with it at once if it failed (a wedged VM: 64 requests queued
        // behind it would otherwise time out one after the other, and a departure's
        // shutdown behind them all); other tenants never wait for it.
        let gate = {
            let mut gates = self.negotiating.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(gates.entry(key.clone()).or_default())
        };
        let seen = gate.failures();
        let _turn = gate.turn.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ch) = self.live(key) {
            return stream_client(&ch);
        }
        if let Some(why) = gate.failed_since(seen) {
            return Err(AgentClientError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the agent channel's negotiation this request waited for failed: {why}"),
            )));
        }
        let cfg = MuxConfig {
            max_streams: MAX_STREAMS,
            idle: Some(IDLE),
            ..MuxConfig::default()
        };
        let negotiated = connect().and_then(|c| negotiate(c, cfg, timeout));
        if let Err(e) = &negotiated {
            gate.record_failure(e);
        }
        match negotiated? {
            Negotiated::Mux(ch) => {
                let ch = Arc::new(ch);
                {
                    let mut map = self.channels.lock().unwrap_or_else(|p| p.into_inner());
                    // Channels of VMs that stopped (their loops ended) are never asked for
                    // again under their key: drop them here, so the map holds live VMs only.
                    map.retain(|_, c| c.ended().is_none());
                    map.insert(key.clone(), Arc::clone(&ch));
                }
                self.sweep_gates(key);
                stream_client(&ch)
            }
            Negotiated::Plain(client) => Ok(client),
        }
    }

    /// Drops the negotiation gates nobody holds, of VMs without a live channel, except
    /// `current`'s: one gate per VM would otherwise outlive every VM the daemon ran.
    fn sweep_gates(&self, current: &ChannelKey) {
        let live: Vec<ChannelKey> = self
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        let mut gates = self.negotiating.lock().unwrap_or_else(|p| p.into_inner());
        gates.retain(|k, g| k == current || live.contains(k) || Arc::strong_count(g) > 1);
    }

    /// How many VMs have a channel or a negotiation gate on record (for tests).
    #[cfg(test)]
    fn records(&self) -> (usize, usize) {
        (
            self.channels.lock().unwrap().len(),
            self.negotiating.lock().unwrap().len(),
        )
    }
}

fn stream_client(ch: &MuxChannel) -> Result<AgentClient, AgentClientError> {
    ch.open_stream()
        .map(AgentClient::over_stream)
        .map_err(|e| AgentClientError::Io(std::io::Error::other(e.to_string())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::OwnedFd;
    use std::os::unix::net::{UnixListener, UnixStream};
    use tenantvm_agent_protocol::mux::{accept_offer, serve_guest};
    use tenantvm_agent_protocol::{
        decode_body, encode_frame, read_frame, Outcome, Reply, Request, RequestFrame, ResponseFrame,
    };

    /// A fake mux agent on `listener`: each connection answers the hello, then serves
    /// `status` on every stream; with `hostile`, the first connection sends garbage
    /// instead once the hello is answered.
    fn fake_mux_agent(listener: UnixListener, hostile: bool) {
        std::thread::spawn(move || {
            for (n, conn) in listener.incoming().enumerate() {
                let Ok(mut conn) = conn else { return };
                let body = read_frame(&mut conn).unwrap();
                let req: RequestFrame = decode_body(&body).unwrap();
                let Request::Mux {
                    version,
                    max_streams,
                    window,
                } = req.request
                else {
                    panic!("the first request must be the hello");
                };
                let cfg = accept_offer(version, max_streams, window, 8).unwrap();
                let reply = ResponseFrame {
                    id: req.id,
                    outcome: Outcome::Ok(Reply::Mux {
                        version,
                        max_streams: cfg.max_streams as u32,
                        window,
                    }),
                };
                conn.write_all(&encode_frame(&reply).unwrap()).unwrap();
                if hostile && n == 0 {
                    let _ = conn.write_all(b"NOT A MUX FRAME AT ALL");
                    let mut sink = Vec::new();
                    let _ = conn.read_to_end(&mut sink);
                    continue;
                }
                std::thread::spawn(move || {
                    serve_guest(OwnedFd::from(conn), cfg, &mut |mut s: UnixStream, _| {
                        std::thread::spawn(move || {
                            while let Ok(body) = read_frame(&mut s) {
                                let req: RequestFrame = decode_body(&body).unwrap();
                                let resp = ResponseFrame {
                                    id: req.id,
                                    outcome: Outcome::Ok(Reply::ModelRemoved),
                                };
                                if s.write_all(&encode_frame(&resp).unwrap()).is_err() {
                                    return;
                                }
                            }
                        });
                    });
                });
            }
        });
    }

    fn key(dir: &std::path::Path) -> ChannelKey {
        ChannelKey {
            socket: dir.join("agent.sock"),
            pid: 1,
            start_time_ticks: 1,
        }
    }

    /// A plain connection to `k`'s socket, as the daemon's peer-checked connect makes one.
    fn plain_connect(k: &ChannelKey, t: Duration) -> Result<AgentClient, AgentClientError> {
        AgentClient::connect(
            &tenantvm_agent_protocol::AgentEndpoint::Serial(k.socket.clone()),
            t,
        )
    }

    #[test]
    fn requests_share_one_channel_and_a_broken_channel_is_renegotiated() {
        let dir = tempfile::tempdir().unwrap();
        let k = key(dir.path());
        fake_mux_agent(UnixListener::bind(&k.socket).unwrap(), true);
        let chans = MuxChannels::default();
        let t = Duration::from_secs(5);
        let connect = || plain_connect(&k, t);
        // The first channel is broken by the guest right after the hello: the request on
        // it fails, the channel is forgotten, and the next request negotiates anew.
        let first = chans
            .client(&k, connect, t)
            .and_then(|mut c| c.call(&Request::Status, t));
        first.unwrap_err();
        let until = std::time::Instant::now() + t;
        while chans.is_multiplexed(&k) && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!chans.is_multiplexed(&k));
        let mut a = chans.client(&k, connect, t).unwrap();
        assert!(chans.is_multiplexed(&k));
        // Two clients at once on the one channel (a second connection to the socket
        // would not be accepted by this fake: it answers one connection at a time).
        let mut b = chans.client(&k, connect, t).unwrap();
        a.call(&Request::Status, t).unwrap();
        b.call(&Request::Status, t).unwrap();
    }

    #[test]
    fn the_channels_and_gates_of_stopped_vms_are_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let old = key(dir.path());
        fake_mux_agent(UnixListener::bind(&old.socket).unwrap(), false);
        let chans = MuxChannels::default();
        let t = Duration::from_secs(5);
        let connect = || plain_connect(&old, t);
        chans
            .client(&old, connect, t)
            .unwrap()
            .call(&Request::Status, t)
            .unwrap();
        assert_eq!(chans.records(), (1, 1));
        // The old VM's channel goes idle and ends; a new VM (same socket, new pid) opens
        // its own, and the old one's records go.
        let until = std::time::Instant::now() + IDLE * 5;
        let open = |k: &ChannelKey| {
            let map = chans.channels.lock().unwrap();
            map.get(k).is_some_and(|c| c.ended().is_none())
        };
        while open(&old) && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
        let new = ChannelKey {
            pid: 2,
            ..old.clone()
        };
        chans
            .client(&new, connect, t)
            .unwrap()
            .call(&Request::Status, t)
            .unwrap();
        assert_eq!(
            chans.records(),
            (1, 1),
            "the ended channel and its gate were kept"
        );
        assert!(chans.is_multiplexed(&new));
    }

    #[test]
    fn requests_queued_behind_a_failing_negotiation_fail_with_it_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let k = key(dir.path());
        // A wedged guest: its port takes connections and never answers the hello.
        let listener = UnixListener::bind(&k.socket).unwrap();
        let attempts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&attempts);
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for conn in listener.incoming() {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(conn);
            }
        });
        let chans = Arc::new(MuxChannels::default());
        let t = Duration::from_secs(1);
        const WAITERS: usize = 12;
        let started = std::time::Instant::now();
        let results: Vec<_> = (0..WAITERS)
            .map(|_| {
                let (chans, k) = (Arc::clone(&chans), k.clone());
                std::thread::spawn(move || chans.client(&k, || plain_connect(&k, t), t).is_err())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        let took = started.elapsed();
        assert!(results.iter().all(|failed| *failed));
        // One negotiation (or a few, for requests that came after a failure) was tried,
        // not one per request in turn, each its full timeout.
        let tried = attempts.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            tried < WAITERS / 2,
            "{tried} negotiations tried in {took:?}"
        );
        assert!(took < t * (WAITERS as u32) / 2, "{took:?}");
    }
}
