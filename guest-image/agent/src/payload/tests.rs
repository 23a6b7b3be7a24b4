//! The supervisor against real child processes (shell scripts): restart with back-off,
//! stop and restart on request, and the log's caps under a flood.

use super::*;
use crate::config::PayloadConfig;

fn sh(script: &str, dir: &std::path::Path) -> PayloadConfig {
    PayloadConfig {
        command: vec!["/bin/sh".into(), "-c".into(), script.into()],
        env: Default::default(),
        workdir: dir.to_path_buf(),
        port: 1,
        health_path: "/health".into(),
        confine: None,
    }
}

fn supervisor(script: &str, dir: &std::path::Path, logs: &Arc<LogBuffer>) -> Supervisor {
    Supervisor::new(
        sh(script, dir),
        dir.to_path_buf(),
        Reaper::start().unwrap(),
        Arc::clone(logs),
    )
}

/// Polls `f` up to `secs` seconds (a generous deadline, not a timing assertion).
fn eventually(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn lines(logs: &LogBuffer, source: &str) -> Vec<String> {
    logs.since(0, 100_000)
        .0
        .into_iter()
        .filter(|l| l.source == source)
        .map(|l| l.line)
        .collect()
}

#[test]
fn a_payload_that_exits_is_restarted_with_a_growing_back_off() {
    let dir = tempfile::tempdir().unwrap();
    let logs = Arc::new(LogBuffer::new(1000));
    // Each run appends a line to a file in the working directory, then fails.
    let s = supervisor("echo run >> runs; exit 3", dir.path(), &logs);
    let first = s.start().unwrap();
    assert!(
        eventually(30, || matches!(
            s.observe(),
            Observed::Exited {
                code: 3,
                restart_in: Some(_),
                ..
            }
        )),
        "{:?}",
        s.observe()
    );
    // The second start comes after the first back-off (1 s), the third after 2 s.
    assert!(eventually(60, || std::fs::read_to_string(
        dir.path().join("runs")
    )
    .unwrap_or_default()
    .lines()
    .count()
        >= 3));
    let agent_lines = lines(&logs, "agent");
    let delays: Vec<&String> = agent_lines
        .iter()
        .filter(|l| l.starts_with("payload exited with code 3"))
        .collect();
    assert!(delays.len() >= 2, "{agent_lines:?}");
    assert!(delays[0].ends_with("restarting it in 1 s"), "{delays:?}");
    assert!(delays[1].ends_with("restarting it in 2 s"), "{delays:?}");
    assert!(
        agent_lines
            .iter()
            .any(|l| l.starts_with("payload restarted (restart 1)")),
        "{agent_lines:?}"
    );
    // A stop ends the restarts: no run is added afterwards.
    s.stop(Duration::from_secs(5));
    let runs = std::fs::read_to_string(dir.path().join("runs"))
        .unwrap()
        .lines()
        .count();
    assert!(matches!(
        s.observe(),
        Observed::Exited {
            restart_in: None,
            ..
        }
    ));
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("runs"))
            .unwrap()
            .lines()
            .count(),
        runs,
        "a stopped payload was started again"
    );
    assert_ne!(first, 0);
}

