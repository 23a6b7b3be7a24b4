//! Quotas at the front door: concurrency and request rate per tenant, a client that leaves
//! mid-stream frees its place, and one tenant's clients hold no more than their share of
//! connections.

use std::io::{BufRead, BufReader, Read, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::json;

use super::door::{door, error_code, Door, Tls};

#[test]
fn quotas_hold_at_the_front_door_and_a_client_that_leaves_frees_its_place() {
    let Some(d) = door(&[
        ("alice", "max_concurrency = 2\nrequests_per_s = 1000"),
        ("bob", "requests_per_s = 1"),
    ]) else {
        return;
    };
    let hold = json!({"model": "alice-model", "prompt": "hold"});
    // Two requests really in flight at once in alice's guest; a third is refused at once.
    let held: Vec<_> = (0..2)
        .map(|_| {
            let d_addr = (d.addr, d.client.clone(), d.keys["alice"].clone());
            let body = hold.to_string();
            std::thread::spawn(move || {
                let d = Door::detached(d_addr);
                d.status_of("/v1/completions", &body)
            })
        })
        .collect();
    let until = Instant::now() + Duration::from_secs(10);
    while d
        .guests
        .open
        .lock()
        .unwrap()
        .get("alice")
        .map_or(0, |e| e.0)
        < 2
    {
        assert!(
            Instant::now() < until,
            "two requests never were in flight at once"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let refused = d.post("/v1/completions", "alice", hold.clone());
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(error_code(&refused.json()), "concurrency_limit_exceeded");
    // bob is not slowed by alice's full house.
    assert_eq!(
        d.post(
            "/v1/completions",
            "bob",
            json!({"model": "bob-model", "prompt": "x"})
        )
        .status,
        200
    );
    // ...and bob's own rate (1 per second) refuses his next request at once.
    let r = d.post(
        "/v1/completions",
        "bob",
        json!({"model": "bob-model", "prompt": "x"}),
    );
    assert_eq!(r.status, 429);
    assert!(r.header("retry-after").is_some());
    assert_eq!(error_code(&r.json()), "rate_limit_exceeded");
    d.guests.release.store(1, Ordering::SeqCst);
    for h in held {
        assert_eq!(h.join().unwrap(), 200);
    }
    assert_eq!(d.guests.open.lock().unwrap()["alice"].1, 2);

    // A client that leaves mid-stream: the guest connection is closed and the place freed.
    let mut s = d.post(
        "/v1/completions",
        "alice",
        json!({"model": "alice-model", "prompt": "endless", "stream": true}),
    );
    assert_eq!(s.status, 200);
    assert!(s.next_chunk().is_some());
    drop(s);
    let until = Instant::now() + Duration::from_secs(10);
    while d.guests.cut_off.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < until,
            "the endless stream was not cut off after its client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Both places are free again: two held requests are in flight at once.
    let both: Vec<_> = (0..2)
        .map(|_| {
            let d_addr = (d.addr, d.client.clone(), d.keys["alice"].clone());
            let body = hold.to_string();
            std::thread::spawn(move || Door::detached(d_addr).status_of("/v1/completions", &body))
        })
        .collect();
    for h in both {
        assert_eq!(h.join().unwrap(), 200);
    }
}

/// A kept-alive connection that has made one `GET /v1/models` with `key`; its status.
fn kept_alive(d: &Door, key: &str) -> (BufReader<Tls>, u16) {
    let mut s = d.connect();
    write!(
        s,
        "GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n\r\n"
    )
    .unwrap();
    s.flush().unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line.split(' ').nth(1).unwrap().parse().unwrap();
    let mut len = 0;
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        if line == "\r\n" {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).unwrap();
    (r, status)
}

#[test]
fn one_tenants_clients_cannot_hold_more_than_their_share_of_connections() {
    let Some(d) = door(&[("alice", "requests_per_s = 100000"), ("bob", "")]) else {
        return;
    };
    let mut held: Vec<_> = (0..crate::frontdoor::MAX_TENANT_CONNECTIONS)
        .map(|_| {
            let (c, status) = kept_alive(&d, &d.keys["alice"]);
            assert_eq!(status, 200);
            c
        })
        .collect();
    let (_, status) = kept_alive(&d, &d.keys["alice"]);
    assert_eq!(status, 429, "alice opened more than her share");
    // bob is not affected, and one of alice's connections closing makes room for another.
    assert_eq!(kept_alive(&d, &d.keys["bob"]).1, 200);
    drop(held.pop());
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if kept_alive(&d, &d.keys["alice"]).1 == 200 {
            break;
        }
        assert!(
            Instant::now() < until,
            "a closed connection was never given back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
