//! The door under a flood: more hostile connections than the old door's 1,024 places (idle
//! TCP sockets, trickled ClientHellos, trickled request heads, from 40 loopback sources,
//! reconnecting whenever the door closes them) while each tenant's legitimate client keeps
//! asking, on new connections and on a connection it authenticated before the flood.

use std::io::BufReader;
use std::time::{Duration, Instant};

use serde_json::json;

use super::door::{door, request_on, Door, Tls};
use crate::test_support::flood::{Flood, FloodPlan};

/// Hostile connections: above the old door's 1,024, as in the report (1,100).
const HOSTILE: usize = 1_100;
/// How long the legitimate clients keep asking under the flood (long enough for the door's
/// first-byte and rate deadlines to close and the flood to reconnect several times).
const UNDER_FLOOD: Duration = Duration::from_secs(5);

fn completion(tenant: &str) -> Vec<u8> {
    json!({"model": format!("{tenant}-model"), "prompt": "x"})
        .to_string()
        .into_bytes()
}

/// One request on a new connection: its status, or why there was none.
fn fresh(d: &Door, tenant: &str) -> Result<u16, String> {
    let tls = d.try_connect()?;
    let body = completion(tenant);
    let r = request_on(
        BufReader::new(tls),
        "POST",
        "/v1/completions",
        Some(&d.keys[tenant]),
        Some(&body),
        true,
    )?;
    let status = r.status;
    r.try_body()?;
    Ok(status)
}

/// One request on a kept connection (handed back for the next one).
fn kept(d: &Door, tenant: &str, conn: BufReader<Tls>) -> Result<(u16, BufReader<Tls>), String> {
    let body = completion(tenant);
    let r = request_on(
        conn,
        "POST",
        "/v1/completions",
        Some(&d.keys[tenant]),
        Some(&body),
        false,
    )?;
    let status = r.status;
    let (_, conn) = r.try_body()?;
    Ok((status, conn))
}

#[test]
fn a_flood_of_idle_and_trickling_connections_never_locks_a_tenants_clients_out() {
    let Some(d) = door(&[
        ("alice", "requests_per_s = 1000"),
        ("bob", "requests_per_s = 1000"),
    ]) else {
        return;
    };
    // The flood's sockets and the door's share this process's descriptors.
    let limit = crate::fd_limit::raise_soft_limit().unwrap();
    if limit.soft < 4 * HOSTILE as u64 {
        tenantvm_skip::record_skip!(
            "RLIMIT_NOFILE's hard limit ({}) is too low for {HOSTILE} connections and the door's",
            limit.hard
        );
        return;
    }
    // alice's client authenticated its connection before the flood began.
    let (status, mut alice_conn) = kept(&d, "alice", BufReader::new(d.connect())).unwrap();
    assert_eq!(status, 200);

    let flood = Flood::start(FloodPlan::of(d.addr, d.client.clone(), HOSTILE));
    assert!(
        flood.wait_opened(HOSTILE as u64, Duration::from_secs(60)),
        "the flood never opened {HOSTILE} connections: {:?}",
        flood.stats
    );
    let started = Instant::now();
    let (mut asked, mut failures) = (0, Vec::new());
    while started.elapsed() < UNDER_FLOOD || asked < 30 {
        for tenant in ["alice", "bob"] {
            asked += 1;
            match fresh(&d, tenant) {
                Ok(200) => {}
                other => failures.push(format!("{tenant} on a new connection: {other:?}")),
            }
        }
        asked += 1;
        match kept(&d, "alice", alice_conn) {
            Ok((200, conn)) => alice_conn = conn,
            other => {
                failures.push(format!(
                    "alice on her kept connection: {:?}",
                    other.map(|(s, _)| s)
                ));
                alice_conn = BufReader::new(d.connect());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let stats = flood.stop();
    assert!(
        failures.is_empty(),
        "{} of {asked} legitimate requests failed under the flood ({stats:?}):\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The control: the flood really held the door and was really turned away (closed
    // connections, reconnected).
    assert!(
        stats.opened.load(std::sync::atomic::Ordering::Relaxed) > HOSTILE as u64
            && stats
                .closed_by_door
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0,
        "{stats:?}"
    );
}

#[test]
fn a_client_applications_burst_of_connections_from_one_address_is_not_evicted() {
    // A client application opening its pool of connections at once, from one address: none
    // of them is taken for a flood (the door once allowed a source only an eighth of its
    // unauthenticated pool, and evicted the rest of such a burst).
    let Some(d) = door(&[("alice", "requests_per_s = 100000\nmax_concurrency = 64")]) else {
        return;
    };
    const BURST: usize = 48;
    let start = std::sync::Arc::new(std::sync::Barrier::new(BURST));
    let d = std::sync::Arc::new(d);
    let results: Vec<Result<u16, String>> = (0..BURST)
        .map(|_| {
            let (d, start) = (d.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                fresh(&d, "alice")
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let failed: Vec<_> = results.iter().filter(|r| **r != Ok(200)).collect();
    assert!(failed.is_empty(), "{} of {BURST}: {failed:?}", failed.len());
}
