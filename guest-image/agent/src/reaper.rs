//! Child processes under PID 1: one thread reaps every child (orphans included, as init
//! must), and keeps the exit status of the children the agent started so that their
//! owners can wait for them. Never mix with `std::process::Child::wait`.

use std::collections::{HashMap, HashSet};
use std::io;
use std::process::{ChildStderr, ChildStdin, ChildStdout, Command};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;

#[derive(Default)]
struct Table {
    watched: HashSet<i32>,
    exited: HashMap<i32, i32>,
}

/// A child started through the [`Reaper`]: its pid and pipes. Deliberately not a
/// `std::process::Child`, whose `wait` would race with the reaper.
#[derive(Debug)]
pub struct Spawned {
    /// Process id.
    pub pid: u32,
    /// Its stdin, when piped.
    pub stdin: Option<ChildStdin>,
    /// Its stdout, when piped.
    pub stdout: Option<ChildStdout>,
    /// Its stderr, when piped.
    pub stderr: Option<ChildStderr>,
}

/// The reaper: spawn children through it and wait for them with it.
#[derive(Clone)]
pub struct Reaper {
    shared: Arc<(Mutex<Table>, Condvar)>,
}

/// Exit code of a status: the code, or 128 + the signal number.
fn code_of(status: WaitStatus) -> Option<(i32, i32)> {
    match status {
        WaitStatus::Exited(pid, code) => Some((pid.as_raw(), code)),
        WaitStatus::Signaled(pid, sig, _) => Some((pid.as_raw(), 128 + sig as i32)),
        _ => None,
    }
}

impl Reaper {
    /// The process's reaper, starting its thread on first use. There is only ever one
    /// per process: two threads calling `waitpid(-1)` would steal each other's children.
    pub fn start() -> io::Result<Self> {
        static PROCESS_REAPER: Mutex<Option<Reaper>> = Mutex::new(None);
        let mut slot = PROCESS_REAPER.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = slot.as_ref() {
            return Ok(r.clone());
        }
        let r = Self::spawn_thread()?;
        *slot = Some(r.clone());
        Ok(r)
    }

    fn spawn_thread() -> io::Result<Self> {
        let shared = Arc::new((Mutex::new(Table::default()), Condvar::new()));
        let s = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || loop {
                match waitpid(Pid::from_raw(-1), None) {
                    Ok(status) => {
                        if let Some((pid, code)) = code_of(status) {
                            let (lock, cv) = &*s;
                            let mut t = lock.lock().unwrap_or_else(|p| p.into_inner());
                            if t.watched.remove(&pid) {
                                t.exited.insert(pid, code);
                                cv.notify_all();
                            }
                        }
                    }
                    Err(Errno::ECHILD) => std::thread::sleep(Duration::from_millis(50)),
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            })?;
        Ok(Self { shared })
    }

    /// Spawns `cmd` and registers the child before the reaper can see its exit.
    // The reaper thread collects the exit status; `Child::wait` must never be called.
    #[allow(clippy::zombie_processes)]
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<Spawned> {
        let (lock, _) = &*self.shared;
        let mut t = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut child = cmd.spawn()?;
        t.watched.insert(child.id() as i32);
        Ok(Spawned {
            pid: child.id(),
            stdin: child.stdin.take(),
            stdout: child.stdout.take(),
            stderr: child.stderr.take(),
        })
    }

    /// The exit code of `pid` if it has exited (consumes it).
    pub fn try_status(&self, pid: u32) -> Option<i32> {
        let (lock, _) = &*self.shared;
        let mut t = lock.lock().unwrap_or_else(|p| p.into_inner());
        t.exited.remove(&(pid as i32))
    }

    /// Waits up to `timeout` for `pid` to exit; returns its exit code.
    pub fn wait(&self, pid: u32, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.shared;
        let mut t = lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(code) = t.exited.remove(&(pid as i32)) {
                return Some(code);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            t = cv
                .wait_timeout(t, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
