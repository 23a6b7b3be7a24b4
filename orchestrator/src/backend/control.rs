//! Newline-delimited JSON over a Unix socket: the `tenantvm-vmm` control socket and QMP.
//! The other end runs as the tenant's uid, so its answers are untrusted: lines are capped
//! and every read and write has a timeout.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::BackendError;

/// The longest answer line accepted (docs/vmm.md caps requests at 64 KiB too).
const MAX_LINE: u64 = 64 * 1024;
/// Unix socket paths longer than this do not fit in sockaddr_un.
pub const MAX_SOCKET_PATH: usize = 107;

/// A connected JSON-lines client.
pub struct JsonLines {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl JsonLines {
    /// Connects with `timeout` for every read and write, and checks that the process
    /// listening is the tenant's (`expected_uid`, from SO_PEERCRED). The socket lives in a
    /// directory the tenant's VMM can write, so a compromised VMM could replace it with a
    /// symlink to another tenant's socket: the credential check refuses that peer.
    pub fn connect(
        path: &Path,
        timeout: Duration,
        expected_uid: u32,
    ) -> Result<Self, BackendError> {
        let err = |message: String| BackendError::Control {
            path: path.to_path_buf(),
            message,
        };
        let stream = UnixStream::connect(path).map_err(|e| err(format!("cannot connect: {e}")))?;
        let creds =
            nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials)
                .map_err(|e| err(format!("cannot read the peer's credentials: {e}")))?;
        if creds.uid() != expected_uid {
            return Err(err(format!(
                "the socket is served by uid {}, not the tenant's uid {expected_uid}; refusing to talk to it",
                creds.uid()
            )));
        }
        stream
            .set_read_timeout(Some(timeout))
            .map_err(|e| err(e.to_string()))?;
        stream
            .set_write_timeout(Some(timeout))
            .map_err(|e| err(e.to_string()))?;
        let writer = stream.try_clone().map_err(|e| err(e.to_string()))?;
        Ok(Self {
            path: path.to_path_buf(),
            reader: BufReader::new(stream),
            writer,
        })
    }

    fn err(&self, message: String) -> BackendError {
        BackendError::Control {
            path: self.path.clone(),
            message,
        }
    }

    /// Sends one JSON value as a line.
    pub fn send(&mut self, value: &serde_json::Value) -> Result<(), BackendError> {
        let mut line = value.to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .map_err(|e| self.err(format!("cannot send: {e}")))
    }

    /// Reads one line and parses it as a JSON object.
    pub fn receive(&mut self) -> Result<serde_json::Value, BackendError> {
        let mut line = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_LINE + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| self.err(format!("no answer: {e}")))?;
        if n == 0 {
            return Err(self.err("the other end closed the connection".into()));
        }
        if line.last() != Some(&b'\n') {
            return Err(self.err(format!("answer longer than {MAX_LINE} bytes or cut off")));
        }
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
        assert!(c.call(&serde_json::json!({})).is_err());
        t.join().unwrap();
    }

    #[test]
    fn missing_socket_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            JsonLines::connect(&dir.path().join("none"), Duration::from_secs(1), my_uid()).is_err()
        );
    }
}
