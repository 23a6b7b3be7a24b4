//! The OpenAI routes end to end (models, completions, chat, streaming) and the OpenAI-shaped
//! error every bad request gets: no key, a bad key, a bad body, an unknown model, too large.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::json;

use super::door::{door, error_code};
use super::guests::{BYTE_TOKEN_EVENTS, EMBEDDINGS_REFUSAL};

#[test]
fn openai_routes_stream_through_and_every_bad_request_gets_openais_error_shape() {
    let Some(d) = door(&[("alice", "max_request_bytes = 2048"), ("bob", "")]) else {
        return;
    };

    // GET /v1/models and a completion, with alice's key, reach alice's guest.
    let models = d.send("GET", "/v1/models", Some(&d.keys["alice"]), None);
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["id"], "alice-model");
    let c = d.post(
        "/v1/completions",
        "alice",
        json!({"model": "alice-model", "prompt": "hi", "max_tokens": 4}),
    );
    assert_eq!(c.status, 200);
    let v = c.json();
    assert_eq!(v["choices"][0]["text"], " answer");
    assert_eq!(v["usage"]["total_tokens"], 2);

    // Streaming: server-sent events arrive one by one, usage last, then [DONE].
    let mut s = d.post(
        "/v1/chat/completions",
        "alice",
        json!({"model": "alice-model", "stream": true,
        "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(s.status, 200);
    assert_eq!(s.header("content-type"), Some("text/event-stream"));
    let mut events = Vec::new();
    while let Some(chunk) = s.next_chunk() {
        events.push(String::from_utf8(chunk).unwrap());
    }
    assert!(
        events.len() >= 4,
        "the answer came in {} piece(s): {events:?}",
        events.len()
    );
    let all = events.concat();
    assert!(all.ends_with("data: [DONE]\n\n"), "{all}");
    assert!(all.contains("\"total_tokens\":4"), "{all}");

    // Keys: none, malformed, unknown: the same 401.
    for key in [
        None,
        Some("sk-not-ours"),
        Some("tvk-0000000000000000000000000000000000000000000000000000000000000000"),
    ] {
        let r = d.send("GET", "/v1/models", key, None);
        assert_eq!(r.status, 401);
        assert_eq!(error_code(&r.json()), "invalid_api_key");
    }
    // The admin token is no inference key.
    let admin = d.h.admin_token();
    assert_eq!(
        d.send("GET", "/v1/models", Some(admin.trim()), None).status,
        401
    );

    // bob's key asking for alice's model gets exactly what an unknown model gets.
    let theirs = d.post(
        "/v1/completions",
        "bob",
        json!({"model": "alice-model", "prompt": "x"}),
    );
    let unknown = d.post(
        "/v1/completions",
        "bob",
        json!({"model": "no-such-model", "prompt": "x"}),
    );
    assert_eq!((theirs.status, unknown.status), (404, 404));
    let (theirs, unknown) = (theirs.json(), unknown.json());
    assert_eq!(error_code(&theirs), "model_not_found");
    assert_eq!(error_code(&unknown), "model_not_found");
    assert_eq!(theirs["error"]["type"], unknown["error"]["type"]);

    // Malformed JSON, a JSON non-object, wrong method, unknown route, oversized body.
    for bad in [&b"{not json"[..], b"[1,2]"] {
        let r = d.send("POST", "/v1/completions", Some(&d.keys["alice"]), Some(bad));
        assert_eq!(r.status, 400);
        assert_eq!(error_code(&r.json()), "invalid_json");
    }
    let r = d.send("GET", "/v1/completions", Some(&d.keys["alice"]), None);
    assert_eq!(r.status, 405);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let r = d.send(
        "POST",
        "/v1/tenants/alice/stop",
        Some(&d.keys["alice"]),
        Some(b"{}"),
    );
    assert_eq!(r.status, 404);
    assert_eq!(error_code(&r.json()), "unknown_url");
    let big = json!({"model": "alice-model", "prompt": "p".repeat(4096)});
    let r = d.post("/v1/completions", "alice", big.clone());
    assert_eq!(r.status, 413);
    assert_eq!(error_code(&r.json()), "request_too_large");
    // bob's limit is the default (1 MiB): the same body passes.
    let mut big = big;
    big["model"] = json!("bob-model");
    assert_eq!(d.post("/v1/completions", "bob", big).status, 200);

    // TLS is required: plain HTTP on the port gets no HTTP answer.
    let mut plain = TcpStream::connect(d.addr).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    plain
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    let _ = plain.read_to_end(&mut got);
    assert!(
        !got.starts_with(b"HTTP/"),
        "{}",
        String::from_utf8_lossy(&got)
    );

    // Metrics: alice's key reads alice's series only, tokens from the payload's usage
    // counts (1 + 1 from the completion, 1 + 3 from the stream), refusals by reason.
    let m = d.send("GET", "/metrics", Some(&d.keys["alice"]), None);
    assert_eq!(m.status, 200);
    let text = String::from_utf8(m.body()).unwrap();
    assert!(!text.contains("bob"), "{text}");
    assert!(
        text.contains("tenantvm_frontdoor_tokens_total{tenant=\"alice\",kind=\"completion\"} 4"),
        "{text}"
    );
    assert!(
        text.contains("tenantvm_frontdoor_tokens_total{tenant=\"alice\",kind=\"prompt\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("tenantvm_frontdoor_refusals_total{tenant=\"alice\",reason=\"size\"} 1"),
        "{text}"
    );
    assert!(text.contains("tenantvm_frontdoor_requests_total{tenant=\"alice\",route=\"chat.completions\",status=\"200\"} 1"), "{text}");
    assert!(
        text.contains("tenantvm_frontdoor_first_byte_seconds_count{tenant=\"alice\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("tenantvm_frontdoor_in_flight{tenant=\"alice\"} 0"),
        "{text}"
    );
    assert_eq!(d.send("GET", "/metrics", None, None).status, 401);

    // A revoked key stops working at once.
    let alice = d.h.svc.store().tenant("alice").unwrap().unwrap();
    let id = d.h.svc.store().inference_keys(alice.id).unwrap()[0].id;
    assert!(d.h.svc.store().revoke_inference_key(alice.id, id).unwrap());
    assert_eq!(
        d.send("GET", "/v1/models", Some(&d.keys["alice"]), None)
            .status,
        401
    );
}

#[test]
fn engine_routes_and_answers_pass_through_unchanged() {
    let Some(d) = door(&[("alice", "")]) else {
        return;
    };
    // /v1/embeddings reaches the engine; its own refusal (status, OpenAI-shaped body)
    // comes back as it wrote it.
    let r = d.post(
        "/v1/embeddings",
        "alice",
        json!({"model": "alice-model", "input": "hi"}),
    );
    assert_eq!(r.status, 501);
    let body = r.body();
    assert_eq!(body, EMBEDDINGS_REFUSAL.as_bytes());
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["type"], "not_supported_error");
    assert_eq!(
        d.send("GET", "/v1/embeddings", Some(&d.keys["alice"]), None)
            .status,
        405
    );
    // A path the engine may serve but that is no OpenAI route stays closed.
    let r = d.send("GET", "/props", Some(&d.keys["alice"]), None);
    assert_eq!(r.status, 404);
    assert_eq!(error_code(&r.json()), "unknown_url");

    // Byte tokens that are not UTF-8 on their own pass through byte for byte.
    let mut s = d.post(
        "/v1/completions",
        "alice",
        json!({"model": "alice-model", "prompt": "bytes", "stream": true}),
    );
    assert_eq!(s.status, 200);
    let mut got = Vec::new();
    while let Some(chunk) = s.next_chunk() {
        got.extend_from_slice(&chunk);
    }
    assert_eq!(got, BYTE_TOKEN_EVENTS.concat());
}
