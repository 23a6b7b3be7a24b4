//! `tenantvm ... | head`: when whoever reads the CLI's output goes away, every command exits
//! quietly (no panic, no backtrace, no message) with status 141, as a command killed by
//! SIGPIPE does. A canned daemon on a Unix socket answers the API calls, so these run
//! without root, KVM or a real tenantvmd.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tenantvm::api::types::{LogChunk, LogPosition, LogStream, TenantList, TenantView};
use tenantvm::domain::lifecycle::LifecycleState;
use tenantvm::domain::spec::TenantSpec;

/// The exit status of a command whose output pipe closed (128 + SIGPIPE).
const BROKEN_PIPE: i32 = 141;

fn view(name: &str) -> TenantView {
    TenantView {
        name: name.into(),
        state: LifecycleState::Running,
        op: Some("create".into()),
        error: None,
        steps: Vec::new(),
        spec: TenantSpec::from_toml(&format!("name = \"{name}\"\n[image]\nname = \"idle\"\n"))
            .unwrap(),
        uid: Some(200_000),
        pid: Some(4242),
        gpu: None,
        created_ms: 0,
        updated_ms: 0,
        recovering: false,
        agent_channel: None,
        vsock_cid: None,
        guest: None,
    }
}

/// Serves canned answers on `sock` until the test process ends: the body depends only on
/// the request's path.
fn canned_daemon(sock: &Path) {
    let listener = UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request_line = String::new();
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            let mut content_length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    content_length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; content_length];
            let _ = reader.read_exact(&mut body);
            let target = request_line.split_whitespace().nth(1).unwrap_or("/");
            // The client sends the absolute form (`http://localhost/v1/...`).
            let path = target.strip_prefix("http://localhost").unwrap_or(target);
            let answer = if path.starts_with("/v1/tenants/alice/logs") {
                serde_json::to_vec(&LogChunk {
                    stream: LogStream::Serial,
                    text: "serial line\n".repeat(2000),
                    next: LogPosition::default(),
                    skipped: false,
                    events: Vec::new(),
                })
            } else if path.starts_with("/v1/tenants/alice") {
                serde_json::to_vec(&view("alice"))
            } else if path.starts_with("/v1/tenants") {
                serde_json::to_vec(&TenantList {
                    tenants: (0..500).map(|i| view(&format!("t{i}"))).collect(),
                })
            } else {
                Ok(br#"{"receipts": []}"#.to_vec())
            }
            .unwrap();
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                answer.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&answer);
        }
    });
}

/// A pipe whose read end is already closed: every write to it fails with EPIPE.
fn closed_pipe() -> OwnedFd {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into the array it is given.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: fds[0] and fds[1] were just returned by pipe2 and are owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    write
}

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

#[test]
fn every_command_exits_quietly_when_its_reader_goes_away() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("d.sock");
    canned_daemon(&sock);
    let tenants = fixture("tenants/mixed.toml");
    let commands: Vec<Vec<&str>> = vec![
        vec!["status", "alice", "--json"],
        vec!["status", "alice"],
        vec!["list"],
        vec!["list", "--json"],
        vec!["logs", "alice"],
        vec!["receipt", "show", "--json"],
        vec![
            "plan",
            "-t",
            tenants.to_str().unwrap(),
            "--gpu",
            "h100-80gb",
            "--count",
            "8",
        ],
        vec!["--help"],
    ];
    for args in commands {
        let out = Command::new(env!("CARGO_BIN_EXE_tenantvm"))
            .arg("--socket")
            .arg(&sock)
            .args(["--token", "tvm_test"])
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(closed_pipe()))
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"),
            "tenantvm {args:?} panicked on a closed pipe:\n{stderr}"
        );
        // clap prints --help itself and already swallows broken pipes (status 0).
        let expected = if args == ["--help"] { 0 } else { BROKEN_PIPE };
        assert_eq!(
            out.status.code(),
            Some(expected),
            "tenantvm {args:?}: {stderr}"
        );
        assert!(
            stderr.is_empty(),
            "tenantvm {args:?} was not quiet: {stderr}"
        );
    }
}
