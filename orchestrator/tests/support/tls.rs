//! The TLS front door of a live daemon, from the client's side: a free local port, a
//! self-signed pair ([`super::tls_pair`]) for `--tls-cert` and `--tls-key` with a client
//! that trusts only it, and one HTTP/1.1 request at a time over it. Needs `mod daemon` and
//! `mod tls_pair` beside it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::daemon::TestDaemon;
use super::tls_pair::TlsPair;

/// A front door's address, certificate pair and a client that trusts it.
pub struct FrontDoorTls {
    /// `127.0.0.1` and a port that was free when this was made.
    pub addr: SocketAddr,
    /// The certificate (PEM), for `--tls-cert`.
    pub cert_pem: PathBuf,
    /// Its private key (PEM), for `--tls-key`.
    pub key_pem: PathBuf,
    /// A client that trusts the certificate and nothing else.
    pub client: Arc<rustls::ClientConfig>,
    _dir: tempfile::TempDir,
}

impl FrontDoorTls {
    /// A fresh port and a fresh self-signed `localhost` pair.
    pub fn new() -> FrontDoorTls {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        let pair = TlsPair::write(dir.path());
        FrontDoorTls {
            addr: ([127, 0, 0, 1], port).into(),
            cert_pem: pair.cert_pem,
            key_pem: pair.key_pem,
            client: pair.client,
            _dir: dir,
        }
    }

    /// The daemon flags that serve the front door here: `--listen`, `--tls-cert`,
    /// `--tls-key`.
    pub fn daemon_args(&self) -> Vec<String> {
        vec![
            "--listen".into(),
            self.addr.to_string(),
            "--tls-cert".into(),
            self.cert_pem.to_str().unwrap().into(),
            "--tls-key".into(),
            self.key_pem.to_str().unwrap().into(),
        ]
    }

    /// One request on a connection of its own (`Connection: close`): `GET` without a body,
    /// `POST` of a JSON body with one. Waits at most `timeout` for each read; returns the
    /// status and the body (de-chunked, or as long as its `Content-Length`, or to the end).
    pub fn request(
        &self,
        path: &str,
        key: Option<&str>,
        body: Option<&serde_json::Value>,
        timeout: Duration,
    ) -> (u16, Vec<u8>) {
        request_to(self.addr, &self.client, path, key, body, timeout)
    }
}

/// [`FrontDoorTls::request`] to the door at `addr` with `client`, from any thread.
pub fn request_to(
    addr: SocketAddr,
    client: &Arc<rustls::ClientConfig>,
    path: &str,
    key: Option<&str>,
    body: Option<&serde_json::Value>,
    timeout: Duration,
) -> (u16, Vec<u8>) {
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(timeout)).unwrap();
    let conn =
        rustls::ClientConnection::new(client.clone(), "localhost".try_into().unwrap()).unwrap();
    let mut s = rustls::StreamOwned::new(conn, tcp);
    let mut head = match body {
        Some(_) => format!("POST {path} HTTP/1.1\r\n"),
        None => format!("GET {path} HTTP/1.1\r\n"),
    };
    head.push_str("Host: localhost\r\nConnection: close\r\n");
    if let Some(k) = key {
        head.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    if !body.is_empty() {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    write!(s, "{head}\r\n{body}").unwrap();
    s.flush().unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line.split(' ').nth(1).unwrap().parse().unwrap();
    let (mut chunked, mut len) = (false, None);
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        if h.trim().is_empty() {
            break;
        }
        if let Some((n, v)) = h.split_once(':') {
            if n.eq_ignore_ascii_case("content-length") {
                len = Some(v.trim().parse::<usize>().unwrap());
            } else if n.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked") {
                chunked = true;
            }
        }
    }
    let mut out = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            let mut chunk = vec![0u8; n + 2];
            r.read_exact(&mut chunk).unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&chunk[..n]);
        }
    } else if let Some(n) = len {
        out.resize(n, 0);
        r.read_exact(&mut out).unwrap();
    } else {
        let _ = r.read_to_end(&mut out);
    }
    (status, out)
}

impl TestDaemon {
    /// Serves the TLS front door `tls` names (its `--listen`, `--tls-cert`, `--tls-key`) at
    /// every start. (Here rather than in `daemon.rs`, which benchmarks load on its own.)
    pub fn with_front_door(self, tls: &FrontDoorTls) -> TestDaemon {
        let args = tls.daemon_args();
        self.with_args(&args.iter().map(String::as_str).collect::<Vec<_>>())
    }
}
