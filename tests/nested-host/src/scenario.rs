//! What the scenario programs (`nh-*`, run inside the outer guest) share: their inputs
//! from the environment, their figures, and a tenantvmd they start and stop.

use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// The path in environment variable `key`, which scripts/nested-host.sh sets.
pub fn env_path(key: &str) -> Result<PathBuf, String> {
    std::env::var_os(key)
        .map(PathBuf::from)
        .ok_or_else(|| format!("{key} is not set (run through scripts/nested-host.sh)"))
}

/// Prints a figure and appends it to the file in `NH_NOTES` (the harness reports it as a
/// NOTE line).
pub fn note(figure: &str) {
    use std::io::Write;
    println!("{figure}");
    if let Ok(notes) = std::env::var("NH_NOTES") {
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(notes)
            .and_then(|mut f| writeln!(f, "{figure}"));
    }
}

/// A tenantvmd a scenario started, stopped when dropped: SIGTERM, then SIGKILL after 30 s
/// (the scenario's session is killed on its timeout too).
pub struct Daemon {
    /// The daemon's process.
    pub child: Child,
    /// Its log file (stdout and stderr).
    pub log: PathBuf,
}

impl Daemon {
    /// The last 40 lines of the daemon's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Waits until the daemon answers on `socket`, up to 60 s; an error with its log when
    /// it exits first or does not answer in time.
    pub fn wait_ready(&mut self, socket: &Path) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Err(format!(
                    "tenantvmd exited at start ({st}):\n{}",
                    self.log_tail()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!("tenantvmd did not start:\n{}", self.log_tail()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Waits for the daemon to end on its own (a crash hook), up to `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Result<ExitStatus, String> {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Ok(st);
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "tenantvmd did not die at its crash point:\n{}",
                    self.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        // SAFETY: kill(2) on our own child's pid; no memory is touched.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
