//! The host side of the control channel, for the orchestrator: connect over a Unix
//! socket, wait for the agent, deliver the key, start the payload, check health, forward
//! inference, shut down. Synchronous (std only).
//!
//! The socket and everything behind it belong to the tenant, so every connect, read and
//! write has a deadline (`crate::channel`): a VMM that stops accepting, a guest that
//! stops reading, or one that sends nothing makes the call fail with a timeout instead of
//! holding the caller's thread. [`AgentClient::connect_checked`] also refuses a socket not
//! served by the expected uid (`SO_PEERCRED`), so a socket swapped for another tenant's
//! never receives this tenant's key.
//!
//! Everything the guest sends is hostile: frames are decoded by [`FrameDecoder`] with the
//! protocol's size cap, answers to other ids are dropped (bounded), and a framing error
//! marks the connection broken so the caller reconnects instead of reading garbage.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use thiserror::Error;

mod infer_body;
mod requests;
pub use infer_body::InferBody;

use crate::channel::{self, ChannelError, ChannelStream};
use crate::frame::{decode_body, encode_frame, FrameDecoder, FrameError, StaleMux, MAX_DATA_LEN};
use crate::message::{
    AgentFailure, DiskKey, DiskState, HttpHead, HttpRequest, HttpResponse, LogLine, ModelEntry,
    Outcome, PayloadState, Reply, Request, RequestFrame, ResponseFrame, ShutdownReport,
    StatusReply, AGENT_VSOCK_PORT,
};

/// Most unrelated responses skipped while waiting for one id.
const MAX_STALE_RESPONSES: usize = 64;
/// Bytes of stale mux frames (a previous client's session the agent is still ending) a
/// plain call drops before it gives up on the connection.
const MAX_STALE_MUX_BYTES: usize = 16 << 20;
/// Longest hybrid-vsock handshake answer (`OK <port>\n`) read before giving up.
const MAX_HANDSHAKE_LINE: usize = 64;

/// Where the agent's channel is reachable from the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentEndpoint {
    /// A Unix socket that is the channel itself (QEMU `-chardev socket` behind a
    /// virtio-serial port).
    Serial(PathBuf),
    /// A hybrid-vsock Unix socket (tenantvm-vmm, Firecracker style): the client writes
    /// `CONNECT <port>\n` and expects `OK <n>\n` before the stream carries frames.
    HybridVsock {
        /// The VMM's vsock socket.
        path: PathBuf,
        /// The guest port, normally [`AGENT_VSOCK_PORT`].
        port: u32,
    },
    /// The VM's vsock device through the host kernel (`AF_VSOCK`; QEMU's
    /// `vhost-vsock-pci`): one connection per request, like the hybrid socket. The peer
    /// is whichever VM holds `cid` on this host: the kernel lets one VM at a time hold a
    /// CID, so the caller identifies the tenant by its CID and by its VM process being
    /// alive (see [`AgentClient::connect_checked`]).
    Vsock {
        /// The guest's context id (>= 3).
        cid: u32,
        /// The guest port, normally [`AGENT_VSOCK_PORT`].
        port: u32,
    },
}

impl std::fmt::Display for AgentEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Serial(p) => write!(f, "{}", p.display()),
            Self::HybridVsock { path, port } => write!(f, "{} (vsock port {port})", path.display()),
            Self::Vsock { cid, port } => write!(f, "vsock CID {cid} port {port}"),
        }
    }
}

impl AgentEndpoint {
    /// The hybrid-vsock endpoint on the agent's standard port.
    pub fn vsock(path: impl Into<PathBuf>) -> Self {
        Self::HybridVsock {
            path: path.into(),
            port: AGENT_VSOCK_PORT,
        }
    }

    /// The agent's port on the VM's vhost-vsock device with context id `cid`.
    pub fn vhost_vsock(cid: u32) -> Self {
        Self::Vsock {
            cid,
            port: AGENT_VSOCK_PORT,
        }
    }

    /// The Unix socket the host connects to; `None` for an `AF_VSOCK` endpoint.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Self::Serial(p) | Self::HybridVsock { path: p, .. } => Some(p),
            Self::Vsock { .. } => None,
        }
    }

    /// Whether each request gets a connection of its own (vsock, hybrid or not), so that
    /// requests run concurrently and a request may take its connection for a stream
    /// (`infer-stream`, `model-push`). The virtio-serial port is one stream for all.
    pub fn connection_per_request(&self) -> bool {
        !matches!(self, Self::Serial(_))
    }

    /// How this endpoint carries the channel, for people: `virtio-serial`,
    /// `hybrid-vsock` or `vhost-vsock`.
    pub fn transport(&self) -> &'static str {
        match self {
            Self::Serial(_) => "virtio-serial",
            Self::HybridVsock { .. } => "hybrid-vsock",
            Self::Vsock { .. } => "vhost-vsock",
        }
    }
}

/// Why a call to the agent failed.
#[derive(Debug, Error)]
pub enum AgentClientError {
    /// The socket could not be opened.
    #[error("Cannot connect to the agent channel at {endpoint}: {source}")]
    Connect {
        /// The endpoint (socket path, or vsock CID and port).
        endpoint: String,
        /// Cause.
        source: io::Error,
    },
    /// Nothing accepted the connection before the deadline (the listener's backlog stayed
    /// full: the VMM is stopped, wedged or hostile).
    #[error("The agent channel at {endpoint} did not accept a connection within {timeout:?}; the VM's process may be stopped or hung")]
    ConnectTimeout {
        /// The endpoint (socket path, or vsock CID and port).
        endpoint: String,
        /// The limit.
        timeout: Duration,
    },
    /// The socket is served by another user than the one expected.
    #[error("The agent channel at {path} is served by uid {actual}, not the expected uid {expected}; refusing to talk to it")]
    PeerMismatch {
        /// Socket path.
        path: PathBuf,
        /// The uid the caller expected (the tenant's).
        expected: u32,
        /// The uid serving the socket.
        actual: u32,
    },
    /// The peer's credentials could not be read.
    #[error("Cannot read the credentials of the process serving {path}: {source}; refusing to talk to it")]
    PeerCredentials {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        source: io::Error,
    },
    /// The hybrid-vsock handshake was refused or garbled.
    #[error("The VMM's vsock socket refused CONNECT {port}: {answer:?}; is the agent listening?")]
    Handshake {
        /// Guest port.
        port: u32,
        /// What came back (truncated).
        answer: String,
    },
    /// Reading or writing the socket failed.
    #[error("Agent channel I/O failed: {0}")]
    Io(#[from] io::Error),
    /// The guest sent something that is not a valid frame; the connection is unusable.
    #[error("The agent sent an invalid frame ({0}); the connection was dropped, reconnect")]
    Protocol(#[source] FrameError),
    /// A frame was valid but the JSON was not a response.
    #[error("The agent sent an invalid response: {0}")]
    BadResponse(#[source] FrameError),
    /// A request could not be encoded.
    #[error("Cannot encode the request: {0}")]
    Encode(#[source] FrameError),
    /// No answer before the deadline.
    #[error("The agent did not answer {what} within {timeout:?}")]
    Timeout {
        /// The request.
        what: &'static str,
        /// The limit.
        timeout: Duration,
    },
    /// The guest sent too many answers nobody asked for.
    #[error(
        "The agent sent more than {0} unsolicited responses; the connection was dropped, reconnect"
    )]
    Flooded(usize),
    /// More than this many bytes of a previous client's mux session came instead of an
    /// answer.
    #[error(
        "The agent sent more than {0} bytes of stale mux frames instead of an answer; the connection was dropped, reconnect"
    )]
    StaleMuxFlood(usize),
    /// The connection had failed earlier.
    #[error("The agent connection is broken by an earlier error; reconnect")]
    Broken,
    /// The peer closed the socket.
    #[error("The agent channel was closed by the other side")]
    Closed,
    /// The agent answered with an error.
    #[error("The agent refused {what}: {failure:?}")]
    Agent {
        /// The request.
        what: &'static str,
        /// The agent's error.
        failure: AgentFailure,
    },
    /// The agent answered with a reply of the wrong kind.
    #[error("The agent answered {what} with an unexpected reply")]
    UnexpectedReply {
        /// The request.
        what: &'static str,
    },
    /// The agent does not know the request: an older agent, which answers `bad-request`
    /// to a command it cannot decode.
    #[error("The agent does not support {what} (an older guest image); rebuild the image with this version's agent")]
    Unsupported {
        /// The request.
        what: &'static str,
    },
    /// The reply decoded but broke the protocol's caps (a hostile or broken guest).
    #[error("The agent's answer to {what} was refused: {reason}")]
    RefusedReply {
        /// The request.
        what: &'static str,
        /// Which cap it broke.
        reason: String,
    },
    /// The payload did not become ready in time.
    #[error(
        "The payload was not ready within {timeout:?}; last state {last:?}; check the agent's logs"
    )]
    PayloadNotReady {
        /// The limit.
        timeout: Duration,
        /// Last observed state.
        last: PayloadState,
    },
}

