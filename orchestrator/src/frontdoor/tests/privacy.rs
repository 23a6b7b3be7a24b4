//! No prompt or completion text reaches the log, an event, a file in the state directory or
//! an error body, whichever way a request ends.

use std::io::Write;
use std::sync::{Arc, Mutex};

use serde_json::json;

use super::door::door;
use super::guests::COMPLETION_MARKER;

/// Everything the process logs from here on (all threads), for the no-prompt-in-logs test.
fn captured_log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: std::sync::OnceLock<Arc<Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("no other global subscriber");
        buf
    })
    .clone()
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Files under `dir` (the state directory, store, logs, everything) holding `needle`.
fn files_holding(dir: &std::path::Path, needle: &[u8]) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            found.extend(files_holding(&p, needle));
        } else if std::fs::read(&p).is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle)) {
            found.push(p);
        }
    }
    found
}

#[test]
fn no_prompt_or_completion_text_reaches_a_log_an_event_a_file_or_an_error() {
    let log = captured_log();
    let Some(d) = door(&[("alice", "max_request_bytes = 4096\nrequests_per_s = 1000")]) else {
        return;
    };
    let prompt = "secret-prompt-a41d07";
    // Answered, streamed, refused as too large, refused as malformed, refused by quota.
    let r = d.post(
        "/v1/completions",
        "alice",
        json!({"model": "alice-model", "prompt": prompt}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["choices"][0]["text"], COMPLETION_MARKER);
    let r = d.post(
        "/v1/chat/completions",
        "alice",
        json!({"model": "alice-model", "stream": true,
        "messages": [{"role": "user", "content": prompt}]}),
    );
    assert_eq!(r.status, 200);
    assert!(String::from_utf8(r.body()).unwrap().contains("[DONE]"));
    let mut errors = Vec::new();
    let r = d.post(
        "/v1/completions",
        "alice",
        json!({"model": "alice-model", "prompt": prompt.repeat(300)}),
    );
    assert_eq!(r.status, 413);
    errors.push(r.body());
    let r = d.send(
        "POST",
        "/v1/completions",
        Some(&d.keys["alice"]),
        Some(format!("{{\"prompt\": \"{prompt}\"").as_bytes()),
    );
    assert_eq!(r.status, 400);
    errors.push(r.body());
    let r = d.send(
        "POST",
        "/v1/completions",
        Some(prompt),
        Some(format!("{{\"prompt\": \"{prompt}\"}}").as_bytes()),
    );
    assert_eq!(r.status, 401);
    errors.push(r.body());
    for e in &errors {
        let e = String::from_utf8_lossy(e);
        assert!(!e.contains(prompt), "an error quotes the prompt: {e}");
    }
    // The log saw these requests (so the check below can fail), but not their text.
    let logged = String::from_utf8(log.lock().unwrap().clone()).unwrap();
    assert!(
        logged.contains("front door request") && logged.contains("alice"),
        "{logged}"
    );
    for marker in [prompt, COMPLETION_MARKER] {
        assert!(!logged.contains(marker), "the log holds {marker:?}");
        let holders = files_holding(d.h.dir.path(), marker.as_bytes());
        assert!(holders.is_empty(), "{marker:?} is in {holders:?}");
    }
    // Positive control for the file scan: a marker that is stored is found.
    let t = d.h.svc.store().tenant("alice").unwrap().unwrap();
    d.h.svc
        .store()
        .add_event(Some(t.id), "test", "control-marker-77ab")
        .unwrap();
    assert!(!files_holding(d.h.dir.path(), b"control-marker-77ab").is_empty());
}
