//! The control socket against a running VM: status, pause, resume, hostile input, and
//! shutdown ending the process with status 6.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{tiny_elf, vmm, write_file, SPIN};

fn connect(path: &std::path::Path) -> UnixStream {
    let start = Instant::now();
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return s,
            Err(e) if start.elapsed() > Duration::from_secs(30) => panic!("no control socket: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn request(stream: &mut UnixStream, reader: &mut impl BufRead, line: &str) -> serde_json::Value {
    stream.write_all(line.as_bytes()).unwrap();
    stream.write_all(b"\n").unwrap();
    let mut response = String::new();
    reader.read_line(&mut response).unwrap();
    serde_json::from_str(&response).unwrap_or_else(|e| panic!("bad response {response:?}: {e}"))
}

#[test]
fn status_pause_resume_and_shutdown_exit_6() {
    if !common::kvm_available("status_pause_resume_and_shutdown_exit_6") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = write_file(dir.path(), "spin.elf", &tiny_elf(SPIN, 0));
    let sock = dir.path().join("api.sock");
    let mut child = vmm()
        .args([
            "--kernel",
            kernel.to_str().unwrap(),
            "--vcpus",
            "2",
            "--memory-mib",
            "64",
        ])
        .args(["--serial", "none", "--api-sock", sock.to_str().unwrap()])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut stream = connect(&sock);
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());

    let status = request(&mut stream, &mut reader, r#"{"command":"status"}"#);
    assert_eq!(status["ok"], true);
    assert_eq!(status["state"], "running");
    assert_eq!(status["vcpus"], 2);
    assert_eq!(status["memory_mib"], 64);
    assert_eq!(status["pid"], child.id());

    let paused = request(&mut stream, &mut reader, r#"{"command":"pause"}"#);
    assert_eq!(paused["state"], "paused");
    let status = request(&mut stream, &mut reader, r#"{"command":"status"}"#);
    assert_eq!(status["state"], "paused");

    let bad = request(&mut stream, &mut reader, "this is not json");
    assert_eq!(bad["ok"], false);
    let unknown = request(&mut stream, &mut reader, r#"{"command":"explode"}"#);
    assert_eq!(unknown["ok"], false);
    let huge = format!(r#"{{"command":"{}"}}"#, "x".repeat(70 * 1024));
    let too_big = request(&mut stream, &mut reader, &huge);
    assert_eq!(too_big["ok"], false);

    let resumed = request(&mut stream, &mut reader, r#"{"command":"resume"}"#);
    assert_eq!(resumed["state"], "running");
    let shutdown = request(&mut stream, &mut reader, r#"{"command":"shutdown"}"#);
    assert_eq!(shutdown["ok"], true);

    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(6));
    assert!(!sock.exists(), "the VMM removes its socket on exit");
}

#[test]
fn pause_is_refused_not_half_done_when_a_vcpu_is_blocked_on_serial_output() {
    if !common::kvm_available("pause_is_refused_not_half_done") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Floods COM1: mov dx, 0x3f8; out dx, al; jmp back to the out.
    let flood = [0x66, 0xba, 0xf8, 0x03, 0xee, 0xeb, 0xfd];
    let kernel = write_file(dir.path(), "flood.elf", &tiny_elf(&flood, 0));
    let sock = dir.path().join("api.sock");
    // stdout is a pipe this test never reads: the vCPU blocks once it is full.
    let mut child = vmm()
        .args(["--kernel", kernel.to_str().unwrap(), "--memory-mib", "32"])
        .args(["--api-sock", sock.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // How many bytes a full pipe holds depends on how the writes were cut (each pipe
    // page takes one write's worth at least); the vCPU's state is what tells.
    wait_for_output(child.stdout.as_ref().unwrap());
    wait_until_vcpu_sleeps(child.id());
    let mut stream = connect(&sock);
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());

    let paused = request(&mut stream, &mut reader, r#"{"command":"pause"}"#);
    assert_eq!(paused["ok"], false, "{paused}");
    assert!(
        paused["error"].as_str().unwrap().contains("left running"),
        "{paused}"
    );
    let status = request(&mut stream, &mut reader, r#"{"command":"status"}"#);
    assert_eq!(status["state"], "running");

    let shutdown = request(&mut stream, &mut reader, r#"{"command":"shutdown"}"#);
    assert_eq!(shutdown["ok"], true);
    assert_eq!(child.wait().unwrap().code(), Some(6));
}

/// Waits until `vcpu0` of VMM `pid` sleeps in the kernel for a while: a guest that only
/// floods its serial port never halts, so a sleeping vCPU is one blocked on its output
/// (serial output is batched, so it blocks once its batch is full, not at once).
fn wait_until_vcpu_sleeps(pid: u32) {
    let start = Instant::now();
    let mut asleep = 0;
    while asleep < 5 {
        let state = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter_map(|t| {
                let dir = t.ok()?.path();
                let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
                (comm.trim() == "vcpu0").then(|| std::fs::read_to_string(dir.join("stat")).ok())?
            })
            .next()
            .and_then(|stat| {
                // The state follows the parenthesised name.
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_string))
            });
        asleep = if state.as_deref() == Some("S") {
            asleep + 1
        } else {
            0
        };
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "vcpu0 never blocked on its output (state {state:?})"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until the guest has written something to the VMM's stdout pipe.
fn wait_for_output(pipe: &impl std::os::fd::AsRawFd) {
    let start = Instant::now();
    loop {
        let mut queued: libc::c_int = 0;
        // SAFETY: FIONREAD stores one int into `queued`, which outlives the call.
        let rc = unsafe { libc::ioctl(pipe.as_raw_fd(), libc::FIONREAD, &mut queued) };
        assert_eq!(rc, 0, "FIONREAD on the stdout pipe");
        if queued > 0 {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the guest never wrote to the pipe"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
