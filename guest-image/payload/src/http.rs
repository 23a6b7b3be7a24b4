//! HTTP/1.1 server connections (httparse for the request head), bounded everywhere: the
//! header block, the header count and the body have hard limits, a request must arrive
//! whole within a deadline (a client that trickles bytes is cut off as surely as one that
//! sends nothing), an idle keep-alive connection is closed, and writes have a deadline so a
//! client that stops reading a stream frees its generation slot.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use thiserror::Error;

/// Most header lines in a request.
pub const MAX_HEADERS: usize = 64;

/// The connection limits (`serve` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Largest header block (request line included).
    pub max_header_bytes: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// A request must arrive whole within this, from its first byte (from accept for the
    /// first request of a connection).
    pub read_timeout: Duration,
    /// A kept-alive connection may wait this long for its next request.
    pub idle_timeout: Duration,
    /// Each write must complete within this.
    pub write_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_header_bytes: 16 * 1024,
            max_body_bytes: 1024 * 1024,
            read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(30),
        }
    }
}

/// Why a request could not be read.
#[derive(Debug, Error)]
pub enum HttpReadError {
    /// The peer closed (or stayed idle past the keep-alive timeout) between requests.
    #[error("Connection closed between requests")]
    Closed,
    /// The request did not arrive whole in time.
    #[error("The request did not arrive in time")]
    Timeout,
    /// The header block is over the limit.
    #[error("The request headers are too large")]
    HeadersTooLarge,
    /// The body is over the limit (`Content-Length` if known).
    #[error("The request body is too large")]
    BodyTooLarge(Option<usize>),
    /// Not valid HTTP/1.x.
    #[error("{0}")]
    Malformed(&'static str),
    /// The connection failed.
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

/// A request, fully read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Method.
    pub method: String,
    /// Target path, without the query string.
    pub path: String,
    /// Headers in order.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Vec<u8>,
    /// HTTP/1.1 (else 1.0).
    pub http11: bool,
    /// The client allows another request on this connection.
    pub keep_alive: bool,
}

impl Request {
    /// The first header named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

fn has_token(value: &str, token: &str) -> bool {
    value
        .split(',')
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// The reason phrase of a status this server sends.
pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// A parsed request head and how its body is framed.
struct Head {
    /// Bytes of the head.
    len: usize,
    /// The request, body still empty.
    req: Request,
    content_length: Option<usize>,
    chunked: bool,
    expect_continue: bool,
}

/// One client connection.
pub struct Connection {
    stream: TcpStream,
    limits: HttpLimits,
    /// Bytes read and not yet consumed (the start of a pipelined request).
    buf: Vec<u8>,
    /// When the connection was accepted.
    accepted: Instant,
    /// Requests read so far.
    served: u64,
    /// The body of the current response is sent with chunked framing.
    chunked: bool,
}

impl Connection {
    /// Wraps an accepted stream.
    pub fn new(stream: TcpStream, limits: HttpLimits) -> io::Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(limits.write_timeout))?;
        Ok(Self {
            stream,
            limits,
            buf: Vec::new(),
            accepted: Instant::now(),
            served: 0,
            chunked: false,
        })
    }

