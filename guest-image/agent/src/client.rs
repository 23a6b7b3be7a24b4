//! The host side of the control channel, for the orchestrator: connect over a Unix
//! socket, wait for the agent, deliver the key, start the payload, check health, forward
//! inference, shut down. Synchronous (std only) with deadlines on every call.
//!
//! Everything the guest sends is hostile: frames are decoded by [`FrameDecoder`] with the
//! protocol's size cap, answers to other ids are dropped (bounded), and a framing error
//! marks the connection broken so the caller reconnects instead of reading garbage.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::protocol::{
    decode_body, encode_frame, AgentFailure, DiskKey, DiskState, FrameDecoder, FrameError,
    HttpRequest, HttpResponse, LogLine, Outcome, PayloadState, Reply, Request, RequestFrame,
    ResponseFrame, ShutdownReport, StatusReply, AGENT_VSOCK_PORT,
};

/// Most unrelated responses skipped while waiting for one id.
const MAX_STALE_RESPONSES: usize = 64;

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
}

impl AgentEndpoint {
    /// The hybrid-vsock endpoint on the agent's standard port.
    pub fn vsock(path: impl Into<PathBuf>) -> Self {
        Self::HybridVsock {
            path: path.into(),
            port: AGENT_VSOCK_PORT,
        }
    }

    /// The Unix socket to connect to.
    pub fn path(&self) -> &Path {
        match self {
            Self::Serial(p) | Self::HybridVsock { path: p, .. } => p,
        }
    }
}

/// Why a call to the agent failed.
#[derive(Debug, Error)]
pub enum AgentClientError {
    /// The socket could not be opened.
    #[error("Cannot connect to the agent channel at {path}: {source}")]
    Connect {
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
    stream: UnixStream,
    decoder: FrameDecoder,
    next_id: u64,
    broken: bool,
}

fn what(req: &Request) -> &'static str {
    match req {
        Request::Status => "status",
        Request::UnlockDisk { .. } => "unlock-disk",
        Request::Mount { .. } => "mount",
        Request::StartPayload => "start-payload",
        Request::Health => "health",
        Request::Logs { .. } => "logs",
        Request::Infer(_) => "infer",
        Request::Shutdown => "shutdown",
    }
}

