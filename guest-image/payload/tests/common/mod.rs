//! Shared by the integration tests: a server on 127.0.0.1:0 serving the model trained from
//! guest-image/corpus, and a small HTTP/1.1 client that reads what the server really sends
//! (status line, headers, chunked framing, server-sent events).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use tenantvm_ngram::{load_model_file, ModelSource, NgramModel, Registry, ServeConfig, Server};

/// The model the image ships: order 3, trained from guest-image/corpus/*.txt.
pub fn corpus_model() -> NgramModel {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    let mut text = String::new();
    for f in files {
        text.push_str(&std::fs::read_to_string(f).unwrap());
        text.push('\n');
    }
    NgramModel::train(&text, 3).unwrap()
}

/// Writes `model` to `path` as `tenantvm-ngram train` does.
pub fn write_model(path: &Path, model: &NgramModel) {
    std::fs::write(path, serde_json::to_vec(model).unwrap()).unwrap();
}

/// A config for tests: cheap prefill so debug builds stay quick.
pub fn test_config() -> ServeConfig {
    ServeConfig {
        prefill_rounds: 8,
        ..ServeConfig::default()
    }
}

/// Starts a server with the corpus model built in as `tenantvm-ngram`.
pub fn start(config: ServeConfig, models_dir: Option<PathBuf>) -> SocketAddr {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.json");
    write_model(&path, &corpus_model());
    let builtin = load_model_file("tenantvm-ngram", &path, ModelSource::Builtin, 1 << 30).unwrap();
    let registry = Registry::new(Some(builtin), models_dir, 1 << 30);
    registry.rescan();
    Server::bind("127.0.0.1:0", registry, config)
        .unwrap()
        .spawn()
        .unwrap()
}

/// A whole response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts an error in OpenAI's shape with this status; returns the `error` object.
    pub fn openai_error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", self.text());
        let v = self.json();
        let e = v["error"].clone();
        let keys: Vec<&str> = e.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["code", "message", "param", "type"], "{v}");
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        e
    }
}

/// Reads a response head from `r`.
pub fn read_head(r: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (n, v) = h.split_once(':').unwrap();
        headers.push((n.to_string(), v.trim().to_string()));
    }
    (status, headers)
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers
        .iter()
        .any(|(n, v)| n.eq_ignore_ascii_case("transfer-encoding") && v == "chunked")
}

/// Reads one chunk's data (`None` at the last chunk).
pub fn read_chunk(r: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut size = String::new();
    r.read_line(&mut size).unwrap();
    let n = usize::from_str_radix(size.trim(), 16)
        .unwrap_or_else(|_| panic!("bad chunk size {size:?}"));
    if n == 0 {
        let mut end = String::new();
        r.read_line(&mut end).unwrap();
        return None;
    }
    let mut data = vec![0u8; n + 2];
    r.read_exact(&mut data).unwrap();
    assert_eq!(&data[n..], b"\r\n");
    data.truncate(n);
    Some(data)
}

/// Reads a response with its body (Content-Length, chunked or to the end).
pub fn read_response(r: &mut impl BufRead) -> Response {
    let (status, headers) = read_head(r);
    let mut body = Vec::new();
    if is_chunked(&headers) {
        while let Some(c) = read_chunk(r) {
            body.extend(c);
        }
    } else if let Some((_, len)) = headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
    {
        body = vec![0u8; len.parse().unwrap()];
        r.read_exact(&mut body).unwrap();
    } else {
        r.read_to_end(&mut body).unwrap();
    }
    Response {
        status,
        headers,
        body,
    }
}

/// Sends raw bytes and reads one response.
pub fn raw(addr: SocketAddr, bytes: &[u8]) -> Response {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(bytes).unwrap();
    read_response(&mut BufReader::new(s))
}

/// One request with `Connection: close`.
pub fn call(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Response {
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    raw(addr, req.as_bytes())
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Response {
    call(addr, "POST", path, Some(&body.to_string()))
}

pub fn get(addr: SocketAddr, path: &str) -> Value {
    let r = call(addr, "GET", path, None);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// The `data:` payloads of a server-sent-event body, checking the framing: every event is
/// one `data: ` line followed by a blank line.
pub fn sse_events(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(
        text.ends_with("\n\n"),
        "events end with a blank line: {text:?}"
    );
    text.trim_end_matches('\n')
        .split("\n\n")
        .map(|ev| {
            assert!(!ev.contains('\n'), "one data line per event: {ev:?}");
            ev.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {ev:?}"))
                .to_string()
        })
        .collect()
}

/// A streamed response read incrementally.
pub struct EventStream {
    pub reader: BufReader<TcpStream>,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pending: String,
}

impl EventStream {
    /// Sends `body` to `path` and reads the response head.
    pub fn open(addr: SocketAddr, path: &str, body: &Value) -> Self {
        let body = body.to_string();
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut reader = BufReader::new(s);
        let (status, headers) = read_head(&mut reader);
        Self {
            reader,
            status,
            headers,
            pending: String::new(),
        }
    }

    /// The next event's data, `None` at the end of the body.
    pub fn next_event(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.pending.find("\n\n") {
                let ev: String = self.pending.drain(..end + 2).collect();
                return Some(ev.trim_end().strip_prefix("data: ").unwrap().to_string());
            }
            let chunk = read_chunk(&mut self.reader)?;
            self.pending.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }
}

/// Polls `GET /v1/tenantvm/stats` until `pred` holds (or panics after `limit`).
pub fn wait_for_stats(addr: SocketAddr, limit: Duration, pred: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        // A server at its connection limit answers 503: ask again.
        let r = call(addr, "GET", "/v1/tenantvm/stats", None);
        let s = if r.status == 200 {
            r.json()
        } else {
            Value::Null
        };
        if pred(&s) {
            return s;
        }
        assert!(start.elapsed() < limit, "stats never matched: {s}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
