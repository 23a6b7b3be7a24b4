//! The verifier's client of the front door: one blocking HTTPS/1.1 request per connection,
//! with an inference key, trusting only the CA the operator names (`--front-door-ca`). Checks
//! 7 and 9 read a probe's metrics and models here as a tenant's client would.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

use super::host::HostError;

/// Largest answer read (a probe's metrics and model list are far smaller).
const MAX_ANSWER: u64 = 4 << 20;

/// Where the front door is and how to trust it.
#[derive(Debug, Clone)]
pub struct FrontDoorTarget {
    /// Its TCP address.
    pub addr: SocketAddr,
    /// The name its certificate is issued to.
    pub server_name: String,
    /// The CA (or self-signed certificate) that issued it, PEM.
    pub ca: PathBuf,
}

/// A front door ready to be asked.
pub struct FrontDoorClient {
    target: FrontDoorTarget,
    config: Arc<rustls::ClientConfig>,
    server: ServerName<'static>,
}

fn failed(what: &str, e: impl std::fmt::Display) -> HostError {
    HostError::Failed(format!("front door: {what}: {e}"))
}

impl FrontDoorClient {
    /// Reads the CA and builds the TLS configuration.
    pub fn new(target: FrontDoorTarget) -> Result<FrontDoorClient, HostError> {
        let io = |e: String| HostError::Io {
            path: target.ca.display().to_string(),
            message: e,
        };
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&target.ca).map_err(|e| io(e.to_string()))? {
            roots
                .add(cert.map_err(|e| io(e.to_string()))?)
                .map_err(|e| io(e.to_string()))?;
        }
        if roots.is_empty() {
            return Err(io("it holds no certificate".into()));
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| failed("TLS", e))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let server = ServerName::try_from(target.server_name.clone())
            .map_err(|e| failed("server name", e))?;
        Ok(FrontDoorClient {
            target,
            config: Arc::new(config),
            server,
        })
    }

    /// `GET path` (no body) or `POST path` with a JSON body, with `key`, within `timeout`
    /// for each read and write: the status and the body as text.
    pub fn request(
        &self,
        key: &str,
        path: &str,
        body: Option<&serde_json::Value>,
        timeout: Duration,
    ) -> Result<(u16, String), HostError> {
        let tcp = TcpStream::connect_timeout(&self.target.addr, timeout)
            .map_err(|e| HostError::Unreachable(format!("front door {}: {e}", self.target.addr)))?;
        tcp.set_read_timeout(Some(timeout))
            .and_then(|()| tcp.set_write_timeout(Some(timeout)))
            .map_err(|e| failed("socket", e))?;
        let conn = rustls::ClientConnection::new(self.config.clone(), self.server.clone())
            .map_err(|e| failed("TLS", e))?;
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        let payload = body.map(|b| b.to_string()).unwrap_or_default();
        let head = format!(
            "{} {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n{}Content-Length: {}\r\n\r\n",
            if body.is_some() { "POST" } else { "GET" },
            self.target.server_name,
            if body.is_some() { "Content-Type: application/json\r\n" } else { "" },
            payload.len(),
        );
        tls.write_all(head.as_bytes())
            .and_then(|()| tls.write_all(payload.as_bytes()))
            .and_then(|()| tls.flush())
            .map_err(|e| failed("send", e))?;
        let mut answer = Vec::new();
        match (&mut tls).take(MAX_ANSWER).read_to_end(&mut answer) {
            Ok(_) => {}
            // A peer that closes without close_notify after a complete answer.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !answer.is_empty() => {}
            Err(e) => return Err(failed("read", e)),
        }
        parse(&answer)
    }
}

/// Splits an HTTP/1.1 answer into its status and body (chunked bodies are de-chunked).
fn parse(answer: &[u8]) -> Result<(u16, String), HostError> {
    let text = String::from_utf8_lossy(answer);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| failed("answer", "no complete head"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| failed("answer", "no status"))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    if !chunked {
        return Ok((status, body.to_string()));
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).map_err(|e| failed("chunk", e))?;
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    Ok((status, out))
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn answers_are_split_and_dechunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
        assert_eq!(parse(plain).unwrap(), (200, "hello".to_string()));
        let chunked =
            b"HTTP/1.1 401 Unauthorized\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse(chunked).unwrap(), (401, "abcde".to_string()));
        parse(b"HTTP/1.1 200").unwrap_err();
    }
}
