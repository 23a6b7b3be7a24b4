//! The payload's supervisor: starts the inference server (confined in its own root when
//! the config says so, [`crate::confine`]), restarts it with a back-off when it exits on
//! its own, stops it (SIGTERM to its process group, SIGKILL after a grace time) and
//! restarts it on request, and pumps its stdout and stderr into the agent's log buffer
//! with the log's caps: lines cut at [`crate::logbuf::MAX_LINE_LEN`] bytes without
//! buffering the rest, and at most [`LINES_PER_S`] lines a second per stream (a burst of
//! [`LINE_BURST`]), the lines dropped beyond it counted in a note. A payload that floods
//! its log costs the agent a fixed buffer and the ring its oldest lines, never memory.
//! Each kept line also goes to the console, i.e. the tenant's serial log on the host
//! (`tenantvm logs TENANT`), which the daemon caps and rotates.
//!
//! One watcher thread per started process waits for its exit through the [`Reaper`] (the
//! only waiter for that pid) and decides on the restart; everything else reads the state.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use thiserror::Error;

use crate::config::PayloadConfig;
use crate::logbuf::{LogBuffer, MAX_LINE_LEN};
use crate::reaper::Reaper;

/// Lines per second each of the payload's streams may log (sustained).
pub const LINES_PER_S: u32 = 200;
/// Lines a stream may log at once before [`LINES_PER_S`] applies.
pub const LINE_BURST: u32 = 1000;
/// The first restart's delay after the payload exited on its own.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest delay between restarts (the delay doubles with each quick exit).
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A process that ran this long before it exited starts the back-off afresh.
pub const STABLE_AFTER: Duration = Duration::from_secs(60);
/// How long the payload gets after SIGTERM before SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// Why the payload could not be started.
#[derive(Debug, Error)]
pub enum PayloadError {
    /// It is already running.
    #[error("The payload is already running")]
    Running,
    /// Its confinement could not be prepared.
    #[error(transparent)]
    Confine(#[from] crate::confine::ConfineError),
    /// The process could not be started.
    #[error("Starting the payload {program} failed: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// Why (for a confined payload: the namespace, mount, chroot or uid change).
        source: std::io::Error,
    },
}

/// What the supervisor knows (read by `health`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    /// Never started.
    NotStarted,
    /// A process runs.
    Running {
        /// Its pid.
        pid: u32,
        /// Restarts after exits of its own since the last start on request.
        restarts: u32,
    },
    /// No process runs.
    Exited {
        /// The last exit code (128 + signal for a signal).
        code: i32,
        /// As in `Running`.
        restarts: u32,
        /// When the next start comes, if one is due.
        restart_in: Option<Duration>,
    },
}

#[derive(Default)]
struct State {
    pid: Option<u32>,
    last_exit: Option<i32>,
    /// Whether the payload should be running (started and not stopped).
    wanted: bool,
    /// Bumped by every start and stop on request: a watcher of an older generation only
    /// records its exit.
    generation: u64,
    restarts: u32,
    /// The delay before the next restart.
    backoff: Option<Duration>,
    next_start: Option<Instant>,
}

/// The payload's supervisor.
#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: PayloadConfig,
    /// The data disk's mount point (bound inside a confined payload's root).
    data: PathBuf,
    /// The guest's `/dev` (device nodes for a confined payload).
    dev: PathBuf,
    reaper: Reaper,
    logs: Arc<LogBuffer>,
    state: Mutex<State>,
    changed: Condvar,
}

impl Supervisor {
    /// A supervisor for `cfg`; `data` is the data disk's mount point.
    pub fn new(cfg: PayloadConfig, data: PathBuf, reaper: Reaper, logs: Arc<LogBuffer>) -> Self {
        Self::with_dev(cfg, data, PathBuf::from("/dev"), reaper, logs)
    }

