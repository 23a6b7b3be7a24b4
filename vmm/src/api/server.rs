//! The control socket: a Unix stream socket speaking newline-delimited JSON.
//!
//! Clients are untrusted. Requests are capped at [`MAX_REQUEST_BYTES`], connections at
//! [`MAX_CONNECTIONS`], work per readable event at one read; malformed requests get an
//! error line and the connection stays usable; a client that does not read its responses
//! is disconnected rather than allowed to block the VMM.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use tenantvm_vmm_api::control::{parse_request, VmCommand, VmResponse, MAX_LINE_BYTES};

/// Longest accepted request line, newline excluded (the contract's line cap).
pub const MAX_REQUEST_BYTES: usize = MAX_LINE_BYTES;
/// Most simultaneous client connections; more are closed at once.
pub const MAX_CONNECTIONS: usize = 16;
/// Bytes read per readable event.
const READ_CHUNK: usize = 16 * 1024;

/// Why the control socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A live VMM (or something else) answers on the path.
    #[error(
        "Control socket {} is busy: a live listener answers there; stop that VMM or choose \
         another --api-sock",
        path.display()
    )]
    Busy {
        /// The path given.
        path: PathBuf,
    },
    /// Something that is not a socket exists at the path.
    #[error("{} exists and is not a socket; remove it or choose another --api-sock", path.display())]
    NotASocket {
        /// The path given.
        path: PathBuf,
    },
    /// The socket cannot be created there.
    #[error(
        "Cannot create control socket {}: {source}; check that the directory exists and is \
         writable, and that the path is under 108 bytes",
        path.display()
    )]
    Unwritable {
        /// The path given.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
}

struct Connection {
    stream: UnixStream,
    buf: Vec<u8>,
    /// Dropping the rest of an over-long line.
    discarding: bool,
}

/// The listening control socket and its clients.
pub struct ApiServer {
    listener: UnixListener,
    path: PathBuf,
    conns: HashMap<RawFd, Connection>,
}

/// What happened to a connection after handling its readable event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionState {
    /// Still open.
    Open,
    /// Closed (end of file, error, or a client that does not read): stop watching the fd,
    /// then call [`ApiServer::close`].
    Closed,
}

impl ApiServer {
    /// Binds the socket at `path`, replacing a stale socket file but refusing a live one.
    pub fn bind(path: &Path) -> Result<Self, ApiError> {
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                return Err(ApiError::NotASocket {
                    path: path.to_owned(),
                });
            }
            match UnixStream::connect(path) {
                Ok(_) => {
                    return Err(ApiError::Busy {
                        path: path.to_owned(),
                    })
                }
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(path).map_err(|source| ApiError::Unwritable {
                        path: path.to_owned(),
                        source,
                    })?;
                }
                Err(source) => {
                    return Err(ApiError::Unwritable {
                        path: path.to_owned(),
                        source,
                    })
                }
            }
        }
        let unwritable = |source| ApiError::Unwritable {
            path: path.to_owned(),
            source,
        };
        let listener = UnixListener::bind(path).map_err(unwritable)?;
        listener.set_nonblocking(true).map_err(unwritable)?;
        Ok(Self {
            listener,
            path: path.to_owned(),
            conns: HashMap::new(),
        })
    }

    /// The listening socket's fd, to watch for new connections.
    pub fn listener_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }

    /// Accepts every pending connection; returns the fds to watch.
    pub fn accept(&mut self) -> Vec<RawFd> {
        let mut new = Vec::new();
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.conns.len() >= MAX_CONNECTIONS || stream.set_nonblocking(true).is_err()
                    {
                        let mut s = stream;
                        let _ = s.write_all(
                            VmResponse::error("Too many control connections; close one and retry")
                                .to_line()
                                .as_bytes(),
                        );
                        continue;
                    }
                    let fd = stream.as_raw_fd();
                    self.conns.insert(
                        fd,
                        Connection {
                            stream,
                            buf: Vec::new(),
                            discarding: false,
                        },
                    );
                    new.push(fd);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return new,
            }
        }
    }

    /// Reads from connection `fd` and answers each complete request with `handle`.
    pub fn handle_readable(
        &mut self,
        fd: RawFd,
        mut handle: impl FnMut(VmCommand) -> VmResponse,
    ) -> ConnectionState {
        let Some(conn) = self.conns.get_mut(&fd) else {
            return ConnectionState::Closed;
        };
        conn.serve(&mut handle)
    }

    /// Closes connection `fd`. Call after [`ApiServer::handle_readable`] reported it
    /// closed, once the fd is out of the caller's epoll set (so that a reused fd number is
    /// never confused with the old connection).
    pub fn close(&mut self, fd: RawFd) {
        self.conns.remove(&fd);
    }
}