/// What [`AgentClient::bring_up`] had to do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BringUp {
    /// The key was delivered (the disk was locked).
    pub unlocked: bool,
    /// The disk was mounted by this call.
    pub mounted: bool,
    /// A new file system was created (first use).
    pub formatted: bool,
    /// The payload was started by this call.
    pub started: bool,
}

/// A connection to one guest agent.
pub struct AgentClient {
    stream: ChannelStream,
    decoder: FrameDecoder,
    next_id: u64,
    broken: bool,
    /// A hybrid-vsock `CONNECT` sent but its `OK` not read yet
    /// ([`Self::connect_checked_pipelined`]): read before the first answer.
    pending_ok: Option<PendingOk>,
}

/// The `OK` line a pipelined connection still owes.
struct PendingOk {
    port: u32,
    deadline: Instant,
    timeout: Duration,
}

fn what(req: &Request) -> &'static str {
    match req {
        Request::Status => "status",
        Request::UnlockDisk { .. } => "unlock-disk",
        Request::InstallLicence { .. } => "install-licence",
        Request::Mount { .. } => "mount",
        Request::StartPayload => "start-payload",
        Request::RestartPayload => "restart-payload",
        Request::Health => "health",
        Request::Logs { .. } => "logs",
        Request::Infer(_) => "infer",
        Request::InferStream(_) => "infer-stream",
        Request::ModelPush { .. } => "model-push",
        Request::ModelPushDir { .. } => "model-push-dir",
        Request::ModelList => "model-list",
        Request::ModelRemove { .. } => "model-remove",
        Request::Load(_) => "load",
        Request::LoadStatus { .. } => "load-status",
        Request::Shutdown => "shutdown",
        Request::GpuInfo => "gpu-info",
        Request::Mux { .. } => "mux hello",
    }
}

/// The first request id of a new connection: the clock in microseconds (below 2^53, exact
/// in JSON), so a late answer to an earlier connection's request on the same serial
/// channel (QEMU keeps one channel across connections) is never taken for an answer to
/// this one's.
fn first_id() -> u64 {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    micros.clamp(1, (1 << 53) - 1)
}

impl AgentClient {
    /// Connects to the channel (and completes the hybrid-vsock handshake), all within
    /// `timeout`. Accepts whoever serves the socket: use [`Self::connect_checked`] for a
    /// socket in a place a tenant could swap.
    pub fn connect(endpoint: &AgentEndpoint, timeout: Duration) -> Result<Self, AgentClientError> {
        Self::open(endpoint, None, timeout)
    }

    /// [`Self::connect`], refusing a socket not served by `expected_uid` (`SO_PEERCRED`,
    /// checked before anything is written to it). An `AF_VSOCK` endpoint has no peer
    /// credentials: its peer is the VM holding the CID, which the kernel keeps unique per
    /// host, so the caller must check that the tenant's VM process (which took the CID at
    /// start and holds it while it lives) is still alive once this returns, before sending
    /// anything secret (the orchestrator's `steps::guest::connect` does).
    pub fn connect_checked(
        endpoint: &AgentEndpoint,
        expected_uid: u32,
        timeout: Duration,
    ) -> Result<Self, AgentClientError> {
        Self::open(endpoint, Some(expected_uid), timeout)
    }

    /// [`Self::connect_checked`] without waiting for the hybrid-vsock handshake's `OK`:
    /// the `CONNECT` line is sent, and the first request may follow it at once (the VMM
    /// hands the bytes after the line to the guest once it accepts); the `OK` is read,
    /// and checked, before the first answer, within `timeout` of now. Saves a round trip
    /// to the guest per connection. A serial endpoint has no handshake: the same as
    /// [`Self::connect_checked`].
    pub fn connect_checked_pipelined(
        endpoint: &AgentEndpoint,
        expected_uid: u32,
        timeout: Duration,
    ) -> Result<Self, AgentClientError> {
        Self::open_with(endpoint, Some(expected_uid), timeout, true)
    }

    /// A client over one stream of a multiplexed channel
    /// ([`crate::mux::MuxChannel::open_stream`]): the same calls as over a vsock
    /// connection, each with its deadline.
    pub fn over_stream(stream: std::os::unix::net::UnixStream) -> Self {
        Self {
            stream: ChannelStream::from_fd(std::os::fd::OwnedFd::from(stream)),
            decoder: FrameDecoder::default(),
            next_id: first_id(),
            broken: false,
            pending_ok: None,
        }
    }

    /// The connection's socket, for the mux once the hello was answered. Refused when
    /// the connection is broken or the agent sent bytes beyond its answer.
    pub(crate) fn into_channel(self) -> Result<std::os::fd::OwnedFd, AgentClientError> {
        if self.broken || self.pending_ok.is_some() {
            return Err(AgentClientError::Broken);
        }
        if self.decoder.pending() > 0 {
            return Err(AgentClientError::Broken);
        }
        Ok(self.stream.into_fd())
    }

    fn open(
        endpoint: &AgentEndpoint,
        expected_uid: Option<u32>,
        timeout: Duration,
    ) -> Result<Self, AgentClientError> {
        Self::open_with(endpoint, expected_uid, timeout, false)
    }