impl AgentClient {
    /// Connects to the channel (and completes the hybrid-vsock handshake) within `timeout`.
    pub fn connect(endpoint: &AgentEndpoint, timeout: Duration) -> Result<Self, AgentClientError> {
        let path = endpoint.path();
        let stream = UnixStream::connect(path).map_err(|source| AgentClientError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        let mut client = Self {
            stream,
            decoder: FrameDecoder::default(),
            next_id: 1,
            broken: false,
        };
        if let AgentEndpoint::HybridVsock { port, .. } = endpoint {
            client.handshake(*port, timeout)?;
        }
        Ok(client)
    }

    fn handshake(&mut self, port: u32, timeout: Duration) -> Result<(), AgentClientError> {
        self.stream
            .write_all(format!("CONNECT {port}\n").as_bytes())?;
        self.stream.set_read_timeout(Some(timeout))?;
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while line.len() < 64 {
            match self.stream.read(&mut byte) {
                Ok(0) => break,
                Ok(_) if byte[0] == b'\n' => {
                    let text = String::from_utf8_lossy(&line).into_owned();
                    if text.starts_with("OK ") {
                        return Ok(());
                    }
                    return Err(AgentClientError::Handshake { port, answer: text });
                }
                Ok(_) => line.push(byte[0]),
                Err(e) if is_timeout(&e) => {
                    return Err(AgentClientError::Timeout {
                        what: "vsock CONNECT",
                        timeout,
                    })
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(AgentClientError::Handshake {
            port,
            answer: String::from_utf8_lossy(&line).into_owned(),
        })
    }

    /// A client over a stream the caller connected itself (e.g. after checking the
    /// listener's credentials): a serial channel, or a vsock stream past its handshake.
    /// Its ids start from the clock (below 2^53, exact in JSON), so a late answer to an
    /// earlier connection's request on the same serial channel is never taken for an
    /// answer to this one's.
    pub fn from_stream(stream: UnixStream) -> Self {
        let micros = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(1);
        Self {
            stream,
            decoder: FrameDecoder::default(),
            next_id: micros.clamp(1, (1 << 53) - 1),
            broken: false,
        }
    }

    /// A client over a stream the caller connected to `endpoint` itself (e.g. after
    /// checking the listener's credentials), completing the hybrid-vsock handshake within
    /// `timeout` when the endpoint is one.
    pub fn over_stream(
        stream: UnixStream,
        endpoint: &AgentEndpoint,
        timeout: Duration,
    ) -> Result<Self, AgentClientError> {
        let mut client = Self::from_stream(stream);
        if let AgentEndpoint::HybridVsock { port, .. } = endpoint {
            client.handshake(*port, timeout)?;
        }
        Ok(client)
    }

    /// Connects and polls `status` until the agent answers or `timeout` passes. Works
    /// while the guest is still booting: the channel socket exists before the agent does.
    pub fn wait_for_ready(
        endpoint: &AgentEndpoint,
        timeout: Duration,
    ) -> Result<(Self, StatusReply), AgentClientError> {
        Self::wait_for_ready_with(&mut |t| Self::connect(endpoint, t), timeout)
    }

    /// [`Self::wait_for_ready`] with the caller's way of connecting (called again after
    /// each failed attempt with the time it may take).
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
                        match client.send(&Request::Status) {
                            Ok(id) => sent.push(id),
                            Err(e) => {
                                // The socket may accept before the far end is up; reconnect.
                                last_err = Some(e);
                                break;
                            }
                        }
                        let left = deadline.saturating_duration_since(Instant::now());
                        match client.receive_any(&sent, left.min(Duration::from_secs(1))) {
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
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(last_err.unwrap_or(AgentClientError::Timeout {
            what: "status",
            timeout,
        }))
    }

    fn send(&mut self, req: &Request) -> Result<u64, AgentClientError> {
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
        if let Err(e) = self.stream.write_all(&frame) {
            self.broken = true;
            return Err(e.into());
        }
        Ok(id)
    }

    /// Waits for a response to any of `ids`, dropping a bounded number of others.
    fn receive_any(
        &mut self,
        ids: &[u64],
        timeout: Duration,
    ) -> Result<ResponseFrame, AgentClientError> {
        let deadline = Instant::now() + timeout;
        let mut skipped = 0;
        let mut buf = [0u8; 16 * 1024];
        loop {
            match self.decoder.next_frame() {
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
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(AgentClientError::Timeout {
                    what: "response",
                    timeout,
                });
            }
            self.stream.set_read_timeout(Some(left))?;
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    self.broken = true;
                    return Err(AgentClientError::Closed);
                }
                Ok(n) => self.decoder.push(&buf[..n]),
                Err(e) if is_timeout(&e) => {
                    return Err(AgentClientError::Timeout {
                        what: "response",
                        timeout,
                    })
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.broken = true;
                    return Err(e.into());
                }
            }
        }
    }

    /// Sends one request and returns the agent's reply (an agent error becomes
    /// [`AgentClientError::Agent`]).
    pub fn call(&mut self, req: &Request, timeout: Duration) -> Result<Reply, AgentClientError> {
        let name = what(req);
        let id = self.send(req)?;
        match self.receive_any(&[id], timeout) {
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

    /// The agent's state.
    pub fn status(&mut self, timeout: Duration) -> Result<StatusReply, AgentClientError> {
        match self.call(&Request::Status, timeout)? {
            Reply::Status(s) => Ok(s),
            _ => Err(AgentClientError::UnexpectedReply { what: "status" }),
        }
    }

    /// Delivers the disk key; the agent opens the dm-crypt mapping with it.
    pub fn unlock_disk(
        &mut self,
        key: &DiskKey,
        timeout: Duration,
    ) -> Result<(), AgentClientError> {
        match self.call(&Request::UnlockDisk { key: key.clone() }, timeout)? {
            Reply::Unlocked => Ok(()),
            _ => Err(AgentClientError::UnexpectedReply {
                what: "unlock-disk",
            }),
        }
    }

    /// Mounts the unlocked disk; returns whether a file system was created.
    pub fn mount(
        &mut self,
        format_if_missing: bool,
        timeout: Duration,
    ) -> Result<bool, AgentClientError> {
        match self.call(&Request::Mount { format_if_missing }, timeout)? {
            Reply::Mounted { formatted } => Ok(formatted),
            _ => Err(AgentClientError::UnexpectedReply { what: "mount" }),
        }
    }

    /// Starts the payload; returns its guest pid.
    pub fn start_payload(&mut self, timeout: Duration) -> Result<u32, AgentClientError> {
        match self.call(&Request::StartPayload, timeout)? {
            Reply::PayloadStarted { pid } => Ok(pid),
            _ => Err(AgentClientError::UnexpectedReply {
                what: "start-payload",
            }),
        }
    }

    /// The payload's state and readiness.
    pub fn health(&mut self, timeout: Duration) -> Result<PayloadState, AgentClientError> {
        match self.call(&Request::Health, timeout)? {
            Reply::Health { payload } => Ok(payload),
            _ => Err(AgentClientError::UnexpectedReply { what: "health" }),
        }
    }

    /// Polls health until the payload is ready; fails early if it exits.
    pub fn wait_payload_ready(&mut self, timeout: Duration) -> Result<(), AgentClientError> {
        let deadline = Instant::now() + timeout;
        let mut last = PayloadState::NotStarted;
        while Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            last = self.health(left.max(Duration::from_secs(1)))?;
            match last {
                PayloadState::Running { ready: true, .. } => return Ok(()),
                PayloadState::Exited { .. } => break,
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
        Err(AgentClientError::PayloadNotReady { timeout, last })
    }

    /// Brings the guest from whatever state it is in to "payload ready": delivers the key
    /// if the disk is locked, mounts it (creating ext4 on first use), starts the payload if
    /// it is not running, and waits for readiness. Idempotent, so an orchestrator resuming
    /// an interrupted create can call it again.
    pub fn bring_up(
        &mut self,
        key: &DiskKey,
        timeout: Duration,
    ) -> Result<BringUp, AgentClientError> {
        let deadline = Instant::now() + timeout;
        let left = || {
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        let status = self.status(left())?;
        let mut done = BringUp::default();
        if status.disk == DiskState::Locked {
            self.unlock_disk(key, left())?;
            done.unlocked = true;
        }
        if status.disk != DiskState::Mounted {
            done.formatted = self.mount(true, left())?;
            done.mounted = true;
        }
        if !matches!(status.payload, PayloadState::Running { .. }) {
            self.start_payload(left())?;
            done.started = true;
        }
        self.wait_payload_ready(left())?;
        Ok(done)
    }

    /// Log lines after `after`, waiting up to `wait` (≤ 30 s) for a first new one; pass
    /// the returned cursor back to follow the log. `timeout` must exceed `wait`.
    pub fn logs(
        &mut self,
        after: u64,
        max: u32,
        wait: Duration,
        timeout: Duration,
    ) -> Result<(Vec<LogLine>, u64), AgentClientError> {
        let wait_ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX);
        match self.call(
            &Request::Logs {
                after,
                max,
                wait_ms,
            },
            timeout,
        )? {
            Reply::Logs { lines, next } => Ok((lines, next)),
            _ => Err(AgentClientError::UnexpectedReply { what: "logs" }),
        }
    }

    /// Forwards an HTTP request to the payload.
    pub fn infer(
        &mut self,
        req: HttpRequest,
        timeout: Duration,
    ) -> Result<HttpResponse, AgentClientError> {
        match self.call(&Request::Infer(req), timeout)? {
            Reply::Infer(resp) => Ok(resp),
            _ => Err(AgentClientError::UnexpectedReply { what: "infer" }),
        }
    }

    /// Asks for a clean shutdown; the guest powers off after answering.
    pub fn shutdown(&mut self, timeout: Duration) -> Result<ShutdownReport, AgentClientError> {
        match self.call(&Request::Shutdown, timeout)? {
            Reply::ShuttingDown(report) => Ok(report),
            _ => Err(AgentClientError::UnexpectedReply { what: "shutdown" }),
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{
        read_frame, ErrorCode, HEADER_LEN, MAGIC, MAX_BODY_LEN, PROTOCOL_VERSION,
    };
    use std::os::unix::net::UnixListener;
    use std::thread;

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
                assert_eq!(failure.code, ErrorCode::WrongState)
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
                disk: crate::protocol::DiskState::Locked,
                payload: PayloadState::NotStarted,
            };
            answer(&mut s, req.id, Outcome::Ok(Reply::Status(status)));
            thread::sleep(Duration::from_secs(1));
        });
        let (_c, s) = AgentClient::wait_for_ready(&ep, Duration::from_secs(20)).unwrap();
        assert_eq!(s.channel, "virtio-serial");
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