#[test]
fn restart_on_request_replaces_the_process_and_its_children() {
    let dir = tempfile::tempdir().unwrap();
    let logs = Arc::new(LogBuffer::new(1000));
    // A payload with a child of its own, both ignoring nothing: SIGTERM to the group ends
    // both (a kill of the pid alone would leave the child).
    let s = supervisor(
        "sleep 300 & echo $! > child; echo started; wait",
        dir.path(),
        &logs,
    );
    let first = s.start().unwrap();
    assert!(eventually(30, || dir.path().join("child").exists()));
    let child: i32 = eventually(10, || {
        std::fs::read_to_string(dir.path().join("child"))
            .is_ok_and(|t| t.trim().parse::<i32>().is_ok())
    })
    .then(|| {
        std::fs::read_to_string(dir.path().join("child"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    })
    .unwrap();
    assert!(matches!(s.start(), Err(PayloadError::Running)));
    let second = s.restart(Duration::from_secs(5)).unwrap();
    assert_ne!(first, second);
    assert!(
        matches!(s.observe(), Observed::Running { pid, restarts: 0 } if pid == second),
        "{:?}",
        s.observe()
    );
    // The old payload's child got the SIGTERM too.
    assert!(
        eventually(10, || kill(Pid::from_raw(child), None).is_err()),
        "the old payload's child outlived the restart"
    );
    s.stop(Duration::from_secs(5));
}

#[test]
fn a_payload_that_ignores_sigterm_is_killed_after_the_grace_time() {
    let dir = tempfile::tempdir().unwrap();
    let logs = Arc::new(LogBuffer::new(1000));
    let s = supervisor(
        "trap '' TERM; echo ready; while :; do sleep 1; done",
        dir.path(),
        &logs,
    );
    s.start().unwrap();
    assert!(eventually(30, || !lines(&logs, "payload-stdout").is_empty()));
    let code = s.stop(Duration::from_millis(500));
    assert_eq!(code, Some(128 + 9), "{:?}", lines(&logs, "agent"));
    assert!(lines(&logs, "agent")
        .iter()
        .any(|l| l == "payload ignored SIGTERM, killing it"));
}

#[test]
fn a_flooding_payload_is_capped_in_lines_and_line_length() {
    let logs = LogBuffer::new(100_000);
    // One 1 MiB line without a newline, then 5,000 short lines, all at once.
    let mut flood = vec![b'x'; 1 << 20];
    flood.push(b'\n');
    for i in 0..5000 {
        flood.extend_from_slice(format!("line {i}\n").as_bytes());
    }
    // A stopped clock: no refill while the flood is read.
    let limiter = Limiter::default();
    let t0 = limiter.last;
    pump_lines(&flood[..], &logs, "payload-stderr", limiter, || t0);
    let kept = lines(&logs, "payload-stderr");
    // The burst: the long line and 999 short ones; the rest is counted, not kept.
    assert_eq!(kept.len(), LINE_BURST as usize, "{}", kept.len());
    assert!(kept[0].len() <= MAX_LINE_LEN);
    assert!(
        kept[0].ends_with(&format!("…[cut: {} more bytes]", (1 << 20) - MAX_LINE_LEN)),
        "{}",
        &kept[0][kept[0].len() - 40..]
    );
    let notes = lines(&logs, "agent");
    assert_eq!(
        notes,
        vec![format!(
            "payload-stderr: {} lines dropped (over {LINES_PER_S} lines/s)",
            5001 - LINE_BURST
        )]
    );
}

#[test]
fn lines_within_the_rate_are_all_kept_and_bytes_pass_as_they_are() {
    let logs = LogBuffer::new(1000);
    let text = b"first\nnot utf-8: \xff\xfe\nlast without a newline";
    pump_lines(
        &text[..],
        &logs,
        "payload-stdout",
        Limiter::default(),
        Instant::now,
    );
    assert_eq!(
        lines(&logs, "payload-stdout"),
        vec![
            "first".to_string(),
            "not utf-8: \u{fffd}\u{fffd}".to_string(),
            "last without a newline".to_string()
        ]
    );
    assert!(lines(&logs, "agent").is_empty());
}

#[test]
fn the_rate_refills_over_time() {
    let mut l = Limiter::default();
    let t0 = l.last;
    for _ in 0..LINE_BURST {
        assert!(l.admit(t0));
    }
    assert!(!l.admit(t0));
    assert_eq!(l.dropped, 1);
    // One second later LINES_PER_S more are allowed, and no more.
    let t1 = t0 + Duration::from_secs(1);
    for _ in 0..LINES_PER_S {
        assert!(l.admit(t1));
    }
    assert!(!l.admit(t1));
}