    fn open_with(
        endpoint: &AgentEndpoint,
        expected_uid: Option<u32>,
        timeout: Duration,
        pipelined: bool,
    ) -> Result<Self, AgentClientError> {
        let deadline = Instant::now() + timeout;
        let connected = match endpoint {
            AgentEndpoint::Serial(path) | AgentEndpoint::HybridVsock { path, .. } => {
                channel::connect(path, deadline)
            }
            AgentEndpoint::Vsock { cid, port } => channel::connect_vsock(*cid, *port, deadline),
        };
        let stream = connected.map_err(|e| match e {
            ChannelError::TimedOut => AgentClientError::ConnectTimeout {
                endpoint: endpoint.to_string(),
                timeout,
            },
            ChannelError::Io(source) => AgentClientError::Connect {
                endpoint: endpoint.to_string(),
                source,
            },
        })?;
        if let (Some(expected), Some(path)) = (expected_uid, endpoint.path()) {
            let actual =
                channel::peer_uid(&stream).map_err(|source| AgentClientError::PeerCredentials {
                    path: path.to_path_buf(),
                    source,
                })?;
            if actual != expected {
                return Err(AgentClientError::PeerMismatch {
                    path: path.to_path_buf(),
                    expected,
                    actual,
                });
            }
        }
        let mut client = Self {
            stream,
            decoder: FrameDecoder::default(),
            next_id: first_id(),
            broken: false,
            pending_ok: None,
        };
        if let AgentEndpoint::HybridVsock { port, .. } = endpoint {
            if pipelined {
                client.send_connect(*port, deadline, timeout)?;
                client.pending_ok = Some(PendingOk {
                    port: *port,
                    deadline,
                    timeout,
                });
            } else {
                client.handshake(*port, deadline, timeout)?;
            }
        }
        Ok(client)
    }

