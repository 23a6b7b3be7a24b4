//! No prompt or completion text reaches the log, an event, a file in the state directory or
//! an error body, whichever way a request ends.

use serde_json::json;

use super::door::door;
use super::guests::COMPLETION_MARKER;
use crate::test_support::{captured_log, files_holding};

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
