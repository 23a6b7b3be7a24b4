//! The agent's side of the channel: finds the transport (vsock if the VM has a vsock
//! device, else the named virtio-serial port), reads frames, hands requests to the
//! [`Agent`] and writes the answers. A bad frame gets an error answer and the stream is
//! resynchronised; nothing the host sends can stop the loop except `shutdown`.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{
    accept, bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, VsockAddr,
};
use thiserror::Error;

use tenantvm_agent_protocol::{
    decode_body, read_frame, resync, salvage_id, skip_body, ErrorCode, FrameError, Outcome,
    Request, RequestFrame, ResponseFrame, AGENT_VSOCK_PORT, VIRTIO_SERIAL_PORT_NAME,
};

use tenantvm_agent_protocol::mux::{accept_offer, serve_guest, MuxConfig, PumpEnd};
use tenantvm_agent_protocol::Reply;

use crate::agent::{After, Agent};
use crate::answer::{error_frame, send};

/// Most connections served at once on a socket channel: each streamed inference request
/// has one of its own (the host's per-tenant `max_concurrency` is the real limit; this
/// one only bounds the agent's threads).
pub const MAX_CONNECTIONS: usize = 256;
/// Most garbage bytes skipped while looking for the next frame.
const MAX_RESYNC: usize = 1 << 20;
/// The virtio device id of vsock.
const VIRTIO_ID_VSOCK: &str = "0x0013";

/// Why the channel could not be set up.
#[derive(Debug, Error)]
pub enum ChannelError {
    /// Neither a vsock device nor the named virtio-serial port exists.
    #[error("No vsock device and no virtio-serial port named {VIRTIO_SERIAL_PORT_NAME}; start the VM with one of them")]
    NoChannel,
    /// Opening or listening failed.
    #[error("Setting up the {what} channel failed: {source}")]
    Setup {
        /// Which channel.
        what: &'static str,
        /// Cause.
        source: std::io::Error,
    },
}

/// How a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// The host went away (EOF or I/O error).
    Closed,
    /// Shutdown was answered; power off now.
    PowerOff,
    /// The host's mux hello was accepted (virtio-serial only): the port carries mux
    /// frames from the next byte on.
    Mux(MuxConfig),
}

/// Serves one stream until the host closes it or shutdown is answered.
///
/// Reads go straight to the stream, without a userspace buffer, so that the bytes of a
/// key-bearing frame exist only in the frame's zeroized buffer.
pub fn serve_stream(agent: &Agent, r: impl Read, writer: impl Write) -> StreamEnd {
    serve_stream_with(agent, r, writer, false)
}

