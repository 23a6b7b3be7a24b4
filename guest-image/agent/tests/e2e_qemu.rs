//! End to end under QEMU software emulation: boot the image set, deliver the key of a
//! LUKS2 disk formatted on the host, mount (mkfs on first use), start the CI payload,
//! get a real completion, shut down cleanly, and check that the marker the guest wrote
//! never reached the host image in plaintext. A second boot proves the write persisted
//! (encrypted) on the disk.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{boot_tcg, have, image_build_blocker, image_set};
use tenantvm_agent_protocol::{AgentClient, AgentEndpoint, DiskKey, DiskState, HttpRequest};

const READY_TIMEOUT: Duration = Duration::from_secs(300);
const STEP_TIMEOUT: Duration = Duration::from_secs(300);

fn random_bytes(n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .expect("reading /dev/urandom");
    buf
}

fn luks_format(disk: &Path, key_file: &Path) {
    let f = std::fs::File::create(disk).unwrap();
    f.set_len(64 << 20).unwrap();
    // PBKDF2 at its minimum: the key is 256 random bits, so key stretching adds nothing,
    // and argon2's memory cost would be slow under emulation.
    let status = Command::new("cryptsetup")
        .args([
            "luksFormat",
            "--type",
            "luks2",
            "--batch-mode",
            "--pbkdf",
            "pbkdf2",
        ])
        .args(["--pbkdf-force-iterations", "1000", "--key-file"])
        .arg(key_file)
        .arg(disk)
        .status()
        .expect("running cryptsetup");
    assert!(status.success(), "cryptsetup luksFormat failed");
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn console_tail(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let start = bytes.len().saturating_sub(4000);
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

#[test]
fn guest_unlocks_serves_inference_and_keeps_data_encrypted() {
    if !have("qemu-system-x86_64") {
        tenantvm_skip::skip!("qemu-system-x86_64 is not installed (run scripts/setup.sh)");
    }
    if let Some(why) = image_build_blocker() {
        tenantvm_skip::skip!("{why}");
    }
    let image = image_set();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.img");
    let key_file = dir.path().join("key");
    let key = random_bytes(32);
    std::fs::write(&key_file, &key).unwrap();
    luks_format(&disk, &key_file);
    let key = DiskKey::new(&key).unwrap();
    let marker = format!("TENANTVM-MARKER-{}", hex::encode(random_bytes(8)));

    // First boot: format, write, shut down.
    let sock = dir.path().join("agent.sock");
    let console = dir.path().join("console.log");
    let started = Instant::now();
    let mut vm = boot_tcg(&image, &disk, &sock, &console);
    let ep = AgentEndpoint::Serial(sock.clone());
    let (mut agent, status) = AgentClient::wait_for_ready(&ep, READY_TIMEOUT)
        .unwrap_or_else(|e| panic!("agent not ready: {e}\n{}", console_tail(&console)));
    eprintln!(
        "boot-to-ready under TCG: {:.2} s (agent uptime {} ms)",
        started.elapsed().as_secs_f64(),
        status.uptime_ms
    );
    assert_eq!(status.channel, "virtio-serial");
    assert_eq!(status.disk, DiskState::Locked);

    // A wrong key is refused and the disk stays locked.
    let wrong = DiskKey::new(&random_bytes(32)).unwrap();
    let err = agent.unlock_disk(&wrong, STEP_TIMEOUT).unwrap_err();
    assert!(err.to_string().contains("BadKey"), "{err}");

    let t = Instant::now();
    agent
        .unlock_disk(&key, STEP_TIMEOUT)
        .unwrap_or_else(|e| panic!("unlock: {e}\n{}", console_tail(&console)));
    eprintln!("unlock took {:.2} s", t.elapsed().as_secs_f64());
    let formatted = agent
        .mount(true, STEP_TIMEOUT)
        .unwrap_or_else(|e| panic!("mount: {e}\n{}", console_tail(&console)));
    assert!(
        formatted,
        "a fresh LUKS2 disk must be formatted on first use"
    );
    agent.start_payload(STEP_TIMEOUT).unwrap();
    agent
        .wait_payload_ready(STEP_TIMEOUT)
        .unwrap_or_else(|e| panic!("payload: {e}\n{}", console_tail(&console)));
    eprintln!(
        "boot-to-payload-ready under TCG: {:.2} s",
        started.elapsed().as_secs_f64()
    );

    let body = serde_json::json!({
        "model": "tenantvm-ngram",
        "prompt": format!("{marker} four score and seven years"),
        "max_tokens": 8,
        "temperature": 0
    });
    let t = Instant::now();
    let resp = agent
        .infer(
            HttpRequest {
                method: "POST".into(),
                path: "/v1/completions".into(),
                headers: vec![("Content-Type".into(), "application/json".into())],
                body: body.to_string(),
            },
            STEP_TIMEOUT,
        )
        .unwrap();
    eprintln!("inference round trip: {:.2} s", t.elapsed().as_secs_f64());
    assert_eq!(resp.status, 200, "{}", resp.body);
    let v: serde_json::Value = serde_json::from_str(&resp.body).unwrap();
    let text = v["choices"][0]["text"].as_str().unwrap();
    // Greedy decoding of the order-3 model continues the Gettysburg Address.
    assert!(
        text.starts_with(" ago our fathers brought forth"),
        "{text:?}"
    );
    assert_eq!(v["usage"]["completion_tokens"], 8);

    let (lines, _) = agent.logs(0, 1000, Duration::ZERO, STEP_TIMEOUT).unwrap();
    assert!(lines
        .iter()
        .any(|l| l.source == "payload-stderr" && l.line.contains("serving")));

    let report = agent.shutdown(STEP_TIMEOUT).unwrap();
    assert!(
        report.payload_stopped && report.unmounted && report.disk_closed,
        "{report:?}"
    );
    assert_eq!(
        vm.wait_exit(Duration::from_secs(120)),
        Some(true),
        "QEMU did not power off"
    );
    drop(vm);

    let bytes = std::fs::read(&disk).unwrap();
    assert!(
        !contains(&bytes, marker.as_bytes()),
        "the marker reached the host disk image in plaintext"
    );
    assert!(!contains(&bytes, b"four score and seven"));

    // Second boot: the same key opens the disk, no format, and the payload finds the
    // completion it recorded: the marker is on the disk, encrypted.
    let sock = dir.path().join("agent2.sock");
    let mut vm = boot_tcg(&image, &disk, &sock, &console);
    let (mut agent, _) =
        AgentClient::wait_for_ready(&AgentEndpoint::Serial(sock), READY_TIMEOUT).unwrap();
    let done = agent.bring_up(&key, STEP_TIMEOUT).unwrap();
    assert!(done.unlocked && done.mounted && done.started, "{done:?}");
    assert!(!done.formatted, "the file system must persist");
    let (lines, _) = agent.logs(0, 1000, Duration::ZERO, STEP_TIMEOUT).unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.line.contains("history: 1 completions on record")),
        "{lines:?}"
    );
    agent.shutdown(STEP_TIMEOUT).unwrap();
    assert_eq!(vm.wait_exit(Duration::from_secs(120)), Some(true));
}
