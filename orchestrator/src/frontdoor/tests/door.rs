//! A running front door for the tests: a real TLS listener on a TCP port over a harness
//! whose tenants are served by the fake guests of [`super::guests`], and a minimal HTTP/1.1
//! client over rustls that speaks to it as an OpenAI client would.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::guests::{serve_guest, Guests};
use crate::auth::Caller;
use crate::domain::spec::TenantSpec;
use crate::tenant::fault::FaultHook;
use crate::tenant::service::TenantCommand;
use crate::tenant::test_utils::{fake_agent_socket, Harness};
use crate::test_support::tls_pair::TlsPair;

/// A running front door over a harness with tenants `alice` and `bob`, each with a key.
pub(super) struct Door {
    _rt: tokio::runtime::Runtime,
    pub(super) h: Harness,
    pub(super) addr: SocketAddr,
    pub(super) client: Arc<rustls::ClientConfig>,
    pub(super) keys: HashMap<&'static str, String>,
    pub(super) guests: Arc<Guests>,
}

pub(super) fn door(quotas: &[(&'static str, &str)]) -> Option<Door> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tenantvm_skip::record_skip!("needs root to serve agent sockets as tenant uids");
        return None;
    }
    let h = Harness::new(FaultHook::default());
    h.host.state().agent_vsock = true;
    let guests = Arc::new(Guests::default());
    let mut keys = HashMap::new();
    for (name, q) in quotas {
        let spec = TenantSpec::from_toml(&format!(
            "name = \"{name}\"\n[image]\nname = \"hello\"\n[quotas]\n{q}\n"
        ))
        .unwrap();
        h.svc
            .execute(&Caller::Admin, TenantCommand::Create(spec))
            .unwrap();
    }
    h.svc.wait_idle();
    for (name, _) in quotas {
        serve_guest(
            name.to_string(),
            fake_agent_socket(&h.svc, name),
            guests.clone(),
        );
        let t = h.svc.store().tenant(name).unwrap().unwrap();
        let (key, _, _) = crate::auth::inference_key::create(h.svc.store(), t.id).unwrap();
        keys.insert(*name, key);
    }
    let pair = TlsPair::write(h.dir.path());
    let tls = crate::frontdoor::tls_config(&pair.cert_pem, &pair.key_pem).unwrap();
    let rt = crate::daemon::runtime().unwrap();
    let listener = rt
        .block_on(crate::frontdoor::bind("127.0.0.1:0".parse().unwrap()))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(crate::frontdoor::serve(
        listener,
        tls,
        h.svc.clone(),
        std::future::pending(),
    ));
    Some(Door {
        _rt: rt,
        h,
        addr,
        client: pair.client,
        keys,
        guests,
    })
}

pub(super) type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// A response read as far as its head; the body is read with [`Response::body`] or
/// piece by piece with [`Response::next_chunk`].
pub(super) struct Response {
    pub(super) status: u16,
    headers: Vec<(String, String)>,
    r: BufReader<Tls>,
}

impl Response {
    pub(super) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The next chunk of a chunked body (None at its end).
    pub(super) fn next_chunk(&mut self) -> Option<Vec<u8>> {
        let mut line = String::new();
        self.r.read_line(&mut line).ok()?;
        let size = usize::from_str_radix(line.trim(), 16).ok()?;
        let mut data = vec![0u8; size + 2];
        self.r.read_exact(&mut data).ok()?;
        data.truncate(size);
        (size > 0).then_some(data)
    }

    /// The body (a whole `Content-Length` one, or every chunk) and the connection, for the
    /// next request on it.
    pub(super) fn try_body(mut self) -> Result<(Vec<u8>, BufReader<Tls>), String> {
        if let Some(len) = self.header("content-length") {
            let mut data = vec![0u8; len.parse().map_err(|_| format!("length {len:?}"))?];
            self.r
                .read_exact(&mut data)
                .map_err(|e| format!("reading the body: {e}"))?;
            return Ok((data, self.r));
        }
        let mut all = Vec::new();
        while let Some(c) = self.next_chunk() {
            all.extend(c);
        }
        Ok((all, self.r))
    }

    pub(super) fn body(mut self) -> Vec<u8> {
        if let Some(len) = self.header("content-length") {
            let mut data = vec![0u8; len.parse().unwrap()];
            self.r.read_exact(&mut data).unwrap();
            return data;
        }
        let mut all = Vec::new();
        while let Some(c) = self.next_chunk() {
            all.extend(c);
        }
        all
    }

    pub(super) fn json(self) -> Value {
        serde_json::from_slice(&self.body()).unwrap()
    }
}

impl Door {
    pub(super) fn connect(&self) -> Tls {
        self.try_connect().unwrap()
    }

    /// A TLS connection to the door (the handshake happens with the first write).
    pub(super) fn try_connect(&self) -> Result<Tls, String> {
        let tcp = TcpStream::connect(self.addr).map_err(|e| format!("connect: {e}"))?;
        tcp.set_read_timeout(Some(Duration::from_secs(20)))
            .map_err(|e| e.to_string())?;
        let conn =
            rustls::ClientConnection::new(self.client.clone(), "localhost".try_into().unwrap())
                .map_err(|e| e.to_string())?;
        Ok(rustls::StreamOwned::new(conn, tcp))
    }

    pub(super) fn send(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: Option<&[u8]>,
    ) -> Response {
        request_on(
            BufReader::new(self.connect()),
            method,
            path,
            key,
            body,
            true,
        )
        .unwrap()
    }

    pub(super) fn post(&self, path: &str, tenant: &str, body: Value) -> Response {
        self.send(
            "POST",
            path,
            Some(&self.keys[tenant]),
            Some(body.to_string().as_bytes()),
        )
    }
}

/// Sends one request on `r`'s connection (asking the door to close it after the answer if
/// `close`) and reads the answer's head.
pub(super) fn request_on(
    mut r: BufReader<Tls>,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&[u8]>,
    close: bool,
) -> Result<Response, String> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\n");
    if close {
        head.push_str("Connection: close\r\n");
    }
    if let Some(k) = key {
        head.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    let s = r.get_mut();
    s.write_all(head.as_bytes())
        .and_then(|()| body.map_or(Ok(()), |b| s.write_all(b)))
        .and_then(|()| s.flush())
        .map_err(|e| format!("sending: {e}"))?;
    let mut status_line = String::new();
    r.read_line(&mut status_line)
        .map_err(|e| format!("reading the status: {e}"))?;
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line: {status_line:?}"))?;
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        r.read_line(&mut line)
            .map_err(|e| format!("reading the head: {e}"))?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (n, v) = line
            .split_once(':')
            .ok_or_else(|| format!("bad header line {line:?}"))?;
        headers.push((n.to_string(), v.trim().to_string()));
    }
    Ok(Response { status, headers, r })
}

pub(super) fn error_code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

/// A client of a running door from another thread.
pub(super) struct Detached {
    addr: SocketAddr,
    client: Arc<rustls::ClientConfig>,
    key: String,
}

impl Door {
    pub(super) fn detached(
        (addr, client, key): (SocketAddr, Arc<rustls::ClientConfig>, String),
    ) -> Detached {
        Detached { addr, client, key }
    }
}

impl Detached {
    pub(super) fn status_of(&self, path: &str, body: &str) -> u16 {
        let tcp = TcpStream::connect(self.addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let conn =
            rustls::ClientConnection::new(self.client.clone(), "localhost".try_into().unwrap())
                .unwrap();
        let mut s = rustls::StreamOwned::new(conn, tcp);
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.key,
            body.len()
        )
        .unwrap();
        s.flush().unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        line.split(' ').nth(1).unwrap().parse().unwrap()
    }
}
