//! The front door: each tenant's clients reach its inference server here, on TCP with TLS
//! (`tenantvmd --listen ADDR:PORT --tls-cert FILE --tls-key FILE`), apart from the admin's
//! Unix socket. OpenAI-compatible: `GET /v1/models`, `POST /v1/completions`,
//! `POST /v1/chat/completions` and `POST /v1/embeddings` (the table `ROUTES`) with an
//! inference key (`tenantvm key create TENANT`) as the
//! bearer token; the key alone picks the tenant, so a client written for OpenAI works by
//! changing its base URL and key, and a key can only run its own tenant's inference.
//!
//! Each request is authenticated, size-checked against the tenant's
//! `quotas.max_request_bytes` and admitted by its tenant's gate (request rate and
//! concurrency) before any work reaches the guest, then forwarded through
//! [`forward_http`](crate::tenant::infer::forward_http): the payload's answer is passed through as the payload produces it
//! (server-sent events for `stream: true`), never buffered whole.
//!
//! Threads and connections, so that no tenant's slow client and no anonymous one holds
//! anyone else's place:
//! - connections ([`connections`]): as many as the process's descriptors allow
//!   ([`DoorLimits`]); the unauthenticated in a small pool with a share per source, where a
//!   newcomer evicts the oldest instead of being refused, and which each must leave with a
//!   good key soon ([`connections::UNAUTHENTICATED_LIFETIME`]) while sending at a minimum
//!   rate; the authenticated in their tenant's own pool. Each request head has
//!   [`HEADER_TIMEOUT`] (idle keep-alive connections included) and each body
//!   [`BODY_TIMEOUT`];
//! - a forwarded request runs on a thread of its own holding its tenant's admission
//!   permit; it hands the answer to the connection through a channel of [`PIPE_CHUNKS`]
//!   pieces, so a client that reads slowly stalls only its own request (and spends only
//!   its own tenant's concurrency), and one that goes away ends its request at the next
//!   piece: the guest connection closes and the permit is freed.
//!
//! Nothing of a request body (prompts) or an answer (completions) is logged, put in an
//! event or quoted in an error: log records carry the tenant, the route, the status and
//! the time taken.

pub mod connections;
mod errors;
pub mod keys;
mod workers;

use std::convert::Infallible;
use std::io::Read;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};

pub use connections::{DoorLimits, MAX_TENANT_CONNECTIONS};
pub use errors::OpenAiError;

use self::connections::{ClaimRefused, Connections, Counted, Received, Slot, Source};
use crate::channel_body::ChannelBody;
use crate::metrics::RefusalReason;
use crate::tenant::admission::Refused;
use crate::tenant::infer::{self, InferError, PayloadRequest};
use crate::tenant::service::TenantService;

/// How long a client has to send a request's head (also how long an idle keep-alive
/// connection is kept).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client has to send a request's body.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Pieces of an answer buffered between the guest and a slow client (each at most
/// [`PIECE_BYTES`]).
pub const PIPE_CHUNKS: usize = 8;
/// Largest piece read from the guest at a time.
pub const PIECE_BYTES: usize = 16 * 1024;

