//! The OpenAI-compatible API over real HTTP/1.1: every endpoint, streaming parsed back,
//! the chat template, and errors in OpenAI's shape for each bad input.

mod common;

use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use tenantvm_ngram::ServeConfig;

const PROMPT: &str = "TVMMARK123 four score and seven years";

#[test]
fn health_and_models_list_the_builtin_model() {
    let addr = start(test_config(), None);
    assert_eq!(get(addr, "/health"), json!({"status": "ok"}));
    let models = get(addr, "/v1/models");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "tenantvm-ngram");
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["owned_by"], "tenantvm");
    assert!(models["data"][0]["created"].is_u64());
    let one = get(addr, "/v1/models/tenantvm-ngram");
    assert_eq!(one["id"], "tenantvm-ngram");
    call(addr, "GET", "/v1/models/nope", None).openai_error(404);
}

#[test]
fn the_daemons_completion_request_still_works() {
    // Exactly what `tenantvm infer` and the agent's end-to-end test send today.
    let addr = start(test_config(), None);
    for body in [
        json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}),
        json!({"model": "tenantvm-ngram", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}),
    ] {
        let r = post(addr, "/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("content-type"), Some("application/json"));
        let v = r.json();
        assert_eq!(v["object"], "text_completion");
        assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
        assert_eq!(v["model"], "tenantvm-ngram");
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert!(text.starts_with(" ago our fathers brought forth"), "{text}");
        assert_eq!(v["choices"][0]["index"], 0);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["choices"][0]["logprobs"], Value::Null);
        assert_eq!(v["usage"]["prompt_tokens"], 6);
        assert_eq!(v["usage"]["completion_tokens"], 8);
        assert_eq!(v["usage"]["total_tokens"], 14);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    }
}

#[test]
fn completions_take_stop_echo_and_several_prompts() {
    let addr = start(test_config(), None);
    let v = post(
        addr,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stop": "brought"}),
    )
    .json();
    assert_eq!(v["choices"][0]["text"], " ago our fathers ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 4);

    let v = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "four score", "max_tokens": 2, "temperature": 0, "echo": true}),
    )
    .json();
    assert_eq!(v["choices"][0]["text"], "four score and seven");

    let v = post(
        addr,
        "/v1/completions",
        &json!({"prompt": ["four score and", "we hold these truths"], "max_tokens": 2, "temperature": 0}),
    )
    .json();
    assert_eq!(v["choices"][0]["text"], " seven years");
    assert_eq!(v["choices"][1]["text"], " to be");
    assert_eq!(v["choices"][1]["index"], 1);
    assert_eq!(v["usage"]["prompt_tokens"], 3 + 4);
    assert_eq!(v["usage"]["completion_tokens"], 4);

    // Seeded sampling is reproducible; other seeds give other text.
    let sample = |seed: u64| {
        post(
            addr,
            "/v1/completions",
            &json!({"prompt": "the", "max_tokens": 12, "temperature": 1.0, "seed": seed}),
        )
        .json()["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(sample(7), sample(7));
    assert!((8..20).any(|s| sample(s) != sample(7)));
}

#[test]
fn chat_completions_use_the_template_and_openais_shape() {
    let addr = start(test_config(), None);
    let body = json!({
        "model": "tenantvm-ngram",
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "four score and seven years"}
        ],
        "max_tokens": 5,
        "temperature": 0
    });
    let r = post(addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["role"], "assistant");
    let content = msg["content"].as_str().unwrap();
    assert!(
        !content.is_empty() && !content.starts_with(' '),
        "{content:?}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // "system: Answer briefly.\nuser: four score and seven years\nassistant:" is
    // system : answer briefly . user : four score and seven years assistant : = 14 tokens.
    assert_eq!(v["usage"]["prompt_tokens"], 14);
    assert_eq!(v["usage"]["completion_tokens"], 5);

    // The same text through /v1/completions with the template applied by hand.
    let plain = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "system: Answer briefly.\nuser: four score and seven years\nassistant:",
                "max_tokens": 5, "temperature": 0}),
    )
    .json();
    assert_eq!(
        plain["choices"][0]["text"].as_str().unwrap().trim_start(),
        content
    );
}

