//! Running tenantvm-vmm on a guest: arguments, a timeout, serial output and exit status.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::report::{parse_report, Report, ReportError};

/// Why a VMM run went wrong (as opposed to what the VM did, which is in [`RunOutcome`]).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The VMM could not be started.
    #[error("Cannot start {vmm}: {source}; build it with `cargo build -p tenantvm-vmm`")]
    Spawn {
        /// The VMM path.
        vmm: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The VM did not end within the timeout; it was killed.
    #[error("The VM did not end within {timeout:?}; killed it. Serial so far:\n{serial}\nstderr:\n{stderr}")]
    Timeout {
        /// The timeout.
        timeout: Duration,
        /// Serial output up to the kill.
        serial: String,
        /// The VMM's standard error.
        stderr: String,
    },
    /// Serial output did not show the text within the timeout.
    #[error("{needle:?} did not appear on the serial console within {timeout:?}. Serial so far:\n{serial}")]
    NotSeen {
        /// The text waited for.
        needle: String,
        /// The timeout.
        timeout: Duration,
        /// Serial output so far.
        serial: String,
    },
    /// Writing to or waiting for the VMM failed.
    #[error("Talking to the VMM process failed: {0}")]
    Io(#[from] std::io::Error),
}

/// A VM to run: the VMM binary, the kernel and the usual flags.
#[derive(Clone, Debug)]
pub struct VmRun {
    vmm: PathBuf,
    kernel: PathBuf,
    cmdline: String,
    memory_mib: u32,
    vcpus: u32,
    extra: Vec<String>,
    stdin: Option<Vec<u8>>,
    timeout: Duration,
}

impl VmRun {
    /// A 1-vCPU, 128 MiB VM of `kernel` under `vmm` (integration tests pass
    /// `env!("CARGO_BIN_EXE_tenantvm-vmm")`), with a 120 s timeout.
    pub fn new(vmm: impl Into<PathBuf>, kernel: impl Into<PathBuf>) -> Self {
        VmRun {
            vmm: vmm.into(),
            kernel: kernel.into(),
            cmdline: String::new(),
            memory_mib: 128,
            vcpus: 1,
            extra: Vec::new(),
            stdin: None,
            timeout: Duration::from_secs(120),
        }
    }

    /// Sets the kernel command line to `tvm.test=<name>`.
    pub fn test(mut self, name: &str) -> Self {
        self.cmdline = format!("tvm.test={name}");
        self
    }

    /// Sets the whole kernel command line.
    pub fn cmdline(mut self, cmdline: &str) -> Self {
        self.cmdline = cmdline.to_string();
        self
    }

    /// Guest RAM in MiB.
    pub fn memory_mib(mut self, mib: u32) -> Self {
        self.memory_mib = mib;
        self
    }

    /// Number of vCPUs.
    pub fn vcpus(mut self, n: u32) -> Self {
        self.vcpus = n;
        self
    }

    /// Adds VMM arguments after the usual ones.
    pub fn args<I: IntoIterator<Item = S>, S: Into<String>>(mut self, args: I) -> Self {
        self.extra.extend(args.into_iter().map(Into::into));
        self
    }

    /// Bytes written to the VMM's stdin (the guest's COM1 input) once it has started.
    pub fn stdin(mut self, bytes: &[u8]) -> Self {
        self.stdin = Some(bytes.to_vec());
        self
    }

    /// How long the VM may run before it is killed.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.vmm);
        cmd.arg("--kernel")
            .arg(&self.kernel)
            .arg("--cmdline")
            .arg(&self.cmdline)
            .arg("--memory-mib")
            .arg(self.memory_mib.to_string())
            .arg("--vcpus")
            .arg(self.vcpus.to_string())
            .arg("--serial")
            .arg("stdout")
            .args(&self.extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Starts the VM and returns a handle to watch and stop it.
    pub fn spawn(&self) -> Result<RunningVm, RunError> {
        let start = Instant::now();
        let mut child = self.command().spawn().map_err(|source| RunError::Spawn {
            vmm: self.vmm.clone(),
            source,
        })?;
        let serial = Arc::new(Captured::default());
        let stderr = Arc::new(Captured::default());
        let readers = vec![
            pump(child.stdout.take(), Arc::clone(&serial)),
            pump(child.stderr.take(), Arc::clone(&stderr)),
        ];
        let mut stdin = child.stdin.take();
        if let (Some(bytes), Some(pipe)) = (&self.stdin, stdin.as_mut()) {
            pipe.write_all(bytes)?;
        }
        Ok(RunningVm {
            child,
            stdin,
            serial,
            stderr,
            readers,
            start,
            timeout: self.timeout,
        })
    }

    /// Runs the VM to its end (or the timeout) and returns what happened.
    pub fn run(&self) -> Result<RunOutcome, RunError> {
        self.spawn()?.wait()
    }
}

#[derive(Default)]
struct Captured {
    text: Mutex<Vec<u8>>,
    grew: Condvar,
}

impl Captured {
    fn snapshot(&self) -> String {
        String::from_utf8_lossy(&self.text.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

fn pump<R: Read + Send + 'static>(source: Option<R>, sink: Arc<Captured>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let Some(mut source) = source else { return };
        let mut buf = [0u8; 4096];
        while let Ok(n) = source.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.text
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(&buf[..n]);
            sink.grew.notify_all();
        }
    })
}

/// A VM that is running.
pub struct RunningVm {
    child: Child,
    stdin: Option<ChildStdin>,
    serial: Arc<Captured>,
    stderr: Arc<Captured>,
    readers: Vec<JoinHandle<()>>,
    start: Instant,
    timeout: Duration,
}

impl RunningVm {
    /// The VMM's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Serial output so far.
    pub fn serial(&self) -> String {
        self.serial.snapshot()
    }

    /// Waits until the serial output contains `needle` (counting from the start).
    pub fn wait_for_serial(&self, needle: &str, timeout: Duration) -> Result<(), RunError> {
        self.wait_for_serial_count(needle, 1, timeout)
    }

    /// Waits until `needle` occurs at least `count` times in the serial output.
    pub fn wait_for_serial_count(
        &self,
        needle: &str,
        count: usize,
        timeout: Duration,
    ) -> Result<(), RunError> {
        let deadline = Instant::now() + timeout;
        let mut text = self.serial.text.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if String::from_utf8_lossy(&text).matches(needle).count() >= count {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                let serial = String::from_utf8_lossy(&text).into_owned();
                return Err(RunError::NotSeen {
                    needle: needle.to_string(),
                    timeout,
                    serial,
                });
            }
            text = self
                .serial
                .grew
                .wait_timeout(text, (deadline - now).min(Duration::from_millis(200)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Writes bytes to the guest's serial input (the VMM's stdin).
    pub fn write_stdin(&mut self, bytes: &[u8]) -> Result<(), RunError> {
        match self.stdin.as_mut() {
            Some(pipe) => Ok(pipe.write_all(bytes)?),
            None => Err(RunError::Io(std::io::Error::other("stdin already closed"))),
        }
    }

    /// Waits for the VMM to end (killing it at the run's timeout) and returns the outcome.
    pub fn wait(mut self) -> Result<RunOutcome, RunError> {
        drop(self.stdin.take());
        let deadline = self.start + self.timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                for r in self.readers.drain(..) {
                    let _ = r.join();
                }
                return Err(RunError::Timeout {
                    timeout: self.timeout,
                    serial: self.serial.snapshot(),
                    stderr: self.stderr.snapshot(),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let elapsed = self.start.elapsed();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        Ok(RunOutcome {
            status: status.code(),
            serial: self.serial.snapshot(),
            stderr: self.stderr.snapshot(),
            elapsed,
        })
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// How a VM run ended.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    /// The VMM's exit status (`None` when a signal ended it).
    pub status: Option<i32>,
    /// Everything the guest wrote to COM1.
    pub serial: String,
    /// The VMM's standard error.
    pub stderr: String,
    /// From spawning to exit.
    pub elapsed: Duration,
}

impl RunOutcome {
    /// The guest's report line for `test`.
    pub fn report(&self, test: &str) -> Result<Report, ReportError> {
        parse_report(&self.serial, test)
    }

    /// A readable account of the run, for assertion messages.
    pub fn describe(&self) -> String {
        format!(
            "exit status {:?} after {:?}\n--- serial ---\n{}\n--- stderr ---\n{}",
            self.status, self.elapsed, self.serial, self.stderr
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Writes an executable shell script standing in for the VMM (tests of the runner only).
    ///
    /// A child shell writes it, not a descriptor of this process: another test thread that
    /// forks while this process holds the script open for writing passes that descriptor to
    /// its child until the child execs, and exec'ing the script meanwhile fails with
    /// ETXTBSY ("Text file busy", seen in CI).
    fn fake_vmm(dir: &Path, body: &str) -> PathBuf {
        let path = dir.join("fake-vmm");
        let mut sh = Command::new("sh")
            .args(["-c", "cat > \"$1\" && chmod 755 \"$1\"", "sh"])
            .arg(&path)
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        sh.stdin
            .take()
            .unwrap()
            .write_all(format!("#!/bin/sh\n{body}\n").as_bytes())
            .unwrap();
        assert!(sh.wait().unwrap().success());
        path
    }

    #[test]
    fn run_captures_serial_stderr_and_status_and_passes_flags() {
        let dir = tempfile::tempdir().unwrap();
        let vmm = fake_vmm(
            dir.path(),
            r#"echo "TVMTEST t PASS args=$*"; echo oops >&2; exit 3"#,
        );
        let out = VmRun::new(vmm, "/k")
            .test("t")
            .vcpus(2)
            .memory_mib(64)
            .run()
            .unwrap();
        assert_eq!(out.status, Some(3));
        assert_eq!(out.stderr.trim(), "oops");
        let report = out.report("t").unwrap();
        assert!(report
            .detail
            .contains("--kernel /k --cmdline tvm.test=t --memory-mib 64 --vcpus 2"));
    }

    #[test]
    fn run_past_the_timeout_is_killed_and_reported() {
        let dir = tempfile::tempdir().unwrap();
        let vmm = fake_vmm(dir.path(), "echo started; exec sleep 30");
        let err = VmRun::new(vmm, "/k")
            .timeout(Duration::from_millis(300))
            .run()
            .unwrap_err();
        match err {
            RunError::Timeout { serial, .. } => assert!(serial.contains("started")),
            other => panic!("expected a timeout, got {other}"),
        }
    }

    #[test]
    fn stdin_reaches_the_process_and_serial_can_be_awaited() {
        let dir = tempfile::tempdir().unwrap();
        let vmm = fake_vmm(dir.path(), "read line; echo \"got $line\"");
        let mut vm = VmRun::new(vmm, "/k").spawn().unwrap();
        vm.write_stdin(b"hello\n").unwrap();
        vm.wait_for_serial("got hello", Duration::from_secs(10))
            .unwrap();
        assert_eq!(vm.wait().unwrap().status, Some(0));
    }

    #[test]
    fn missing_vmm_is_a_spawn_error() {
        let err = VmRun::new("/nonexistent/vmm", "/k").run().unwrap_err();
        assert!(matches!(err, RunError::Spawn { .. }), "{err}");
    }
}
