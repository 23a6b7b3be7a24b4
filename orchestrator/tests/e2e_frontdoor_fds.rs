//! tenantvmd's file descriptors under a front-door flood. Started as systemd starts a
//! service (a soft `RLIMIT_NOFILE` of 1,024 under a higher hard limit), it raises the soft
//! limit to the hard one; held low (768, the hard limit too: below the old door's 1,024
//! connections, so that the old daemon ran out of descriptors on every run here, where at
//! 1,024 it ran out on some), it sizes the front door's connections from it with a
//! reserve, so 1,100 hostile connections that hold and reconnect starve neither the admin
//! API, a create, nor a tenant's client, and a failing `accept` does not fill its log.
//! Skips without root or /dev/kvm.

#[path = "support/flood.rs"]
mod flood;
mod support;

use std::time::{Duration, Instant};

use flood::{Flood, FloodPlan};
use support::cli::{tenantvm, text};
use support::daemon::{self, TestDaemon};
use support::tls::FrontDoorTls;

/// Hostile connections: above the daemon's descriptors, as in the report.
const HOSTILE: usize = 1_100;

/// The soft and hard `RLIMIT_NOFILE` of process `pid`.
fn nofile_of(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let n: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (n[0], n[1])
}

#[test]
fn the_daemon_raises_its_soft_descriptor_limit_to_the_hard_one() {
    if daemon::should_skip("the_daemon_raises_its_soft_descriptor_limit_to_the_hard_one") {
        return;
    }
    let mut d = TestDaemon::new().with_nofile(1024, 4096);
    d.start(None);
    assert_eq!(nofile_of(d.pid().unwrap()), (4096, 4096), "{}", d.log());
    d.stop();
}

/// One front-door request with `key` on a connection of its own: the status, or why none.
fn door_status(door: &FrontDoorTls, key: &str) -> Result<u16, String> {
    let (addr, client, key) = (door.addr, door.client.clone(), key.to_string());
    // FrontDoorTls::request panics on a refused connection; that is a failure to count.
    std::thread::spawn(move || {
        support::tls::request_to(
            addr,
            &client,
            "/v1/models",
            Some(&key),
            None,
            Duration::from_secs(20),
        )
        .0
    })
    .join()
    .map_err(|e| {
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

#[test]
fn at_a_low_descriptor_limit_a_flood_starves_neither_the_admin_api_nor_a_create_nor_a_client() {
    let test =
        "at_a_low_descriptor_limit_a_flood_starves_neither_the_admin_api_nor_a_create_nor_a_client";
    if daemon::should_skip(test) {
        return;
    }
    // The flood's own sockets live in this process.
    let limit = tenantvm::fd_limit::raise_soft_limit().unwrap();
    if limit.soft < 3 * HOSTILE as u64 {
        tenantvm_skip::record(
            &format!("{}::{test}", env!("CARGO_CRATE_NAME")),
            format!(
                "RLIMIT_NOFILE's hard limit ({}) is too low for {HOSTILE} connections",
                limit.hard
            ),
        );
        return;
    }
    let door = FrontDoorTls::new();
    let mut d = TestDaemon::new()
        .with_front_door(&door)
        .with_nofile(768, 768);
    d.start(None);
    let admin = d.admin_token_file();
    let create = |name: &str| {
        tenantvm(
            &d,
            &admin,
            &[
                "create",
                "--name",
                name,
                "--image",
                "idle",
                "--memory-mib",
                "32",
            ],
        )
    };
    let name = daemon::unique("fds");
    let o = create(&name);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = tenantvm(&d, &admin, &["key", "create", &name]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let key = String::from_utf8(o.stdout).unwrap().trim().to_string();
    // The idle guest has no inference server: its clear 400 is "served".
    assert_eq!(door_status(&door, &key), Ok(400));

    let flood = Flood::start(FloodPlan::of(door.addr, door.client.clone(), HOSTILE));
    assert!(
        flood.wait_opened(HOSTILE as u64, Duration::from_secs(60)),
        "the flood never opened {HOSTILE} connections: {:?}",
        flood.stats
    );
    let mut failures = Vec::new();
    let started = Instant::now();
    for round in 0..6 {
        let asked = Instant::now();
        match d.health() {
            Some(h) if h["status"].is_string() => {}
            other => failures.push(format!(
                "round {round}: the admin API's health check failed after {:?}: {other:?}",
                asked.elapsed()
            )),
        }
        match door_status(&door, &key) {
            Ok(400) => {}
            other => failures.push(format!("round {round}: the tenant's client got {other:?}")),
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let second = daemon::unique("fds2");
    let o = create(&second);
    if o.status.code() != Some(0) {
        failures.push(format!("a create under the flood failed: {}", text(&o)));
    }
    let under_flood = started.elapsed();
    let stats = flood.stop();
    let log = d.log();
    let accept_lines = log.matches("accept failed").count();
    d.stop();
    assert!(
        failures.is_empty(),
        "under a flood of {HOSTILE} ({stats:?}):\n{}\n--- daemon log (tail) ---\n{}",
        failures.join("\n"),
        &log[log.len().saturating_sub(4000)..]
    );
    // At most one line per 10 s (plus the first) however often accept fails.
    assert!(
        accept_lines as u64 <= 2 + under_flood.as_secs() / 10,
        "{accept_lines} accept failure lines in {under_flood:?}"
    );
}
