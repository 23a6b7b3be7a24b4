//! The agent's kept-alive connections to its payload (inside the guest; the payload is the
//! tenant's own process). A streamed request takes an idle connection if one is kept, or
//! opens a new one, and gives it back once its answer was read to the end with a length
//! or chunked framing and no `Connection: close`; at most [`MAX_IDLE`] are kept. A kept
//! connection that the payload has closed is noticed before use (a non-blocking peek), and
//! a request whose kept connection ends before any answer is tried once more on a new one.
//! Every connection has Nagle's algorithm off (the request goes in one write anyway).

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tenantvm_agent_protocol::HttpRequest;

use crate::http1::{self, BodyStream, HttpCodecError, StreamedResponse};

/// Most idle connections kept to the payload.
pub const MAX_IDLE: usize = 8;
/// How long opening a connection to the payload may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Kept-alive connections to the payload at one address.
#[derive(Debug)]
pub struct PayloadPool {
    addr: SocketAddr,
    idle: Mutex<Vec<TcpStream>>,
}

impl PayloadPool {
    /// A pool for the payload at `addr` (nothing is opened yet).
    pub fn new(addr: SocketAddr) -> Self {
        PayloadPool {
            addr,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// The payload's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Idle connections kept now.
    pub fn idle(&self) -> usize {
        self.lock().len()
    }

    /// Drops every kept connection (the payload is being replaced).
    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<TcpStream>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A kept connection that still looks open, if any.
    fn take(&self) -> Option<TcpStream> {
        loop {
            let conn = self.lock().pop()?;
            if still_open(&conn) {
                return Some(conn);
            }
        }
    }

    /// Sends `req` and returns the answer's status and headers as soon as they come, and
    /// its body to be read; every read and write waits at most `timeout`. Hand the body to
    /// [`PayloadPool::give_back`] once read to its end.
    pub fn stream(
        &self,
        req: &HttpRequest,
        timeout: Duration,
    ) -> Result<StreamedResponse<TcpStream>, String> {
        let host = self.addr.to_string();
        if let Some(conn) = self.take() {
            if set_timeouts(&conn, timeout).is_ok() {
                match http1::exchange_stream_keep_alive(conn, &host, req) {
                    Ok(answer) => return Ok(answer),
                    // Closed by the payload between the peek and the request: nothing of
                    // an answer came, so the request is sent again on a new connection.
                    Err(HttpCodecError::Truncated) => {}
                    Err(HttpCodecError::Io(e)) if is_reset(&e) => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
        }
        let conn = TcpStream::connect_timeout(&self.addr, CONNECT_TIMEOUT)
            .map_err(|e| format!("Cannot connect to the payload on {}: {e}", self.addr))?;
        set_timeouts(&conn, timeout).map_err(|e| e.to_string())?;
        http1::exchange_stream_keep_alive(conn, &host, req).map_err(|e| e.to_string())
    }

    /// Keeps the connection of an answer read to its end, if it can serve another request.
    pub fn give_back(&self, body: BodyStream<TcpStream>) {
        if let Some(conn) = body.into_reusable() {
            let mut idle = self.lock();
            if idle.len() < MAX_IDLE {
                idle.push(conn);
            }
        }
    }
}

fn set_timeouts(conn: &TcpStream, timeout: Duration) -> io::Result<()> {
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))
}

fn is_reset(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
    )
}

/// Whether a kept connection is still open with nothing unread on it.
fn still_open(conn: &TcpStream) -> bool {
    if conn.set_nonblocking(true).is_err() {
        return false;
    }
    let mut byte = [0u8; 1];
    let open = matches!(conn.peek(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
    open && conn.set_nonblocking(false).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;

    fn post() -> HttpRequest {
        HttpRequest {
            method: "POST".into(),
            path: "/v1/completions".into(),
            headers: vec![],
            body: "{}".into(),
        }
    }

    /// A payload that answers `answers` requests per connection (chunked), then closes;
    /// it reports each new connection.
    fn payload(answers: usize, close_header: bool) -> (SocketAddr, std::sync::mpsc::Receiver<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(s) = s else { return };
                let _ = tx.send(());
                std::thread::spawn(move || {
                    let mut r = BufReader::new(s);
                    for _ in 0..answers {
                        let mut len = 0;
                        loop {
                            let mut line = String::new();
                            if r.read_line(&mut line).unwrap_or(0) == 0 {
                                return;
                            }
                            if let Some(v) =
                                line.to_ascii_lowercase().strip_prefix("content-length:")
                            {
                                len = v.trim().parse().unwrap();
                            }
                            if line == "\r\n" {
                                break;
                            }
                        }
                        let mut body = vec![0u8; len];
                        r.read_exact(&mut body).unwrap();
                        let close = if close_header {
                            "Connection: close\r\n"
                        } else {
                            ""
                        };
                        let answer = format!(
                            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n{close}\r\n3\r\nabc\r\n0\r\n\r\n"
                        );
                        if r.get_mut().write_all(answer.as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, rx)
    }

    fn run(pool: &PayloadPool) -> Vec<u8> {
        let (status, _, mut body) = pool.stream(&post(), Duration::from_secs(10)).unwrap();
        assert_eq!(status, 200);
        let mut out = Vec::new();
        let mut buf = [0u8; 64];
        loop {
            let n = body.next_piece(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        pool.give_back(body);
        out
    }

    #[test]
    fn a_finished_connection_serves_the_next_request() {
        let (addr, conns) = payload(100, false);
        let pool = PayloadPool::new(addr);
        for _ in 0..5 {
            assert_eq!(run(&pool), b"abc");
        }
        assert_eq!(pool.idle(), 1);
        assert_eq!(conns.try_iter().count(), 1, "one connection for all five");
    }

    #[test]
    fn connections_the_payload_closes_are_not_reused_and_requests_still_succeed() {
        // `Connection: close` answers are never kept.
        let (addr, conns) = payload(1, true);
        let pool = PayloadPool::new(addr);
        for _ in 0..3 {
            assert_eq!(run(&pool), b"abc");
        }
        assert_eq!(pool.idle(), 0);
        assert_eq!(conns.try_iter().count(), 3);
        // A payload that closes a kept connection after one answer without saying so: the
        // next request notices and goes on a new connection.
        let (addr, conns) = payload(1, false);
        let pool = PayloadPool::new(addr);
        for _ in 0..3 {
            assert_eq!(run(&pool), b"abc");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(conns.try_iter().count(), 3);
    }

    #[test]
    fn an_answer_not_read_to_its_end_does_not_keep_its_connection() {
        let (addr, _conns) = payload(100, false);
        let pool = PayloadPool::new(addr);
        let (_, _, body) = pool.stream(&post(), Duration::from_secs(10)).unwrap();
        pool.give_back(body);
        assert_eq!(pool.idle(), 0);
    }
}