    fn send_connect(
        &mut self,
        port: u32,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(), AgentClientError> {
        channel::write_all_by(
            &mut self.stream,
            format!("CONNECT {port}\n").as_bytes(),
            deadline,
        )
        .map_err(|e| match e {
            ChannelError::TimedOut => AgentClientError::Timeout {
                what: "vsock CONNECT",
                timeout,
            },
            ChannelError::Io(e) => AgentClientError::Io(e),
        })
    }

    /// Reads the `OK` line a pipelined connection owes, in pieces: what follows the
    /// newline is the agent's and goes to the frame decoder. Any failure breaks the
    /// connection.
    fn finish_handshake(&mut self) -> Result<(), AgentClientError> {
        let Some(PendingOk {
            port,
            deadline,
            timeout,
        }) = self.pending_ok.take()
        else {
            return Ok(());
        };
        let mut line = Vec::new();
        let mut buf = [0u8; 4096];
        let result = loop {
            let n = match channel::read_by(&mut self.stream, &mut buf, deadline) {
                Ok(0) => {
                    break Err(AgentClientError::Handshake {
                        port,
                        answer: String::from_utf8_lossy(&line).into_owned(),
                    })
                }
                Ok(n) => n,
                Err(ChannelError::TimedOut) => {
                    break Err(AgentClientError::Timeout {
                        what: "vsock CONNECT",
                        timeout,
                    })
                }
                Err(ChannelError::Io(e)) => break Err(AgentClientError::Io(e)),
            };
            let got = &buf[..n];
            match got.iter().position(|&b| b == b'\n') {
                Some(end) if line.len() + end <= MAX_HANDSHAKE_LINE => {
                    line.extend_from_slice(&got[..end]);
                    let text = String::from_utf8_lossy(&line).into_owned();
                    if !text.starts_with("OK ") {
                        break Err(AgentClientError::Handshake { port, answer: text });
                    }
                    self.decoder.push(&got[end + 1..]);
                    break Ok(());
                }
                None if line.len() + n <= MAX_HANDSHAKE_LINE => line.extend_from_slice(got),
                _ => {
                    line.extend_from_slice(got);
                    line.truncate(MAX_HANDSHAKE_LINE);
                    break Err(AgentClientError::Handshake {
                        port,
                        answer: String::from_utf8_lossy(&line).into_owned(),
                    });
                }
            }
        };
        if result.is_err() {
            self.broken = true;
        }
        result
    }

    fn handshake(
        &mut self,
        port: u32,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(), AgentClientError> {
        let timed_out = |e: ChannelError| match e {
            ChannelError::TimedOut => AgentClientError::Timeout {
                what: "vsock CONNECT",
                timeout,
            },
            ChannelError::Io(e) => AgentClientError::Io(e),
        };
        channel::write_all_by(
            &mut self.stream,
            format!("CONNECT {port}\n").as_bytes(),
            deadline,
        )
        .map_err(timed_out)?;
        // One byte at a time: the bytes after the newline are the agent's.
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while line.len() < MAX_HANDSHAKE_LINE {
            match channel::read_by(&mut self.stream, &mut byte, deadline).map_err(timed_out)? {
                0 => break,
                _ if byte[0] == b'\n' => {
                    let text = String::from_utf8_lossy(&line).into_owned();
                    if text.starts_with("OK ") {
                        return Ok(());
                    }
                    return Err(AgentClientError::Handshake { port, answer: text });
                }
                _ => line.push(byte[0]),
            }
        }
        Err(AgentClientError::Handshake {
            port,
            answer: String::from_utf8_lossy(&line).into_owned(),
        })
    }

    /// Connects and polls `status` until the agent answers or `timeout` passes. Works
    /// while the guest is still booting: the channel socket exists before the agent does.
    pub fn wait_for_ready(
        endpoint: &AgentEndpoint,
        timeout: Duration,
    ) -> Result<(Self, StatusReply), AgentClientError> {
        Self::wait_for_ready_with(&mut |t| Self::connect(endpoint, t), timeout)
    }

    /// [`Self::wait_for_ready`] with the caller's way of connecting (e.g.
    /// [`Self::connect_checked`]), called again after each failed attempt with the time
    /// it may take.
    pub fn wait_for_ready_with(
        connect: &mut dyn FnMut(Duration) -> Result<Self, AgentClientError>,
        timeout: Duration,
    ) -> Result<(Self, StatusReply), AgentClientError> {
        let deadline = Instant::now() + timeout;
        let mut last_err = None;
        while Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            match connect(left.min(Duration::from_secs(5))) {
                Ok(mut client) => {
                    let mut sent = Vec::new();
                    while Instant::now() < deadline {
                        let left = deadline.saturating_duration_since(Instant::now());
                        let poll = left.min(Duration::from_secs(1));
                        match client.send(&Request::Status, Instant::now() + poll, poll) {
                            Ok(id) => sent.push(id),
                            Err(e) => {
                                // The socket may accept before the far end is up; reconnect.
                                last_err = Some(e);
                                break;
                            }
                        }
                        match client.receive_any(&sent, Instant::now() + poll, poll) {
                            Ok(ResponseFrame {
                                outcome: Outcome::Ok(Reply::Status(s)),
                                ..
                            }) => return Ok((client, s)),
                            Ok(_) => {
                                return Err(AgentClientError::UnexpectedReply { what: "status" })
                            }
                            Err(AgentClientError::Timeout { .. }) => continue,
                            Err(e) => {
                                last_err = Some(e);
                                break;
                            }
                        }
                    }
                }
                Err(e) => last_err = Some(e),
            }
            std::thread::sleep(
                Duration::from_millis(100).min(deadline.saturating_duration_since(Instant::now())),
            );
        }
        Err(last_err.unwrap_or(AgentClientError::Timeout {
            what: "status",
            timeout,
        }))
    }

    /// Writes one request frame before `deadline` (`timeout` is what a timeout error
    /// reports). A write cut short leaves part of a frame on the channel, so any failure
    /// marks the connection broken.
    fn send(
        &mut self,
        req: &Request,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<u64, AgentClientError> {
        if self.broken {
            return Err(AgentClientError::Broken);
        }
        let id = self.next_id;
        self.next_id += 1;
        let frame = encode_frame(&RequestFrame {
            id,
            request: req.clone(),
        })
        .map_err(AgentClientError::Encode)?;
        if let Err(e) = channel::write_all_by(&mut self.stream, &frame, deadline) {
            self.broken = true;
            return Err(match e {
                ChannelError::TimedOut => AgentClientError::Timeout {
                    what: "request",
                    timeout,
                },
                ChannelError::Io(e) => e.into(),
            });
        }
        Ok(id)
    }

    /// Waits until `deadline` for a response to any of `ids`, dropping a bounded number
    /// of others. `timeout` is what a timeout error reports.
    fn receive_any(
        &mut self,
        ids: &[u64],
        deadline: Instant,
        timeout: Duration,
    ) -> Result<ResponseFrame, AgentClientError> {
        self.finish_handshake()?;
        let mut skipped = 0;
        let mut stale_mux_bytes = 0usize;
        let mut buf = [0u8; 16 * 1024];
        loop {
            let stale = self.decoder.skip_stale_mux().map_err(|e| {
                self.broken = true;
                AgentClientError::Protocol(e)
            })?;
            if let StaleMux::Skipped(n) = stale {
                stale_mux_bytes += n;
                if stale_mux_bytes > MAX_STALE_MUX_BYTES {
                    self.broken = true;
                    return Err(AgentClientError::StaleMuxFlood(MAX_STALE_MUX_BYTES));
                }
                continue;
            }
            let next = if stale == StaleMux::NeedMore {
                Ok(None)
            } else {
                self.decoder.next_frame()
            };
            match next {
                Ok(Some(body)) => {
                    let resp: ResponseFrame =
                        decode_body(&body).map_err(AgentClientError::BadResponse)?;
                    if ids.contains(&resp.id) {
                        return Ok(resp);
                    }
                    skipped += 1;
                    if skipped > MAX_STALE_RESPONSES {
                        self.broken = true;
                        return Err(AgentClientError::Flooded(MAX_STALE_RESPONSES));
                    }
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    self.broken = true;
                    return Err(AgentClientError::Protocol(e));
                }
            }
            match channel::read_by(&mut self.stream, &mut buf, deadline) {
                Ok(0) => {
                    self.broken = true;
                    return Err(AgentClientError::Closed);
                }
                Ok(n) => self.decoder.push(&buf[..n]),
                Err(ChannelError::TimedOut) => {
                    return Err(AgentClientError::Timeout {
                        what: "response",
                        timeout,
                    })
                }
                Err(ChannelError::Io(e)) => {
                    self.broken = true;
                    return Err(e.into());
                }
            }
        }
    }

    /// Sends one request and returns the agent's reply (an agent error becomes
    /// [`AgentClientError::Agent`]).
    /// The whole call (writing the request, reading the answer) ends within `timeout`.
    pub fn call(&mut self, req: &Request, timeout: Duration) -> Result<Reply, AgentClientError> {
        let name = what(req);
        let deadline = Instant::now() + timeout;
        let sent = self
            .send(req, deadline, timeout)
            .and_then(|id| self.receive_any(&[id], deadline, timeout));
        match sent {
            Ok(resp) => match resp.outcome {
                Outcome::Ok(reply) => Ok(reply),
                Outcome::Err(failure) => Err(AgentClientError::Agent {
                    what: name,
                    failure,
                }),
            },
            Err(AgentClientError::Timeout { timeout, .. }) => Err(AgentClientError::Timeout {
                what: name,
                timeout,
            }),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{read_frame, HEADER_LEN, MAGIC, MAX_BODY_LEN, PROTOCOL_VERSION};
    use crate::message::ErrorCode;
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::thread;

    #[test]
    fn endpoints_say_how_they_carry_the_channel() {
        let serial = AgentEndpoint::Serial("/t/run/agent.sock".into());
        let hybrid = AgentEndpoint::vsock("/t/run/vsock.sock");
        let vhost = AgentEndpoint::vhost_vsock(7);
        assert_eq!(
            vhost,
            AgentEndpoint::Vsock {
                cid: 7,
                port: AGENT_VSOCK_PORT
            }
        );
        assert!(!serial.connection_per_request());
        assert!(hybrid.connection_per_request() && vhost.connection_per_request());
        assert_eq!(
            [serial.transport(), hybrid.transport(), vhost.transport()],
            ["virtio-serial", "hybrid-vsock", "vhost-vsock"]
        );
        assert_eq!(vhost.path(), None);
        assert_eq!(serial.path(), Some(Path::new("/t/run/agent.sock")));
        assert_eq!(vhost.to_string(), "vsock CID 7 port 1024");
    }

    #[test]
    fn a_vsock_endpoint_nobody_serves_fails_within_its_deadline() {
        // No VM holds this CID (and this host may have no vsock at all): an error either
        // way, never a wait past the deadline, and a checked connect cannot skip it.
        let started = Instant::now();
        let ep = AgentEndpoint::vhost_vsock(0x7fff_fff0);
        for r in [
            AgentClient::connect(&ep, Duration::from_millis(500)),
            AgentClient::connect_checked(&ep, 1234, Duration::from_millis(500)),
        ] {
            match r {
                Err(AgentClientError::Connect { endpoint, .. })
                | Err(AgentClientError::ConnectTimeout { endpoint, .. }) => {
                    assert_eq!(endpoint, "vsock CID 2147483632 port 1024");
                }
                Err(other) => panic!("unexpected error {other:?}"),
                Ok(_) => panic!("connected to a CID nobody holds"),
            }
        }
        assert!(started.elapsed() < Duration::from_secs(3));
        // A deadline already past is a timeout before any socket is made.
        assert!(matches!(
            AgentClient::connect(&ep, Duration::ZERO),
            Err(AgentClientError::ConnectTimeout { .. })
        ));
    }

    /// Runs `guest` as a fake agent on a fresh socket and returns the endpoint.
    fn fake_guest(
        guest: impl FnOnce(UnixStream) + Send + 'static,
    ) -> (tempfile::TempDir, AgentEndpoint) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            guest(s);
        });
        (dir, AgentEndpoint::Serial(path))
    }

    fn answer(s: &mut UnixStream, id: u64, outcome: Outcome) {
        s.write_all(&encode_frame(&ResponseFrame { id, outcome }).unwrap())
            .unwrap();
    }

    fn next_request(s: &mut UnixStream) -> RequestFrame {
        decode_body(&read_frame(s).unwrap()).unwrap()
    }

    #[test]
    fn call_skips_stale_answers_and_returns_the_matching_one() {
        let (_d, ep) = fake_guest(|mut s| {
            let req = next_request(&mut s);
            answer(&mut s, req.id + 100, Outcome::Ok(Reply::Unlocked));
            answer(
                &mut s,
                req.id,
                Outcome::Ok(Reply::Mounted { formatted: true }),
            );
        });
        let mut c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        assert!(c.mount(true, Duration::from_secs(5)).unwrap());
    }

    /// A mux frame as an agent still serving a previous client's session writes it.
    fn mux_frame(stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = b"TVMX".to_vec();
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(&[2, 0, 0, 0]);
        f.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn a_previous_clients_mux_frames_are_dropped_and_the_answer_read_after_them() {
        let (_d, ep) = fake_guest(|mut s| {
            // The tail of a killed daemon's log stream, in pieces, then the answer.
            let mut stale = mux_frame(3, b"a log line\n");
            stale.extend(mux_frame(3, &[7u8; 4000]));
            for chunk in stale.chunks(5) {
                s.write_all(chunk).unwrap();
                s.flush().unwrap();
            }
            let req = next_request(&mut s);
            answer(
                &mut s,
                req.id,
                Outcome::Ok(Reply::Mounted { formatted: false }),
            );
        });
        let mut c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        assert!(!c.mount(true, Duration::from_secs(5)).unwrap());
    }

    #[test]
    fn endless_mux_frames_or_a_lying_mux_length_end_the_connection() {
        let (_d, ep) = fake_guest(|mut s| {
            let frame = mux_frame(3, &[0u8; 60 * 1024]);
            // Past the bound, never an answer.
            while s.write_all(&frame).is_ok() {}
        });
        let mut c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        let err = c.mount(true, Duration::from_secs(10)).unwrap_err();
        assert!(matches!(err, AgentClientError::StaleMuxFlood(_)), "{err:?}");
        let (_d, ep) = fake_guest(|mut s| {
            let mut lying = mux_frame(3, b"");
            lying[12..16].copy_from_slice(&u32::MAX.to_be_bytes());
            s.write_all(&lying).unwrap();
            let _ = next_request(&mut s);
        });
        let mut c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        let err = c.mount(true, Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(err, AgentClientError::Protocol(FrameError::BadMagic(_))),
            "{err:?}"
        );
    }

    #[test]
    fn agent_errors_surface_with_their_code() {
        let (_d, ep) = fake_guest(|mut s| {
            let req = next_request(&mut s);
            answer(
                &mut s,
                req.id,
                Outcome::Err(AgentFailure {
                    code: ErrorCode::WrongState,
                    message: "Unlock the disk first".into(),
                }),
            );
        });
        let mut c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        match c.mount(false, Duration::from_secs(5)) {
            Err(AgentClientError::Agent { failure, .. }) => {
                assert_eq!(failure.code, ErrorCode::WrongState);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn oversized_frame_from_guest_breaks_the_connection_without_allocating() {
        let (_d, ep) = fake_guest(|mut s| {
            let _ = next_request(&mut s);
            let mut h = MAGIC.to_vec();
            h.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
            h.extend_from_slice(&0u16.to_be_bytes());
            h.extend_from_slice(&(MAX_BODY_LEN + 1).to_be_bytes());
            assert_eq!(h.len(), HEADER_LEN);
            s.write_all(&h).unwrap();
            thread::sleep(Duration::from_secs(2));
        });
        let mut c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        assert!(matches!(
            c.status(Duration::from_secs(5)),
            Err(AgentClientError::Protocol(FrameError::TooLarge { .. }))
        ));
        assert!(matches!(
            c.status(Duration::from_secs(1)),
            Err(AgentClientError::Broken)
        ));
    }

    #[test]
    fn garbage_and_bad_json_from_guest_are_errors() {
        let (_d, ep) = fake_guest(|mut s| {
            let req = next_request(&mut s);
            let mut f = encode_frame(&ResponseFrame {
                id: req.id,
                outcome: Outcome::Ok(Reply::Unlocked),
            })
            .unwrap()
            .to_vec();
            // Same length, corrupted JSON.
            let n = f.len();
            f[n - 3] = b'!';
            s.write_all(&f).unwrap();
            let _ = next_request(&mut s);
            s.write_all(b"HTTP/1.1 200 OK\r\n\r\n").unwrap();
            thread::sleep(Duration::from_secs(2));
        });
        let mut c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        assert!(matches!(
            c.status(Duration::from_secs(5)),
            Err(AgentClientError::BadResponse(_))
        ));
        assert!(matches!(
            c.status(Duration::from_secs(5)),
            Err(AgentClientError::Protocol(FrameError::BadMagic(_)))
        ));
    }

    #[test]
    fn silent_guest_times_out_and_wrong_reply_kind_is_refused() {
        let (_d, ep) = fake_guest(|mut s| {
            let _ = next_request(&mut s);
            let req = next_request(&mut s);
            answer(&mut s, req.id, Outcome::Ok(Reply::Unlocked));
            thread::sleep(Duration::from_secs(1));
        });
        let mut c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        assert!(matches!(
            c.health(Duration::from_millis(200)),
            Err(AgentClientError::Timeout { what: "health", .. })
        ));
        assert!(matches!(
            c.health(Duration::from_secs(5)),
            Err(AgentClientError::UnexpectedReply { what: "health" })
        ));
    }

    fn stream_request(s: &mut UnixStream) -> u64 {
        let req = next_request(s);
        assert!(matches!(req.request, Request::InferStream(_)), "{req:?}");
        req.id
    }

    fn head(s: &mut UnixStream, id: u64) {
        answer(
            s,
            id,
            Outcome::Ok(Reply::InferHead(HttpHead {
                status: 200,
                headers: vec![("Content-Type".into(), "text/event-stream".into())],
            })),
        );
    }

    fn get() -> HttpRequest {
        HttpRequest {
            method: "POST".into(),
            path: "/v1/completions".into(),
            headers: vec![],
            body: "{}".into(),
        }
    }

    #[test]
    fn a_streamed_answer_arrives_piece_by_piece_and_ends_at_the_empty_frame() {
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (_d, ep) = fake_guest(move |mut s| {
            let id = stream_request(&mut s);
            head(&mut s, id);
            s.write_all(&crate::frame::encode_data(b"data: 1\n\n").unwrap())
                .unwrap();
            // The second piece only after the client has read the first.
            go_rx.recv().unwrap();
            s.write_all(&crate::frame::encode_data(b"data: [DONE]\n\n").unwrap())
                .unwrap();
            s.write_all(&crate::frame::encode_data(b"").unwrap())
                .unwrap();
            thread::sleep(Duration::from_secs(1));
        });
        let c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let (h, mut body) = c
            .infer_stream(get(), Duration::from_secs(5), deadline)
            .unwrap();
        assert_eq!(h.status, 200);
        let mut buf = [0u8; 64];
        let n = io::Read::read(&mut body, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"data: 1\n\n");
        go_tx.send(()).unwrap();
        let mut rest = Vec::new();
        io::Read::read_to_end(&mut body, &mut rest).unwrap();
        assert_eq!(rest, b"data: [DONE]\n\n");
        assert_eq!(io::Read::read(&mut body, &mut buf).unwrap(), 0);
    }

    #[test]
    fn pieces_already_buffered_are_read_together_and_the_end_still_reads_zero() {
        let (_d, ep) = fake_guest(move |mut s| {
            let id = stream_request(&mut s);
            let mut bytes = Vec::new();
            for piece in [
                &b"data: 1\n\n"[..],
                b"data: 2\n\n",
                b"data: [DONE]\n\n",
                b"",
            ] {
                bytes.extend_from_slice(&crate::frame::encode_data(piece).unwrap());
            }
            head(&mut s, id);
            s.write_all(&bytes).unwrap();
            thread::sleep(Duration::from_secs(1));
        });
        let c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        let (_, mut body) = c
            .infer_stream(
                get(),
                Duration::from_secs(5),
                Instant::now() + Duration::from_secs(20),
            )
            .unwrap();
        // Wait until all of it is on the socket, then one read takes every piece.
        thread::sleep(Duration::from_millis(300));
        let mut buf = [0u8; 1024];
        let n = io::Read::read(&mut body, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n");
        assert_eq!(io::Read::read(&mut body, &mut buf).unwrap(), 0);
        // A small buffer still gets every byte, in order.
        let (_d, ep) = fake_guest(move |mut s| {
            let id = stream_request(&mut s);
            head(&mut s, id);
            let mut bytes = Vec::new();
            for piece in [&b"abc"[..], b"defg", b""] {
                bytes.extend_from_slice(&crate::frame::encode_data(piece).unwrap());
            }
            s.write_all(&bytes).unwrap();
            thread::sleep(Duration::from_secs(1));
        });
        let c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        let (_, mut body) = c
            .infer_stream(
                get(),
                Duration::from_secs(5),
                Instant::now() + Duration::from_secs(20),
            )
            .unwrap();
        thread::sleep(Duration::from_millis(300));
        let mut all = Vec::new();
        let mut small = [0u8; 5];
        loop {
            let n = io::Read::read(&mut body, &mut small).unwrap();
            if n == 0 {
                break;
            }
            all.extend_from_slice(&small[..n]);
        }
        assert_eq!(all, b"abcdefg");
    }

    #[test]
    fn hostile_streams_are_errors_not_memory_or_waits() {
        // An oversized data frame is refused from its header alone.
        let (_d, ep) = fake_guest(|mut s| {
            let id = stream_request(&mut s);
            head(&mut s, id);
            let mut h = MAGIC.to_vec();
            h.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
            h.extend_from_slice(&0u16.to_be_bytes());
            h.extend_from_slice(&(MAX_DATA_LEN + 1).to_be_bytes());
            s.write_all(&h).unwrap();
            thread::sleep(Duration::from_secs(2));
        });
        let c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        let (_, mut body) = c
            .infer_stream(
                get(),
                Duration::from_secs(5),
                Instant::now() + Duration::from_secs(20),
            )
            .unwrap();
        let e = io::Read::read_to_end(&mut body, &mut Vec::new()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");

        // A guest that goes silent is cut off after the idle time.
        let (_d, ep) = fake_guest(|mut s| {
            let id = stream_request(&mut s);
            head(&mut s, id);
            s.write_all(&crate::frame::encode_data(b"x").unwrap())
                .unwrap();
            thread::sleep(Duration::from_secs(5));
        });
        let c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        let (_, mut body) = c
            .infer_stream(
                get(),
                Duration::from_millis(300),
                Instant::now() + Duration::from_secs(20),
            )
            .unwrap();
        let mut got = Vec::new();
        let e = io::Read::read_to_end(&mut body, &mut got).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert_eq!(got, b"x");

        // An endless stream ends at the deadline.
        let (_d, ep) = fake_guest(|mut s| {
            let id = stream_request(&mut s);
            head(&mut s, id);
            let piece = crate::frame::encode_data(&[b'y'; 1024]).unwrap();
            while s.write_all(&piece).is_ok() {
                thread::sleep(Duration::from_millis(5));
            }
        });
        let c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        let (_, mut body) = c
            .infer_stream(
                get(),
                Duration::from_secs(5),
                Instant::now() + Duration::from_millis(500),
            )
            .unwrap();
        let e = io::Read::read_to_end(&mut body, &mut Vec::new()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");

        // A guest that closes mid-stream is an error, not a short success.
        let (_d, ep) = fake_guest(|mut s| {
            let id = stream_request(&mut s);
            head(&mut s, id);
            s.write_all(&crate::frame::encode_data(b"half").unwrap())
                .unwrap();
        });
        let c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        let (_, mut body) = c
            .infer_stream(
                get(),
                Duration::from_secs(5),
                Instant::now() + Duration::from_secs(20),
            )
            .unwrap();
        let e = io::Read::read_to_end(&mut body, &mut Vec::new()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
    }

    #[test]
    fn a_model_push_sends_its_bytes_as_data_frames_and_returns_the_agents_check() {
        let (_d, ep) = fake_guest(|mut s| {
            let req = next_request(&mut s);
            let Request::ModelPush { name, size, .. } = req.request else {
                panic!("{req:?}")
            };
            assert_eq!((name.as_str(), size), ("m", 100_000));
            answer(&mut s, req.id, Outcome::Ok(Reply::ModelReady));
            let mut got = Vec::new();
            loop {
                let data = read_frame(&mut s).unwrap();
                assert!(data.len() <= MAX_DATA_LEN as usize);
                if data.is_empty() {
                    break;
                }
                got.extend_from_slice(&data);
            }
            assert_eq!(got, vec![9u8; 100_000]);
            answer(
                &mut s,
                req.id,
                Outcome::Ok(Reply::ModelStored {
                    name: "m".into(),
                    bytes: 100_000,
                    sha256: "ab".into(),
                }),
            );
        });
        let c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        let data = vec![9u8; 100_000];
        let (bytes, sha) = c
            .model_push("m", 100_000, "ab", &mut &data[..], Duration::from_secs(10))
            .unwrap();
        assert_eq!((bytes, sha.as_str()), (100_000, "ab"));

        // A refusal before the data (a full disk) is the agent's error.
        let (_d, ep) = fake_guest(|mut s| {
            let req = next_request(&mut s);
            answer(
                &mut s,
                req.id,
                Outcome::Err(AgentFailure {
                    code: ErrorCode::NoSpace,
                    message: "full".into(),
                }),
            );
        });
        let c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
        match c.model_push("m", 1, "ab", &mut &b"x"[..], Duration::from_secs(10)) {
            Err(AgentClientError::Agent { failure, .. }) => {
                assert_eq!(failure.code, ErrorCode::NoSpace);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn hybrid_vsock_handshake_is_checked() {
        let (_d, ep) = fake_guest(|mut s| {
            let mut line = [0u8; 13];
            s.read_exact(&mut line).unwrap();
            assert_eq!(&line, b"CONNECT 1024\n");
            s.write_all(b"NOPE\n").unwrap();
        });
        let AgentEndpoint::Serial(path) = ep else {
            unreachable!()
        };
        let ep = AgentEndpoint::vsock(path);
        assert!(matches!(
            AgentClient::connect(&ep, Duration::from_secs(5)),
            Err(AgentClientError::Handshake { port: 1024, .. })
        ));
    }

    #[test]
    fn a_pipelined_connection_sends_its_request_before_the_ok_and_reads_what_follows_it() {
        let (_d, ep) = fake_guest(|mut s| {
            let mut line = [0u8; 13];
            s.read_exact(&mut line).unwrap();
            assert_eq!(&line, b"CONNECT 1024\n");
            // The request is already here, before any OK was sent.
            let id = stream_request(&mut s);
            // The OK and the agent's first frames in one write.
            let mut bytes = b"OK 1073741824\n".to_vec();
            bytes.extend_from_slice(
                &encode_frame(&ResponseFrame {
                    id,
                    outcome: Outcome::Ok(Reply::InferHead(HttpHead {
                        status: 200,
                        headers: vec![],
                    })),
                })
                .unwrap(),
            );
            bytes.extend_from_slice(&crate::frame::encode_data(b"data: 1\n\n").unwrap());
            bytes.extend_from_slice(&crate::frame::encode_data(b"").unwrap());
            s.write_all(&bytes).unwrap();
            thread::sleep(Duration::from_secs(1));
        });
        let AgentEndpoint::Serial(path) = ep else {
            unreachable!()
        };
        let ep = AgentEndpoint::vsock(path);
        let me = nix::unistd::getuid().as_raw();
        let c = AgentClient::connect_checked_pipelined(&ep, me, Duration::from_secs(5)).unwrap();
        let (h, mut body) = c
            .infer_stream(
                get(),
                Duration::from_secs(5),
                Instant::now() + Duration::from_secs(20),
            )
            .unwrap();
        assert_eq!(h.status, 200);
        let mut rest = Vec::new();
        io::Read::read_to_end(&mut body, &mut rest).unwrap();
        assert_eq!(rest, b"data: 1\n\n");
    }

    #[test]
    fn a_pipelined_connection_checks_the_ok_it_owes() {
        // Refused, closed without a word, a line that never ends.
        for answer in [&b"NOPE\n"[..], &b""[..], &[b'O'; 200][..]] {
            let answer = answer.to_vec();
            let (_d, ep) = fake_guest(move |mut s| {
                let mut line = [0u8; 13];
                s.read_exact(&mut line).unwrap();
                let _ = next_request(&mut s);
                s.write_all(&answer).unwrap();
            });
            let AgentEndpoint::Serial(path) = ep else {
                unreachable!()
            };
            let ep = AgentEndpoint::vsock(path);
            let me = nix::unistd::getuid().as_raw();
            let c =
                AgentClient::connect_checked_pipelined(&ep, me, Duration::from_secs(5)).unwrap();
            let err = c
                .infer_stream(
                    get(),
                    Duration::from_secs(5),
                    Instant::now() + Duration::from_secs(20),
                )
                .map(|_| ())
                .unwrap_err();
            assert!(
                matches!(err, AgentClientError::Handshake { port: 1024, .. }),
                "{err}"
            );
        }
        // A peer that never answers OK: the connect's own deadline.
        let (_d, ep) = fake_guest(|mut s| {
            let mut line = [0u8; 13];
            s.read_exact(&mut line).unwrap();
            let _ = next_request(&mut s);
            thread::sleep(Duration::from_secs(5));
        });
        let AgentEndpoint::Serial(path) = ep else {
            unreachable!()
        };
        let ep = AgentEndpoint::vsock(path);
        let me = nix::unistd::getuid().as_raw();
        let started = Instant::now();
        let c =
            AgentClient::connect_checked_pipelined(&ep, me, Duration::from_millis(500)).unwrap();
        let err = c
            .infer_stream(
                get(),
                Duration::from_secs(5),
                Instant::now() + Duration::from_secs(20),
            )
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(
                err,
                AgentClientError::Timeout {
                    what: "vsock CONNECT",
                    ..
                }
            ),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn wait_for_ready_retries_until_the_agent_answers() {
        let (_d, ep) = fake_guest(|mut s| {
            // Ignore the first two polls, as a booting guest would.
            let _ = next_request(&mut s);
            let _ = next_request(&mut s);
            let req = next_request(&mut s);
            let status = StatusReply {
                agent_version: "t".into(),
                protocol: PROTOCOL_VERSION,
                channel: "virtio-serial".into(),
                uptime_ms: 1,
                disk: DiskState::Locked,
                payload: PayloadState::NotStarted,
            };
            answer(&mut s, req.id, Outcome::Ok(Reply::Status(status)));
            thread::sleep(Duration::from_secs(1));
        });
        let (_c, s) = AgentClient::wait_for_ready(&ep, Duration::from_secs(20)).unwrap();
        assert_eq!(s.channel, "virtio-serial");
    }

    /// Runs `f` on its own thread and returns its result and how long it took; fails the
    /// test (instead of hanging it) if `f` has not returned after `limit`.
    fn finishes_within<T: Send + 'static>(
        limit: Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> (T, Duration) {
        let (tx, rx) = std::sync::mpsc::channel();
        thread::spawn(move || {
            let started = Instant::now();
            let out = f();
            let _ = tx.send((out, started.elapsed()));
        });
        rx.recv_timeout(limit)
            .unwrap_or_else(|_| panic!("still blocked after {limit:?}: the call has no deadline"))
    }

    /// A listener that never accepts, with its backlog already full (as a QEMU that
    /// stopped accepting leaves its chardev socket). Returns what must stay alive.
    fn full_backlog() -> (tempfile::TempDir, PathBuf, Vec<std::os::fd::OwnedFd>) {
        use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wedged.sock");
        let addr = UnixAddr::new(&path).unwrap();
        let stream = || {
            socket::socket(
                AddressFamily::Unix,
                SockType::Stream,
                SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
                None,
            )
            .unwrap()
        };
        let listener = stream();
        socket::bind(listener.as_raw_fd(), &addr).unwrap();
        socket::listen(&listener, Backlog::new(0).unwrap()).unwrap();
        let mut held = vec![listener];
        loop {
            let fd = stream();
            match socket::connect(fd.as_raw_fd(), &addr) {
                Ok(()) => held.push(fd),
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => panic!("filling the backlog: {e}"),
            }
            assert!(held.len() < 64, "the backlog never filled");
        }
        (dir, path, held)
    }

    #[test]
    fn connect_to_a_listener_that_never_accepts_times_out_within_its_deadline() {
        let (_dir, path, _held) = full_backlog();
        let timeout = Duration::from_secs(1);
        for ep in [
            AgentEndpoint::Serial(path.clone()),
            AgentEndpoint::vsock(path.clone()),
        ] {
            let (result, took) = finishes_within(Duration::from_secs(60), move || {
                AgentClient::connect(&ep, timeout).map(|_| ())
            });
            match result {
                Err(AgentClientError::ConnectTimeout { timeout: t, .. }) => {
                    assert_eq!(t, timeout);
                }
                other => panic!("expected ConnectTimeout, got {other:?}"),
            }
            assert!(took >= timeout, "gave up early, after {took:?}");
        }
        let me = nix::unistd::getuid().as_raw();
        let (result, _) = finishes_within(Duration::from_secs(60), move || {
            AgentClient::connect_checked(&AgentEndpoint::Serial(path), me, timeout).map(|_| ())
        });
        assert!(matches!(
            result,
            Err(AgentClientError::ConnectTimeout { .. })
        ));
    }

    #[test]
    fn vsock_peer_that_accepts_but_never_answers_ok_times_out() {
        let (_d, ep) = fake_guest(|mut s| {
            let mut line = [0u8; 13];
            s.read_exact(&mut line).unwrap();
            thread::sleep(Duration::from_secs(30));
        });
        let AgentEndpoint::Serial(path) = ep else {
            unreachable!()
        };
        let timeout = Duration::from_millis(500);
        let (result, took) = finishes_within(Duration::from_secs(20), move || {
            AgentClient::connect(&AgentEndpoint::vsock(path), timeout).map(|_| ())
        });
        assert!(
            matches!(
                result,
                Err(AgentClientError::Timeout {
                    what: "vsock CONNECT",
                    ..
                })
            ),
            "{result:?}"
        );
        assert!(took >= timeout, "gave up early, after {took:?}");
    }

    #[test]
    fn vsock_peer_that_trickles_its_answer_cannot_stretch_the_deadline() {
        // One byte every 300 ms, never a newline: each read answers well within the
        // timeout, so only a deadline over the whole handshake ends it in time (a
        // per-read timeout would read 64 bytes over ~19 s and report a bad answer).
        let (_d, ep) = fake_guest(|mut s| {
            let mut line = [0u8; 13];
            s.read_exact(&mut line).unwrap();
            for _ in 0..100 {
                if s.write_all(b"O").is_err() {
                    return;
                }
                thread::sleep(Duration::from_millis(300));
            }
        });
        let AgentEndpoint::Serial(path) = ep else {
            unreachable!()
        };
        let (result, _) = finishes_within(Duration::from_secs(60), move || {
            AgentClient::connect(&AgentEndpoint::vsock(path), Duration::from_secs(1)).map(|_| ())
        });
        assert!(
            matches!(
                result,
                Err(AgentClientError::Timeout {
                    what: "vsock CONNECT",
                    ..
                })
            ),
            "{result:?}"
        );
    }

    #[test]
    fn a_guest_that_stops_reading_makes_the_request_time_out() {
        // The guest accepts and then never reads: a request larger than the socket
        // buffers can only be written in part.
        let (_d, ep) = fake_guest(|_s| thread::sleep(Duration::from_secs(30)));
        let timeout = Duration::from_secs(1);
        let (result, took) = finishes_within(Duration::from_secs(60), move || {
            let mut c = AgentClient::connect(&ep, Duration::from_secs(5)).unwrap();
            let big = HttpRequest {
                method: "POST".into(),
                path: "/v1/completions".into(),
                headers: vec![],
                body: "a".repeat(3 * 1024 * 1024),
            };
            let first = c.infer(big, timeout).map(|_| ());
            let again = c.status(timeout).map(|_| ());
            (first, again)
        });
        assert!(
            matches!(
                result.0,
                Err(AgentClientError::Timeout { what: "infer", .. })
            ),
            "{:?}",
            result.0
        );
        assert!(took >= timeout, "gave up early, after {took:?}");
        // Part of a frame went out: the connection cannot be used again.
        assert!(matches!(result.1, Err(AgentClientError::Broken)));
    }

    #[test]
    fn connect_checked_refuses_a_socket_served_by_another_uid() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let _listener = UnixListener::bind(&path).unwrap();
        let me = nix::unistd::getuid().as_raw();
        let ep = AgentEndpoint::Serial(path);
        match AgentClient::connect_checked(&ep, me.wrapping_add(1), Duration::from_secs(5)) {
            Err(
                e @ AgentClientError::PeerMismatch {
                    expected, actual, ..
                },
            ) => {
                assert_eq!((expected, actual), (me.wrapping_add(1), me));
                assert!(e.to_string().contains("refusing to talk to it"), "{e}");
            }
            other => panic!("expected PeerMismatch, got {:?}", other.err()),
        }
        AgentClient::connect_checked(&ep, me, Duration::from_secs(5)).unwrap();
    }

    /// A FAKE agent for client tests: a state machine that answers like the real one,
    /// with no disk or payload behind it.
    fn fake_agent(
        mut s: UnixStream,
        mut disk: DiskState,
        mut payload: PayloadState,
    ) -> Vec<String> {
        let mut seen = Vec::new();
        while let Ok(body) = read_frame(&mut s) {
            let req: RequestFrame = decode_body(&body).unwrap();
            let outcome = match req.request {
                Request::Status => Outcome::Ok(Reply::Status(StatusReply {
                    agent_version: "fake".into(),
                    protocol: PROTOCOL_VERSION,
                    channel: "virtio-serial".into(),
                    uptime_ms: 1,
                    disk,
                    payload: payload.clone(),
                })),
                Request::UnlockDisk { .. } => {
                    disk = DiskState::Unlocked;
                    Outcome::Ok(Reply::Unlocked)
                }
                Request::Mount { .. } => {
                    disk = DiskState::Mounted;
                    Outcome::Ok(Reply::Mounted { formatted: true })
                }
                Request::StartPayload => {
                    payload = PayloadState::Running {
                        pid: 9,
                        ready: true,
                        restarts: 0,
                    };
                    Outcome::Ok(Reply::PayloadStarted { pid: 9 })
                }
                Request::Health => Outcome::Ok(Reply::Health {
                    payload: payload.clone(),
                }),
                _ => Outcome::Ok(Reply::Unlocked),
            };
            seen.push(what(&req.request).to_string());
            answer(&mut s, req.id, outcome);
        }
        seen
    }

    #[test]
    fn bring_up_runs_every_step_from_a_fresh_guest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let guest = thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            fake_agent(s, DiskState::Locked, PayloadState::NotStarted)
        });
        let mut c =
            AgentClient::connect(&AgentEndpoint::Serial(path), Duration::from_secs(5)).unwrap();
        let key = DiskKey::new(&[1; 32]).unwrap();
        let done = c.bring_up(&key, Duration::from_secs(10)).unwrap();
        assert_eq!(
            done,
            BringUp {
                unlocked: true,
                mounted: true,
                formatted: true,
                started: true
            }
        );
        drop(c);
        assert_eq!(
            guest.join().unwrap(),
            vec!["status", "unlock-disk", "mount", "start-payload", "health"]
        );
    }

    #[test]
    fn bring_up_resumes_without_repeating_done_steps() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let guest = thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            fake_agent(
                s,
                DiskState::Mounted,
                PayloadState::Running {
                    pid: 3,
                    ready: true,
                    restarts: 0,
                },
            )
        });
        let mut c =
            AgentClient::connect(&AgentEndpoint::Serial(path), Duration::from_secs(5)).unwrap();
        let key = DiskKey::new(&[1; 32]).unwrap();
        assert_eq!(
            c.bring_up(&key, Duration::from_secs(10)).unwrap(),
            BringUp::default()
        );
        drop(c);
        assert_eq!(guest.join().unwrap(), vec!["status", "health"]);
    }

    #[test]
    fn wait_for_ready_gives_up_when_nothing_listens() {
        let dir = tempfile::tempdir().unwrap();
        let ep = AgentEndpoint::Serial(dir.path().join("missing.sock"));
        assert!(matches!(
            AgentClient::wait_for_ready(&ep, Duration::from_millis(300)),
            Err(AgentClientError::Connect { .. })
        ));
    }
}