    /// As [`new`](Self::new), with the device directory a confined payload's nodes come
    /// from (tests).
    pub fn with_dev(
        cfg: PayloadConfig,
        data: PathBuf,
        dev: PathBuf,
        reaper: Reaper,
        logs: Arc<LogBuffer>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                cfg,
                data,
                dev,
                reaper,
                logs,
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn log(&self, msg: &str) {
        eprintln!("tenantvm-agent: {msg}");
        self.inner.logs.push("agent", msg);
    }

    /// What is known of the payload now.
    pub fn observe(&self) -> Observed {
        let st = self.state();
        match (st.pid, st.last_exit) {
            (Some(pid), _) => Observed::Running {
                pid,
                restarts: st.restarts,
            },
            (None, Some(code)) => Observed::Exited {
                code,
                restarts: st.restarts,
                restart_in: st
                    .next_start
                    .filter(|_| st.wanted)
                    .map(|t| t.saturating_duration_since(Instant::now())),
            },
            (None, None) => Observed::NotStarted,
        }
    }

    /// Starts the payload (it must not be running); returns its pid.
    pub fn start(&self) -> Result<u32, PayloadError> {
        let mut st = self.state();
        if st.pid.is_some() {
            return Err(PayloadError::Running);
        }
        st.generation += 1;
        st.wanted = true;
        st.restarts = 0;
        st.backoff = None;
        st.next_start = None;
        let generation = st.generation;
        let pid = self.spawn()?;
        st.pid = Some(pid);
        st.last_exit = None;
        drop(st);
        self.watch(pid, generation);
        Ok(pid)
    }

    /// Stops the payload: no restart, SIGTERM to its process group, SIGKILL after `grace`.
    /// Returns the exit code, or None when nothing ran or it did not die.
    pub fn stop(&self, grace: Duration) -> Option<i32> {
        let pid = {
            let mut st = self.state();
            st.wanted = false;
            st.generation += 1;
            st.next_start = None;
            self.inner.changed.notify_all();
            st.pid?
        };
        let group = Pid::from_raw(-(pid as i32));
        let _ = kill(group, Signal::SIGTERM);
        if let Some(code) = self.wait_gone(pid, grace) {
            return Some(code);
        }
        self.log("payload ignored SIGTERM, killing it");
        let _ = kill(group, Signal::SIGKILL);
        self.wait_gone(pid, Duration::from_secs(5))
    }

    /// Stops the payload and starts it again (the back-off starts afresh).
    pub fn restart(&self, grace: Duration) -> Result<u32, PayloadError> {
        if let Some(code) = self.stop(grace) {
            self.log(&format!("payload stopped for a restart (exit code {code})"));
        }
        self.start()
    }

    /// Waits until `pid` is recorded as exited; its exit code.
    fn wait_gone(&self, pid: u32, timeout: Duration) -> Option<i32> {
        let (st, gone) = self.wait_until(Instant::now() + timeout, |st| st.pid != Some(pid));
        if gone {
            st.last_exit
        } else {
            None
        }
    }

    /// Waits on the state until `done` holds or `deadline` passes; the state and whether
    /// `done` held.
    fn wait_until(
        &self,
        deadline: Instant,
        mut done: impl FnMut(&State) -> bool,
    ) -> (MutexGuard<'_, State>, bool) {
        let mut st = self.state();
        loop {
            if done(&st) {
                return (st, true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return (st, false);
            }
            st = self
                .inner
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Spawns one payload process and its log pumps.
    fn spawn(&self) -> Result<u32, PayloadError> {
        let p = &self.inner.cfg;
        let mut cmd = Command::new(&p.command[0]);
        cmd.args(&p.command[1..])
            .env_clear()
            .env("PATH", "/payload/bin:/sbin:/bin:/usr/sbin:/usr/bin")
            .envs(&p.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        match &p.confine {
            // The working directory is inside the root: entered after the chroot.
            Some(c) => {
                let data = crate::confine::DataMount {
                    source: &self.inner.data,
                    inside: &self.inner.data,
                };
                crate::confine::apply(&mut cmd, c, data, &p.workdir, &self.inner.dev)?;
            }
            None => {
                use std::os::unix::process::CommandExt;
                cmd.current_dir(&p.workdir).process_group(0);
            }
        }
        let mut child =
            self.inner
                .reaper
                .spawn(&mut cmd)
                .map_err(|source| PayloadError::Spawn {
                    program: p.command[0].clone(),
                    source,
                })?;
        let streams: [(&'static str, Option<Box<dyn Read + Send>>); 2] = [
            (
                "payload-stdout",
                child
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn Read + Send>),
            ),
            (
                "payload-stderr",
                child
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn Read + Send>),
            ),
        ];
        for (source, stream) in streams {
            if let Some(stream) = stream {
                let logs = Arc::clone(&self.inner.logs);
                let _ = std::thread::Builder::new()
                    .name(source.into())
                    .spawn(move || {
                        pump_lines(stream, &logs, source, Limiter::default(), Instant::now);
                    });
            }
        }
        Ok(child.pid)
    }

    /// Watches `pid` of `generation` until the supervisor no longer wants a payload of
    /// that generation, restarting it with the back-off after each exit of its own.
    fn watch(&self, first: u32, generation: u64) {
        let sup = self.clone();
        let _ = std::thread::Builder::new()
            .name("payload-watch".into())
            .spawn(move || {
                // None: the last restart failed to spawn (counted as an immediate exit).
                let mut pid = Some(first);
                let mut started = Instant::now();
                loop {
                    let (code, ran) = match pid {
                        Some(p) => (sup.wait_exit(p), started.elapsed()),
                        None => (127, Duration::ZERO),
                    };
                    let Some(delay) = sup.exited(pid, code, generation, ran) else {
                        return;
                    };
                    if !sup.sleep_unless_changed(generation, delay) {
                        return;
                    }
                    match sup.respawn(generation) {
                        None => return,
                        Some(Ok(next)) => {
                            pid = Some(next);
                            started = Instant::now();
                        }
                        Some(Err(e)) => {
                            sup.log(&format!("payload restart failed: {e}"));
                            pid = None;
                        }
                    }
                }
            });
    }

    /// Waits (without a deadline: the payload may serve for months) for `pid` to exit.
    fn wait_exit(&self, pid: u32) -> i32 {
        loop {
            if let Some(code) = self.inner.reaper.wait(pid, Duration::from_secs(3600)) {
                return code;
            }
        }
    }

    /// Records the exit of `pid`; the delay before the restart when one is due.
    fn exited(
        &self,
        pid: Option<u32>,
        code: i32,
        generation: u64,
        ran: Duration,
    ) -> Option<Duration> {
        let mut st = self.state();
        if pid.is_some() && st.pid == pid {
            st.pid = None;
        }
        st.last_exit = Some(code);
        self.inner.changed.notify_all();
        if !st.wanted || st.generation != generation {
            return None;
        }
        let delay = match st.backoff {
            Some(d) if ran < STABLE_AFTER => (d * 2).min(MAX_BACKOFF),
            _ => FIRST_BACKOFF,
        };
        st.backoff = Some(delay);
        st.next_start = Some(Instant::now() + delay);
        drop(st);
        self.log(&format!(
            "payload exited with code {code} after {:.1} s; restarting it in {} s",
            ran.as_secs_f64(),
            delay.as_secs()
        ));
        Some(delay)
    }

    /// Sleeps `delay` unless a stop or start on request changes the generation first;
    /// whether the restart is still due.
    fn sleep_unless_changed(&self, generation: u64, delay: Duration) -> bool {
        let (st, changed) = self.wait_until(Instant::now() + delay, |st| {
            !st.wanted || st.generation != generation
        });
        drop(st);
        !changed
    }

    /// Starts the next process of `generation`, if it is still wanted.
    fn respawn(&self, generation: u64) -> Option<Result<u32, PayloadError>> {
        let mut st = self.state();
        if !st.wanted || st.generation != generation || st.pid.is_some() {
            return None;
        }
        st.next_start = None;
        let spawned = self.spawn();
        if let Ok(pid) = spawned {
            st.pid = Some(pid);
            st.restarts += 1;
            let n = st.restarts;
            drop(st);
            self.log(&format!("payload restarted (restart {n}), pid {pid}"));
        }
        Some(spawned)
    }
}

/// A token bucket of lines for one stream.
pub(crate) struct Limiter {
    tokens: f64,
    last: Instant,
    dropped: u64,
}

impl Default for Limiter {
    fn default() -> Self {
        Self {
            tokens: f64::from(LINE_BURST),
            last: Instant::now(),
            dropped: 0,
        }
    }
}

impl Limiter {
    /// Whether a line may be kept now.
    fn admit(&mut self, now: Instant) -> bool {
        let refill =
            now.saturating_duration_since(self.last).as_secs_f64() * f64::from(LINES_PER_S);
        self.tokens = (self.tokens + refill).min(f64::from(LINE_BURST));
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            self.dropped += 1;
            false
        }
    }
}

/// Reads `stream` to its end, pushing each line (cut at [`MAX_LINE_LEN`] bytes, the rest
/// of a long line skipped unread into memory) to `logs` under `source`, within the rate
/// of `limiter`; lines dropped for the rate are counted in a note before the next kept
/// line and at the end.
pub(crate) fn pump_lines(
    mut stream: impl Read,
    logs: &LogBuffer,
    source: &str,
    mut limiter: Limiter,
    clock: impl Fn() -> Instant,
) {
    let mut buf = [0u8; 8192];
    let mut line: Vec<u8> = Vec::with_capacity(256);
    let mut cut = 0u64;
    let emit = |line: &mut Vec<u8>, cut: &mut u64, limiter: &mut Limiter| {
        if limiter.admit(clock()) {
            if limiter.dropped > 0 {
                logs.push(
                    "agent",
                    &format!(
                        "{source}: {} lines dropped (over {LINES_PER_S} lines/s)",
                        limiter.dropped
                    ),
                );
                limiter.dropped = 0;
            }
            let mut text = String::from_utf8_lossy(line).into_owned();
            if *cut > 0 {
                let note = format!(" …[cut: {cut} more bytes]");
                let mut keep = text.len().min(MAX_LINE_LEN.saturating_sub(note.len()));
                while !text.is_char_boundary(keep) {
                    keep -= 1;
                }
                text.truncate(keep);
                text.push_str(&note);
            }
            // The console is the tenant's serial log on the host (capped and rotated
            // there); the ring is what `logs` answers.
            eprintln!("{source}: {text}");
            logs.push(source, &text);
        }
        line.clear();
        *cut = 0;
    };
    loop {
        let n = match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for piece in buf[..n].split_inclusive(|&b| b == b'\n') {
            let (body, ends) = match piece.split_last() {
                Some((b'\n', body)) => (body, true),
                _ => (piece, false),
            };
            let room = MAX_LINE_LEN.saturating_sub(line.len());
            line.extend_from_slice(&body[..body.len().min(room)]);
            cut += body.len().saturating_sub(room) as u64;
            if ends {
                emit(&mut line, &mut cut, &mut limiter);
            }
        }
    }
    if !line.is_empty() || cut > 0 {
        emit(&mut line, &mut cut, &mut limiter);
    }
    if limiter.dropped > 0 {
        logs.push(
            "agent",
            &format!(
                "{source}: {} lines dropped (over {LINES_PER_S} lines/s)",
                limiter.dropped
            ),
        );
    }
}

#[cfg(test)]
mod tests;
