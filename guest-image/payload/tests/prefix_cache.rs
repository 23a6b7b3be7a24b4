//! The prefix cache (issue 16's positive control): a repeated long prefix is prefilled from
//! the cache, measured by the work counters (prompt tokens absorbed), not by the clock.

mod common;

use common::*;
use serde_json::{json, Value};
use tenantvm_ngram::ServeConfig;

/// A 2000-token prompt made of words from the corpus, distinct per `tag`.
fn long_prompt(tag: &str) -> String {
    let words = [
        "four", "score", "and", "seven", "years", "ago", "our", "fathers",
    ];
    let mut p = tag.to_string();
    for i in 0..1999 {
        p.push(' ');
        p.push_str(words[i % words.len()]);
    }
    p
}

fn computed(addr: std::net::SocketAddr) -> u64 {
    get(addr, "/v1/tenantvm/stats")["prefill_tokens_computed"]
        .as_u64()
        .unwrap()
}

fn complete(addr: std::net::SocketAddr, prompt: &str, stream: bool) -> Value {
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 42,
                      "stream": stream, "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }});
    let r = post(addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    if !stream {
        return r.json();
    }
    let events = sse_events(&r.body);
    serde_json::from_str(&events[events.len() - 2]).unwrap()
}

fn cache_on() -> ServeConfig {
    ServeConfig {
        prefix_cache_bytes: Some(64 << 20),
        ..test_config()
    }
}

#[test]
fn a_repeated_prefix_is_prefilled_from_the_cache() {
    let addr = start(cache_on(), None);
    assert_eq!(
        get(addr, "/v1/tenantvm/serving")["prefix_cache"]["enabled"],
        true
    );
    let prefix = long_prompt("probeA");

    let before = computed(addr);
    let first = complete(addr, &format!("{prefix} fresh tail one"), false);
    let fresh_work = computed(addr) - before;
    assert_eq!(first["usage"]["prompt_tokens"], 2003);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(fresh_work, 2003);

    // Same 2000-token prefix, another tail: only the tail and the partial block before it.
    let before = computed(addr);
    let second = complete(addr, &format!("{prefix} other tail two"), true);
    let cached_work = computed(addr) - before;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        2000 / 16 * 16
    );
    assert_eq!(cached_work, 2003 - 2000 / 16 * 16);
    assert!(
        cached_work * 10 < fresh_work,
        "{cached_work} vs {fresh_work}"
    );

    // A fresh prefix of the same length costs the full prefill again.
    let before = computed(addr);
    let other = complete(
        addr,
        &format!("{} fresh tail one", long_prompt("probeB")),
        false,
    );
    assert_eq!(computed(addr) - before, 2003);
    assert_eq!(other["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let stats = get(addr, "/v1/tenantvm/stats");
    assert!(
        stats["prefix_cache"]["hit_blocks"].as_u64().unwrap() >= 125,
        "{stats}"
    );
    assert_eq!(stats["prefill_tokens_cached"], 2000);
}

#[test]
fn the_cache_changes_speed_only_never_the_answer() {
    let on = start(cache_on(), None);
    let off = start(test_config(), None);
    let prompt = format!("{} and so on", long_prompt("same"));
    // Sampled (temperature 1, seed 42): the context state seeds sampling, so a wrong cached
    // state would change the text.
    let a1 = complete(on, &prompt, false);
    let a2 = complete(on, &prompt, false);
    let b = complete(off, &prompt, false);
    assert_eq!(a2["usage"]["prompt_tokens_details"]["cached_tokens"], 2000);
    assert_eq!(a1["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(a2["choices"][0]["text"], b["choices"][0]["text"]);
}

#[test]
fn with_the_cache_off_every_request_prefills_everything() {
    let addr = start(test_config(), None);
    assert_eq!(
        get(addr, "/v1/tenantvm/serving")["prefix_cache"]["enabled"],
        false
    );
    let prompt = long_prompt("nocache");
    complete(addr, &prompt, false);
    let before = computed(addr);
    let again = complete(addr, &prompt, false);
    assert_eq!(computed(addr) - before, 2000);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(get(addr, "/v1/tenantvm/stats")["prefix_cache"], Value::Null);
}