/// [`serve_stream`]; with `offer_mux` (the virtio-serial port), a mux hello the agent can
/// accept is answered and ends the stream with [`StreamEnd::Mux`].
fn serve_stream_with(
    agent: &Agent,
    mut r: impl Read,
    mut writer: impl Write,
    offer_mux: bool,
) -> StreamEnd {
    let mut lost_sync = false;
    loop {
        let frame = if lost_sync {
            resync(&mut r, MAX_RESYNC)
        } else {
            read_frame(&mut r)
        };
        lost_sync = false;
        let body = match frame {
            Ok(body) => body,
            Err(FrameError::Closed | FrameError::Truncated | FrameError::Io(_)) => {
                return StreamEnd::Closed
            }
            Err(e @ FrameError::TooLarge { len, .. }) => {
                let msg = e.to_string();
                if skip_body(&mut r, len).is_err() {
                    return StreamEnd::Closed;
                }
                if !send(&mut writer, &error_frame(0, ErrorCode::TooLarge, msg)) {
                    return StreamEnd::Closed;
                }
                continue;
            }
            Err(e) => {
                lost_sync = true;
                if !send(
                    &mut writer,
                    &error_frame(0, ErrorCode::BadRequest, e.to_string()),
                ) {
                    return StreamEnd::Closed;
                }
                continue;
            }
        };
        let resp = match decode_body::<RequestFrame>(&body) {
            Ok(RequestFrame {
                id,
                request: Request::InferStream(http),
            }) => {
                // The connection is the stream's: it ends with the answer.
                agent.infer_stream(id, &http, &mut writer);
                return StreamEnd::Closed;
            }
            Ok(RequestFrame {
                id,
                request: Request::ModelPush { name, size, sha256 },
            }) => {
                // The connection carries the model's data frames, then ends.
                agent.model_push(id, (&name, size, &sha256), &mut r, &mut writer);
                return StreamEnd::Closed;
            }
            Ok(RequestFrame {
                id,
                request:
                    Request::ModelPushDir {
                        name,
                        files,
                        size,
                        sha256,
                    },
            }) => {
                agent.model_push_dir(id, (&name, &files, size, &sha256), &mut r, &mut writer);
                return StreamEnd::Closed;
            }
            Ok(RequestFrame {
                id,
                request:
                    Request::Mux {
                        version,
                        max_streams,
                        window,
                    },
            }) if offer_mux => match accept_offer(version, max_streams, window, MAX_CONNECTIONS) {
                Some(cfg) => {
                    let resp = ResponseFrame {
                        id,
                        outcome: Outcome::Ok(Reply::Mux {
                            version,
                            max_streams: u32::try_from(cfg.max_streams).unwrap_or(u32::MAX),
                            window,
                        }),
                    };
                    if !send(&mut writer, &resp) {
                        return StreamEnd::Closed;
                    }
                    return StreamEnd::Mux(cfg);
                }
                None => error_frame(
                    id,
                    ErrorCode::BadRequest,
                    format!("mux version {version} with {max_streams} streams and a {window}-byte window is not offered here"),
                ),
            },
            Ok(frame) => {
                let (outcome, after) = agent.handle(frame.request);
                let resp = ResponseFrame {
                    id: frame.id,
                    outcome,
                };
                let sent = send(&mut writer, &resp);
                if after == After::PowerOff {
                    return StreamEnd::PowerOff;
                }
                if !sent {
                    return StreamEnd::Closed;
                }
                continue;
            }
            Err(e) => error_frame(salvage_id(&body), ErrorCode::BadRequest, e.to_string()),
        };
        if !send(&mut writer, &resp) {
            return StreamEnd::Closed;
        }
    }
}

/// Whether the VM has a virtio vsock device.
pub fn has_vsock_device(sys: &Path) -> bool {
    std::fs::read_dir(sys.join("bus/virtio/devices")).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            std::fs::read_to_string(e.path().join("device"))
                .is_ok_and(|id| id.trim() == VIRTIO_ID_VSOCK)
        })
    })
}

/// The /dev node of the virtio-serial port called `name`, if present.
pub fn find_serial_port(sys: &Path, name: &str) -> Option<PathBuf> {
    let entries = std::fs::read_dir(sys.join("class/virtio-ports")).ok()?;
    let mut ports: Vec<_> = entries.flatten().collect();
    ports.sort_by_key(|e| e.file_name());
    ports.into_iter().find_map(|e| {
        let port_name = std::fs::read_to_string(e.path().join("name")).ok()?;
        (port_name.trim() == name).then(|| Path::new("/dev").join(e.file_name()))
    })
}

/// Serves vsock port [`AGENT_VSOCK_PORT`], one connection at a time, until shutdown.
pub fn serve_vsock(agent: &Agent) -> Result<(), ChannelError> {
    let setup = |source| ChannelError::Setup {
        what: "vsock",
        source,
    };
    let fd = socket(
        AddressFamily::Vsock,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| setup(e.into()))?;
    bind(
        fd.as_raw_fd(),
        &VsockAddr::new(libc::VMADDR_CID_ANY, AGENT_VSOCK_PORT),
    )
    .map_err(|e| setup(e.into()))?;
    listen(&fd, Backlog::new(64).map_err(|e| setup(e.into()))?).map_err(|e| setup(e.into()))?;
    agent.set_channel("vsock");
    agent.log(&format!("serving vsock port {AGENT_VSOCK_PORT}"));
    serve_connections(agent, &fd);
    Ok(())
}

