//! Following a scenario run: the result lines run-scenarios.sh writes to its results channel
//! (inside the outer guest a virtio-serial port that QEMU writes to a file; on a real host a
//! file), the deadlines the host side keeps on its own, and the console tail a failure gets.
//!
//! The in-guest runner kills a scenario at its limit and says so. The host side only steps
//! in when the runner itself stops answering: no result within the scenario's limit plus a
//! grace period (the outer guest hung), or the QEMU process ended before `DONE` (it
//! crashed). Then the running scenario and those after it fail with the console's last 50
//! lines.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use crate::catalog::Scenario;

/// How many console lines a failure carries.
pub const CONSOLE_TAIL_LINES: usize = 50;

/// What became of a scenario.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// It exited 0.
    Pass,
    /// It failed, timed out, or never reported.
    Fail {
        /// One line.
        reason: String,
        /// The console's last lines when the failure was seen.
        console_tail: String,
    },
    /// It could not run on this host.
    Skip {
        /// One line.
        reason: String,
    },
}

/// One scenario's outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The scenario.
    pub name: String,
    /// How long it ran (measured where it ran).
    pub seconds: f64,
    /// What became of it.
    pub verdict: Verdict,
}

impl Outcome {
    /// Whether it failed.
    pub fn failed(&self) -> bool {
        matches!(self.verdict, Verdict::Fail { .. })
    }
}

impl std::fmt::Display for Outcome {
    /// `PASS name (12.3 s)`, `SKIP name: reason`, or `FAIL name: reason` followed by the
    /// console tail, indented.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.verdict {
            Verdict::Pass => write!(f, "PASS {} ({:.1} s)", self.name, self.seconds),
            Verdict::Skip { reason } => write!(f, "SKIP {}: {reason}", self.name),
            Verdict::Fail {
                reason,
                console_tail,
            } => {
                write!(f, "FAIL {}: {reason}", self.name)?;
                if !console_tail.is_empty() {
                    write!(f, "\n    console, last {CONSOLE_TAIL_LINES} lines:")?;
                    for line in console_tail.lines() {
                        write!(f, "\n    | {line}")?;
                    }
                }
                Ok(())
            }
        }
    }
}

/// One line of the results channel.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A scenario started with this limit in seconds.
    Start {
        /// Scenario.
        name: String,
        /// Its limit.
        limit_s: u64,
    },
    /// A scenario ended.
    End(Outcome),
    /// A figure a scenario wrote to $NH_NOTES (benchmarks).
    Note {
        /// Scenario.
        name: String,
        /// One line.
        text: String,
    },
    /// The outer guest's init is about to run the scenarios, at this guest uptime.
    Ready {
        /// Seconds since the guest kernel started.
        uptime_s: f64,
    },
    /// All scenarios ran.
    Done,
}

/// What [`watch`] reports as it goes.
#[derive(Clone, Debug, PartialEq)]
pub enum Progress {
    /// The host side saw READY this long after the start (wall clock).
    Ready {
        /// Wall-clock seconds since the process started.
        wall_s: f64,
        /// The guest's uptime then.
        uptime_s: f64,
    },
    /// A scenario's figure.
    Note {
        /// Scenario.
        name: String,
        /// One line.
        text: String,
    },
    /// A scenario's outcome.
    Outcome(Outcome),
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Progress::Ready { wall_s, uptime_s } => write!(
                f,
                "nested-host: init ready to run the scenarios {wall_s:.1} s after the start (guest uptime {uptime_s:.1} s)"
            ),
            Progress::Note { name, text } => write!(f, "NOTE {name}: {text}"),
            Progress::Outcome(o) => o.fmt(f),
        }
    }
}

