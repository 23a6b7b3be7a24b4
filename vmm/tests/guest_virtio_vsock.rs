//! virtio-vsock under real KVM through the hybrid Unix-socket backend: the guest connects
//! to host port 5000 (`<socket>_5000`) and gets its line echoed; then the host connects to
//! guest port 1234 with `CONNECT 1234` and gets its line echoed.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use tenantvm_testkit::{exit, guest, require_kvm, GuestImage, Verdict, VmRun};

const WAIT: Duration = Duration::from_secs(60);

fn read_line(stream: &UnixStream) -> String {
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).unwrap();
    line
}

#[test]
fn echo_both_ways_started_from_either_side() {
    require_kvm!("echo_both_ways_started_from_either_side");
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vsock.sock");
    let listener = UnixListener::bind(format!("{}_5000", sock.display())).unwrap();
    let vm = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("virtio-vsock")
    .args([
        "--vsock".to_string(),
        format!("cid=7,socket={}", sock.display()),
    ])
    .spawn()
    .unwrap();

    // Guest-initiated: accept, read its line, echo it upper-cased.
    let (from_guest, _) = listener.accept().unwrap();
    from_guest.set_read_timeout(Some(WAIT)).unwrap();
    let line = read_line(&from_guest);
    assert_eq!(line, "hello-from-guest\n");
    (&from_guest)
        .write_all(line.to_uppercase().as_bytes())
        .unwrap();

    // Host-initiated: once the guest listens, connect to its port 1234.
    vm.wait_for_serial("TVMTEST virtio-vsock READY", WAIT)
        .unwrap();
    let to_guest = UnixStream::connect(&sock).unwrap();
    to_guest.set_read_timeout(Some(WAIT)).unwrap();
    (&to_guest).write_all(b"CONNECT 1234\n").unwrap();
    let mut reader = BufReader::new(&to_guest);
    let mut ok = String::new();
    reader.read_line(&mut ok).unwrap();
    assert!(ok.starts_with("OK "), "{ok:?}");
    (&to_guest).write_all(b"ping-from-host\n").unwrap();
    let mut echo = String::new();
    reader.read_line(&mut echo).unwrap();
    assert_eq!(echo, "PING-FROM-HOST\n");
    drop(reader);
    drop(to_guest);
    drop(from_guest);

    let out = vm.wait().unwrap();
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
    let report = out.report("virtio-vsock").unwrap();
    assert_eq!(report.verdict, Verdict::Pass, "{}", out.describe());
    assert_eq!(report.field("cid"), Some("7"));
    assert_eq!(report.field("closed"), Some("1"), "{}", out.describe());
}

#[test]
fn guest_connect_with_nobody_listening_fails_cleanly() {
    require_kvm!("guest_connect_with_nobody_listening_fails_cleanly");
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vsock.sock");
    let out = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("virtio-vsock")
    .args([
        "--vsock".to_string(),
        format!("cid=3,socket={}", sock.display()),
    ])
    .run()
    .unwrap();
    // The VMM answers the guest's REQUEST with RST; the guest reports it and powers off.
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
    let report = out.report("virtio-vsock").unwrap();
    assert_eq!(report.verdict, Verdict::Fail, "{}", out.describe());
    assert!(report.detail.contains("op 3"), "{}", out.describe());
}