fn lock_fds(m: &Mutex<Vec<RawFd>>) -> std::sync::MutexGuard<'_, Vec<RawFd>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Accepts connections on a listening stream socket (vsock in the guest) and serves each
/// on its own thread, at most [`MAX_CONNECTIONS`] at once, until one of them answers
/// `shutdown`; the others are then cut off so the agent can power off.
pub fn serve_connections(agent: &Agent, listener: &OwnedFd) {
    let stop = AtomicBool::new(false);
    // Open connections; an fd is removed (under the lock) before it is closed.
    let active: Mutex<Vec<RawFd>> = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        while !stop.load(Ordering::SeqCst) {
            let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::from(200u16)) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            }
            let conn: OwnedFd = match accept(listener) {
                Ok(conn) => conn,
                Err(e) => {
                    agent.log(&format!("accept failed: {e}"));
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            let raw = conn.as_raw_fd();
            {
                let mut open = lock_fds(&active);
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                if open.len() >= MAX_CONNECTIONS {
                    agent.log("refusing a connection: too many open");
                    continue;
                }
                open.push(raw);
            }
            let (stop, active) = (&stop, &active);
            scope.spawn(move || {
                let file = File::from(conn);
                let end = serve_stream(agent, &file, &file);
                let mut open = lock_fds(active);
                open.retain(|fd| *fd != raw);
                if end == StreamEnd::PowerOff {
                    stop.store(true, Ordering::SeqCst);
                    for fd in open.iter() {
                        // SAFETY: shutdown(2) on a descriptor that is still open (it is
                        // removed from the list, under this lock, before it is closed).
                        unsafe { libc::shutdown(*fd, libc::SHUT_RDWR) };
                    }
                }
                drop(open);
                drop(file);
            });
        }
    });
}

/// Serves the virtio-serial port at `dev` until shutdown. The port reads EOF while no
/// host is connected, so EOF means "wait", not "stop".
pub fn serve_serial(agent: &Agent, dev: &Path) -> Result<(), ChannelError> {
    let port = OpenOptions::new()
        .read(true)
        .write(true)
        .open(dev)
        .map_err(|source| ChannelError::Setup {
            what: "virtio-serial",
            source,
        })?;
    agent.set_channel("virtio-serial");
    agent.log(&format!("serving virtio-serial port {}", dev.display()));
    let mut carry = Vec::new();
    loop {
        match serve_port_once(agent, &port, &mut carry) {
            PortEnd::PowerOff => return Ok(()),
            PortEnd::Closed => std::thread::sleep(Duration::from_millis(50)),
            PortEnd::Served => {}
            PortEnd::Setup(source) => {
                return Err(ChannelError::Setup {
                    what: "virtio-serial",
                    source,
                })
            }
        }
    }
}

/// How one turn of the serial port's loop ended.
enum PortEnd {
    /// Shutdown was answered.
    PowerOff,
    /// The host is not connected (end of file): wait and read again.
    Closed,
    /// A mux session ended; the port is plain again.
    Served,
    /// The port could not be cloned for the mux loop.
    Setup(std::io::Error),
}