impl Connection {
    fn serve(&mut self, handle: &mut impl FnMut(VmCommand) -> VmResponse) -> ConnectionState {
        let mut chunk = [0u8; READ_CHUNK];
        let n = match self.stream.read(&mut chunk) {
            Ok(0) => return ConnectionState::Closed,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                return ConnectionState::Open
            }
            Err(_) => return ConnectionState::Closed,
        };
        self.buf.extend_from_slice(&chunk[..n]);
        let mut responses = String::new();
        while let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=pos).collect();
            if std::mem::take(&mut self.discarding) {
                continue;
            }
            let line = line.strip_suffix(b"\n").unwrap_or(&line);
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let response = if line.len() > MAX_REQUEST_BYTES {
                too_long()
            } else {
                match parse_request(line) {
                    Ok(command) => handle(command),
                    Err(error) => error,
                }
            };
            responses.push_str(&response.to_line());
        }
        if self.buf.len() > MAX_REQUEST_BYTES {
            self.buf.clear();
            if !self.discarding {
                self.discarding = true;
                responses.push_str(&too_long().to_line());
            }
        }
        // The socket is non-blocking: a client whose receive buffer is full is not reading
        // its responses, and is dropped rather than allowed to stall the VMM.
        match self.stream.write_all(responses.as_bytes()) {
            Ok(()) => ConnectionState::Open,
            Err(_) => ConnectionState::Closed,
        }
    }
}

fn too_long() -> VmResponse {
    VmResponse::error(format!(
        "Request over {MAX_REQUEST_BYTES} bytes refused; requests are single short JSON lines"
    ))
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        // Best effort: the file is ours; a failure leaves a stale socket the next VMM replaces.
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use tenantvm_vmm_api::control::VmState;

    fn answer(cmd: VmCommand) -> VmResponse {
        match cmd {
            VmCommand::Pause => VmResponse::Done {
                ok: true,
                state: VmState::Paused,
            },
            _ => VmResponse::Done {
                ok: true,
                state: VmState::Running,
            },
        }
    }

    /// Serves `server` until `client_lines` responses are read.
    fn exchange(
        server: &mut ApiServer,
        client: &mut UnixStream,
        input: &[u8],
        lines: usize,
    ) -> Vec<String> {
        client.write_all(input).unwrap();
        let mut fds = server.accept();
        let mut reader = BufReader::new(client.try_clone().unwrap());
        reader.get_mut().set_nonblocking(true).unwrap();
        let mut out = Vec::new();
        let mut line = String::new();
        while out.len() < lines {
            fds.extend(server.accept());
            for fd in &fds {
                server.handle_readable(*fd, answer);
            }
            match reader.read_line(&mut line) {
                Ok(n) if n > 0 && line.ends_with('\n') => out.push(std::mem::take(&mut line)),
                _ => std::thread::yield_now(),
            }
        }
        out
    }

    #[test]
    fn requests_get_one_response_each_and_errors_keep_connection() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let mut server = ApiServer::bind(&path).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        let out = exchange(
            &mut server,
            &mut client,
            b"{\"command\":\"pause\"}\nnonsense\n{\"command\":\"fly\"}\n{\"command\":\"resume\"}\n",
            4,
        );
        assert!(out[0].contains("\"paused\""), "{out:?}");
        assert!(out[1].contains("\"ok\":false"), "{out:?}");
        assert!(out[2].contains("\"ok\":false"), "{out:?}");
        assert!(out[3].contains("\"running\""), "{out:?}");
    }

    #[test]
    fn oversized_request_is_refused_once_and_connection_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let mut server = ApiServer::bind(&path).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        let mut input = vec![b'x'; MAX_REQUEST_BYTES + 10];
        input.extend_from_slice(b"\n{\"command\":\"pause\"}\n");
        let out = exchange(&mut server, &mut client, &input, 2);
        assert!(out[0].contains("over"), "{out:?}");
        assert!(out[1].contains("\"paused\""), "{out:?}");
    }

    #[test]
    fn clients_beyond_the_limit_get_an_error_and_are_closed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let mut server = ApiServer::bind(&path).unwrap();
        let clients: Vec<UnixStream> = (0..MAX_CONNECTIONS)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        assert_eq!(server.accept().len(), MAX_CONNECTIONS);
        let extra = UnixStream::connect(&path).unwrap();
        assert!(server.accept().is_empty());
        let mut line = String::new();
        BufReader::new(extra).read_line(&mut line).unwrap();
        assert!(line.contains("Too many control connections"), "{line}");
        drop(clients);
    }

    #[test]
    fn live_socket_is_busy_and_stale_socket_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let live = ApiServer::bind(&path).unwrap();
        assert!(matches!(ApiServer::bind(&path), Err(ApiError::Busy { .. })));
        drop(live);
        let stale_path = dir.path().join("stale.sock");
        tenantvm_testkit::stale_unix_socket(&stale_path);
        assert!(stale_path.exists());
        let replaced = ApiServer::bind(&stale_path);
        assert!(replaced.is_ok(), "{:?}", replaced.err());
    }

    #[test]
    fn regular_file_and_missing_directory_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(
            ApiServer::bind(&file),
            Err(ApiError::NotASocket { .. })
        ));
        let missing = dir.path().join("no/such/dir/api.sock");
        assert!(matches!(
            ApiServer::bind(&missing),
            Err(ApiError::Unwritable { .. })
        ));
    }
}
