//! One request to the VMM's control socket (newline-delimited JSON, docs/vmm.md).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Why a control socket request failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Connecting, writing or reading failed.
    #[error("Control socket {path}: {source}")]
    Io {
        /// The socket path.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The response is not JSON.
    #[error("Control socket answered non-JSON {line:?}: {source}")]
    BadResponse {
        /// The line received.
        line: String,
        /// The parse error.
        source: serde_json::Error,
    },
}

/// Sends one request line and returns the parsed response line (10 s timeout each way).
pub fn api_request(
    sock: &Path,
    request: &serde_json::Value,
) -> Result<serde_json::Value, ApiError> {
    let io = |source| ApiError::Io {
        path: sock.display().to_string(),
        source,
    };
    let mut stream = UnixStream::connect(sock).map_err(io)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    stream
        .set_write_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    let mut line = request.to_string();
    line.push('\n');
    stream.write_all(line.as_bytes()).map_err(io)?;
    let mut reader = BufReader::new(stream);
    let mut response = String::new();
    reader.read_line(&mut response).map_err(io)?;
    serde_json::from_str(response.trim_end()).map_err(|source| ApiError::BadResponse {
        line: response.clone(),
        source,
    })
}