    /// Reads more bytes before `deadline`; `Ok(0)` at end of stream.
    fn fill(&mut self, deadline: Instant) -> Result<usize, HttpReadError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HttpReadError::Timeout);
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut chunk = [0u8; 16 * 1024];
        match self.stream.read(&mut chunk) {
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(n)
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(HttpReadError::Timeout)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(self.fill(deadline)?),
            Err(e) => Err(e.into()),
        }
    }

    /// Reads the next request. [`HttpReadError::Closed`] when the client closed or stayed
    /// idle between requests.
    pub fn read_request(&mut self) -> Result<Request, HttpReadError> {
        let mut deadline = if self.served == 0 {
            self.accepted + self.limits.read_timeout
        } else {
            Instant::now() + self.limits.idle_timeout
        };
        if self.buf.is_empty() {
            match self.fill(deadline) {
                Ok(0) => return Err(HttpReadError::Closed),
                Err(HttpReadError::Timeout) if self.served > 0 => {
                    return Err(HttpReadError::Closed)
                }
                Err(e) => return Err(e),
                Ok(_) => {}
            }
            if self.served > 0 {
                deadline = Instant::now() + self.limits.read_timeout;
            }
        }
        self.served += 1;
        let Head {
            len: head_len,
            mut req,
            content_length,
            chunked,
            expect_continue,
        } = loop {
            match self.parse_head()? {
                Some(parsed) => break parsed,
                None if self.buf.len() >= self.limits.max_header_bytes => {
                    return Err(HttpReadError::HeadersTooLarge)
                }
                None => {
                    if self.fill(deadline)? == 0 {
                        return Err(HttpReadError::Malformed(
                            "the connection closed in the middle of the request headers",
                        ));
                    }
                }
            }
        };
        if head_len > self.limits.max_header_bytes {
            return Err(HttpReadError::HeadersTooLarge);
        }
        self.buf.drain(..head_len);
        if let Some(len) = content_length {
            if len > self.limits.max_body_bytes {
                return Err(HttpReadError::BodyTooLarge(Some(len)));
            }
        }
        if expect_continue && (content_length.is_some_and(|l| l > 0) || chunked) {
            self.stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
        }
        req.body = if chunked {
            self.read_chunked_body(deadline)?
        } else {
            let len = content_length.unwrap_or(0);
            while self.buf.len() < len {
                if self.fill(deadline)? == 0 {
                    return Err(HttpReadError::Malformed(
                        "the connection closed before the whole body arrived",
                    ));
                }
            }
            self.buf.drain(..len).collect()
        };
        Ok(req)
    }

    /// Parses the head in `buf`: `None` if incomplete.
    fn parse_head(&self) -> Result<Option<Head>, HttpReadError> {
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Request::new(&mut slots);
        let head_len = match parsed.parse(&self.buf) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => return Err(HttpReadError::HeadersTooLarge),
            Err(_) => return Err(HttpReadError::Malformed("not a valid HTTP/1.x request")),
        };
        let method = parsed.method.unwrap_or_default().to_string();
        let target = parsed.path.unwrap_or_default();
        if !target.starts_with('/') {
            return Err(HttpReadError::Malformed(
                "the request target must be a path starting with '/'",
            ));
        }
        let path = target.split(['?', '#']).next().unwrap_or("/").to_string();
        let http11 = parsed.version == Some(1);
        let mut headers = Vec::with_capacity(parsed.headers.len());
        for h in parsed.headers.iter() {
            let value = std::str::from_utf8(h.value)
                .map_err(|_| HttpReadError::Malformed("a header value is not UTF-8"))?;
            headers.push((h.name.to_string(), value.trim().to_string()));
        }
        let mut content_length = None;
        for (_, v) in headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("content-length"))
        {
            let len: usize = v
                .parse()
                .map_err(|_| HttpReadError::Malformed("bad Content-Length"))?;
            if content_length.is_some_and(|l| l != len) {
                return Err(HttpReadError::Malformed(
                    "conflicting Content-Length headers",
                ));
            }
            content_length = Some(len);
        }
        let chunked = match header(&headers, "transfer-encoding") {
            None => false,
            Some(te) if te.eq_ignore_ascii_case("chunked") => true,
            Some(_) => {
                return Err(HttpReadError::Malformed(
                    "only Transfer-Encoding: chunked is supported",
                ))
            }
        };
        if chunked && content_length.is_some() {
            return Err(HttpReadError::Malformed(
                "a request must not carry both Content-Length and Transfer-Encoding",
            ));
        }
        let connection = header(&headers, "connection").unwrap_or("");
        let keep_alive = if http11 {
            !has_token(connection, "close")
        } else {
            has_token(connection, "keep-alive")
        };
        let expect_continue =
            header(&headers, "expect").is_some_and(|e| e.eq_ignore_ascii_case("100-continue"));
        let req = Request {
            method,
            path,
            headers,
            body: Vec::new(),
            http11,
            keep_alive,
        };
        Ok(Some(Head {
            len: head_len,
            req,
            content_length,
            chunked,
            expect_continue,
        }))
    }

    fn read_chunked_body(&mut self, deadline: Instant) -> Result<Vec<u8>, HttpReadError> {
        let max = self.limits.max_body_bytes;
        let mut body = Vec::new();
        loop {
            let (consumed, size) = loop {
                match httparse::parse_chunk_size(&self.buf) {
                    Ok(httparse::Status::Complete(c)) => break c,
                    Ok(httparse::Status::Partial) if self.buf.len() > 1024 => {
                        return Err(HttpReadError::Malformed("chunk size line too long"))
                    }
                    Ok(httparse::Status::Partial) => {
                        if self.fill(deadline)? == 0 {
                            return Err(HttpReadError::Malformed("the body ended mid-chunk"));
                        }
                    }
                    Err(_) => return Err(HttpReadError::Malformed("bad chunk size")),
                }
            };
            let size = usize::try_from(size).unwrap_or(usize::MAX);
            if size > max.saturating_sub(body.len()) {
                return Err(HttpReadError::BodyTooLarge(None));
            }
            self.buf.drain(..consumed);
            if size == 0 {
                return self.skip_trailers(deadline).map(|()| body);
            }
            while self.buf.len() < size + 2 {
                if self.fill(deadline)? == 0 {
                    return Err(HttpReadError::Malformed("the body ended mid-chunk"));
                }
            }
            if &self.buf[size..size + 2] != b"\r\n" {
                return Err(HttpReadError::Malformed("chunk not followed by CRLF"));
            }
            body.extend_from_slice(&self.buf[..size]);
            self.buf.drain(..size + 2);
        }
    }

    fn skip_trailers(&mut self, deadline: Instant) -> Result<(), HttpReadError> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let empty = end == 0;
                self.buf.drain(..end + 2);
                if empty {
                    return Ok(());
                }
                continue;
            }
            if self.buf.len() > self.limits.max_header_bytes {
                return Err(HttpReadError::HeadersTooLarge);
            }
            if self.fill(deadline)? == 0 {
                return Err(HttpReadError::Malformed("the body ended in its trailers"));
            }
        }
    }

    fn head(
        status: u16,
        content_type: &str,
        extra: &[(&str, String)],
        framing: &str,
        keep_alive: bool,
    ) -> String {
        let mut head = format!(
            "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\n{framing}Connection: {}\r\n",
            reason(status),
            if keep_alive { "keep-alive" } else { "close" }
        );
        for (name, value) in extra {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        head
    }

    /// Writes a whole response.
    pub fn write_response(
        &mut self,
        status: u16,
        content_type: &str,
        extra: &[(&str, String)],
        body: &[u8],
        keep_alive: bool,
    ) -> io::Result<()> {
        let framing = format!("Content-Length: {}\r\n", body.len());
        let mut out = Self::head(status, content_type, extra, &framing, keep_alive).into_bytes();
        out.extend_from_slice(body);
        self.stream.write_all(&out)?;
        self.stream.flush()
    }

    /// Starts a streamed 200 response: chunked for HTTP/1.1; for HTTP/1.0 the body runs to
    /// the end of the connection.
    pub fn start_stream(
        &mut self,
        content_type: &str,
        extra: &[(&str, String)],
        http11: bool,
        keep_alive: bool,
    ) -> io::Result<()> {
        self.chunked = http11;
        let framing = if http11 {
            "Transfer-Encoding: chunked\r\n"
        } else {
            ""
        };
        let head = Self::head(200, content_type, extra, framing, keep_alive && http11);
        self.stream.write_all(head.as_bytes())?;
        self.stream.flush()
    }

    /// Sends one piece of a streamed body at once.
    pub fn write_chunk(&mut self, data: &[u8]) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        if self.chunked {
            let mut out = format!("{:x}\r\n", data.len()).into_bytes();
            out.extend_from_slice(data);
            out.extend_from_slice(b"\r\n");
            self.stream.write_all(&out)?;
        } else {
            self.stream.write_all(data)?;
        }
        self.stream.flush()
    }

    /// Closes after an error answer without a reset: stops sending, then reads and
    /// discards what the client still sends (a body the server refused) for a moment, so the
    /// client reads the answer instead of a connection reset.
    pub fn linger_close(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        let deadline = Instant::now() + Duration::from_millis(500);
        let mut sink = [0u8; 16 * 1024];
        let mut budget = 4 * self.limits.max_body_bytes.max(64 * 1024);
        while budget > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.stream.set_read_timeout(Some(left)).is_err() {
                return;
            }
            match self.stream.read(&mut sink) {
                Ok(0) | Err(_) => return,
                Ok(n) => budget = budget.saturating_sub(n),
            }
        }
    }

    /// Ends a streamed body.
    pub fn end_stream(&mut self) -> io::Result<()> {
        if self.chunked {
            self.stream.write_all(b"0\r\n\r\n")?;
        }
        self.chunked = false;
        self.stream.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A connected pair: (client, server-side Connection).
    fn pair(limits: HttpLimits) -> (TcpStream, Connection) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        (client, Connection::new(server, limits).unwrap())
    }

    fn short() -> HttpLimits {
        HttpLimits {
            read_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_millis(300),
            ..HttpLimits::default()
        }
    }

    #[test]
    fn reads_content_length_chunked_and_pipelined_requests() {
        let (mut c, mut conn) = pair(short());
        c.write_all(
            b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello\
              POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nT: x\r\n\r\n\
              GET /c HTTP/1.0\r\n\r\n",
        )
        .unwrap();
        let a = conn.read_request().unwrap();
        assert_eq!(
            (a.method.as_str(), a.path.as_str()),
            ("POST", "/v1/completions")
        );
        assert_eq!(a.body, b"hello");
        assert!(a.http11 && a.keep_alive);
        assert_eq!(a.header("HOST"), Some("a"));
        let b = conn.read_request().unwrap();
        assert_eq!(b.body, b"abcde");
        let c3 = conn.read_request().unwrap();
        assert_eq!(c3.path, "/c");
        assert!(!c3.http11 && !c3.keep_alive);
        // Idle past the keep-alive timeout: closed quietly.
        assert!(matches!(conn.read_request(), Err(HttpReadError::Closed)));
    }

    #[test]
    fn limits_are_enforced_before_reading_everything() {
        let limits = HttpLimits {
            max_body_bytes: 10,
            max_header_bytes: 256,
            ..short()
        };
        let (mut c, mut conn) = pair(limits);
        c.write_all(b"POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n")
            .unwrap();
        assert!(matches!(
            conn.read_request(),
            Err(HttpReadError::BodyTooLarge(Some(11)))
        ));

        let (mut c, mut conn) = pair(limits);
        c.write_all(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n12345678\r\n8\r\n")
            .unwrap();
        assert!(matches!(
            conn.read_request(),
            Err(HttpReadError::BodyTooLarge(None))
        ));

        let (mut c, mut conn) = pair(limits);
        let long = format!("GET / HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(300));
        c.write_all(long.as_bytes()).unwrap();
        assert!(matches!(
            conn.read_request(),
            Err(HttpReadError::HeadersTooLarge)
        ));

        let (mut c, mut conn) = pair(limits);
        let many: String = (0..70).map(|i| format!("H{i}: v\r\n")).collect();
        c.write_all(format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes())
            .unwrap();
        assert!(matches!(
            conn.read_request(),
            Err(HttpReadError::HeadersTooLarge)
        ));
    }

    #[test]
    fn malformed_and_smuggling_shaped_requests_are_refused() {
        for raw in [
            &b"NOT HTTP\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"GET http://x/ HTTP/1.1\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        ] {
            let (mut c, mut conn) = pair(short());
            c.write_all(raw).unwrap();
            assert!(
                matches!(conn.read_request(), Err(HttpReadError::Malformed(_))),
                "{}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    #[test]
    fn a_trickling_client_is_cut_off_at_the_deadline() {
        let (mut c, mut conn) = pair(short());
        let t = std::thread::spawn(move || {
            for b in b"POST / HTTP/1.1\r\nHost: slow\r\n" {
                if c.write_all(&[*b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            c
        });
        let started = Instant::now();
        assert!(matches!(conn.read_request(), Err(HttpReadError::Timeout)));
        // The deadline is for the whole request, not per read: well before the client
        // would have finished trickling (31 bytes x 20 ms) plus another timeout.
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(t.join());
    }

    #[test]
    fn expect_continue_is_answered_before_the_body() {
        let (mut c, mut conn) = pair(short());
        c.write_all(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
            .unwrap();
        let t = std::thread::spawn(move || {
            let mut got = [0u8; 25];
            c.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"HTTP/1.1 100 Continue\r\n\r\n");
            c.write_all(b"ok").unwrap();
            c
        });
        assert_eq!(conn.read_request().unwrap().body, b"ok");
        drop(t.join().unwrap());
    }

    #[test]
    fn streamed_responses_use_chunked_framing() {
        let (mut c, mut conn) = pair(short());
        conn.start_stream("text/event-stream", &[], true, false)
            .unwrap();
        conn.write_chunk(b"data: x\n\n").unwrap();
        conn.end_stream().unwrap();
        drop(conn);
        let mut all = String::new();
        c.read_to_string(&mut all).unwrap();
        assert!(all.starts_with("HTTP/1.1 200 OK\r\n"), "{all}");
        assert!(all.contains("Transfer-Encoding: chunked\r\n"));
        assert!(
            all.ends_with("\r\n\r\n9\r\ndata: x\n\n\r\n0\r\n\r\n"),
            "{all:?}"
        );
    }
}
