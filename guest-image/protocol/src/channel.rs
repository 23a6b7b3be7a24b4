//! Socket I/O with deadlines for the host end of the agent channel: whatever serves the
//! socket (QEMU's chardev, the VMM's hybrid-vsock listener, the guest behind them) is the
//! tenant's, and may stop answering at any point, so no call here waits past its deadline.
//!
//! Connecting to a Unix socket blocks when the listener's backlog is full (QEMU listens
//! with a backlog of 1 and may stop accepting). A non-blocking `connect(2)` does not help:
//! on a full backlog it fails at once with `EAGAIN` and `poll(2)` has nothing to wait for.
//! The kernel bounds a blocking Unix connect by the socket's send timeout instead
//! (`SO_SNDTIMEO`, socket(7)), so [`connect`] sets that to the time left before connecting.

use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, UnixAddr};
use nix::sys::time::TimeVal;

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
pub(crate) fn connect(path: &Path, deadline: Instant) -> Result<UnixStream, ChannelError> {
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
    Ok(UnixStream::from(fd))
}

/// The uid of the process that created the socket at the other end (`SO_PEERCRED`).
pub(crate) fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    let creds = socket::getsockopt(&stream.as_fd(), sockopt::PeerCredentials)?;
    Ok(creds.uid())
}

/// Writes all of `bytes` before `deadline`. On `TimedOut` part of it may have been sent.
pub(crate) fn write_all_by(
    stream: &mut UnixStream,
    mut bytes: &[u8],
    deadline: Instant,
) -> Result<(), ChannelError> {
    while !bytes.is_empty() {
        stream.set_write_timeout(Some(time_left(deadline)?))?;
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
    stream: &mut UnixStream,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<usize, ChannelError> {
    loop {
        stream.set_read_timeout(Some(time_left(deadline)?))?;
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
        assert!(connect(&path, far).is_ok());
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