#[test]
fn streamed_completions_are_openai_chunks_ending_in_done() {
    let addr = start(test_config(), None);
    let whole = post(
        addr,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 10, "temperature": 0}),
    )
    .json();
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": true}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    let events = sse_events(&r.body);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    // One chunk per token, then the finishing chunk.
    assert_eq!(chunks.len(), 11);
    let id = chunks[0]["id"].clone();
    let mut text = String::new();
    for c in &chunks[..10] {
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["id"], id, "one id per stream");
        assert_eq!(c["choices"][0]["finish_reason"], Value::Null);
        assert!(c.get("usage").is_none());
        text.push_str(c["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
    assert_eq!(chunks[10]["choices"][0]["text"], "");
    assert_eq!(chunks[10]["choices"][0]["finish_reason"], "length");

    // With include_usage: every chunk has usage null, then a last chunk with no choices.
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}}),
    );
    let events = sse_events(&r.body);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["prompt_tokens"], 6);
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    assert_eq!(usage["usage"]["total_tokens"], 9);
    for e in &events[..events.len() - 2] {
        let c: Value = serde_json::from_str(e).unwrap();
        assert_eq!(c["usage"], Value::Null, "{c}");
    }
}

#[test]
fn streamed_chat_opens_with_the_role_and_closes_with_an_empty_delta() {
    let addr = start(test_config(), None);
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "four score and seven years"}],
                "max_tokens": 4, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}}),
    );
    let events = sse_events(&r.body);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(events.last().unwrap(), "[DONE]");
    // role, 4 content deltas, finish, usage
    assert_eq!(chunks.len(), 7, "{events:?}");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["choices"][0]["delta"]["content"], "");
    let content: String = chunks[1..5]
        .iter()
        .map(|c| {
            assert_eq!(
                c["choices"][0]["delta"].as_object().unwrap().len(),
                1,
                "{c}"
            );
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let whole = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "four score and seven years"}],
                "max_tokens": 4, "temperature": 0}),
    )
    .json();
    assert_eq!(content, whole["choices"][0]["message"]["content"]);
    assert_eq!(chunks[5]["choices"][0]["delta"], json!({}));
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[6]["choices"], json!([]));
    assert_eq!(chunks[6]["usage"]["completion_tokens"], 4);
}

#[test]
fn each_bad_input_gets_an_openai_error() {
    let addr = start(test_config(), None);
    // (path, body, status, param, code)
    type Case<'a> = (&'a str, String, u16, Option<&'a str>, Option<&'a str>);
    let cases: Vec<Case> = vec![
        ("/v1/completions", "{not json".into(), 400, None, None),
        (
            "/v1/completions",
            json!({"prompt": "a", "frobnicate": true}).to_string(),
            400,
            Some("frobnicate"),
            Some("unknown_parameter"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": "ten"}).to_string(),
            400,
            Some("max_tokens"),
            Some("invalid_type"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "n": 2}).to_string(),
            400,
            Some("n"),
            Some("unsupported_value"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 1_000_000}).to_string(),
            400,
            Some("max_tokens"),
            Some("integer_above_max_value"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": -5}).to_string(),
            400,
            Some("max_tokens"),
            Some("integer_below_min_value"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "temperature": 3}).to_string(),
            400,
            Some("temperature"),
            Some("decimal_above_max_value"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "model": "gpt-4"}).to_string(),
            404,
            None,
            Some("model_not_found"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tenantvm-ngram"}).to_string(),
            400,
            Some("messages"),
            Some("missing_required_parameter"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "robot", "content": "x"}]}).to_string(),
            400,
            Some("messages[0].role"),
            Some("invalid_value"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "n": 3}).to_string(),
            400,
            Some("n"),
            Some("unsupported_value"),
        ),
    ];
    for (path, body, status, param, code) in cases {
        let r = call(addr, "POST", path, Some(&body));
        let e = r.openai_error(status);
        assert_eq!(e["param"].as_str(), param, "{body}: {e}");
        assert_eq!(e["code"].as_str(), code, "{body}: {e}");
        assert_eq!(e["type"], "invalid_request_error", "{body}");
    }
    let e = call(addr, "GET", "/v1/nothing", None).openai_error(404);
    assert!(e["message"].as_str().unwrap().contains("Invalid URL"));
    let r = call(addr, "GET", "/v1/completions", None);
    r.openai_error(405);
    assert_eq!(r.header("allow"), Some("POST"));
    // Errors keep nothing of the prompt in the server's state: the server still answers.
    assert_eq!(get(addr, "/health")["status"], "ok");
}