/// One turn of the serial port's loop: plain requests until the host disconnects or a mux
/// hello is accepted, then the mux session. `carry` holds bytes a mux session handed back
/// (a plain request that arrived where a mux frame was due: the daemon that agreed the mux
/// went without an `end`, a new one speaks plainly); they are read before the port's.
fn serve_port_once<P: AsFd>(agent: &Agent, port: &P, carry: &mut Vec<u8>) -> PortEnd
where
    for<'a> &'a P: Read + Write,
{
    let end = if carry.is_empty() {
        serve_stream_with(agent, port, port, true)
    } else {
        let first = std::io::Cursor::new(std::mem::take(carry));
        serve_stream_with(agent, first.chain(port), port, true)
    };
    match end {
        StreamEnd::PowerOff => PortEnd::PowerOff,
        StreamEnd::Closed => PortEnd::Closed,
        StreamEnd::Mux(cfg) => {
            let chan = match port.as_fd().try_clone_to_owned() {
                Ok(c) => c,
                Err(e) => return PortEnd::Setup(e),
            };
            agent.set_channel("virtio-serial (multiplexed)");
            let end = serve_muxed(agent, chan, cfg);
            agent.set_channel("virtio-serial");
            match end {
                Muxed::PowerOff => return PortEnd::PowerOff,
                Muxed::Ended(PumpEnd::Closed) => {}
                Muxed::Ended(PumpEnd::Plain(bytes)) => {
                    agent.log(
                        "mux channel left without an end; a plain request followed: serving it plainly",
                    );
                    *carry = bytes;
                }
                Muxed::Ended(PumpEnd::Failed(why)) => {
                    agent.log(&format!("mux channel dropped: {why}"));
                }
            }
            PortEnd::Served
        }
    }
}

/// How a multiplexed session of the serial port ended.
enum Muxed {
    /// A stream answered `shutdown`.
    PowerOff,
    /// The host went away or broke the rules: serve the port plainly again.
    Ended(PumpEnd),
}

/// Serves the multiplexed port: each stream the host opens is served on its own thread as
/// a vsock connection is, until the host disconnects or a stream answers `shutdown`.
fn serve_muxed(agent: &Agent, chan: OwnedFd, cfg: MuxConfig) -> Muxed {
    let power_off = AtomicBool::new(false);
    let end = std::thread::scope(|scope| {
        let power_off = &power_off;
        serve_guest(chan, cfg, &mut |stream, stop| {
            scope.spawn(move || {
                if serve_stream(agent, &stream, &stream) == StreamEnd::PowerOff {
                    power_off.store(true, Ordering::SeqCst);
                    stop.stop();
                }
            });
        })
    });
    if power_off.load(Ordering::SeqCst) {
        Muxed::PowerOff
    } else {
        Muxed::Ended(end)
    }
}