/// Parses one results line; `None` for anything else (a partial or garbled line).
/// `console_tail` is what a failure carries.
pub fn parse_event(line: &str, console_tail: impl FnOnce() -> String) -> Option<Event> {
    let mut words = line.trim_end().splitn(4, ' ');
    let kind = words.next()?;
    if kind == "DONE" {
        return Some(Event::Done);
    }
    if kind == "READY" {
        return Some(Event::Ready {
            uptime_s: words.next()?.parse().ok()?,
        });
    }
    let name = words.next()?.to_string();
    if kind == "NOTE" {
        let text = [words.next()?, words.next().unwrap_or("")].join(" ");
        return Some(Event::Note {
            name,
            text: text.trim().to_string(),
        });
    }
    let number = words.next()?;
    let rest = words.next().unwrap_or("").trim().to_string();
    if kind == "START" {
        return Some(Event::Start {
            name,
            limit_s: number.parse().ok()?,
        });
    }
    let seconds: f64 = number.parse().ok()?;
    let verdict = match kind {
        "PASS" => Verdict::Pass,
        "SKIP" => Verdict::Skip { reason: rest },
        "FAIL" => Verdict::Fail {
            reason: rest,
            console_tail: console_tail(),
        },
        _ => return None,
    };
    Some(Event::End(Outcome {
        name,
        seconds,
        verdict,
    }))
}

/// The last `n` lines of the file at `path` (carriage returns and other control characters
/// but tabs dropped), or a note that it cannot be read.
pub fn tail(path: &Path, n: usize) -> String {
    let mut bytes = Vec::new();
    let read = std::fs::File::open(path).and_then(|mut f| {
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(256 << 10)))?;
        f.read_to_end(&mut bytes)
    });
    if let Err(e) = read {
        return format!("(cannot read {}: {e})", path.display());
    }
    let text: String = String::from_utf8_lossy(&bytes)
        .chars()
        .filter(|c| *c == '\n' || *c == '\t' || !c.is_control())
        .collect();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// How the host side follows a run.
#[derive(Clone, Debug)]
pub struct WatchConfig {
    /// Where results are appended.
    pub results: std::path::PathBuf,
    /// The console log (or the runner's output on a real host).
    pub console: std::path::PathBuf,
    /// Time from the start to the first scenario's START (the outer guest's boot).
    pub boot_timeout: Duration,
    /// Time beyond a scenario's limit before the host side gives up on the runner.
    pub grace: Duration,
    /// What the process is, in messages ("the outer guest", "the scenario runner").
    pub what: &'static str,
    /// The outer guest's heartbeat, when it has one.
    pub heartbeat: Option<Heartbeat>,
}

/// A file the watched process appends a line to every few seconds while it lives (the outer
/// guest's `HB <uptime>` lines, init.sh). Once the first line is there, a silence longer than
/// `silence` means the process froze: it is stopped without waiting for the scenario's limit.
#[derive(Clone, Debug)]
pub struct Heartbeat {
    /// The file.
    pub path: std::path::PathBuf,
    /// How long it may stay silent.
    pub silence: Duration,
}

/// Why the watched process was stopped before it said `DONE`.
#[derive(Clone, Debug, PartialEq)]
pub enum Stop {
    /// Its heartbeat fell silent: the outer guest froze.
    Froze {
        /// The scenario running then, if any.
        during: Option<String>,
        /// The guest's uptime in its last heartbeat.
        last_beat_uptime_s: Option<f64>,
        /// How long it had been silent.
        silent_s: u64,
    },
    /// No result within a scenario's limit plus the grace, or no scenario started in time.
    Hung,
    /// The process ended on its own (a crash, a panic).
    Exited,
    /// The heartbeat file stopped growing because the host's file system under it is full:
    /// the guest may be alive, but nothing can tell; not a freeze.
    HostDiskFull {
        /// Bytes free there when the silence was noticed.
        free_bytes: u64,
    },
}

/// Below this many free bytes where the heartbeat file lives, a silent heartbeat is read as
/// a full host disk (its writes failing), not as a frozen guest.
const DISK_FULL_BELOW: u64 = 16 << 20;

