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
