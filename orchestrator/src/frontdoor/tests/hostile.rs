//! Hostile payloads: an oversized or garbled answer from a tenant's guest breaks only that
//! answer, quickly, and frees the tenant's place at once.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use serde_json::json;

use super::door::door;

#[test]
fn a_hostile_payload_breaks_only_its_own_answer_and_frees_its_place_at_once() {
    let Some(d) = door(&[
        ("alice", "max_concurrency = 1\nrequests_per_s = 1000"),
        ("bob", ""),
    ]) else {
        return;
    };
    for prompt in ["huge", "garbled"] {
        let started = Instant::now();
        // Whatever arrives before the connection is cut (the head and the first piece may or
        // may not have been written by then): never a complete answer, never the bad frame.
        let mut c = d.connect();
        let body = json!({"model": "alice-model", "prompt": prompt, "stream": true}).to_string();
        write!(
            c,
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            d.keys["alice"],
            body.len()
        )
        .unwrap();
        c.flush().unwrap();
        let mut got = Vec::new();
        let _ = c.read_to_end(&mut got);
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{prompt}: {:?}",
            started.elapsed()
        );
        let got = String::from_utf8_lossy(&got).to_string();
        assert!(
            !got.contains("[DONE]"),
            "{prompt}: a broken answer looked complete: {got}"
        );
        assert!(
            !got.contains("zzzz"),
            "{prompt}: the oversized frame was passed on"
        );
        assert!(
            got.is_empty() || got.starts_with("HTTP/1.1 200"),
            "{prompt}: the request did not reach the hostile guest: {got}"
        );
        assert!(
            !got.ends_with("0\r\n\r\n"),
            "{prompt}: the cut answer was ended as complete: {got}"
        );
        // alice's only place is free again, and bob was never held up.
        let r = d.post(
            "/v1/completions",
            "alice",
            json!({"model": "alice-model", "prompt": "x"}),
        );
        assert_eq!(r.status, 200, "{prompt}: alice's place was not freed");
        let r = d.post(
            "/v1/completions",
            "bob",
            json!({"model": "bob-model", "prompt": "x"}),
        );
        assert_eq!(r.status, 200);
    }
}
