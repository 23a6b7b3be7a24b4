//! Newline-delimited JSON over a Unix socket: the `tenantvm-vmm` control socket and QMP.
//! The other end runs as the tenant's uid, so its answers are untrusted: the peer's uid is
//! checked, lines are capped, and the whole exchange (connect, every write and read) ends
//! by one deadline ([`super::socket`]).

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tenantvm_vmm_api::control::MAX_LINE_BYTES;

use super::socket::{connect_checked, DeadlineStream, PeerSocketError};
use super::BackendError;

/// Unix socket paths longer than this do not fit in sockaddr_un.
pub const MAX_SOCKET_PATH: usize = 107;

/// A connected JSON-lines client.
pub struct JsonLines {
    path: PathBuf,
    timeout: Duration,
    stream: BufReader<DeadlineStream>,
}

impl JsonLines {
    /// Connects, checks that the process listening is the tenant's (`expected_uid`), and
    /// gives the whole session `timeout`: connect, every send and every answer must be
    /// done by then.
    pub fn connect(
        path: &Path,
        timeout: Duration,
        expected_uid: u32,
    ) -> Result<Self, BackendError> {
        let (stream, deadline) = connect_checked(path, expected_uid, timeout)?;
        Ok(Self {
            path: path.to_path_buf(),
            timeout,
            stream: BufReader::new(DeadlineStream::new(stream, deadline)),
        })
    }

    fn err(&self, message: String) -> BackendError {
        BackendError::Control {
            path: self.path.clone(),
            message,
        }
    }

    fn io_err(&self, what: &'static str, e: std::io::Error) -> BackendError {
        if e.kind() == ErrorKind::TimedOut {
            PeerSocketError::Timeout {
                path: self.path.clone(),
                what,
                timeout: self.timeout,
            }
            .into()
        } else {
            self.err(format!("{what} failed: {e}"))
        }
    }

    /// Sends one line (the newline is added).
    pub fn send_line(&mut self, line: &str) -> Result<(), BackendError> {
        let mut bytes = line.trim_end_matches('\n').as_bytes().to_vec();
        bytes.push(b'\n');
        self.stream
            .get_mut()
            .write_all(&bytes)
            .map_err(|e| self.io_err("send", e))
    }

    /// Sends one JSON value as a line.
    pub fn send(&mut self, value: &serde_json::Value) -> Result<(), BackendError> {
        self.send_line(&value.to_string())
    }

    /// Reads one line, at most [`MAX_LINE_BYTES`] long, newline included.
    pub fn receive_line(&mut self) -> Result<Vec<u8>, BackendError> {
        let mut line = Vec::new();
        let n = (&mut self.stream)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| self.io_err("answer", e))?;
        if n == 0 {
            return Err(self.err("the other end closed the connection".into()));
        }
        if line.last() != Some(&b'\n') {
            return Err(self.err(format!(
                "answer longer than {MAX_LINE_BYTES} bytes or cut off"
            )));
        }
        Ok(line)
    }

    /// Reads one line and parses it as a JSON object.
    pub fn receive(&mut self) -> Result<serde_json::Value, BackendError> {
        let line = self.receive_line()?;
        let value: serde_json::Value = serde_json::from_slice(&line)
            .map_err(|e| self.err(format!("answer is not JSON: {e}")))?;
        if !value.is_object() {
            return Err(self.err("answer is not a JSON object".into()));
        }
        Ok(value)
    }

    /// Sends `request` and returns the answer line.
    pub fn call(&mut self, request: &serde_json::Value) -> Result<serde_json::Value, BackendError> {
        self.send(request)?;
        self.receive()
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn serve(answer: &'static [u8]) -> (tempfile::TempDir, PathBuf, std::thread::JoinHandle<()>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 256];
            let _ = s.read(&mut buf);
            let _ = s.write_all(answer);
        });
        (dir, path, t)
    }

    fn my_uid() -> u32 {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() }
    }

    #[test]
    fn socket_served_by_another_uid_is_refused() {
        let (_d, path, t) = serve(b"{\"ok\":true}\n");
        let err = JsonLines::connect(&path, Duration::from_secs(5), my_uid() + 1)
            .err()
            .unwrap();
        assert!(err.to_string().contains("refusing"), "{err}");
        t.join().unwrap();
    }

    #[test]
    fn call_returns_the_answer_object() {
        let (_d, path, t) = serve(b"{\"ok\":true,\"state\":\"running\"}\n");
        let mut c = JsonLines::connect(&path, Duration::from_secs(5), my_uid()).unwrap();
        let v = c.call(&serde_json::json!({"command":"status"})).unwrap();
        assert_eq!(v["state"], "running");
        t.join().unwrap();
    }

    #[test]
    fn garbage_answer_is_an_error() {
        let (_d, path, t) = serve(b"not json\n");
        let mut c = JsonLines::connect(&path, Duration::from_secs(5), my_uid()).unwrap();
        assert!(matches!(
            c.call(&serde_json::json!({})),
            Err(BackendError::Control { .. })
        ));
        t.join().unwrap();
    }

    #[test]
    fn oversized_answer_is_refused() {
        let big: &'static [u8] = Box::leak(vec![b'x'; 70 * 1024].into_boxed_slice());
        let (_d, path, t) = serve(big);
        let mut c = JsonLines::connect(&path, Duration::from_secs(5), my_uid()).unwrap();
        let err = c.call(&serde_json::json!({})).unwrap_err();
        assert!(err.to_string().contains("longer"), "{err}");
        t.join().unwrap();
    }

    #[test]
    fn closed_connection_is_an_error() {
        let (_d, path, t) = serve(b"");
        let mut c = JsonLines::connect(&path, Duration::from_secs(5), my_uid()).unwrap();
        c.call(&serde_json::json!({})).unwrap_err();
        t.join().unwrap();
    }

    /// A control socket whose listener never accepts, its backlog full (a SIGSTOPped QEMU
    /// listens with a backlog of 1): the client gives up at its deadline.
    #[test]
    fn a_listener_that_never_accepts_is_a_timeout_not_a_hang() {
        use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wedged.sock");
        let listener = socket::socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        socket::bind(listener.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
        socket::listen(&listener, Backlog::new(0).unwrap()).unwrap();
        // Accepted by the kernel into the queue, never by the process: no answer comes.
        let started = std::time::Instant::now();
        let mut first = JsonLines::connect(&path, Duration::from_millis(500), my_uid()).unwrap();
        let err = first
            .call(&serde_json::json!({"command": "status"}))
            .unwrap_err();
        assert!(
            matches!(
                err,
                BackendError::Socket(PeerSocketError::Timeout { what: "answer", .. })
            ),
            "{err}"
        );
        assert!(err.is_unresponsive());
        // The queue is full now: connect(2) itself would block for good without a deadline.
        let err = JsonLines::connect(&path, Duration::from_millis(500), my_uid())
            .err()
            .unwrap();
        assert!(
            matches!(
                err,
                BackendError::Socket(PeerSocketError::Timeout {
                    what: "connect",
                    ..
                })
            ),
            "{err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn missing_socket_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            JsonLines::connect(&dir.path().join("none"), Duration::from_secs(1), my_uid()).is_err()
        );
    }
}
