//! Connecting to a socket that a tenant's process serves (the VMM's control socket, QMP,
//! the guest agent's channel): one place for the two rules every such connection follows.
//!
//! 1. **A deadline on everything.** The listener runs as the tenant and may be wedged,
//!    stopped or hostile. `connect(2)` on a Unix socket whose backlog is full (QEMU listens
//!    with a backlog of 1; a stopped QEMU never accepts) blocks until the peer accepts; it is
//!    bounded here by `SO_SNDTIMEO`, which the kernel applies to that wait. Every read and
//!    write afterwards gets what is left of the same deadline ([`DeadlineStream`]), so a
//!    peer that trickles bytes cannot stretch an exchange either.
//! 2. **The peer's uid.** The sockets live in the tenant's `run/` directory, which its VMM
//!    can write: a compromised VMM could replace one with a symlink to another tenant's
//!    socket. `SO_PEERCRED` must name the tenant's uid, or the connection is refused.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, UnixAddr};
use nix::sys::time::TimeVal;

/// Why a tenant-served socket could not be used.
#[derive(Debug, thiserror::Error)]
pub enum PeerSocketError {
    /// The socket could not be reached (missing, refused, not a socket, ...).
    #[error("Cannot connect to {}: {source}", path.display())]
    Connect {
        /// The socket.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// The deadline passed: the process behind the socket is wedged, stopped or too slow.
    #[error("{what} on {} did not complete within {timeout:?}: the process serving it does not answer", path.display())]
    Timeout {
        /// The socket.
        path: PathBuf,
        /// What was waited for (connect, send, answer).
        what: &'static str,
        /// The whole exchange's deadline.
        timeout: Duration,
    },
    /// `SO_PEERCRED` could not be read.
    #[error("Cannot read the credentials of the process serving {}: {source}", path.display())]
    Credentials {
        /// The socket.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// The socket is served by another uid than the tenant's.
    #[error("{} is served by uid {actual}, not the tenant's uid {expected}; refusing to talk to it", path.display())]
    WrongPeer {
        /// The socket.
        path: PathBuf,
        /// The listener's uid.
        actual: u32,
        /// The tenant's uid.
        expected: u32,
    },
}

/// What is left until `deadline`, or a timeout error naming `what`.
fn left(deadline: Instant, what: &'static str) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(io::Error::new(io::ErrorKind::TimedOut, what))
    } else {
        // A zero socket timeout means "none": never pass one.
        Ok(left.max(Duration::from_millis(1)))
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

/// `connect(2)` bounded by `deadline` (retried after a signal with what is left).
fn connect_before(path: &Path, deadline: Instant) -> io::Result<UnixStream> {
    let addr = UnixAddr::new(path).map_err(io::Error::from)?;
    let fd: OwnedFd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(io::Error::from)?;
    loop {
        let wait = left(deadline, "connect")?;
        socket::setsockopt(
            &fd,
            sockopt::SendTimeout,
            &TimeVal::from(libc_timeval(wait)),
        )
        .map_err(io::Error::from)?;
        match socket::connect(fd.as_raw_fd(), &addr) {
            Ok(()) => return Ok(UnixStream::from(fd)),
            // The backlog stayed full for the whole wait.
            Err(Errno::EAGAIN) => return Err(io::Error::new(io::ErrorKind::TimedOut, "connect")),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

fn libc_timeval(d: Duration) -> libc::timeval {
    libc::timeval {
        tv_sec: d.as_secs() as libc::time_t,
        tv_usec: d.subsec_micros() as libc::suseconds_t,
    }
}

/// Connects to `path` within `timeout` and checks that the listener runs as
/// `expected_uid`. The stream's reads and writes time out at the same deadline; wrap it in
/// a [`DeadlineStream`] to keep that deadline across many calls.
pub fn connect_checked(
    path: &Path,
    expected_uid: u32,
    timeout: Duration,
) -> Result<(UnixStream, Instant), PeerSocketError> {
    let deadline = Instant::now() + timeout;
    let stream = connect_before(path, deadline).map_err(|source| {
        if is_timeout(&source) {
            PeerSocketError::Timeout {
                path: path.to_path_buf(),
                what: "connect",
                timeout,
            }
        } else {
            PeerSocketError::Connect {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    let creds = socket::getsockopt(&stream, sockopt::PeerCredentials).map_err(|e| {
        PeerSocketError::Credentials {
            path: path.to_path_buf(),
            source: e.into(),
        }
    })?;
    if creds.uid() != expected_uid {
        return Err(PeerSocketError::WrongPeer {
            path: path.to_path_buf(),
            actual: creds.uid(),
            expected: expected_uid,
        });
    }
    let set = |stream: &UnixStream| -> io::Result<()> {
        let wait = left(deadline, "connect")?;
        stream.set_read_timeout(Some(wait))?;
        stream.set_write_timeout(Some(wait))
    };
    set(&stream).map_err(|source| {
        if is_timeout(&source) {
            PeerSocketError::Timeout {
                path: path.to_path_buf(),
                what: "connect",
                timeout,
            }
        } else {
            PeerSocketError::Connect {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    Ok((stream, deadline))
}

/// A stream whose every read and write ends by one deadline: each call gets what is left
/// of it, and fails with [`io::ErrorKind::TimedOut`] once it has passed.
#[derive(Debug)]
pub struct DeadlineStream {
    stream: UnixStream,
    deadline: Instant,
}

impl DeadlineStream {
    /// `stream`, bounded by `deadline`.
    pub fn new(stream: UnixStream, deadline: Instant) -> Self {
        Self { stream, deadline }
    }

    /// The deadline.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

fn timed_out(e: io::Error, what: &'static str) -> io::Error {
    if is_timeout(&e) {
        io::Error::new(io::ErrorKind::TimedOut, what)
    } else {
        e
    }
}

impl Read for DeadlineStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let wait = left(self.deadline, "answer")?;
        self.stream.set_read_timeout(Some(wait))?;
        self.stream.read(buf).map_err(|e| timed_out(e, "answer"))
    }
}

impl Write for DeadlineStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let wait = left(self.deadline, "send")?;
        self.stream.set_write_timeout(Some(wait))?;
        self.stream.write(buf).map_err(|e| timed_out(e, "send"))
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn my_uid() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    /// A listener that never accepts, with a backlog of `backlog` (QEMU uses 1).
    fn never_accepting(path: &Path, backlog: i32) -> OwnedFd {
        let fd = socket::socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        socket::bind(fd.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
        socket::listen(&fd, socket::Backlog::new(backlog).unwrap()).unwrap();
        fd
    }

    #[test]
    fn a_listener_with_a_full_backlog_times_out_instead_of_hanging() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("full.sock");
        let _listener = never_accepting(&path, 0);
        // The first connection fills the queue (nobody accepts it).
        let (_first, _) = connect_checked(&path, my_uid(), Duration::from_secs(5)).unwrap();
        let started = Instant::now();
        let err = connect_checked(&path, my_uid(), Duration::from_millis(300)).unwrap_err();
        assert!(
            matches!(
                err,
                PeerSocketError::Timeout {
                    what: "connect",
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(err.to_string().contains("does not answer"), "{err}");
    }

    #[test]
    fn a_peer_that_accepts_but_never_answers_times_out_on_the_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mute.sock");
        let _listener = never_accepting(&path, 4);
        let (stream, deadline) =
            connect_checked(&path, my_uid(), Duration::from_millis(300)).unwrap();
        let mut stream = DeadlineStream::new(stream, deadline);
        let err = stream.read(&mut [0u8; 8]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        // Once the deadline has passed, nothing waits again.
        let started = Instant::now();
        assert_eq!(
            stream.read(&mut [0u8; 8]).unwrap_err().kind(),
            io::ErrorKind::TimedOut
        );
        assert!(started.elapsed() < Duration::from_millis(100));
    }

    #[test]
    fn a_trickling_peer_cannot_stretch_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slow.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            // One byte every 100 ms, forever (until the client goes away).
            while s.write_all(b"x").is_ok() {
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let (stream, deadline) =
            connect_checked(&path, my_uid(), Duration::from_millis(500)).unwrap();
        let mut stream = DeadlineStream::new(stream, deadline);
        let started = Instant::now();
        let mut buf = [0u8; 1];
        let err = loop {
            if let Err(e) = stream.read(&mut buf) {
                break e;
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        drop(stream);
        server.join().unwrap();
    }

    #[test]
    fn a_socket_served_by_another_uid_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let _listener = UnixListener::bind(&path).unwrap();
        let err = connect_checked(&path, my_uid() + 1, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, PeerSocketError::WrongPeer { .. }), "{err}");
        assert!(err.to_string().contains("refusing to talk to it"), "{err}");
        connect_checked(&path, my_uid(), Duration::from_secs(1)).unwrap();
    }

    #[test]
    fn a_missing_socket_is_a_connect_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = connect_checked(&dir.path().join("none"), my_uid(), Duration::from_secs(1))
            .unwrap_err();
        assert!(matches!(err, PeerSocketError::Connect { .. }), "{err}");
    }
}
