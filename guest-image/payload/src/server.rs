//! The OpenAI-style HTTP API over the n-gram model: `GET /health`, `GET /v1/models`,
//! `POST /v1/completions`. Each completion is appended to `completions.jsonl` in the data
//! directory (the encrypted disk in the guest) and synced.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use serde_json::json;
use tenantvm_agent::http1::{read_request, write_response, ParsedRequest};

use crate::model::{FinishReason, NgramModel};

/// Largest accepted request body.
pub const MAX_REQUEST_BODY: usize = 256 * 1024;
/// Most tokens one request may ask for.
pub const MAX_TOKENS_LIMIT: usize = 512;
/// Most connections served at once.
pub const MAX_CONNECTIONS: usize = 16;

/// The served model and where completions are recorded.
pub struct Service {
    /// Name reported in responses.
    pub model_name: String,
    /// The model.
    pub model: NgramModel,
    /// Directory for `completions.jsonl`, if any.
    pub data_dir: Option<PathBuf>,
    history_lock: Mutex<()>,
}

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: String,
    #[serde(default = "default_max_tokens")]
    max_tokens: usize,
    #[serde(default = "default_temperature")]
    temperature: f64,
    #[serde(default)]
    seed: u64,
    #[serde(default)]
    stream: bool,
}

fn default_max_tokens() -> usize {
    16
}

fn default_temperature() -> f64 {
    1.0
}

fn error_body(message: &str) -> Vec<u8> {
    json!({"error": {"message": message, "type": "invalid_request_error"}})
        .to_string()
        .into_bytes()
}

impl Service {
    /// A service for `model`.
    pub fn new(model_name: String, model: NgramModel, data_dir: Option<PathBuf>) -> Self {
        Self {
            model_name,
            model,
            data_dir,
            history_lock: Mutex::new(()),
        }
    }

    /// Answers one parsed request: (status, JSON body).
    pub fn route(&self, req: &ParsedRequest) -> (u16, Vec<u8>) {
        match (req.method.as_str(), req.path.as_str()) {
            ("GET", "/health") => (200, br#"{"status":"ok"}"#.to_vec()),
            ("GET", "/v1/models") => (
                200,
                json!({"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "tenantvm"}]})
                    .to_string()
                    .into_bytes(),
            ),
            ("POST", "/v1/completions") => self.completions(&req.body),
            (_, "/health" | "/v1/models" | "/v1/completions") => {
                (405, error_body("Method not allowed"))
            }
            _ => (404, error_body("Unknown path; use /v1/completions")),
        }
    }

    fn completions(&self, body: &[u8]) -> (u16, Vec<u8>) {
        let req: CompletionRequest = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return (400, error_body(&format!("Invalid request body: {e}"))),
        };
        if req.stream {
            return (
                400,
                error_body("stream=true is not supported by this server"),
            );
        }
        if req.max_tokens > MAX_TOKENS_LIMIT {
            return (
                400,
                error_body(&format!("max_tokens must be at most {MAX_TOKENS_LIMIT}")),
            );
        }
        if !(0.0..=2.0).contains(&req.temperature) {
            return (400, error_body("temperature must be between 0 and 2"));
        }
        let index = self.model.index();
        let c = self.model.complete(
            &index,
            &req.prompt,
            req.max_tokens,
            req.temperature,
            req.seed,
        );
        if let Err(e) = self.record(&req.prompt, &c.text) {
            return (
                500,
                error_body(&format!("Recording the completion failed: {e}")),
            );
        }
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let finish = match c.finish {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        };
        let body = json!({
            "id": format!("cmpl-{created}-{}", req.seed),
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [{"index": 0, "text": c.text, "logprobs": null, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens,
                "total_tokens": c.prompt_tokens + c.completion_tokens
            }
        });
        (200, body.to_string().into_bytes())
    }

    fn record(&self, prompt: &str, completion: &str) -> std::io::Result<()> {
        let Some(dir) = &self.data_dir else {
            return Ok(());
        };
        let _guard = self.history_lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("completions.jsonl"))?;
        let mut line = BTreeMap::new();
        line.insert("prompt", prompt);
        line.insert("completion", completion);
        let mut text = serde_json::to_string(&line).map_err(std::io::Error::other)?;
        text.push('\n');
        f.write_all(text.as_bytes())?;
        f.sync_data()
    }

    /// Serves one connection (one request, then close).
    pub fn serve_connection(&self, stream: TcpStream) {
        let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
        let Ok(write_half) = stream.try_clone() else {
            return;
        };
        let mut r = BufReader::new(stream);
        let mut w = write_half;
        let (status, body) = match read_request(&mut r, MAX_REQUEST_BODY) {
            Ok(Some(req)) => self.route(&req),
            Ok(None) => return,
            Err(e) => (400, error_body(&e.to_string())),
        };
        let _ = write_response(&mut w, status, "application/json", &body);
    }
}

/// Accepts connections forever, at most [`MAX_CONNECTIONS`] at once.
pub fn run(service: Arc<Service>, listener: TcpListener) -> std::io::Result<()> {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        if active.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
            let mut s = stream;
            let _ = write_response(&mut s, 503, "application/json", &error_body("Busy"));
            continue;
        }
        active.fetch_add(1, Ordering::SeqCst);
        let svc = Arc::clone(&service);
        let act = Arc::clone(&active);
        std::thread::spawn(move || {
            svc.serve_connection(stream);
            act.fetch_sub(1, Ordering::SeqCst);
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(dir: Option<PathBuf>) -> Service {
        let m = NgramModel::train("The cat sat on the mat. The dog sat on the log.", 3).unwrap();
        Service::new("ngram".into(), m, dir)
    }

    fn post(body: &str) -> ParsedRequest {
        ParsedRequest {
            method: "POST".into(),
            path: "/v1/completions".into(),
            headers: vec![],
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn completion_returns_openai_shape_and_is_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let s = service(Some(dir.path().to_path_buf()));
        let (status, body) = s.route(&post(
            r#"{"prompt":"the dog sat on","max_tokens":3,"temperature":0}"#,
        ));
        assert_eq!(status, 200);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["choices"][0]["text"], " the log.");
        assert_eq!(v["usage"]["completion_tokens"], 3);
        let hist = std::fs::read_to_string(dir.path().join("completions.jsonl")).unwrap();
        assert!(hist.contains("the dog sat on"));
    }

    #[test]
    fn bad_completion_requests_get_400() {
        let s = service(None);
        for body in [
            "not json",
            r#"{"max_tokens":3}"#,
            r#"{"prompt":"a","max_tokens":100000}"#,
            r#"{"prompt":"a","temperature":9}"#,
            r#"{"prompt":"a","stream":true}"#,
        ] {
            assert_eq!(s.route(&post(body)).0, 400, "{body}");
        }
        let mut get = post("");
        get.method = "GET".into();
        assert_eq!(s.route(&get).0, 405);
        get.path = "/admin".into();
        assert_eq!(s.route(&get).0, 404);
        get.path = "/health".into();
        assert_eq!(s.route(&get).0, 200);
    }
}