/// Bytes free to an unprivileged writer on the file system holding `path`, if it can be read.
fn free_bytes(path: &std::path::Path) -> Option<u64> {
    let dir = path.parent().unwrap_or(path);
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs(3) with a NUL-terminated path and a zeroed out-struct owned here.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `c` outlives the call and `st` is a valid, writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// What [`watch_with`] saw: every scenario's outcome in the order asked for, how the run
/// ended early if it did, and the scenarios that never started then (the caller may run them
/// again in a fresh guest).
#[derive(Clone, Debug)]
pub struct Watched {
    /// One outcome per scenario, in order.
    pub outcomes: Vec<Outcome>,
    /// Why the process was stopped before `DONE`, if it was.
    pub stop: Option<Stop>,
    /// The scenarios that never started because of that stop.
    pub not_run: Vec<String>,
}

/// Follows `child` (QEMU, or the runner on a real host) running `scenarios` until `DONE`, a
/// crash or a hang; calls `report` with each outcome, note and READY as it comes and returns
/// the outcomes in the order of `scenarios` (each scenario exactly once).
pub fn watch(
    child: &mut Child,
    scenarios: &[Scenario],
    cfg: &WatchConfig,
    report: &mut dyn FnMut(&Progress),
) -> Vec<Outcome> {
    let watched = watch_with(child, scenarios, cfg, report, &mut |_| None);
    watched.report_not_run(report);
    watched.outcomes
}

/// [`watch`], calling `before_kill` when the process froze or stopped answering, before it
/// is killed (the outer guest saves its state then); what it returns is added to the
/// failure's reason.
pub fn watch_with(
    child: &mut Child,
    scenarios: &[Scenario],
    cfg: &WatchConfig,
    report: &mut dyn FnMut(&Progress),
    before_kill: &mut dyn FnMut(&Stop) -> Option<String>,
) -> Watched {
    let console_tail = || tail(&cfg.console, CONSOLE_TAIL_LINES);
    let started = Instant::now();
    let mut reader = LineReader::default();
    let mut outcomes: Vec<Outcome> = Vec::new();
    // The running scenario and when it started (host clock), else when the last one ended.
    let mut current: Option<(String, u64)> = None;
    let mut since = started;
    let mut done = false;
    let mut stopped: Option<String> = None;
    let mut stop: Option<Stop> = None;
    let mut beats = BeatWatch::default();
    loop {
        let exited = child.try_wait().ok().flatten();
        if let Some(hb) = &cfg.heartbeat {
            beats.poll(&hb.path);
        }
        // Read after try_wait, so that a process that ended has nothing more to say.
        for line in reader.read_lines(&cfg.results) {
            match parse_event(&line, console_tail) {
                Some(Event::Start { name, limit_s }) => {
                    current = Some((name, limit_s));
                    since = Instant::now();
                }
                Some(Event::End(outcome)) => {
                    current = None;
                    since = Instant::now();
                    report(&Progress::Outcome(outcome.clone()));
                    outcomes.push(outcome);
                }
                Some(Event::Note { name, text }) => report(&Progress::Note { name, text }),
                Some(Event::Ready { uptime_s }) => report(&Progress::Ready {
                    wall_s: started.elapsed().as_secs_f64(),
                    uptime_s,
                }),
                Some(Event::Done) => done = true,
                None => {}
            }
        }
        if done {
            break;
        }
        if let Some(status) = exited {
            stopped = Some(format!(
                "{} stopped ({status}) before all scenarios ran",
                cfg.what
            ));
            stop = Some(Stop::Exited);
            break;
        }
        if let Some(hb) = cfg
            .heartbeat
            .as_ref()
            .filter(|hb| beats.silent_for() >= hb.silence)
        {
            if let Some(free) = free_bytes(&hb.path).filter(|&f| f < DISK_FULL_BELOW) {
                stopped = Some(format!(
                    "the host's disk is full ({} KiB free where {} lives): the heartbeat could \
                     not be written, so whether {} froze cannot be told; free space and run \
                     again",
                    free / 1024,
                    hb.path.display(),
                    cfg.what
                ));
                stop = Some(Stop::HostDiskFull { free_bytes: free });
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            let froze = Stop::Froze {
                during: current.as_ref().map(|(name, _)| name.clone()),
                last_beat_uptime_s: beats.last_uptime_s,
                silent_s: hb.silence.as_secs(),
            };
            let mut why = format!(
                "{} froze: no heartbeat for {} s (its last at uptime {}); killed it",
                cfg.what,
                hb.silence.as_secs(),
                beats
                    .last_uptime_s
                    .map_or("unknown".to_string(), |u| format!("{u:.1} s"))
            );
            if let Some(more) = before_kill(&froze) {
                why.push_str("; ");
                why.push_str(&more);
            }
            stopped = Some(why);
            stop = Some(froze);
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        let deadline = match &current {
            Some((_, limit_s)) => since + Duration::from_secs(*limit_s) + cfg.grace,
            None if outcomes.is_empty() => started + cfg.boot_timeout,
            None => since + cfg.grace,
        };
        if Instant::now() >= deadline {
            stopped = Some(match &current {
                Some((name, limit_s)) => format!(
                    "{} stopped answering: no result from {name} {} s after its {limit_s} s limit; killed it",
                    cfg.what,
                    cfg.grace.as_secs()
                ),
                None if outcomes.is_empty() => format!(
                    "{} did not start the first scenario within {} s; killed it",
                    cfg.what,
                    cfg.boot_timeout.as_secs()
                ),
                None => format!(
                    "{} did not start the next scenario within {} s; killed it",
                    cfg.what,
                    cfg.grace.as_secs()
                ),
            });
            if let Some(more) = before_kill(&Stop::Hung) {
                if let Some(why) = stopped.as_mut() {
                    why.push_str("; ");
                    why.push_str(&more);
                }
            }
            stop = Some(Stop::Hung);
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // Every scenario gets exactly one outcome, in the order asked for.
    let tail_now = console_tail();
    let mut ordered = Vec::new();
    let mut not_run = Vec::new();
    for s in scenarios {
        if let Some(o) = outcomes.iter().find(|o| o.name == s.name) {
            ordered.push(o.clone());
            continue;
        }
        let reason = match (&stopped, &current) {
            (Some(why), Some((name, _))) if *name == s.name => why.clone(),
            (Some(why), _) => {
                not_run.push(s.name.clone());
                format!("not run: {why}")
            }
            (None, _) => format!("no result: {} finished without running it", cfg.what),
        };
        let outcome = Outcome {
            name: s.name.clone(),
            seconds: 0.0,
            verdict: Verdict::Fail {
                reason,
                console_tail: tail_now.clone(),
            },
        };
        ordered.push(outcome);
    }
    // The scenarios that never started are reported by the caller, which may still run
    // them; the one the stop cut short is reported now.
    for o in &ordered {
        if !outcomes.iter().any(|seen| seen.name == o.name) && !not_run.contains(&o.name) {
            report(&Progress::Outcome(o.clone()));
        }
    }
    Watched {
        outcomes: ordered,
        stop,
        not_run,
    }
}

impl Watched {
    /// Reports the outcomes of the scenarios that never started (when they are not run
    /// again elsewhere).
    pub fn report_not_run(&self, report: &mut dyn FnMut(&Progress)) {
        for o in self
            .outcomes
            .iter()
            .filter(|o| self.not_run.contains(&o.name))
        {
            report(&Progress::Outcome(o.clone()));
        }
    }
}

/// Follows the heartbeat file: when it last grew, and the uptime its last line gave.
#[derive(Default)]
struct BeatWatch {
    len: u64,
    changed: Option<Instant>,
    last_uptime_s: Option<f64>,
}

impl BeatWatch {
    fn poll(&mut self, path: &Path) {
        let Ok(len) = std::fs::metadata(path).map(|m| m.len()) else {
            return;
        };
        if len != self.len {
            self.len = len;
            self.changed = Some(Instant::now());
            self.last_uptime_s = tail(path, 1)
                .strip_prefix("HB ")
                .and_then(|u| u.trim().parse().ok());
        }
    }

    /// How long since the heartbeat last grew; zero before its first line.
    fn silent_for(&self) -> Duration {
        self.changed.map_or(Duration::ZERO, |t| t.elapsed())
    }
}

/// Reads whole lines appended to a file since the last call.
#[derive(Default)]
struct LineReader {
    offset: u64,
    partial: Vec<u8>,
}

impl LineReader {
    fn read_lines(&mut self, path: &Path) -> Vec<String> {
        let mut bytes = Vec::new();
        let read = std::fs::File::open(path).and_then(|mut f| {
            f.seek(SeekFrom::Start(self.offset))?;
            f.read_to_end(&mut bytes)
        });
        if read.is_err() {
            return Vec::new();
        }
        self.offset += bytes.len() as u64;
        self.partial.extend_from_slice(&bytes);
        let mut lines = Vec::new();
        while let Some(end) = self.partial.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            lines.push(String::from_utf8_lossy(&line).trim_end().to_string());
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn scenario(name: &str) -> Scenario {
        Scenario {
            name: name.into(),
            path: format!("/s/{name}.sh").into(),
            description: String::new(),
            limit_s: 2,
            sets: Vec::new(),
            needs: Vec::new(),
        }
    }

    #[test]
    fn result_lines_parse() {
        let tail = || "the tail".to_string();
        assert_eq!(
            parse_event("START a 300\n", tail),
            Some(Event::Start {
                name: "a".into(),
                limit_s: 300
            })
        );
        assert_eq!(
            parse_event("FAIL a 5.5 timed out after 5 s", tail),
            Some(Event::End(Outcome {
                name: "a".into(),
                seconds: 5.5,
                verdict: Verdict::Fail {
                    reason: "timed out after 5 s".into(),
                    console_tail: "the tail".into()
                }
            }))
        );
        assert_eq!(
            parse_event("SKIP a 0.1 no edu", tail).map(|e| match e {
                Event::End(o) => o.to_string(),
                _ => String::new(),
            }),
            Some("SKIP a: no edu".into())
        );
        assert_eq!(parse_event("DONE", tail), Some(Event::Done));
        assert_eq!(
            parse_event("READY 4.36", tail),
            Some(Event::Ready { uptime_s: 4.36 })
        );
        assert_eq!(
            parse_event("NOTE bench ratio 2.5x over 3 runs", tail),
            Some(Event::Note {
                name: "bench".into(),
                text: "ratio 2.5x over 3 runs".into()
            })
        );
        for garbled in ["", "PASS", "PASS a", "PASS a soon", "START a x", "WHAT a 1"] {
            assert_eq!(parse_event(garbled, tail), None, "{garbled:?}");
        }
    }

    #[test]
    fn the_tail_is_the_last_lines_without_control_characters() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("console.log");
        let text: String = (1..=80).map(|i| format!("line {i}\r\n")).collect();
        std::fs::write(&p, format!("\x1b[1m{text}")).unwrap();
        let t = tail(&p, 50);
        assert_eq!(t.lines().count(), 50);
        assert!(t.starts_with("line 31\n") && t.ends_with("line 80"), "{t}");
        assert!(tail(&dir.path().join("absent"), 5).starts_with("(cannot read"));
    }

    /// Runs a shell script as the "guest" that writes `results` lines and `console` lines.
    fn run_fake(script: &str, names: &[&str]) -> Vec<Outcome> {
        run_fake_watched(script, names, &mut |_| None).0.outcomes
    }

    /// [`run_fake`] with a heartbeat file (`$3`, 2 s of silence allowed) and a
    /// `before_kill`; also returns how often each outcome was reported.
    fn run_fake_watched(
        script: &str,
        names: &[&str],
        before_kill: &mut dyn FnMut(&Stop) -> Option<String>,
    ) -> (Watched, Vec<String>) {
        run_fake_watched_at(script, names, before_kill, None)
    }

    /// [`run_fake_watched`] with the heartbeat file at `heartbeat` (default: beside the
    /// others).
    fn run_fake_watched_at(
        script: &str,
        names: &[&str],
        before_kill: &mut dyn FnMut(&Stop) -> Option<String>,
        heartbeat: Option<std::path::PathBuf>,
    ) -> (Watched, Vec<String>) {
        let dir = tempfile::tempdir().unwrap();
        let results = dir.path().join("results");
        let console = dir.path().join("console");
        let heartbeat = heartbeat.unwrap_or_else(|| dir.path().join("heartbeat"));
        let mut child = Command::new("sh")
            .args([
                "-c",
                script,
                "fake",
                results.to_str().unwrap(),
                console.to_str().unwrap(),
                heartbeat.to_str().unwrap(),
            ])
            .spawn()
            .unwrap();
        let cfg = WatchConfig {
            results,
            console,
            boot_timeout: Duration::from_secs(3),
            grace: Duration::from_secs(1),
            what: "the outer guest",
            heartbeat: Some(Heartbeat {
                path: heartbeat,
                silence: Duration::from_secs(2),
            }),
        };
        let scenarios: Vec<Scenario> = names.iter().map(|n| scenario(n)).collect();
        let mut seen = Vec::new();
        let mut record = |p: &Progress| {
            if let Progress::Outcome(o) = p {
                seen.push(o.name.clone());
            }
        };
        let watched = watch_with(&mut child, &scenarios, &cfg, &mut record, before_kill);
        watched.report_not_run(&mut record);
        let _ = child.kill();
        let _ = child.wait();
        let mut sorted = seen.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            seen.len(),
            "each outcome is reported once: {seen:?}"
        );
        assert_eq!(
            seen.len(),
            names.len(),
            "every outcome is reported: {seen:?}"
        );
        (watched, seen)
    }

    #[test]
    fn a_full_run_gives_each_outcome_in_order() {
        let out = run_fake(
            r#"echo booting >"$2"; printf 'START b 2\nPASS b 1.25\nSTART a 2\nFAIL a 0.5 broke\n' >>"$1"
               echo "a said why" >>"$2"; printf 'DONE\n' >>"$1""#,
            &["a", "b"],
        );
        assert_eq!(out[0].name, "a");
        assert!(matches!(&out[0].verdict, Verdict::Fail { reason, .. } if reason == "broke"));
        assert_eq!(out[1].to_string(), "PASS b (1.2 s)");
    }

    #[test]
    fn a_hung_guest_fails_the_running_scenario_and_those_after_it_with_the_console_tail() {
        let out = run_fake(
            r#"printf 'START a 1\nPASS a 0.1\nSTART b 1\n' >>"$1"; echo "b is stuck" >>"$2"; sleep 60"#,
            &["a", "b", "c"],
        );
        assert_eq!(out[0].verdict, Verdict::Pass);
        match &out[1].verdict {
            Verdict::Fail {
                reason,
                console_tail,
            } => {
                assert!(
                    reason.contains("stopped answering: no result from b"),
                    "{reason}"
                );
                assert_eq!(console_tail, "b is stuck");
            }
            v => panic!("{v:?}"),
        }
        assert!(
            matches!(&out[2].verdict, Verdict::Fail { reason, .. } if reason.starts_with("not run: ")),
            "{:?}",
            out[2]
        );
        assert!(out[1].to_string().contains("\n    | b is stuck"));
    }

    #[test]
    fn a_crashed_guest_and_a_guest_that_never_boots_fail_everything_left() {
        let out = run_fake(
            r#"printf 'START a 5\n' >>"$1"; echo "Kernel panic" >>"$2"; exit 3"#,
            &["a", "b"],
        );
        assert!(
            matches!(&out[0].verdict, Verdict::Fail { reason, console_tail } if reason.contains("stopped (exit status: 3)") && console_tail == "Kernel panic"),
            "{:?}",
            out[0]
        );
        assert!(out[1].failed());
        let out = run_fake("sleep 60", &["a"]);
        assert!(
            matches!(&out[0].verdict, Verdict::Fail { reason, .. } if reason.contains("did not start the first scenario within 3 s")),
            "{:?}",
            out[0]
        );
    }

    #[test]
    fn a_heartbeat_silent_because_the_disk_is_full_is_not_called_a_freeze() {
        // SAFETY: geteuid(2) has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            tenantvm_skip::skip!("mounting a small tmpfs needs root");
        }
        let mnt = tempfile::tempdir().unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=256k", "tenantvm-full"])
            .arg(mnt.path())
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            tenantvm_skip::skip!("could not mount a tmpfs");
        }
        struct Unmount<'a>(&'a std::path::Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = Command::new("umount").arg(self.0).status();
            }
        }
        let _unmount = Unmount(mnt.path());
        let heartbeat = mnt.path().join("heartbeat");
        // The guest beats on; the file system fills, so the beats stop landing (the first
        // beat is padded to a whole page: tmpfs would take appends into a page it holds).
        let script = r#"printf 'START a 300\n' >>"$1"; echo "a runs" >>"$2"
               printf 'HB 10.0\n%4087s\n' '' >>"$3"; head -c 1048576 /dev/zero >"$3.fill" 2>/dev/null
               while :; do echo "HB 15.0" >>"$3" 2>/dev/null; sleep 0.5; done"#;
        let mut stops = Vec::new();
        let (watched, _) = run_fake_watched_at(
            script,
            &["a", "b"],
            &mut |stop| {
                stops.push(stop.clone());
                None
            },
            Some(heartbeat),
        );
        assert!(
            matches!(watched.stop, Some(Stop::HostDiskFull { free_bytes }) if free_bytes < DISK_FULL_BELOW),
            "{:?}",
            watched.stop
        );
        assert!(
            stops.is_empty(),
            "no freeze diagnosis was asked for: {stops:?}"
        );
        match &watched.outcomes[0].verdict {
            Verdict::Fail { reason, .. } => assert!(
                reason.starts_with("the host's disk is full") && !reason.contains("froze:"),
                "{reason}"
            ),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn a_silent_heartbeat_is_a_frozen_guest_stopped_long_before_the_scenarios_limit() {
        let started = Instant::now();
        let mut stops = Vec::new();
        let (watched, _) = run_fake_watched(
            // The scenario's limit is 300 s; the heartbeat stops after two beats.
            r#"printf 'START a 300\n' >>"$1"; echo "a runs" >>"$2"
               echo "HB 10.0" >>"$3"; sleep 0.5; echo "HB 15.0" >>"$3"; sleep 300"#,
            &["a", "b", "c"],
            &mut |stop| {
                stops.push(stop.clone());
                Some("its state is in cpu-state.txt".into())
            },
        );
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "stopped at the silence, not the limit"
        );
        assert_eq!(
            stops,
            vec![Stop::Froze {
                during: Some("a".into()),
                last_beat_uptime_s: Some(15.0),
                silent_s: 2
            }]
        );
        assert_eq!(watched.stop, stops.first().cloned());
        match &watched.outcomes[0].verdict {
            Verdict::Fail {
                reason,
                console_tail,
            } => {
                assert!(
                    reason.starts_with("the outer guest froze: no heartbeat for 2 s (its last at uptime 15.0 s); killed it; its state is in cpu-state.txt"),
                    "{reason}"
                );
                assert_eq!(console_tail, "a runs");
            }
            v => panic!("{v:?}"),
        }
        assert_eq!(watched.not_run, vec!["b".to_string(), "c".to_string()]);
    }

    #[test]
    fn a_beating_guest_is_not_frozen_and_no_heartbeat_at_all_never_arms_the_check() {
        // Beats every 0.5 s through a 4 s scenario: twice the allowed silence in all.
        let (watched, _) = run_fake_watched(
            r#"printf 'START a 10\n' >>"$1"
               for i in 1 2 3 4 5 6 7 8; do echo "HB $i" >>"$3"; sleep 0.5; done
               printf 'PASS a 4.0\nDONE\n' >>"$1"; sleep 60"#,
            &["a"],
            &mut |_| panic!("a beating guest must not be stopped"),
        );
        assert_eq!(watched.stop, None);
        assert_eq!(watched.outcomes[0].verdict, Verdict::Pass);
        // A guest without the heartbeat port: only the limits apply.
        let (watched, _) = run_fake_watched(
            r#"printf 'START a 10\n' >>"$1"; sleep 4; printf 'PASS a 4.0\nDONE\n' >>"$1"; sleep 60"#,
            &["a"],
            &mut |_| panic!("no heartbeat, no freeze"),
        );
        assert_eq!(watched.outcomes[0].verdict, Verdict::Pass);
    }
}
