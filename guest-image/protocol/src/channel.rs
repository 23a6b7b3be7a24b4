//! Socket I/O with deadlines for the host end of the agent channel: whatever serves the
//! socket (QEMU's chardev, the VMM's hybrid-vsock listener, the guest behind them) is the
//! tenant's, and may stop answering at any point, so no call here waits past its deadline.
//!
//! Connecting to a Unix socket blocks when the listener's backlog is full (QEMU listens
//! with a backlog of 1 and may stop accepting). A non-blocking `connect(2)` does not help:
//! on a full backlog it fails at once with `EAGAIN` and `poll(2)` has nothing to wait for.
//! The kernel bounds a blocking Unix connect by the socket's send timeout instead
//! (`SO_SNDTIMEO`, socket(7)), so [`connect`] sets that to the time left before connecting.
//!
//! An `AF_VSOCK` connection (QEMU's vhost-vsock: the host kernel carries it to the guest
//! with the CID) is made non-blocking and waited for with `poll(2)` up to the deadline
//! ([`connect_vsock`]); both kinds are then the same [`ChannelStream`].

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, UnixAddr, VsockAddr};
use nix::sys::time::TimeVal;

/// A connected stream socket to the agent's channel: a Unix socket (virtio-serial
/// chardev, hybrid vsock) or an `AF_VSOCK` socket. Reads and writes are plain blocking
/// calls bounded by the socket's `SO_RCVTIMEO`/`SO_SNDTIMEO`, which [`read_by`] and
/// [`write_all_by`] set from their deadline before each call.
#[derive(Debug)]
pub(crate) struct ChannelStream(OwnedFd);

impl ChannelStream {
    /// A stream over an already connected socket (one end of a mux stream's pair).
    pub(crate) fn from_fd(fd: OwnedFd) -> Self {
        Self(fd)
    }

    /// The socket.
    pub(crate) fn into_fd(self) -> OwnedFd {
        self.0
    }

    fn set_timeout(&self, send: bool, left: Duration) -> io::Result<()> {
        let tv = timeval(left);
        if send {
            socket::setsockopt(&self.0, sockopt::SendTimeout, &tv)?;
        } else {
            socket::setsockopt(&self.0, sockopt::ReceiveTimeout, &tv)?;
        }
        Ok(())
    }
}

impl AsFd for ChannelStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl Read for ChannelStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        nix::unistd::read(&self.0, buf).map_err(io::Error::from)
    }
}

impl Write for ChannelStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // MSG_NOSIGNAL: a peer that closed must be an error here, not SIGPIPE.
        socket::send(self.0.as_raw_fd(), buf, socket::MsgFlags::MSG_NOSIGNAL)
            .map_err(io::Error::from)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Why a deadline-bound socket call failed.
#[derive(Debug)]
pub(crate) enum ChannelError {
    /// The deadline passed first.
    TimedOut,
    /// The system call failed.
    Io(io::Error),
}

impl From<io::Error> for ChannelError {
    fn from(e: io::Error) -> Self {
        if is_timeout(&e) {
            Self::TimedOut
        } else {
            Self::Io(e)
        }
    }
}

impl From<Errno> for ChannelError {
    fn from(e: Errno) -> Self {
        Self::from(io::Error::from(e))
    }
}

/// Whether an I/O error is a socket timeout (`SO_RCVTIMEO`/`SO_SNDTIMEO` expired).
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// The time left before `deadline`, or `TimedOut` when none is.
fn time_left(deadline: Instant) -> Result<Duration, ChannelError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(ChannelError::TimedOut)
    } else {
        Ok(left)
    }
}

/// `SO_SNDTIMEO` / `SO_RCVTIMEO` value for `left` (never zero, which would mean "no limit").
fn timeval(left: Duration) -> TimeVal {
    let micros = i64::try_from(left.as_micros()).unwrap_or(i64::MAX).max(1);
    TimeVal::new(micros / 1_000_000, micros % 1_000_000)
}

