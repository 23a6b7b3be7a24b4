//! The host's end of the outer guest's heartbeat port (`org.tenantvm.nested.heartbeat`, a
//! virtio-serial port on a QEMU socket chardev).
//!
//! The guest writes `HB <uptime>` every 5 s (init.sh); the pump appends what it reads to a
//! file, which the watcher follows ([`crate::watch::Heartbeat`]) to tell a frozen guest within
//! seconds. The pump also writes one byte into the port every `nudge` interval: a device
//! interrupt that QEMU's I/O thread delivers to the guest's local APIC. That is the cure for
//! the outer guest's freeze (docs/testing.md, "A frozen outer guest"): QEMU's TCG can lose the
//! CPU's interrupt request for a timer interrupt that sits pending in the APIC (a data race in
//! its SVM VMRUN), and the guest then halts for good; the next interrupt from any device makes
//! QEMU look at the APIC again and delivers the lost one with it.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the pump waits for QEMU to create the socket.
const CONNECT_DEADLINE: Duration = Duration::from_secs(30);

/// A running pump; stops when dropped.
pub struct HeartbeatPump {
    stop: Arc<AtomicBool>,
    nudges: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl HeartbeatPump {
    /// Starts the pump on the QEMU socket at `socket`, appending the guest's lines to `log`
    /// and nudging every `nudge` (none: never).
    pub fn start(socket: PathBuf, log: PathBuf, nudge: Option<Duration>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let nudges = Arc::new(AtomicU64::new(0));
        let (stop2, nudges2) = (stop.clone(), nudges.clone());
        let thread = std::thread::spawn(move || pump(&socket, &log, nudge, &stop2, &nudges2));
        HeartbeatPump {
            stop,
            nudges,
            thread: Some(thread),
        }
    }

    /// How many nudges were written so far.
    pub fn nudges(&self) -> u64 {
        self.nudges.load(Ordering::Relaxed)
    }
}

impl Drop for HeartbeatPump {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn connect(socket: &Path, stop: &AtomicBool) -> Option<UnixStream> {
    let deadline = Instant::now() + CONNECT_DEADLINE;
    while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
        if let Ok(s) = UnixStream::connect(socket) {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    None
}

fn pump(socket: &Path, log: &Path, nudge: Option<Duration>, stop: &AtomicBool, nudges: &AtomicU64) {
    let Some(mut stream) = connect(socket, stop) else {
        eprintln!(
            "nested-host: no heartbeat socket at {}: the guest's heartbeat is not followed",
            socket.display()
        );
        return;
    };
    let Ok(mut out) = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
    else {
        return;
    };
    // Short reads, so that nudges keep their rhythm and a stop is seen quickly.
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let mut next_nudge = nudge.map(|n| Instant::now() + n);
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::Relaxed) {
        match stream.read(&mut buf) {
            Ok(0) => return, // QEMU went away
            Ok(n) => {
                let _ = out.write_all(&buf[..n]);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
        if let (Some(at), Some(every)) = (next_nudge, nudge) {
            if Instant::now() >= at {
                // A full buffer in a guest that does not read (yet) is no reason to stop.
                if stream.write_all(b"\n").is_ok() {
                    nudges.fetch_add(1, Ordering::Relaxed);
                }
                next_nudge = Some(Instant::now() + every);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::os::unix::net::UnixListener;

    #[test]
    fn the_pump_logs_what_the_guest_says_and_nudges_on_its_interval() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("hb.sock");
        let log = dir.path().join("heartbeat");
        let listener = UnixListener::bind(&sock).unwrap();
        let pump =
            HeartbeatPump::start(sock.clone(), log.clone(), Some(Duration::from_millis(100)));
        let (guest, _) = listener.accept().unwrap();
        (&guest).write_all(b"HB 1.00\nHB 6.00\n").unwrap();
        // The guest's side reads the nudges: three of them, one line each.
        guest
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut reader = std::io::BufReader::new(&guest);
        for _ in 0..3 {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            assert_eq!(line, "\n");
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::fs::read_to_string(&log).unwrap_or_default() != "HB 1.00\nHB 6.00\n" {
            assert!(Instant::now() < deadline, "the guest's lines reach the log");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(pump.nudges() >= 3);
        drop(pump);
    }

    #[test]
    fn without_a_nudge_interval_the_pump_only_listens() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("hb.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let pump = HeartbeatPump::start(sock, dir.path().join("heartbeat"), None);
        let (guest, _) = listener.accept().unwrap();
        guest
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let mut byte = [0u8; 1];
        assert!((&guest).read(&mut byte).is_err(), "no nudge arrives");
        assert_eq!(pump.nudges(), 0);
    }
}