#[test]
fn context_window_and_body_limit_are_enforced() {
    let addr = start(
        ServeConfig {
            max_context_tokens: 10,
            ..test_config()
        },
        None,
    );
    let e = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "one two three four five six seven", "max_tokens": 4}),
    )
    .openai_error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(e["param"], "prompt");

    let addr = start(test_config(), None);
    let big = format!("{{\"prompt\": \"{}\"}}", "a ".repeat(600 * 1024));
    let e = call(addr, "POST", "/v1/completions", Some(&big)).openai_error(413);
    assert_eq!(e["code"], "request_too_large");
    assert!(e["message"].as_str().unwrap().contains("1048576"));
}

#[test]
fn serving_configuration_reports_models_cache_and_concurrency() {
    let addr = start(
        ServeConfig {
            max_concurrency: 3,
            ..test_config()
        },
        None,
    );
    let s = get(addr, "/v1/tenantvm/serving");
    assert_eq!(s["server"], "tenantvm-ngram");
    assert_eq!(s["instance_id"].as_str().unwrap().len(), 32);
    assert_eq!(s["models"][0]["id"], "tenantvm-ngram");
    assert_eq!(s["models"][0]["source"], "builtin");
    assert_eq!(s["default_model"], "tenantvm-ngram");
    assert_eq!(s["prefix_cache"]["enabled"], false);
    assert_eq!(s["batching"]["max_concurrency"], 3);
    assert_eq!(s["batching"]["max_batch_size"], 1);
    assert_eq!(s["limits"]["max_body_bytes"], 1024 * 1024);
    assert_eq!(s["chat_template"], "tenantvm-plain-v1");
    // Another server is another instance.
    let other = get(start(test_config(), None), "/v1/tenantvm/serving");
    assert_ne!(other["instance_id"], s["instance_id"]);
}

#[test]
fn keep_alive_serves_several_requests_on_one_connection() {
    let addr = start(test_config(), None);
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    for i in 0..3 {
        let body =
            json!({"prompt": "four score", "max_tokens": 1, "temperature": 0, "stream": i == 1})
                .to_string();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let resp = read_response(&mut r);
        assert_eq!(resp.status, 200, "request {i}: {}", resp.text());
        assert_eq!(resp.header("connection"), Some("keep-alive"));
    }
    // Expect: 100-continue (what curl sends for large bodies) is honoured.
    let body = json!({"prompt": "four score", "max_tokens": 1}).to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    let (status, _) = read_head(&mut r);
    assert_eq!(status, 100);
    s.write_all(body.as_bytes()).unwrap();
    assert_eq!(read_response(&mut r).status, 200);
}

#[test]
fn completions_are_recorded_on_the_data_disk() {
    let data = tempfile::tempdir().unwrap();
    let addr = start(
        ServeConfig {
            data_dir: Some(data.path().to_path_buf()),
            ..test_config()
        },
        None,
    );
    post(
        addr,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 2, "temperature": 0}),
    );
    post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true}),
    );
    let record = std::fs::read_to_string(data.path().join("completions.jsonl")).unwrap();
    let lines: Vec<Value> = record
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["prompt"], PROMPT);
    assert_eq!(lines[0]["completion"], " ago our");
    assert_eq!(lines[1]["prompt"], "user: hi\nassistant:");
}