/// Connects a stream socket to `path`, giving up at `deadline` (see the module docs).
pub(crate) fn connect(path: &Path, deadline: Instant) -> Result<ChannelStream, ChannelError> {
    let addr = UnixAddr::new(path)?;
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    loop {
        socket::setsockopt(&fd, sockopt::SendTimeout, &timeval(time_left(deadline)?))?;
        match socket::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr) {
            Ok(()) => break,
            // Interrupted, or the backlog stayed full for the whole send timeout (which
            // may end a little early): try again with what is left.
            Err(Errno::EINTR | Errno::EAGAIN | Errno::EINPROGRESS) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    // The send timeout is set again before every write; clear it so it cannot outlive
    // this call's deadline by surprise.
    socket::setsockopt(&fd, sockopt::SendTimeout, &TimeVal::new(0, 0))?;
    Ok(ChannelStream(fd))
}

/// Connects an `AF_VSOCK` stream socket to `port` of the VM with context id `cid`, giving
/// up at `deadline`: the connect runs non-blocking and `poll(2)` waits for it with the
/// time left (the kernel's own vsock connect timeout, 2 s by default, may end it first:
/// that reads as a timeout too). A host without vsock support fails at once
/// (`EAFNOSUPPORT`); a guest with nothing listening yet answers with a reset
/// (`ECONNRESET`), which callers waiting for the agent retry.
pub(crate) fn connect_vsock(
    cid: u32,
    port: u32,
    deadline: Instant,
) -> Result<ChannelStream, ChannelError> {
    time_left(deadline)?;
    let fd = socket::socket(
        AddressFamily::Vsock,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    let addr = VsockAddr::new(cid, port);
    match socket::connect(fd.as_raw_fd(), &addr) {
        Ok(()) => {}
        Err(Errno::EINPROGRESS | Errno::EINTR | Errno::EAGAIN) => loop {
            let left = time_left(deadline)?;
            let wait = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
            let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLOUT)];
            match poll(&mut fds, wait) {
                Ok(0) | Err(Errno::EINTR) => continue,
                Ok(_) => {
                    let err = socket::getsockopt(&fd, sockopt::SocketError)?;
                    if err != 0 {
                        return Err(io::Error::from_raw_os_error(err).into());
                    }
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        },
        Err(e) => return Err(e.into()),
    }
    // Back to blocking calls: every later read and write is bounded by its own timeout.
    let flags = OFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GETFL)?);
    fcntl(&fd, FcntlArg::F_SETFL(flags - OFlag::O_NONBLOCK))?;
    Ok(ChannelStream(fd))
}

/// The uid of the process that created the socket at the other end (`SO_PEERCRED`).
pub(crate) fn peer_uid(stream: &ChannelStream) -> io::Result<u32> {
    let creds = socket::getsockopt(&stream.as_fd(), sockopt::PeerCredentials)?;
    Ok(creds.uid())
}

/// Writes all of `bytes` before `deadline`. On `TimedOut` part of it may have been sent.
pub(crate) fn write_all_by(
    stream: &mut ChannelStream,
    mut bytes: &[u8],
    deadline: Instant,
) -> Result<(), ChannelError> {
    while !bytes.is_empty() {
        stream.set_timeout(true, time_left(deadline)?)?;
        match stream.write(bytes) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Reads what is available (at least one byte, or 0 at end of stream) before `deadline`.
pub(crate) fn read_by(
    stream: &mut ChannelStream,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<usize, ChannelError> {
    loop {
        stream.set_timeout(false, time_left(deadline)?)?;
        match stream.read(buf) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn timeval_is_never_zero_and_keeps_whole_seconds() {
        assert_eq!(timeval(Duration::from_nanos(1)), TimeVal::new(0, 1));
        assert_eq!(
            timeval(Duration::from_millis(2_500)),
            TimeVal::new(2, 500_000)
        );
    }

    #[test]
    fn a_missing_socket_fails_at_once_and_a_past_deadline_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.sock");
        let far = Instant::now() + Duration::from_secs(30);
        match connect(&missing, far) {
            Err(ChannelError::Io(e)) => assert_eq!(e.kind(), io::ErrorKind::NotFound),
            other => panic!("{other:?}"),
        }
        let path = dir.path().join("ok.sock");
        let _l = UnixListener::bind(&path).unwrap();
        assert!(matches!(
            connect(&path, Instant::now()),
            Err(ChannelError::TimedOut)
        ));
        connect(&path, far).unwrap();
    }

    #[test]
    fn a_path_too_long_for_sockaddr_un_is_an_error() {
        let long = Path::new("/tmp").join("x".repeat(200));
        assert!(matches!(
            connect(&long, Instant::now() + Duration::from_secs(1)),
            Err(ChannelError::Io(_))
        ));
    }
}
