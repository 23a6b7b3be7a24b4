//! Serving benchmark (not a test): time to first token for a 2000-token prompt whose prefix
//! is cached vs a fresh prefix of the same length, with the prefix cache on and (as the
//! negative control) off, in one run, interleaved; then decode throughput. Over real HTTP
//! on 127.0.0.1, release build, default prefill cost (2048 rounds per token).
//!
//! ```text
//! cargo bench -p tenantvm-ngram --bench serving            # BENCH_SAMPLES=N per arm (default 40)
//! ```

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::Instant;

use common::*;
use serde_json::json;
use tenantvm_ngram::prefill::{absorb, DEFAULT_ROUNDS_PER_TOKEN};
use tenantvm_ngram::ServeConfig;

const PREFIX_TOKENS: usize = 2000;

fn prefix(tag: &str) -> String {
    let words = [
        "four", "score", "and", "seven", "years", "ago", "our", "fathers",
    ];
    let mut p = tag.to_string();
    for i in 1..PREFIX_TOKENS {
        p.push(' ');
        p.push_str(words[i % words.len()]);
    }
    p
}

/// Seconds from sending the request to the first token's event, and to the end.
fn stream_times(addr: SocketAddr, prompt: &str, max_tokens: usize) -> (f64, f64, usize) {
    let body =
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true});
    let started = Instant::now();
    let mut s = EventStream::open(addr, "/v1/completions", &body);
    assert_eq!(s.status, 200);
    let first = s.next_event().expect("a first token");
    let ttft = started.elapsed().as_secs_f64();
    assert!(first.contains("\"text\""), "{first}");
    let mut tokens = 1;
    while let Some(ev) = s.next_event() {
        if ev == "[DONE]" {
            break;
        }
        if !ev.contains("\"finish_reason\":\"length\"") {
            tokens += 1;
        }
    }
    (ttft, started.elapsed().as_secs_f64(), tokens)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(name: &str, mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let median = percentile(&xs, 0.5);
    println!(
        "{name:<44} median {:>8.2} ms   p10 {:>8.2} ms   p90 {:>8.2} ms   (n={})",
        median * 1e3,
        percentile(&xs, 0.1) * 1e3,
        percentile(&xs, 0.9) * 1e3,
        xs.len()
    );
    median
}

fn ttft_arms(addr: SocketAddr, label: &str, samples: usize, run: &str) -> (f64, f64) {
    let shared = prefix(&format!("shared{run}"));
    // Warm: the shared prefix is seen once before measuring.
    stream_times(addr, &format!("{shared} warm"), 1);
    let (mut cached, mut fresh) = (Vec::new(), Vec::new());
    for i in 0..samples {
        let tail = format!("tail{i} and");
        let c = || stream_times(addr, &format!("{shared} {tail}"), 1).0;
        let f = || {
            stream_times(
                addr,
                &format!("{} {tail}", prefix(&format!("fresh{run}x{i}"))),
                1,
            )
            .0
        };
        // Alternate which arm goes first.
        if i % 2 == 0 {
            cached.push(c());
            fresh.push(f());
        } else {
            fresh.push(f());
            cached.push(c());
        }
    }
    let c = summary(
        &format!("TTFT, repeated 2000-token prefix ({label})"),
        cached,
    );
    let f = summary(&format!("TTFT, fresh 2000-token prefix ({label})"), fresh);
    (c, f)
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs this with no flag: keep it short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let samples: usize = std::env::var("BENCH_SAMPLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 2 } else { 40 });
    let config = ServeConfig {
        max_tokens: 100_000,
        ..ServeConfig::default()
    };
    let on = start(
        ServeConfig {
            prefix_cache_bytes: Some(64 << 20),
            ..config.clone()
        },
        None,
    );
    let off = start(config, None);

    // The cost model itself.
    let n = 200_000;
    let t = Instant::now();
    let mut s = 0u64;
    for i in 0..n {
        s = absorb(
            s,
            if i % 2 == 0 { "four" } else { "score" },
            DEFAULT_ROUNDS_PER_TOKEN,
        );
    }
    let per_token = t.elapsed().as_secs_f64() / f64::from(n);
    std::hint::black_box(s);
    println!(
        "absorb, {DEFAULT_ROUNDS_PER_TOKEN} rounds: {:.2} µs per token ({:.0} tokens/s)",
        per_token * 1e6,
        1.0 / per_token
    );

    let (c_on, f_on) = ttft_arms(on, "cache on", samples, "a");
    let (c_off, f_off) = ttft_arms(off, "cache off", samples, "b");
    println!(
        "ratio fresh / repeated: cache on {:.1}x, cache off {:.2}x",
        f_on / c_on,
        f_off / c_off
    );

    // Decode throughput: one long stream at a time, and 4 at once.
    let decode = if quick { 200 } else { 5000 };
    let mut rates = Vec::new();
    for _ in 0..if quick { 1 } else { 5 } {
        let (ttft, total, tokens) = stream_times(off, "four score", decode);
        rates.push(tokens as f64 / (total - ttft));
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "decode, one stream of {decode} tokens: median {:.0} tokens/s",
        percentile(&rates, 0.5)
    );
    let t = Instant::now();
    let handles: Vec<_> = (0..4)
        .map(|_| std::thread::spawn(move || stream_times(off, "four score", decode).2))
        .collect();
    let total: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    println!(
        "decode, 4 streams at once: {:.0} tokens/s in all ({} cores here)",
        total as f64 / t.elapsed().as_secs_f64(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );

    // Non-streamed round trip of a short completion, for the record.
    let mut xs = Vec::new();
    for _ in 0..samples.max(5) {
        let t = Instant::now();
        let mut sock = TcpStream::connect(off).unwrap();
        let body = json!({"prompt": "four score", "max_tokens": 8, "temperature": 0}).to_string();
        write!(
            sock,
            "POST /v1/completions HTTP/1.1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let r = read_response(&mut std::io::BufReader::new(sock));
        assert_eq!(r.status, 200);
        xs.push(t.elapsed().as_secs_f64());
    }
    summary("8-token completion, whole round trip", xs);
}