/// Picks the channel (vsock first) and serves it until shutdown is answered.
pub fn serve(agent: &Agent, sys: &Path, port_wait: Duration) -> Result<(), ChannelError> {
    if has_vsock_device(sys) {
        return serve_vsock(agent);
    }
    let deadline = Instant::now() + port_wait;
    loop {
        if let Some(dev) = find_serial_port(sys, VIRTIO_SERIAL_PORT_NAME) {
            if dev.exists() {
                return serve_serial(agent, &dev);
            }
        }
        if Instant::now() >= deadline {
            return Err(ChannelError::NoChannel);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AgentConfig, DiskConfig, PayloadConfig};
    use crate::logbuf::LogBuffer;
    use crate::reaper::Reaper;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;
    use tenantvm_agent_protocol::{
        encode_frame, DiskKey, Reply, Request, HEADER_LEN, MAGIC, MAX_BODY_LEN, PROTOCOL_VERSION,
    };

    fn reaper() -> Reaper {
        Reaper::start().unwrap()
    }

    fn agent(dir: &Path) -> Arc<Agent> {
        let cfg = AgentConfig {
            modules: vec![],
            disk: DiskConfig {
                device: dir.join("disk.img"),
                mapper_name: "t".into(),
                mount_point: dir.join("data"),
                cryptsetup: "/bin/false".into(),
                mkfs: "/bin/false".into(),
            },
            payload: PayloadConfig {
                command: vec!["/bin/true".into()],
                env: Default::default(),
                workdir: dir.to_path_buf(),
                port: 1,
                health_path: "/health".into(),
                confine: None,
            },
        };
        std::fs::write(dir.join("disk.img"), [0u8; 4096]).unwrap();
        Arc::new(Agent::new(cfg, reaper(), Arc::new(LogBuffer::new(100))))
    }

    /// Runs the server on one end of a socket pair; returns the host end.
    fn serve_pair(agent: Arc<Agent>) -> (UnixStream, std::thread::JoinHandle<StreamEnd>) {
        let (host, guest) = UnixStream::pair().unwrap();
        let h = std::thread::spawn(move || serve_stream(&agent, &guest, &guest));
        host.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        (host, h)
    }

    fn ask(host: &mut UnixStream, id: u64, request: Request) -> ResponseFrame {
        host.write_all(&encode_frame(&RequestFrame { id, request }).unwrap())
            .unwrap();
        decode_body(&read_frame(host).unwrap()).unwrap()
    }

    fn error_code(resp: &ResponseFrame) -> ErrorCode {
        match &resp.outcome {
            Outcome::Err(f) => f.code,
            other => panic!("expected an error, got {other:?}"),
        }
    }

    /// The serial port's loop on a socket pair: plain frames, then the mux once the
    /// hello is accepted (as `serve_serial` does with the port).
    fn serve_serial_pair(agent: Arc<Agent>) -> (UnixStream, std::thread::JoinHandle<bool>) {
        let (host, guest) = UnixStream::pair().unwrap();
        let h = std::thread::spawn(move || {
            let mut carry = Vec::new();
            loop {
                match serve_port_once(&agent, &guest, &mut carry) {
                    PortEnd::PowerOff => return true,
                    PortEnd::Closed => return false,
                    PortEnd::Served => {}
                    PortEnd::Setup(e) => panic!("{e}"),
                }
            }
        });
        (host, h)
    }

    #[test]
    fn the_serial_port_serves_streams_concurrently_once_mux_is_agreed() {
        use tenantvm_agent_protocol::mux::{negotiate, MuxConfig, Negotiated};
        use tenantvm_agent_protocol::AgentClient;
        let dir = tempfile::tempdir().unwrap();
        let (host, h) = serve_serial_pair(agent(dir.path()));
        let t = Duration::from_secs(10);
        let cfg = MuxConfig {
            max_streams: 4,
            ..MuxConfig::default()
        };
        let Negotiated::Mux(ch) = negotiate(AgentClient::over_stream(host), cfg, t).unwrap() else {
            panic!("the agent refused the mux");
        };
        // A long poll holds one stream while another is answered: real concurrency.
        let mut waiting = AgentClient::over_stream(ch.open_stream().unwrap());
        let long = std::thread::spawn(move || {
            let started = Instant::now();
            waiting
                .call(
                    &Request::Logs {
                        after: u64::MAX - 1,
                        max: 1,
                        wait_ms: 1500,
                    },
                    Duration::from_secs(10),
                )
                .unwrap();
            started.elapsed()
        });
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        let mut quick = AgentClient::over_stream(ch.open_stream().unwrap());
        quick.status(t).unwrap();
        assert!(started.elapsed() < Duration::from_millis(1000));
        assert!(long.join().unwrap() >= Duration::from_millis(1400));
        // A stream still refuses a second hello (it is not the serial port).
        let mut other = AgentClient::over_stream(ch.open_stream().unwrap());
        let hello = Request::Mux {
            version: 1,
            max_streams: 2,
            window: 4096,
        };
        other.call(&hello, t).unwrap_err();
        drop(other);
        // Shutdown on a stream is answered, then the agent powers off.
        let mut last = AgentClient::over_stream(ch.open_stream().unwrap());
        last.shutdown(t).unwrap();
        assert!(h.join().unwrap());
    }

    #[test]
    fn a_port_the_mux_gave_back_serves_the_next_client_plainly_at_once() {
        use tenantvm_agent_protocol::mux::{negotiate, MuxConfig, Negotiated};
        use tenantvm_agent_protocol::AgentClient;
        let dir = tempfile::tempdir().unwrap();
        let (mut port, h) = serve_serial_pair(agent(dir.path()));
        port.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        // The daemon's channel, on its own descriptor of the port, closes when idle.
        let cfg = MuxConfig {
            max_streams: 4,
            idle: Some(Duration::from_millis(200)),
            ..MuxConfig::default()
        };
        let daemon = AgentClient::over_stream(port.try_clone().unwrap());
        let t = Duration::from_secs(10);
        let Negotiated::Mux(ch) = negotiate(daemon, cfg, t).unwrap() else {
            panic!("the agent refused the mux");
        };
        AgentClient::over_stream(ch.open_stream().unwrap())
            .status(t)
            .unwrap();
        let until = Instant::now() + t;
        while ch.ended().is_none() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(ch);
        // As QEMU's chardev does, the port passes to the next client with no gap the
        // guest could see: its plain request must be read as one, not as mux frames.
        let resp = ask(&mut port, 7, Request::Status);
        assert_eq!(resp.id, 7);
        assert!(
            matches!(resp.outcome, Outcome::Ok(Reply::Status(_))),
            "{resp:?}"
        );
        drop(port);
        assert!(!h.join().unwrap());
    }

    #[test]
    fn after_a_daemon_that_left_without_an_end_the_next_one_is_served_plainly() {
        let dir = tempfile::tempdir().unwrap();
        let (mut port, h) = serve_serial_pair(agent(dir.path()));
        port.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let hello = || Request::Mux {
            version: 1,
            max_streams: 4,
            window: 64 * 1024,
        };
        // A daemon agrees the mux and is killed: no end, no mux frame ever sent.
        let agreed = ask(&mut port, 1, hello());
        assert!(
            matches!(agreed.outcome, Outcome::Ok(Reply::Mux { .. })),
            "{agreed:?}"
        );
        // The next daemon offers the mux afresh, plainly: answered.
        let again = ask(&mut port, 2, hello());
        assert_eq!(again.id, 2);
        assert!(
            matches!(again.outcome, Outcome::Ok(Reply::Mux { .. })),
            "{again:?}"
        );
        // That one is killed too; a direct tool asks plainly: answered.
        let status = ask(&mut port, 3, Request::Status);
        assert_eq!(status.id, 3);
        assert!(
            matches!(status.outcome, Outcome::Ok(Reply::Status(_))),
            "{status:?}"
        );
        drop(port);
        assert!(!h.join().unwrap());
    }

    #[test]
    fn a_bad_hello_on_the_serial_port_is_refused_and_the_port_stays_plain() {
        let dir = tempfile::tempdir().unwrap();
        let (mut host, h) = serve_serial_pair(agent(dir.path()));
        host.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let bad = Request::Mux {
            version: 99,
            max_streams: 2,
            window: 4096,
        };
        assert_eq!(error_code(&ask(&mut host, 1, bad)), ErrorCode::BadRequest);
        let resp = ask(&mut host, 2, Request::Status);
        assert!(matches!(resp.outcome, Outcome::Ok(Reply::Status(_))));
        drop(host);
        assert!(!h.join().unwrap());
    }

    #[test]
    fn hostile_frames_get_errors_and_the_stream_survives() {
        let dir = tempfile::tempdir().unwrap();
        let (mut host, h) = serve_pair(agent(dir.path()));
        let read = |host: &mut UnixStream| -> ResponseFrame {
            decode_body(&read_frame(host).unwrap()).unwrap()
        };

        // Oversized: refused, body skipped.
        let mut big = MAGIC.to_vec();
        big.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
        big.extend_from_slice(&0u16.to_be_bytes());
        big.extend_from_slice(&(MAX_BODY_LEN + 1).to_be_bytes());
        assert_eq!(big.len(), HEADER_LEN);
        host.write_all(&big).unwrap();
        let w = host.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            let mut w = w;
            let chunk = vec![b'x'; 64 * 1024];
            let mut left = MAX_BODY_LEN as usize + 1;
            while left > 0 {
                let n = left.min(chunk.len());
                w.write_all(&chunk[..n]).unwrap();
                left -= n;
            }
        });
        assert_eq!(error_code(&read(&mut host)), ErrorCode::TooLarge);
        writer.join().unwrap();

        // Bad JSON with a readable id: the error carries the id.
        let body = br#"{"id":5,"request":{"cmd":"format-c"}}"#;
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
        f.extend_from_slice(&0u16.to_be_bytes());
        f.extend_from_slice(&(body.len() as u32).to_be_bytes());
        f.extend_from_slice(body);
        host.write_all(&f).unwrap();
        let resp = read(&mut host);
        assert_eq!((resp.id, error_code(&resp)), (5, ErrorCode::BadRequest));

        // Garbage: an error, then resync onto the next good frame.
        host.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(error_code(&read(&mut host)), ErrorCode::BadRequest);
        let resp = ask(&mut host, 6, Request::Status);
        assert_eq!(resp.id, 6);
        assert!(matches!(resp.outcome, Outcome::Ok(Reply::Status(_))));

        drop(host);
        assert_eq!(h.join().unwrap(), StreamEnd::Closed);
    }

    #[test]
    fn random_streams_end_cleanly_without_panicking() {
        let dir = tempfile::tempdir().unwrap();
        let a = agent(dir.path());
        let mut seed = 7u64;
        for _ in 0..200 {
            let n = (seed % 300) as usize;
            let mut input = Vec::with_capacity(n + HEADER_LEN);
            for _ in 0..n {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                input.push((seed >> 33) as u8);
            }
            // Sometimes a valid-looking header announcing a body that never comes.
            if seed % 3 == 0 {
                input.extend_from_slice(&MAGIC);
                input.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
                input.extend_from_slice(&[0, 0, 0, 0, 1, 0]);
            }
            let mut out = Vec::new();
            assert_eq!(serve_stream(&a, &input[..], &mut out), StreamEnd::Closed);
            // Whatever came back is well-formed frames.
            let mut r = &out[..];
            while !r.is_empty() {
                let body = read_frame(&mut r).unwrap();
                decode_body::<ResponseFrame>(&body).unwrap();
            }
        }
    }

    #[test]
    fn socket_channel_serves_connections_concurrently_and_stops_on_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let a = agent(dir.path());
        let path = dir.path().join("agent.sock");
        let listener = OwnedFd::from(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let server = {
            let a = Arc::clone(&a);
            std::thread::spawn(move || serve_connections(&a, &listener))
        };
        let connect = || {
            let s = UnixStream::connect(&path).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            s
        };
        let mut idle = connect();
        let mut busy = connect();
        // Both are served, in any order.
        assert!(matches!(
            ask(&mut idle, 1, Request::Status).outcome,
            Outcome::Ok(Reply::Status(_))
        ));
        assert!(matches!(
            ask(&mut busy, 2, Request::Status).outcome,
            Outcome::Ok(Reply::Status(_))
        ));
        // Beyond the limit, a connection is closed at once.
        let extra: Vec<UnixStream> = (0..MAX_CONNECTIONS - 2).map(|_| connect()).collect();
        let mut refused = connect();
        let mut buf = [0u8; 1];
        assert_eq!(refused.read(&mut buf).unwrap(), 0);
        drop(extra);
        // Shutdown on one connection ends the loop and cuts the idle one off.
        let resp = ask(&mut busy, 3, Request::Shutdown);
        assert!(matches!(resp.outcome, Outcome::Ok(Reply::ShuttingDown(_))));
        server.join().unwrap();
        assert_eq!(idle.read(&mut buf).unwrap(), 0);
    }

    #[test]
    fn commands_out_of_order_are_refused_with_wrong_state() {
        let dir = tempfile::tempdir().unwrap();
        let (mut host, _h) = serve_pair(agent(dir.path()));
        let resp = ask(
            &mut host,
            1,
            Request::Mount {
                format_if_missing: true,
            },
        );
        assert_eq!(error_code(&resp), ErrorCode::WrongState);
        let resp = ask(&mut host, 2, Request::StartPayload);
        assert_eq!(error_code(&resp), ErrorCode::WrongState);
        let resp = ask(
            &mut host,
            3,
            Request::Infer(tenantvm_agent_protocol::HttpRequest {
                method: "GET".into(),
                path: "/".into(),
                headers: vec![],
                body: String::new(),
            }),
        );
        assert_eq!(error_code(&resp), ErrorCode::PayloadUnavailable);
        let resp = ask(&mut host, 4, Request::Health);
        assert!(matches!(
            resp.outcome,
            Outcome::Ok(Reply::Health {
                payload: tenantvm_agent_protocol::PayloadState::NotStarted
            })
        ));
    }

    #[test]
    fn a_stream_request_without_a_payload_is_an_error_and_ends_the_connection() {
        let dir = tempfile::tempdir().unwrap();
        let (mut host, h) = serve_pair(agent(dir.path()));
        let resp = ask(
            &mut host,
            9,
            Request::InferStream(tenantvm_agent_protocol::HttpRequest {
                method: "POST".into(),
                path: "/v1/completions".into(),
                headers: vec![],
                body: "{}".into(),
            }),
        );
        assert_eq!(
            (resp.id, error_code(&resp)),
            (9, ErrorCode::PayloadUnavailable)
        );
        assert_eq!(h.join().unwrap(), StreamEnd::Closed);
        let mut buf = [0u8; 1];
        assert_eq!(host.read(&mut buf).unwrap(), 0);
    }

    #[test]
    fn failed_unlock_is_an_error_that_never_shows_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let a = agent(dir.path());
        // cryptsetup is /bin/false here: it exits 1 without reading the key.
        let (outcome, _) = a.handle(Request::UnlockDisk {
            key: DiskKey::new(&[7; 32]).unwrap(),
        });
        match outcome {
            Outcome::Err(f) => {
                assert_eq!(f.code, ErrorCode::Internal);
                assert!(!f.message.contains("0707"), "{}", f.message);
            }
            other => panic!("{other:?}"),
        }
        let (lines, _) = a.logs().since(0, 100);
        assert!(lines.iter().all(|l| !l.line.contains("0707")));
    }

    #[test]
    fn logs_are_served_with_a_cursor_and_a_cap() {
        let dir = tempfile::tempdir().unwrap();
        let a = agent(dir.path());
        for i in 0..5 {
            a.log(&format!("line {i}"));
        }
        let (mut host, _h) = serve_pair(a);
        let resp = ask(
            &mut host,
            1,
            Request::Logs {
                after: 2,
                max: 2,
                wait_ms: 0,
            },
        );
        let Outcome::Ok(Reply::Logs { lines, next }) = resp.outcome else {
            panic!()
        };
        assert_eq!(lines.len(), 2);
        assert_eq!(next, 4);
    }

    #[test]
    fn channel_discovery_reads_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path();
        assert!(!has_vsock_device(sys));
        assert_eq!(find_serial_port(sys, VIRTIO_SERIAL_PORT_NAME), None);
        let dev = sys.join("bus/virtio/devices/virtio3");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("device"), "0x0003\n").unwrap();
        assert!(!has_vsock_device(sys));
        std::fs::write(dev.join("device"), "0x0013\n").unwrap();
        assert!(has_vsock_device(sys));
        let port = sys.join("class/virtio-ports/vport1p1");
        std::fs::create_dir_all(&port).unwrap();
        std::fs::write(port.join("name"), "org.tenantvm.agent.0\n").unwrap();
        assert_eq!(
            find_serial_port(sys, VIRTIO_SERIAL_PORT_NAME),
            Some(PathBuf::from("/dev/vport1p1"))
        );
    }
}
