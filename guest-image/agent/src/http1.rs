//! A small HTTP/1.1 client codec: what the agent needs to forward inference requests to
//! the payload's port (the payload serves them with its own server,
//! `tenantvm-ngram`'s `http.rs`). Heads and chunk sizes
//! are parsed by `httparse`; reading is bounded here: the head, the header count and the
//! body have hard limits, and every field that is written onto the wire is checked for
//! CR/LF so nothing can inject headers.

use std::io::{self, BufRead, BufReader, Read, Write};

use thiserror::Error;

use tenantvm_agent_protocol::{HttpRequest, HttpResponse};

/// Largest accepted header block.
pub const MAX_HEAD_LEN: usize = 16 * 1024;
/// Most header lines.
pub const MAX_HEADERS: usize = 64;
/// Longest chunk-size line of a chunked body.
const MAX_CHUNK_LINE: usize = 1024;

/// Why an HTTP message could not be read or written.
#[derive(Debug, Error)]
pub enum HttpCodecError {
    /// The connection failed.
    #[error("HTTP I/O failed: {0}")]
    Io(#[from] io::Error),
    /// The peer closed before a complete message.
    #[error("HTTP peer closed the connection before a complete message")]
    Truncated,
    /// A malformed start line, header or chunk.
    #[error("Malformed HTTP message: {0}")]
    Malformed(&'static str),
    /// The head is not valid HTTP/1.x.
    #[error("Malformed HTTP head: {0}")]
    Head(#[source] httparse::Error),
    /// A limit was exceeded.
    #[error("HTTP {what} exceeds the {max} byte limit")]
    TooLarge {
        /// Which part.
        what: &'static str,
        /// The limit.
        max: usize,
    },
    /// A field to be written holds characters that are not allowed there.
    #[error("HTTP {0} contains characters that are not allowed (control characters, spaces in a token, or a path not starting with '/')")]
    InvalidField(&'static str),
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn is_field_value(s: &str) -> bool {
    s.bytes().all(|b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

fn is_path(s: &str) -> bool {
    s.starts_with('/') && s.bytes().all(|b| b > 0x20 && b != 0x7f)
}

/// Reads one line with its LF, bounded by `budget` bytes in total. `Ok(None)` when the
/// stream ends before the first byte.
fn read_raw_line(
    r: &mut impl BufRead,
    budget: &mut usize,
) -> Result<Option<Vec<u8>>, HttpCodecError> {
    let mut line = Vec::new();
    let n = r.take(*budget as u64 + 1).read_until(b'\n', &mut line)?;
    if n == 0 {
        return Ok(None);
    }
    if n > *budget {
        return Err(HttpCodecError::TooLarge {
            what: "header block",
            max: MAX_HEAD_LEN,
        });
    }
    *budget -= n;
    if line.last() != Some(&b'\n') {
        return Err(HttpCodecError::Truncated);
    }
    Ok(Some(line))
}

/// Reads lines up to and including the first empty one (a head, or a chunked body's
/// trailer), at most [`MAX_HEAD_LEN`] bytes. `Ok(None)` when the stream ends first thing.
fn read_block(r: &mut impl BufRead) -> Result<Option<Vec<u8>>, HttpCodecError> {
    let mut budget = MAX_HEAD_LEN;
    let mut block = Vec::new();
    loop {
        let Some(line) = read_raw_line(r, &mut budget)? else {
            return if block.is_empty() {
                Ok(None)
            } else {
                Err(HttpCodecError::Truncated)
            };
        };
        block.extend_from_slice(&line);
        if line == b"\r\n" || line == b"\n" {
            return Ok(Some(block));
        }
    }
}

/// The headers of a parsed head as owned strings (values trimmed).
fn owned_headers(parsed: &[httparse::Header<'_>]) -> Result<Vec<(String, String)>, HttpCodecError> {
    parsed
        .iter()
        .map(|h| {
            let value = std::str::from_utf8(h.value)
                .map_err(|_| HttpCodecError::Malformed("header is not UTF-8"))?;
            Ok((h.name.to_string(), value.trim().to_string()))
        })
        .collect()
}

/// Maps an httparse failure to this codec's errors.
fn head_error(e: httparse::Error) -> HttpCodecError {
    match e {
        httparse::Error::TooManyHeaders => HttpCodecError::TooLarge {
            what: "header count",
            max: MAX_HEADERS,
        },
        other => HttpCodecError::Head(other),
    }
}

/// Checks that httparse consumed the whole block (it ends at the empty line).
fn complete(status: httparse::Status<usize>) -> Result<(), HttpCodecError> {
    match status {
        httparse::Status::Complete(_) => Ok(()),
        httparse::Status::Partial => Err(HttpCodecError::Truncated),
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

fn read_exact_body(r: &mut impl Read, len: usize) -> Result<Vec<u8>, HttpCodecError> {
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => HttpCodecError::Truncated,
        _ => HttpCodecError::Io(e),
    })?;
    Ok(body)
}

fn read_chunked(r: &mut impl BufRead, max_body: usize) -> Result<Vec<u8>, HttpCodecError> {
    let mut body = Vec::new();
    loop {
        let mut budget = MAX_CHUNK_LINE;
        let line = read_raw_line(r, &mut budget)?.ok_or(HttpCodecError::Truncated)?;
        if line.trim_ascii().is_empty() {
            return Err(HttpCodecError::Malformed("bad chunk size"));
        }
        let size = match httparse::parse_chunk_size(&line) {
            Ok(httparse::Status::Complete((_, size))) => size,
            _ => return Err(HttpCodecError::Malformed("bad chunk size")),
        };
        if size == 0 {
            // Trailer fields are read (bounded) and dropped.
            read_block(r)?.ok_or(HttpCodecError::Truncated)?;
            return Ok(body);
        }
        let size = usize::try_from(size)
            .ok()
            .filter(|size| body.len().saturating_add(*size) <= max_body)
            .ok_or(HttpCodecError::TooLarge {
                what: "body",
                max: max_body,
            })?;
        body.extend(read_exact_body(r, size)?);
        let mut budget = 2;
        if read_raw_line(r, &mut budget)?.as_deref() != Some(b"\r\n") {
            return Err(HttpCodecError::Malformed("chunk not followed by CRLF"));
        }
    }
}

fn read_body(
    r: &mut impl BufRead,
    headers: &[(String, String)],
    max_body: usize,
) -> Result<Vec<u8>, HttpCodecError> {
    if header(headers, "transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        return read_chunked(r, max_body);
    }
    if let Some(len) = header(headers, "content-length") {
        let len: usize = len
            .parse()
            .map_err(|_| HttpCodecError::Malformed("bad Content-Length"))?;
        if len > max_body {
            return Err(HttpCodecError::TooLarge {
                what: "body",
                max: max_body,
            });
        }
        return read_exact_body(r, len);
    }
    let mut body = Vec::new();
    r.take(max_body as u64 + 1).read_to_end(&mut body)?;
    if body.len() > max_body {
        return Err(HttpCodecError::TooLarge {
            what: "body",
            max: max_body,
        });
    }
    Ok(body)
}

/// Writes `req` to `w` with the body's length and `Connection: close` unless `keep_alive`,
/// in one write (no small segment left waiting on Nagle's algorithm); every field is
/// checked so nothing can inject headers.
fn write_request(
    w: &mut impl Write,
    host: &str,
    req: &HttpRequest,
    keep_alive: bool,
) -> Result<(), HttpCodecError> {
    if !is_token(&req.method) {
        return Err(HttpCodecError::InvalidField("method"));
    }
    if !is_path(&req.path) {
        return Err(HttpCodecError::InvalidField("path"));
    }
    let mut head = format!("{} {} HTTP/1.1\r\nHost: {host}\r\n", req.method, req.path);
    for (name, value) in &req.headers {
        if !is_token(name) || !is_field_value(value) {
            return Err(HttpCodecError::InvalidField("header"));
        }
        let lower = name.to_ascii_lowercase();
        if ["host", "content-length", "connection", "transfer-encoding"].contains(&lower.as_str()) {
            continue;
        }
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n", req.body.len()));
    if !keep_alive {
        head.push_str("Connection: close\r\n");
    }
    head.push_str("\r\n");
    head.push_str(&req.body);
    w.write_all(head.as_bytes())?;
    w.flush()?;
    Ok(())
}

/// Reads a response head: status and headers.
fn read_response_head(
    r: &mut impl BufRead,
) -> Result<(u16, Vec<(String, String)>), HttpCodecError> {
    let head = read_block(r)?.ok_or(HttpCodecError::Truncated)?;
    let mut parsed_headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut parsed_headers);
    complete(parsed.parse(&head).map_err(head_error)?)?;
    let status = parsed
        .code
        .filter(|s| (100..600).contains(s))
        .ok_or(HttpCodecError::Malformed("bad status line"))?;
    Ok((status, owned_headers(parsed.headers)?))
}

/// Sends `req` to `stream` (a fresh connection to the payload) and reads the response.
pub fn exchange<S: Read + Write>(
    stream: S,
    host: &str,
    req: &HttpRequest,
    max_body: usize,
) -> Result<HttpResponse, HttpCodecError> {
    let mut r = BufReader::new(stream);
    write_request(r.get_mut(), host, req, false)?;
    let (status, headers) = read_response_head(&mut r)?;
    let body = read_body(&mut r, &headers, max_body)?;
    Ok(HttpResponse {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// How a streamed response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// `Transfer-Encoding: chunked`; bytes left in the current chunk (0: read a size line).
    Chunked { left: u64 },
    /// `Content-Length`; bytes left.
    Length(u64),
    /// Until the peer closes.
    Eof,
    /// Done.
    Done,
}

/// A response body read piece by piece, as the payload sends it: what
/// [`exchange_stream`] returns after the head. Each piece is at most the caller's buffer.
pub struct BodyStream<S: Read> {
    r: BufReader<S>,
    framing: Framing,
    /// Whether the connection may carry another request once this body is read.
    reusable: bool,
}

impl<S: Read> BodyStream<S> {
    /// The connection, if it can carry another request: the request asked for keep-alive,
    /// the answer was delimited (length or chunked, no `Connection: close`), read to its
    /// end, and nothing more came after it.
    pub fn into_reusable(self) -> Option<S> {
        (self.reusable && self.framing == Framing::Done && self.r.buffer().is_empty())
            .then(|| self.r.into_inner())
    }

    /// Reads the next piece of the body into `buf`; `Ok(0)` at its end.
    pub fn next_piece(&mut self, buf: &mut [u8]) -> Result<usize, HttpCodecError> {
        loop {
            match self.framing {
                Framing::Done => return Ok(0),
                Framing::Eof => {
                    let n = self.r.read(buf)?;
                    if n == 0 {
                        self.framing = Framing::Done;
                    }
                    return Ok(n);
                }
                Framing::Length(0) => self.framing = Framing::Done,
                Framing::Length(left) => {
                    let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    let n = self.r.read(&mut buf[..want])?;
                    if n == 0 {
                        return Err(HttpCodecError::Truncated);
                    }
                    self.framing = Framing::Length(left - n as u64);
                    return Ok(n);
                }
                Framing::Chunked { left: 0 } => {
                    let mut budget = MAX_CHUNK_LINE;
                    let line = read_raw_line(&mut self.r, &mut budget)?
                        .ok_or(HttpCodecError::Truncated)?;
                    if line.trim_ascii().is_empty() {
                        return Err(HttpCodecError::Malformed("bad chunk size"));
                    }
                    let size = match httparse::parse_chunk_size(&line) {
                        Ok(httparse::Status::Complete((_, size))) => size,
                        _ => return Err(HttpCodecError::Malformed("bad chunk size")),
                    };
                    if size == 0 {
                        read_block(&mut self.r)?.ok_or(HttpCodecError::Truncated)?;
                        self.framing = Framing::Done;
                    } else {
                        self.framing = Framing::Chunked { left: size };
                    }
                }
                Framing::Chunked { left } => {
                    let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    let n = self.r.read(&mut buf[..want])?;
                    if n == 0 {
                        return Err(HttpCodecError::Truncated);
                    }
                    let left = left - n as u64;
                    if left == 0 {
                        let mut budget = 2;
                        if read_raw_line(&mut self.r, &mut budget)?.as_deref() != Some(b"\r\n") {
                            return Err(HttpCodecError::Malformed("chunk not followed by CRLF"));
                        }
                    }
                    self.framing = Framing::Chunked { left };
                    return Ok(n);
                }
            }
        }
    }
}

/// A streamed response: status, headers, and the body still to be read.
pub type StreamedResponse<S> = (u16, Vec<(String, String)>, BodyStream<S>);

/// Sends `req` to `stream` (a fresh connection to the payload) and returns the response's
/// status and headers as soon as they arrive, and its body as a [`BodyStream`].
pub fn exchange_stream<S: Read + Write>(
    stream: S,
    host: &str,
    req: &HttpRequest,
) -> Result<StreamedResponse<S>, HttpCodecError> {
    exchange_stream_with(stream, host, req, false)
}

/// [`exchange_stream`] on a connection to be kept for further requests (no
/// `Connection: close`); see [`BodyStream::into_reusable`].
pub fn exchange_stream_keep_alive<S: Read + Write>(
    stream: S,
    host: &str,
    req: &HttpRequest,
) -> Result<StreamedResponse<S>, HttpCodecError> {
    exchange_stream_with(stream, host, req, true)
}

fn exchange_stream_with<S: Read + Write>(
    stream: S,
    host: &str,
    req: &HttpRequest,
    keep_alive: bool,
) -> Result<StreamedResponse<S>, HttpCodecError> {
    let mut r = BufReader::new(stream);
    write_request(r.get_mut(), host, req, keep_alive)?;
    let (status, headers) = read_response_head(&mut r)?;
    let framing = if header(&headers, "transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        Framing::Chunked { left: 0 }
    } else if let Some(len) = header(&headers, "content-length") {
        Framing::Length(
            len.parse()
                .map_err(|_| HttpCodecError::Malformed("bad Content-Length"))?,
        )
    } else {
        Framing::Eof
    };
    let closes = header(&headers, "connection")
        .is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")));
    let reusable = keep_alive && framing != Framing::Eof && !closes;
    Ok((
        status,
        headers,
        BodyStream {
            r,
            framing,
            reusable,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// A duplex test stream: reads from `input`, records writes.
    struct Duplex {
        input: Cursor<Vec<u8>>,
        output: Vec<u8>,
    }
    impl Read for Duplex {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }
    impl Write for Duplex {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.output.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn post(body: &str) -> HttpRequest {
        HttpRequest {
            method: "POST".into(),
            path: "/v1/completions".into(),
            headers: vec![("Content-Type".into(), "application/json".into())],
            body: body.into(),
        }
    }

    #[test]
    fn request_written_by_exchange_is_a_well_formed_request() {
        let mut d = Duplex {
            input: Cursor::new(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi".to_vec()),
            output: Vec::new(),
        };
        let resp = exchange(&mut d, "127.0.0.1:8000", &post("{\"a\":1}"), 1024).unwrap();
        assert_eq!(resp.status, 200);
        assert_eq!(resp.body, "hi");
        let mut headers = [httparse::EMPTY_HEADER; 16];
        let mut parsed = httparse::Request::new(&mut headers);
        let httparse::Status::Complete(head_len) = parsed.parse(&d.output).unwrap() else {
            panic!(
                "an incomplete request head: {:?}",
                String::from_utf8_lossy(&d.output)
            );
        };
        assert_eq!(parsed.method, Some("POST"));
        assert_eq!(parsed.path, Some("/v1/completions"));
        let length = parsed
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .map(|h| h.value);
        assert_eq!(length, Some(&b"7"[..]));
        assert_eq!(&d.output[head_len..], b"{\"a\":1}");
    }

    #[test]
    fn chunked_and_close_delimited_responses_are_read() {
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        let mut d = Duplex {
            input: Cursor::new(chunked.to_vec()),
            output: Vec::new(),
        };
        assert_eq!(exchange(&mut d, "h", &post(""), 100).unwrap().body, "abcde");
        let mut d = Duplex {
            input: Cursor::new(b"HTTP/1.0 404 Not Found\r\n\r\nnope".to_vec()),
            output: Vec::new(),
        };
        let r = exchange(&mut d, "h", &post(""), 100).unwrap();
        assert_eq!((r.status, r.body.as_str()), (404, "nope"));
    }

    fn stream_all(input: &[u8], piece: usize) -> Result<(u16, Vec<Vec<u8>>), HttpCodecError> {
        let d = Duplex {
            input: Cursor::new(input.to_vec()),
            output: Vec::new(),
        };
        let (status, _, mut body) = exchange_stream(d, "h", &post(""))?;
        let mut pieces = Vec::new();
        let mut buf = vec![0u8; piece];
        loop {
            let n = body.next_piece(&mut buf)?;
            if n == 0 {
                return Ok((status, pieces));
            }
            pieces.push(buf[..n].to_vec());
        }
    }

    #[test]
    fn streamed_bodies_come_out_in_pieces_no_larger_than_the_buffer() {
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n5;x=y\r\ndefgh\r\n0\r\n\r\n";
        let (status, pieces) = stream_all(chunked, 2).unwrap();
        assert_eq!(status, 200);
        assert!(pieces.iter().all(|p| p.len() <= 2));
        assert_eq!(pieces.concat(), b"abcdefgh");
        let (_, pieces) = stream_all(
            b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nwxyzIGNORED",
            64,
        )
        .unwrap();
        assert_eq!(pieces.concat(), b"wxyz");
        let (status, pieces) = stream_all(b"HTTP/1.0 404 Not Found\r\n\r\nnope", 64).unwrap();
        assert_eq!((status, pieces.concat()), (404, b"nope".to_vec()));
        for bad in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
            b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        ] {
            assert!(
                stream_all(bad, 64).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn header_injection_is_refused() {
        let mut d = Duplex {
            input: Cursor::new(Vec::new()),
            output: Vec::new(),
        };
        let mut req = post("");
        req.headers = vec![("X".into(), "a\r\nEvil: 1".into())];
        assert!(matches!(
            exchange(&mut d, "h", &req, 10),
            Err(HttpCodecError::InvalidField("header"))
        ));
        let mut req = post("");
        req.path = "/a HTTP/1.1\r\n".into();
        assert!(matches!(
            exchange(&mut d, "h", &req, 10),
            Err(HttpCodecError::InvalidField("path"))
        ));
        let mut req = post("");
        req.method = "GET /".into();
        assert!(matches!(
            exchange(&mut d, "h", &req, 10),
            Err(HttpCodecError::InvalidField("method"))
        ));
        assert!(d.output.is_empty());
    }

    #[test]
    fn hostile_responses_are_errors() {
        let cases: &[&[u8]] = &[
            b"",
            b"garbage\r\n\r\n",
            b"HTTP/1.1 999 What\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 99999999\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n",
            b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY",
            b"HTTP/1.1 200 OK\r\nX: \xff\r\n\r\n",
        ];
        for case in cases {
            let mut d = Duplex {
                input: Cursor::new(case.to_vec()),
                output: Vec::new(),
            };
            assert!(
                exchange(&mut d, "h", &post(""), 1000).is_err(),
                "{}",
                String::from_utf8_lossy(case)
            );
        }
        let mut huge = b"HTTP/1.1 200 OK\r\n".to_vec();
        huge.extend(std::iter::repeat_n(b'a', MAX_HEAD_LEN + 10));
        let mut d = Duplex {
            input: Cursor::new(huge),
            output: Vec::new(),
        };
        assert!(matches!(
            exchange(&mut d, "h", &post(""), 1000),
            Err(HttpCodecError::TooLarge { .. })
        ));
    }

    #[test]
    fn header_count_and_head_size_are_bounded() {
        let answer = |head: Vec<u8>| {
            let mut d = Duplex {
                input: Cursor::new(head),
                output: Vec::new(),
            };
            exchange(&mut d, "h", &post(""), 10)
        };
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("X-{i}: v\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert!(matches!(
            answer(many),
            Err(HttpCodecError::TooLarge {
                what: "header count",
                ..
            })
        ));
        let mut long = b"HTTP/1.1 200 OK\r\n".to_vec();
        for _ in 0..MAX_HEAD_LEN / 100 + 1 {
            long.extend_from_slice(format!("X-Pad: {}\r\n", "a".repeat(92)).as_bytes());
        }
        long.extend_from_slice(b"\r\n");
        assert!(matches!(
            answer(long),
            Err(HttpCodecError::TooLarge {
                what: "header block",
                ..
            })
        ));
        let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-A:  spaced  \r\n\r\n";
        let resp = answer(ok.to_vec()).unwrap();
        assert_eq!(
            resp.headers,
            vec![
                ("Content-Length".to_string(), "0".to_string()),
                ("X-A".to_string(), "spaced".to_string())
            ]
        );
    }
}
