//! A VMM process (tenantvm-vmm or QEMU) whose serial console the scenario programs read:
//! every byte kept in memory and copied to a log file, waits with deadlines, and a kill on
//! drop.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Serial output so far, and whether it ended.
#[derive(Default)]
struct Shared {
    bytes: Vec<u8>,
    closed: bool,
}

/// A running VM with its serial console on stdout.
pub struct SerialVm {
    child: Child,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    started: Instant,
}

impl SerialVm {
    /// Starts `cmd` (its stdout is the guest's serial console); the console is also appended
    /// to `log`, and the process's stderr goes to `log` with a `.stderr` suffix.
    pub fn spawn(mut cmd: Command, log: &Path) -> std::io::Result<Self> {
        let mut log_file = std::fs::File::create(log)?;
        let stderr = std::fs::File::create(log.with_extension("stderr"))?;
        let started = Instant::now();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()?;
        let mut stdout = child.stdout.take().expect("stdout is piped");
        let shared: Arc<(Mutex<Shared>, Condvar)> = Arc::default();
        let for_reader = shared.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            loop {
                let n = stdout.read(&mut buf).unwrap_or(0);
                let (lock, cond) = &*for_reader;
                let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
                if n == 0 {
                    s.closed = true;
                    cond.notify_all();
                    return;
                }
                s.bytes.extend_from_slice(&buf[..n]);
                let _ = log_file.write_all(&buf[..n]);
                cond.notify_all();
            }
        });
        Ok(SerialVm {
            child,
            shared,
            started,
        })
    }

    /// Seconds since the process started.
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// The serial output so far, as text.
    pub fn serial(&self) -> String {
        let s = self.shared.0.lock().unwrap_or_else(|e| e.into_inner());
        String::from_utf8_lossy(&s.bytes).into_owned()
    }

    /// The last `n` lines of the serial output.
    pub fn serial_tail(&self, n: usize) -> String {
        let text = self.serial();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Waits until the serial output contains `needle`; returns the seconds since start, or
    /// an error with the serial tail when the deadline passes or the console closes first.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> Result<f64, String> {
        let deadline = Instant::now() + timeout;
        let (lock, cond) = &*self.shared;
        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if String::from_utf8_lossy(&s.bytes).contains(needle) {
                return Ok(self.elapsed());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if s.closed || left.is_zero() {
                let why = if s.closed {
                    "the VM ended"
                } else {
                    "timed out"
                };
                drop(s);
                return Err(format!(
                    "{needle:?} did not appear on the serial console ({why} after {:.1} s); last lines:\n{}",
                    self.elapsed(),
                    self.serial_tail(30)
                ));
            }
            s = cond
                .wait_timeout(s, left.min(Duration::from_millis(500)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits for the process to exit; `None` when `timeout` passes first.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                // Let the reader drain what the guest printed last.
                let (lock, cond) = &*self.shared;
                let s = lock.lock().unwrap_or_else(|e| e.into_inner());
                let _ = cond.wait_timeout_while(s, Duration::from_secs(2), |s| !s.closed);
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for SerialVm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
