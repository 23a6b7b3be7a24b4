//! Concurrency and the limits that keep one client from holding the server: requests truly
//! in flight at once, slots that queue and then refuse, slow and oversized clients, clients
//! that vanish mid-stream. Assertions read the server's counters, never the clock.

mod common;

use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use serde_json::json;
use tenantvm_ngram::http::HttpLimits;
use tenantvm_ngram::ServeConfig;

/// A stream far longer than socket buffers hold: it cannot finish while its client is not
/// reading, so it stays in flight until the client goes.
fn endless_stream() -> serde_json::Value {
    json!({"prompt": "four score", "max_tokens": 200_000, "stream": true, "temperature": 1})
}

fn long_streams_config(max_concurrency: usize) -> ServeConfig {
    ServeConfig {
        max_concurrency,
        max_tokens: 200_000,
        queue_timeout: Duration::from_secs(60),
        ..test_config()
    }
}

#[test]
fn concurrent_requests_are_really_in_flight_at_once_and_disconnects_free_them() {
    let addr = start(long_streams_config(4), None);
    let mut streams: Vec<EventStream> = (0..4)
        .map(|_| EventStream::open(addr, "/v1/completions", &endless_stream()))
        .collect();
    // Every one has produced its first token, and none can have finished.
    for s in &mut streams {
        assert_eq!(s.status, 200);
        assert!(s.next_event().is_some());
    }
    let stats = get(addr, "/v1/tenantvm/stats");
    assert_eq!(stats["in_flight"], 4, "{stats}");
    assert_eq!(stats["peak_in_flight"], 4, "{stats}");
    // Other endpoints still answer while every slot is busy.
    assert_eq!(get(addr, "/health")["status"], "ok");

    // Clients that disconnect mid-stream free their slots.
    drop(streams);
    let stats = wait_for_stats(addr, Duration::from_secs(60), |s| s["in_flight"] == 0);
    assert_eq!(stats["client_disconnects"], 4, "{stats}");
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "four score", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200);
}

#[test]
fn requests_beyond_max_concurrency_queue_then_get_503() {
    let addr = start(
        ServeConfig {
            queue_timeout: Duration::from_millis(300),
            ..long_streams_config(1)
        },
        None,
    );
    let mut first = EventStream::open(addr, "/v1/completions", &endless_stream());
    assert!(first.next_event().is_some());
    // The second waits for the only slot, then is refused with Retry-After.
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 1}),
    );
    let e = r.openai_error(503);
    assert_eq!(e["type"], "server_error");
    assert_eq!(e["code"], "server_overloaded");
    assert_eq!(r.header("retry-after"), Some("1"));
    let stats = get(addr, "/v1/tenantvm/stats");
    assert_eq!(
        (stats["in_flight"].as_u64(), stats["queued"].as_u64()),
        (Some(1), Some(0))
    );

    // A queued request is served as soon as the slot frees.
    let addr = start(long_streams_config(1), None);
    let mut first = EventStream::open(addr, "/v1/completions", &endless_stream());
    assert!(first.next_event().is_some());
    let waiter = std::thread::spawn(move || {
        post(
            addr,
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 1}),
        )
        .status
    });
    wait_for_stats(addr, Duration::from_secs(30), |s| s["queued"] == 1);
    drop(first);
    assert_eq!(waiter.join().unwrap(), 200);
}

#[test]
fn a_slowloris_client_is_cut_off_and_its_connection_freed() {
    let addr = start(
        ServeConfig {
            http: HttpLimits {
                read_timeout: std::time::Duration::from_millis(500),
                ..HttpLimits::default()
            },
            ..test_config()
        },
        None,
    );
    // Headers that never finish.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: slow\r\nContent-Le")
        .unwrap();
    let r = read_response(&mut BufReader::new(s.try_clone().unwrap()));
    let e = r.openai_error(408);
    assert!(e["message"].as_str().unwrap().contains("500 ms"));
    // A client that connects and sends nothing is cut off the same way.
    let silent = TcpStream::connect(addr).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    assert_eq!(read_response(&mut BufReader::new(silent)).status, 408);
    // A body that never completes too.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        .unwrap();
    assert_eq!(read_response(&mut BufReader::new(s)).status, 408);
    let stats = wait_for_stats(addr, Duration::from_secs(30), |s| s["connections"] == 1);
    assert_eq!(stats["read_timeouts"], 3, "{stats}");
}

#[test]
fn oversized_headers_and_bodies_are_refused_before_they_are_read() {
    let addr = start(
        ServeConfig {
            http: HttpLimits {
                max_body_bytes: 1000,
                ..HttpLimits::default()
            },
            ..test_config()
        },
        None,
    );
    // Content-Length over the limit: 413 after the headers, the body never sent.
    let r = raw(
        addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n",
    );
    let e = r.openai_error(413);
    assert!(e["message"].as_str().unwrap().contains("5000000"));
    // Sent anyway, whole: the client still reads the 413, not a reset.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let body = format!("{{\"prompt\":\"{}\"}}", "a".repeat(3000));
    let _ = write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    assert_eq!(read_response(&mut BufReader::new(s)).status, 413);
    // Chunked past the limit.
    let chunk = "a".repeat(800);
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n320\r\n{chunk}\r\n320\r\n{chunk}\r\n0\r\n\r\n"
    );
    raw(addr, req.as_bytes()).openai_error(413);
    // A header block over 16 KiB.
    let req = format!(
        "GET /health HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "b".repeat(20_000)
    );
    raw(addr, req.as_bytes()).openai_error(431);
    // Garbage instead of HTTP.
    raw(addr, b"\x16\x03\x01 hello\r\n\r\n").openai_error(400);
}

#[test]
fn connections_past_the_limit_are_answered_503_at_once() {
    let addr = start(
        ServeConfig {
            max_connections: 2,
            ..long_streams_config(4)
        },
        None,
    );
    // Two streams under way hold both places (each has been accepted and answered).
    let mut holders: Vec<EventStream> = (0..2)
        .map(|_| EventStream::open(addr, "/v1/completions", &endless_stream()))
        .collect();
    for h in &mut holders {
        assert!(h.next_event().is_some());
    }
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut text = String::new();
    c.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("server_overloaded"), "{text}");
    assert!(text.contains("Retry-After: 1"), "{text}");
    // Once they go, the server takes connections again.
    drop(holders);
    let stats = wait_for_stats(addr, Duration::from_secs(60), |s| s["in_flight"] == 0);
    // The refused connection counts (and so may a poll that came before the holders left).
    assert!(
        stats["requests_server_error"].as_u64() >= Some(1),
        "{stats}"
    );
}