/// Why the front door could not start.
#[derive(Debug, Error)]
pub enum FrontDoorError {
    /// The certificate or key file could not be read or parsed.
    #[error("Cannot read the TLS {what} {path}: {reason}; give a PEM file (e.g. from `openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout key.pem -out cert.pem -subj /CN=localhost`)")]
    Pem {
        /// `certificate` or `key`.
        what: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        reason: String,
    },
    /// rustls refused the pair.
    #[error("The TLS certificate and key do not make a server configuration: {0}")]
    Tls(#[from] rustls::Error),
    /// The listening socket could not be made.
    #[error("Cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// The TLS server configuration from a PEM certificate chain and private key.
pub fn tls_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, FrontDoorError> {
    let pem = |what, path: &Path, reason: String| FrontDoorError::Pem {
        what,
        path: path.to_path_buf(),
        reason,
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| pem("certificate", cert, e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| pem("certificate", cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(pem("certificate", cert, "it holds no certificate".into()));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| pem("key", key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key_der)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Binds the front door's TCP listener.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, FrontDoorError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| FrontDoorError::Listen { addr, source })
}

/// Serves clients on `listener` until `shutdown` completes, with limits sized from the
/// process's `RLIMIT_NOFILE` as it is now (the daemon raises it first,
/// [`crate::fd_limit::raise_soft_limit`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    svc: TenantService,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let nofile = crate::fd_limit::soft_limit().unwrap_or(1024);
    serve_with(
        listener,
        tls,
        svc,
        DoorLimits::for_fd_limit(nofile),
        shutdown,
    )
    .await;
}

/// How often a failing `accept` is logged at most (each failure waits [`ACCEPT_RETRY`]).
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);
/// How long the door waits after a failed `accept` before the next.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// [`serve`] with the given limits.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    svc: TenantService,
    limits: DoorLimits,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tracing::info!(?limits, "front door connection limits");
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let door = Connections::new(limits);
    let shared = Shared::new(&svc);
    let mut failures = AcceptFailures::default();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // A place first: with every place taken, connections wait in the kernel's backlog
        // rather than failing `accept` for lack of descriptors.
        let place = tokio::select! {
            () = &mut shutdown => return,
            place = door.place() => place,
        };
        let accepted = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                failures.failed(&e);
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let received = Arc::new(Received::default());
        let slot = Arc::new(door.admit(place, Source::of(peer.ip()), received.clone()));
        let _ = tcp.set_nodelay(true);
        let (acceptor, svc, shared) = (acceptor.clone(), svc.clone(), shared.clone());
        tokio::spawn(async move {
            let stream = Counted::new(tcp, received.clone());
            let conn_slot = slot.clone();
            let served = async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |req| {
                    let conn = Conn {
                        slot: conn_slot.clone(),
                        shared: shared.clone(),
                    };
                    handle(svc.clone(), conn, req)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            };
            tokio::select! {
                () = served => {}
                ended = connections::watch(&slot, &received) => {
                    tracing::debug!(?ended, "front door: unauthenticated connection closed");
                }
            }
        });
    }
}

/// Failed `accept`s, logged at most once per [`ACCEPT_LOG_EVERY`] with the count of those
/// not logged (a full descriptor table fails every retry).
#[derive(Default)]
struct AcceptFailures {
    last_logged: Option<Instant>,
    unlogged: u64,
}

impl AcceptFailures {
    fn failed(&mut self, e: &std::io::Error) {
        if self
            .last_logged
            .is_some_and(|at| at.elapsed() < ACCEPT_LOG_EVERY)
        {
            self.unlogged += 1;
            return;
        }
        tracing::warn!(error = %e, not_logged_since = self.unlogged, "front door: accept failed");
        self.last_logged = Some(Instant::now());
        self.unlogged = 0;
    }
}

/// The response body type: a whole body, or pieces as the guest sends them.
type Body = BoxBody<Bytes, std::io::Error>;

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

fn error_response(e: &OpenAiError) -> Response<Body> {
    let mut resp = Response::new(full(e.body()));
    *resp.status_mut() = e.status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(secs) = e.retry_after {
        resp.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    resp
}

/// The OpenAI routes an engine serves, each with its method: passed to the payload at the
/// same path, the answer (the engine's own, errors included) passed back unchanged. An
/// engine that does not serve one (llama-server without `--embeddings`) answers with its
/// own OpenAI-shaped error.
const ROUTES: &[(&str, &str)] = &[
    ("/v1/models", "GET"),
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/embeddings", "POST"),
];

/// The route of `path`, and the payload path it is forwarded to (the same).
fn route(method: &Method, path: &str) -> Result<&'static str, OpenAiError> {
    let Some(&(target, allowed)) = ROUTES.iter().find(|(p, _)| *p == path) else {
        return Err(OpenAiError::unknown_route(method.as_str(), path));
    };
    if method.as_str() != allowed {
        return Err(OpenAiError::wrong_method(method.as_str(), target, allowed));
    }
    Ok(target)
}

/// What all of the front door's connections share.
#[derive(Clone)]
struct Shared {
    /// Keys' tenants, so that a request on a known key queries nothing.
    keys: Arc<keys::KeyCache>,
    /// The store's read-only connection that keys are looked up on (on the async threads):
    /// it never waits behind the store's own lock, however long a write holds it.
    reader: Option<Arc<crate::store::Store>>,
    /// The threads forwarded requests run on.
    workers: workers::Workers,
}

impl Shared {
    fn new(svc: &TenantService) -> Shared {
        let reader = match svc.store().open_reader() {
            Ok(reader) => Some(Arc::new(reader)),
            Err(e) => {
                tracing::warn!(error = %e, "front door: no read-only store connection; keys are looked up on the store's own");
                None
            }
        };
        Shared {
            keys: Arc::default(),
            reader,
            workers: workers::Workers::default(),
        }
    }
}

/// What a request knows of its connection.
struct Conn {
    slot: Arc<Slot>,
    shared: Shared,
}

async fn handle(
    svc: TenantService,
    conn: Conn,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let started = Instant::now();
    let path = req.uri().path().to_string();
    let answer = answer(&svc, &conn, req, started).await;
    let (resp, tenant) = match answer {
        Ok((resp, tenant)) => (resp, Some(tenant)),
        Err((e, tenant)) => {
            let mut resp = error_response(&e);
            if e.code == "too_many_connections" || e.code == "overloaded" {
                resp.headers_mut()
                    .insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
            }
            (resp, tenant)
        }
    };
    if let Some(t) = &tenant {
        svc.metrics()
            .request(t, route_label(&path), resp.status().as_u16());
    }
    // The tenant, the route and the outcome: never a prompt or a completion.
    tracing::info!(
        tenant = tenant.as_deref().unwrap_or("-"),
        route = route_label(&path),
        status = resp.status().as_u16(),
        head_ms = started.elapsed().as_millis() as u64,
        "front door request"
    );
    Ok(resp)
}

/// A fixed label for a path (a client's path is not logged as sent).
fn route_label(path: &str) -> &'static str {
    match path {
        "/v1/models" => "models",
        "/v1/completions" => "completions",
        "/v1/chat/completions" => "chat.completions",
        "/v1/embeddings" => "embeddings",
        "/metrics" => "metrics",
        _ => "unknown",
    }
}

