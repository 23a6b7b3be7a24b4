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

    /// What the VMM and its guest are doing, for a VM that did not end in time: each of the
    /// process's threads (name, state, where it sleeps in the kernel) and, where debugfs
    /// has it, how KVM's counters for its VM moved over two seconds (a guest that takes
    /// no exits and no interrupts is halted for good; one whose counters move is alive and
    /// waiting on something else).
    pub fn diagnose(&self) -> String {
        diagnose_process(self.child.id())
    }
}

/// [`SerialVm::diagnose`] for any process.
pub fn diagnose_process(pid: u32) -> String {
    let mut out = format!("process {pid}:\n");
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    if tasks.is_empty() {
        out.push_str("  no threads (it has exited)\n");
    }
    for task in tasks {
        let read = |f: &str| std::fs::read_to_string(task.join(f)).unwrap_or_default();
        let stat = read("stat");
        // The state is the first field after the parenthesised name.
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.split(' ').next())
            .unwrap_or("?")
            .to_string();
        let stack: Vec<String> = read("stack")
            .lines()
            .take(6)
            .map(|l| l.split_whitespace().last().unwrap_or("").to_string())
            .collect();
        out.push_str(&format!(
            "  {} {} state {state} wchan {} stack {}\n",
            task.file_name().and_then(|n| n.to_str()).unwrap_or("?"),
            read("comm").trim(),
            read("wchan").trim(),
            stack.join(" < ")
        ));
    }
    out.push_str(&kvm_counters(pid));
    out
}

/// How the KVM debugfs counters of `pid`'s VMs moved over two seconds (mounting debugfs
/// where nothing is mounted on /sys/kernel/debug), or why they cannot be read.
fn kvm_counters(pid: u32) -> String {
    let root = Path::new("/sys/kernel/debug/kvm");
    // debugfs not mounted yet (the outer guest's init leaves it): mount it.
    let unmounted = std::fs::read_dir("/sys/kernel/debug").is_ok_and(|mut d| d.next().is_none());
    if !root.exists() && unmounted {
        let _ = Command::new("mount")
            .args(["-t", "debugfs", "debugfs", "/sys/kernel/debug"])
            .status();
    }
    let vms: Vec<std::path::PathBuf> = std::fs::read_dir(root)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&format!("{pid}-")))
                })
                .collect()
        })
        .unwrap_or_default();
    if vms.is_empty() {
        return format!(
            "  no KVM debugfs directory for it under {}\n",
            root.display()
        );
    }
    let sample = |vm: &Path| -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = std::fs::read_dir(vm)
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.path().is_file())
                    .filter_map(|e| {
                        let n = std::fs::read_to_string(e.path())
                            .ok()?
                            .trim()
                            .parse()
                            .ok()?;
                        Some((e.file_name().to_string_lossy().into_owned(), n))
                    })
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    let before: Vec<Vec<(String, u64)>> = vms.iter().map(|vm| sample(vm)).collect();
    std::thread::sleep(Duration::from_secs(2));
    let mut out = String::new();
    for (vm, before) in vms.iter().zip(before) {
        let after = sample(vm);
        let moved: Vec<String> = after
            .iter()
            .filter_map(|(name, n)| {
                let was = before.iter().find(|(b, _)| b == name)?.1;
                (*n != was).then(|| format!("{name} +{}", n.saturating_sub(was)))
            })
            .collect();
        let key: Vec<String> = after
            .iter()
            .filter(|(name, _)| {
                matches!(
                    name.as_str(),
                    "exits"
                        | "halt_exits"
                        | "halt_wakeup"
                        | "irq_injections"
                        | "irq_exits"
                        | "io_exits"
                        | "nmi_injections"
                )
            })
            .map(|(name, n)| format!("{name} {n}"))
            .collect();
        out.push_str(&format!(
            "  KVM {}: {}; in 2 s: {}\n",
            vm.display(),
            key.join(", "),
            if moved.is_empty() {
                "nothing moved (the guest is halted and nothing wakes it)".to_string()
            } else {
                moved.join(", ")
            }
        ));
    }
    out
}

impl Drop for SerialVm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diagnose_lists_a_live_process_threads_and_says_when_there_are_none() {
        let me = diagnose_process(std::process::id());
        assert!(
            me.lines()
                .any(|l| l.contains(" state R ") || l.contains(" state S ")),
            "{me}"
        );
        // A pid above the kernel's maximum (4,194,304) never exists.
        let gone = diagnose_process(4_194_305);
        assert!(gone.contains("no threads (it has exited)"), "{gone}");
    }
}
