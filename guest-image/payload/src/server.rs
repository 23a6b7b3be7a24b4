//! The server: one thread per client connection (at most `--max-connections`). The state
//! every request shares, with its `--max-concurrency` generation slots, is in
//! [`crate::state`].

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::api;
use crate::http::{Connection, HttpLimits, HttpReadError};
use crate::openai::ApiError;
use crate::registry::Registry;
use crate::state::{AppState, ServeConfig};

/// A bound listener and the state it serves.
pub struct Server {
    listener: TcpListener,
    state: Arc<AppState>,
}

impl Server {
    /// Binds `addr` (port 0 picks a free port).
    pub fn bind(addr: &str, registry: Registry, config: ServeConfig) -> io::Result<Self> {
        Ok(Self {
            listener: TcpListener::bind(addr)?,
            state: Arc::new(AppState::new(registry, config)),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The shared state (for counters, rescans from a signal).
    pub fn state(&self) -> Arc<AppState> {
        Arc::clone(&self.state)
    }

    /// Serves forever.
    pub fn run(self) -> io::Result<()> {
        for conn in self.listener.incoming() {
            let stream = match conn {
                Ok(s) => s,
                Err(_) => {
                    // Out of file descriptors or similar: back off instead of spinning.
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let state = Arc::clone(&self.state);
            let open = state.stats.connections.fetch_add(1, Ordering::SeqCst);
            if open >= state.config.max_connections as u64 {
                state.stats.connections.fetch_sub(1, Ordering::SeqCst);
                refuse(
                    &state,
                    stream,
                    ApiError::overloaded(format!(
                        "This server already has {} open connections (--max-connections); retry later",
                        state.config.max_connections
                    )),
                );
                continue;
            }
            // The stream goes to the thread; a failed spawn drops it (the client sees a
            // reset and retries) and releases its connection count.
            let spawned = std::thread::Builder::new()
                .name("tenantvm-ngram-conn".into())
                .spawn({
                    let state = Arc::clone(&state);
                    move || {
                        serve_connection(&state, stream);
                        state.stats.connections.fetch_sub(1, Ordering::SeqCst);
                    }
                });
            if spawned.is_err() {
                state.stats.connections.fetch_sub(1, Ordering::SeqCst);
            }
        }
        Ok(())
    }

    /// Serves on a background thread (tests, benchmarks); returns the address.
    pub fn spawn(self) -> io::Result<SocketAddr> {
        let addr = self.local_addr()?;
        std::thread::Builder::new()
            .name("tenantvm-ngram-accept".into())
            .spawn(move || self.run())?;
        Ok(addr)
    }
}

/// Answers a connection the server will not serve, without reading from it.
fn refuse(state: &AppState, stream: TcpStream, err: ApiError) {
    let limits = HttpLimits {
        write_timeout: Duration::from_millis(200),
        ..state.config.http
    };
    if let Ok(mut conn) = Connection::new(stream, limits) {
        state.stats.count_status(err.status);
        let _ = conn.write_response(
            err.status,
            "application/json",
            &err.headers(),
            &err.body(),
            false,
        );
    }
}

fn serve_connection(state: &AppState, stream: TcpStream) {
    let Ok(mut conn) = Connection::new(stream, state.config.http) else {
        return;
    };
    loop {
        let err = match conn.read_request() {
            Ok(req) => {
                if api::handle(state, &req, &mut conn) {
                    continue;
                }
                return;
            }
            Err(HttpReadError::Closed | HttpReadError::Io(_)) => return,
            Err(HttpReadError::Timeout) => {
                state.stats.read_timeouts.fetch_add(1, Ordering::Relaxed);
                ApiError::timeout(state.config.http.read_timeout.as_millis() as u64)
            }
            Err(HttpReadError::HeadersTooLarge) => {
                ApiError::headers_too_large(state.config.http.max_header_bytes)
            }
            Err(HttpReadError::BodyTooLarge(size)) => {
                ApiError::too_large(size, state.config.http.max_body_bytes)
            }
            Err(HttpReadError::Malformed(what)) => ApiError::bad_http(what),
        };
        state.stats.count_status(err.status);
        if conn
            .write_response(
                err.status,
                "application/json",
                &err.headers(),
                &err.body(),
                false,
            )
            .is_ok()
        {
            conn.linger_close();
        }
        return;
    }
}