type Failure = (OpenAiError, Option<String>);

async fn answer(
    svc: &TenantService,
    conn: &Conn,
    req: Request<Incoming>,
    started: Instant,
) -> Result<(Response<Body>, String), Failure> {
    let is_metrics = req.uri().path() == "/metrics" && req.method() == Method::GET;
    let target = if is_metrics {
        "/metrics"
    } else {
        route(req.method(), req.uri().path()).map_err(|e| (e, None))?
    };
    let authorization = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let keys_store = conn.shared.reader.as_deref().unwrap_or(svc.store());
    let record = conn
        .shared
        .keys
        .authenticate(keys_store, authorization)
        .map_err(|e| (e, None))?;
    let name = record.name.to_string();
    svc.metrics().claim(&name, record.id);
    let fail = |e: OpenAiError| (e, Some(name.clone()));
    match conn.slot.claim(record.id) {
        Ok(()) => {}
        Err(ClaimRefused::TenantFull) => {
            return Err(fail(OpenAiError::too_many_connections(
                conn.slot.limits().per_tenant,
            )))
        }
        Err(ClaimRefused::DoorFull | ClaimRefused::Evicted) => {
            return Err(fail(OpenAiError::overloaded()))
        }
    }
    if is_metrics {
        let text = tenant_metrics(svc.clone(), record).await;
        let mut resp = Response::new(full(text));
        resp.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
        );
        return Ok((resp, name));
    }
    let refused = |e: OpenAiError, reason| {
        svc.metrics().refused(&name, reason);
        fail(e)
    };
    let limit = record.spec.quotas.max_request_bytes;
    let accept = req
        .headers()
        .get(hyper::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = if req.method() == Method::POST {
        // Refused from its announced length before a byte of it is read.
        let announced = req
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if announced.is_some_and(|n| n > u64::from(limit)) {
            return Err(refused(OpenAiError::too_large(limit), RefusalReason::Size));
        }
        let limited = Limited::new(req.into_body(), limit as usize);
        let bytes = match tokio::time::timeout(BODY_TIMEOUT, limited.collect()).await {
            Err(_) => return Err(fail(OpenAiError::request_timeout())),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(refused(OpenAiError::too_large(limit), RefusalReason::Size))
            }
            Ok(Err(_)) => return Err(fail(OpenAiError::request_timeout())),
            Ok(Ok(collected)) => collected.to_bytes(),
        };
        // Checked here so a malformed body costs the guest nothing; the payload checks the
        // fields (and refuses unknown ones) itself.
        let is_object =
            serde_json::from_slice::<serde_json::Value>(&bytes).is_ok_and(|v| v.is_object());
        if !is_object {
            return Err(fail(OpenAiError::invalid_json()));
        }
        bytes.to_vec()
    } else {
        Vec::new()
    };
    let admitted = svc.admit_front_door(record).map_err(|e| match &e {
        InferError::Quota(Refused::Rate { .. }) => refused(e.into(), RefusalReason::Rate),
        InferError::Quota(Refused::Concurrency { .. }) => {
            refused(e.into(), RefusalReason::Concurrency)
        }
        _ => fail(e.into()),
    })?;
    let in_flight = svc.metrics().in_flight(&name);
    let mut headers = Vec::new();
    if !body.is_empty() {
        headers.push(("Content-Type".to_string(), "application/json".to_string()));
    }
    if let Some(accept) = accept.filter(|a| a.len() < 256) {
        headers.push(("Accept".to_string(), accept));
    }
    let request = PayloadRequest {
        method: if body.is_empty() { "GET" } else { "POST" }.to_string(),
        path: target.to_string(),
        headers,
        body,
    };
    let workers = &conn.shared.workers;
    let resp = forward(
        svc.clone(),
        workers,
        &name,
        admitted,
        request,
        started,
        in_flight,
    )
    .await
    .map_err(fail)?;
    Ok((resp, name))
}

