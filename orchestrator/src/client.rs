//! A client of the daemon's API over its Unix socket, used by the `tenantvm` CLI, the
//! end-to-end tests and the benchmark. It speaks the API's own types.

use std::path::{Path, PathBuf};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use thiserror::Error;
use tokio::net::UnixStream;

use crate::api::types::{
    CreateResponse, ErrorBody, Health, LogChunk, LogQuery, LogStream, TenantList, TenantView,
};
use crate::domain::spec::TenantSpec;

/// What can go wrong talking to the daemon.
#[derive(Debug, Error)]
pub enum ClientError {
    /// The socket is not there or refuses connections.
    #[error("Cannot connect to tenantvmd at {socket}: {source} (is the daemon running? see --socket / TENANTVM_SOCKET)")]
    Connect {
        /// The socket path.
        socket: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// HTTP-level failure.
    #[error("HTTP exchange with tenantvmd failed: {0}")]
    Http(String),
    /// The daemon answered with an error.
    #[error("{message}")]
    Api {
        /// HTTP status.
        status: StatusCode,
        /// Stable error code.
        code: String,
        /// Message from the daemon.
        message: String,
    },
    /// The answer did not decode.
    #[error("Unexpected answer from tenantvmd ({status}): {detail}")]
    Decode {
        /// HTTP status.
        status: StatusCode,
        /// Why.
        detail: String,
    },
}

impl ClientError {
    /// The HTTP status of an API error.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            ClientError::Api { status, .. } | ClientError::Decode { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A client bound to a socket and a token.
#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
    token: String,
}

impl Client {
    /// A client for `socket` using `token`.
    pub fn new(socket: impl Into<PathBuf>, token: impl Into<String>) -> Client {
        Client {
            socket: socket.into(),
            token: token.into(),
        }
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// One request; returns status and body bytes.
    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        let stream =
            UnixStream::connect(&self.socket)
                .await
                .map_err(|source| ClientError::Connect {
                    socket: self.socket.clone(),
                    source,
                })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ClientError::Http(e.to_string()))?;
        let conn_task = tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(format!("http://localhost{path}"))
            .header("host", "localhost")
            .header("authorization", format!("Bearer {}", self.token));
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| ClientError::Http(e.to_string()))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| ClientError::Http(e.to_string()))?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| ClientError::Http(e.to_string()))?
            .to_bytes();
        conn_task.abort();
        Ok((status, bytes))
    }

    pub(crate) async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, ClientError> {
        let (status, bytes) = self.raw(method, path, body).await?;
        if status.is_success() {
            return serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode {
                status,
                detail: e.to_string(),
            });
        }
        match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(err) => Err(ClientError::Api {
                status,
                code: err.error.code,
                message: err.error.message,
            }),
            Err(_) => Err(ClientError::Decode {
                status,
                detail: String::from_utf8_lossy(&bytes).into_owned(),
            }),
        }
    }

    /// `GET /v1/health`.
    pub async fn health(&self) -> Result<Health, ClientError> {
        self.call(Method::GET, "/v1/health", None).await
    }

    /// `POST /v1/tenants`.
    pub async fn create(&self, spec: &TenantSpec) -> Result<CreateResponse, ClientError> {
        let body = serde_json::to_vec(spec).map_err(|e| ClientError::Http(e.to_string()))?;
        self.call(Method::POST, "/v1/tenants", Some(body)).await
    }

    /// `GET /v1/host`: the host's GPUs, the shares its ledger holds and the room its tenants
    /// hold (admin).
    pub async fn host(&self) -> Result<crate::api::host::HostView, ClientError> {
        self.call(Method::GET, "/v1/host", None).await
    }

    /// `POST /v1/tenants/{name}/keys`: a new inference key for the front door (shown once).
    pub async fn create_key(
        &self,
        name: &str,
    ) -> Result<crate::api::keys::KeyCreated, ClientError> {
        self.call(
            Method::POST,
            &format!("/v1/tenants/{}/keys", encode(name)),
            None,
        )
        .await
    }

    /// `GET /v1/tenants`.
    pub async fn list(&self) -> Result<TenantList, ClientError> {
        self.call(Method::GET, "/v1/tenants", None).await
    }

    /// `GET /v1/tenants/{name}`.
    pub async fn status(&self, name: &str) -> Result<TenantView, ClientError> {
        self.call(Method::GET, &format!("/v1/tenants/{}", encode(name)), None)
            .await
    }

    /// `GET /v1/tenants/{name}/gpu`: the guest's view of its GPU beside the assignment.
    pub async fn gpu_info(
        &self,
        name: &str,
    ) -> Result<crate::api::gpu_info::GpuInfoView, ClientError> {
        self.call(
            Method::GET,
            &format!("/v1/tenants/{}/gpu", encode(name)),
            None,
        )
        .await
    }

    /// `POST /v1/tenants/{name}/stop`.
    pub async fn stop(&self, name: &str) -> Result<TenantView, ClientError> {
        self.call(
            Method::POST,
            &format!("/v1/tenants/{}/stop", encode(name)),
            None,
        )
        .await
    }

    /// `POST /v1/tenants/{name}/infer`: a completion request to the tenant's inference
    /// server; returns its JSON answer.
    pub async fn infer(
        &self,
        name: &str,
        request: &serde_json::Value,
    ) -> Result<serde_json::Value, ClientError> {
        let body = serde_json::to_vec(request).map_err(|e| ClientError::Http(e.to_string()))?;
        self.call(
            Method::POST,
            &format!("/v1/tenants/{}/infer", encode(name)),
            Some(body),
        )
        .await
    }

    /// `POST /v1/tenants/{name}/start`.
    pub async fn start(&self, name: &str) -> Result<TenantView, ClientError> {
        self.call(
            Method::POST,
            &format!("/v1/tenants/{}/start", encode(name)),
            None,
        )
        .await
    }

    /// `DELETE /v1/tenants/{name}`.
    pub async fn destroy(&self, name: &str) -> Result<TenantView, ClientError> {
        self.call(
            Method::DELETE,
            &format!("/v1/tenants/{}", encode(name)),
            None,
        )
        .await
    }

    /// `GET /v1/receipts[?tenant=NAME]`.
    pub async fn receipts(
        &self,
        tenant: Option<&str>,
    ) -> Result<crate::api::types::ReceiptList, ClientError> {
        let path = match tenant {
            Some(t) => format!("/v1/receipts?tenant={}", encode(t)),
            None => "/v1/receipts".to_string(),
        };
        self.call(Method::GET, &path, None).await
    }

    /// `GET /v1/gpu/quarantine`.
    pub async fn quarantine(&self) -> Result<crate::api::types::QuarantineList, ClientError> {
        self.call(Method::GET, "/v1/gpu/quarantine", None).await
    }

    /// `POST /v1/gpu/quarantine/scrub`.
    pub async fn rescrub(
        &self,
        slice: &str,
    ) -> Result<crate::tenant::departure::RescrubOutcome, ClientError> {
        let body = serde_json::to_vec(&crate::api::types::ScrubRequest {
            slice: slice.to_string(),
        })
        .map_err(|e| ClientError::Http(e.to_string()))?;
        self.call(Method::POST, "/v1/gpu/quarantine/scrub", Some(body))
            .await
    }

    /// `GET /v1/tenants/{name}/logs`.
    pub async fn logs(&self, name: &str, q: &LogQuery) -> Result<LogChunk, ClientError> {
        let mut query = vec![format!(
            "stream={}",
            match q.stream {
                LogStream::Serial => "serial",
                LogStream::Vmm => "vmm",
                LogStream::Events => "events",
            }
        )];
        for (k, v) in [
            ("generation", q.generation),
            ("offset", q.offset),
            ("tail", q.tail),
            ("max_bytes", q.max_bytes),
        ] {
            if let Some(v) = v {
                query.push(format!("{k}={v}"));
            }
        }
        let path = format!("/v1/tenants/{}/logs?{}", encode(name), query.join("&"));
        self.call(Method::GET, &path, None).await
    }
}

/// Percent-encodes a path segment (names are validated server-side; this only keeps odd
/// input from changing the path).
fn encode(segment: &str) -> String {
    let mut out = String::new();
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_cannot_escape() {
        assert_eq!(encode("alice-1"), "alice-1");
        assert_eq!(encode("../x"), "%2E%2E%2Fx");
        assert_eq!(encode("a?b#c"), "a%3Fb%23c");
    }
}