/// The tenant's own series, its VM's cgroup sampled first (on a thread of its own: the
/// store and cgroup reads block).
async fn tenant_metrics(svc: TenantService, record: crate::store::TenantRecord) -> String {
    let (tx, rx) = oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("tenantvmd-metrics".into())
        .spawn(move || {
            sample_vm(&svc, &record);
            let _ = tx.send(svc.metrics().render(Some(record.name.as_str())));
        });
    match spawned {
        Ok(_) => rx.await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Reads what `record`'s VM and GPU slice report into the metrics
/// ([`crate::metrics::sample`]).
pub(crate) fn sample_vm(svc: &TenantService, record: &crate::store::TenantRecord) {
    crate::metrics::sample::sample_tenant(svc, record);
}

/// Runs the forwarded request on a thread of its own (one of `workers`) and returns the response as soon as
/// the payload's head is in; the thread then passes the body on piece by piece.
async fn forward(
    svc: TenantService,
    workers: &workers::Workers,
    tenant: &str,
    admitted: infer::AdmittedInfer,
    request: PayloadRequest,
    started: Instant,
    in_flight: crate::metrics::InFlight,
) -> Result<Response<Body>, OpenAiError> {
    let (head_tx, head_rx) = oneshot::channel();
    let (body_tx, body_rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(PIPE_CHUNKS);
    let tenant_name = tenant.to_string();
    workers
        .run(move || {
            let mut answer = match svc.forward_payload(admitted, request) {
                Ok(answer) => answer,
                Err(e) => {
                    let _ = head_tx.send(Err(e));
                    return;
                }
            };
            let _in_flight = in_flight;
            let head = (answer.status, std::mem::take(&mut answer.headers));
            let mut usage = UsageScanner::new(&head.1);
            if head_tx.send(Ok(head)).is_err() {
                return;
            }
            let metrics = svc.metrics();
            let mut buf = vec![0u8; PIECE_BYTES];
            let mut first = true;
            let mut broke = None;
            loop {
                match answer.body.read(&mut buf) {
                    Ok(0) => {
                        if let Some((prompt, completion)) = usage.finish() {
                            metrics.tokens(&tenant_name, prompt, completion);
                        }
                        metrics.finished(&tenant_name, started.elapsed());
                        break;
                    }
                    Ok(n) => {
                        if first {
                            metrics.first_byte(&tenant_name, started.elapsed());
                            first = false;
                        }
                        usage.push(&buf[..n]);
                        let piece = Bytes::copy_from_slice(&buf[..n]);
                        if body_tx.blocking_send(Ok(piece)).is_err() {
                            // The client went away: dropping the answer closes the guest
                            // connection and frees the tenant's place.
                            tracing::info!(tenant = %tenant_name, "front door: client left mid-answer");
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(tenant = %tenant_name, error = %e, "front door: the guest's answer broke off");
                        broke = Some(e);
                        break;
                    }
                }
            }
            // The guest connection closes and the tenant's place is free before the client
            // learns that the answer ended (a next request of its may come at once).
            drop(answer);
            drop(_in_flight);
            if let Some(e) = broke {
                let _ = body_tx.blocking_send(Err(e));
            }
            drop(body_tx);
        })
        .map_err(|e| {
            OpenAiError::from(InferError::Unavailable(format!(
                "cannot start a thread for the request: {e}"
            )))
        })?;
    let (status, headers) = match head_rx.await {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => {
            return Err(InferError::Unavailable(
                "the request's thread ended without an answer".into(),
            )
            .into())
        }
    };
    let status = StatusCode::from_u16(status)
        .ok()
        .filter(|s| (200..600).contains(&s.as_u16()))
        .ok_or_else(|| {
            OpenAiError::from(InferError::Unavailable(format!(
                "the payload answered with status {status}"
            )))
        })?;
    let mut resp = Response::new(ChannelBody::new(body_rx).boxed());
    *resp.status_mut() = status;
    let content_type = headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("content-type"))
        .and_then(|(_, v)| HeaderValue::from_str(v).ok())
        .unwrap_or(HeaderValue::from_static("application/json"));
    if content_type.as_bytes().starts_with(b"text/event-stream") {
        resp.headers_mut().insert(
            hyper::header::CACHE_CONTROL,
            HeaderValue::from_static("no-cache"),
        );
    }
    resp.headers_mut().insert(CONTENT_TYPE, content_type);
    Ok(resp)
}

/// Finds the payload's usage counts in its answer as it passes, for the token metrics:
/// in a stream, the `usage` of a `data:` event (line by line, each line bounded); in a
/// JSON answer, its `usage` (the answer kept up to [`USAGE_SCAN_BYTES`], else not
/// counted). Only the two numbers are kept; the text is dropped as it is read.
struct UsageScanner {
    stream: bool,
    buf: Vec<u8>,
    overflow: bool,
    found: Option<(u64, u64)>,
}

/// Most bytes of an answer (or of one event line) kept to find its usage.
const USAGE_SCAN_BYTES: usize = 256 * 1024;

fn usage_of(v: &serde_json::Value) -> Option<(u64, u64)> {
    let u = v.get("usage")?;
    Some((
        u.get("prompt_tokens")?.as_u64()?,
        u.get("completion_tokens")?.as_u64()?,
    ))
}

impl UsageScanner {
    fn new(headers: &[(String, String)]) -> Self {
        let stream = headers.iter().any(|(n, v)| {
            n.eq_ignore_ascii_case("content-type") && v.starts_with("text/event-stream")
        });
        UsageScanner {
            stream,
            buf: Vec::new(),
            overflow: false,
            found: None,
        }
    }

    fn push(&mut self, piece: &[u8]) {
        if !self.stream {
            if self.buf.len() + piece.len() > USAGE_SCAN_BYTES {
                self.overflow = true;
                self.buf = Vec::new();
            } else if !self.overflow {
                self.buf.extend_from_slice(piece);
            }
            return;
        }
        let mut rest = piece;
        loop {
            let (part, ends) = match rest.iter().position(|&b| b == b'\n') {
                Some(i) => (&rest[..i], Some(i)),
                None => (rest, None),
            };
            if !self.overflow {
                if self.buf.len() + part.len() > USAGE_SCAN_BYTES {
                    self.overflow = true;
                    self.buf.clear();
                } else {
                    self.buf.extend_from_slice(part);
                }
            }
            let Some(i) = ends else {
                return;
            };
            self.end_line();
            rest = &rest[i + 1..];
        }
    }

    /// A whole event line is in: only one that names `"usage"` is parsed (every token's
    /// event would otherwise be parsed as JSON, a share of the front door's time per
    /// token in a profile).
    fn end_line(&mut self) {
        if !self.overflow {
            if let Some(json) = self.buf.strip_prefix(b"data: ") {
                if json.windows(7).any(|w| w == b"\"usage\"") {
                    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(json) {
                        self.found = usage_of(&v).or(self.found);
                    }
                }
            }
        }
        self.buf.clear();
        self.overflow = false;
    }

    fn finish(&mut self) -> Option<(u64, u64)> {
        if !self.stream && !self.overflow {
            self.found = serde_json::from_slice::<serde_json::Value>(&self.buf)
                .ok()
                .and_then(|v| usage_of(&v));
        }
        self.found
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod usage_tests {
    use super::UsageScanner;

    fn headers(ct: &str) -> Vec<(String, String)> {
        vec![("Content-Type".into(), ct.into())]
    }

    #[test]
    fn usage_is_found_in_split_streams_and_whole_answers_only() {
        let mut s = UsageScanner::new(&headers("text/event-stream"));
        let stream = b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":9}}\n\ndata: [DONE]\n\n";
        for piece in stream.chunks(5) {
            s.push(piece);
        }
        assert_eq!(s.finish(), Some((7, 9)));
        let mut s = UsageScanner::new(&headers("application/json"));
        s.push(br#"{"usage": {"prompt_tokens": 2,"#);
        s.push(br#" "completion_tokens": 3}}"#);
        assert_eq!(s.finish(), Some((2, 3)));
        // Malformed SSE and garbage count nothing, and an oversized line is dropped.
        let mut s = UsageScanner::new(&headers("text/event-stream"));
        s.push(b"data: {not json\n");
        s.push(&vec![b'x'; super::USAGE_SCAN_BYTES + 10]);
        s.push(b"\n");
        assert_eq!(s.finish(), None);
        let mut s = UsageScanner::new(&headers("application/json"));
        s.push(&vec![b' '; super::USAGE_SCAN_BYTES + 1]);
        s.push(br#"{"usage": {"prompt_tokens": 2, "completion_tokens": 3}}"#);
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn usage_split_inside_its_name_or_behind_an_oversized_line_is_still_found() {
        let mut s = UsageScanner::new(&headers("text/event-stream"));
        let mut stream = b"data: ".to_vec();
        stream.extend(vec![b'x'; super::USAGE_SCAN_BYTES]);
        stream.extend_from_slice(b"\ndata: {\"text\":\"hi\"}\n\ndata: {\"us");
        s.push(&stream);
        s.push(b"age\":{\"prompt_tokens\":4,\"completion_tokens\":5}}\n\ndata: [DONE]\n\n");
        assert_eq!(s.finish(), Some((4, 5)));
        // Token events without usage leave the count as it was.
        let mut s = UsageScanner::new(&headers("text/event-stream"));
        for _ in 0..3 {
            s.push(b"data: {\"choices\":[{\"text\":\" usage\"}]}\n\n");
        }
        assert_eq!(s.finish(), None);
    }
}
