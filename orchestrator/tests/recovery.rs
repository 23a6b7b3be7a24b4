//! Recovery after a restart runs behind an API that answers, and a stop signal stops the
//! daemon within seconds even while an operation waits on a silent guest (issue 13,
//! defect 4).
//!
//! The silent guest is a guest image set whose kernel (the stock Debian kernel under
//! `--backend qemu-tcg`) finds no init and hangs: QEMU runs, its agent channel exists, and no
//! agent ever answers, so create waits at await-agent for the whole `--agent-timeout-s`.
//! Skips without root, /dev/kvm, QEMU or the kernel of scripts/setup.sh.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use support::daemon::{self, TestDaemon};
use support::departure::{cli, text};

/// The agent timeout the silent guest would hold the daemon for before the fix.
const AGENT_TIMEOUT_S: &str = "240";
/// A stop signal must end the daemon within this.
const STOP_WITHIN: Duration = Duration::from_secs(10);

/// An empty newc cpio archive: the kernel unpacks it and finds no /init.
fn empty_cpio() -> Vec<u8> {
    let name = b"TRAILER!!!\0";
    let mut out = b"070701".to_vec();
    let fields = [0u32, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, name.len() as u32, 0];
    for f in fields {
        out.extend_from_slice(format!("{f:08X}").as_bytes());
    }
    out.extend_from_slice(name);
    while out.len() % 512 != 0 {
        out.push(0);
    }
    out
}

/// Writes `<image dir>/silent`: a guest image set, complete with its manifest, whose guest
/// never runs the agent.
fn install_silent_set(image_dir: &Path, kernel: &Path) {
    let dir = image_dir.join("silent");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(kernel, dir.join("vmlinuz")).unwrap();
    std::fs::write(dir.join("initramfs.cpio.gz"), empty_cpio()).unwrap();
    // panic=0: the kernel that finds no root waits forever instead of rebooting.
    std::fs::write(dir.join("cmdline"), "console=ttyS0 panic=0\n").unwrap();
    let mut files = serde_json::Map::new();
    for name in ["vmlinuz", "initramfs.cpio.gz", "cmdline"] {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        files.insert(
            name.into(),
            serde_json::json!({"sha256": hex::encode(Sha256::digest(&bytes)), "size": bytes.len()}),
        );
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::json!({"format": 1, "files": files}).to_string(),
    )
    .unwrap();
}

fn status_json(d: &TestDaemon, name: &str) -> serde_json::Value {
    let o = cli(d, None, &["status", name, "--json"]);
    assert!(o.status.success(), "status: {}\n{}", text(&o), d.log());
    serde_json::from_slice(&o.stdout).unwrap()
}

/// SIGTERMs the daemon and returns how long it took to exit.
fn sigterm(d: &mut TestDaemon) -> Duration {
    let pid = d.pid().expect("daemon running");
    let asked = Instant::now();
    // SAFETY: kill(2) on the pid of the daemon this test spawned and has not reaped.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let status = d.wait_for_death(Duration::from_secs(600));
    let took = asked.elapsed();
    eprintln!("SIGTERM: exited {status} after {took:?}");
    took
}

#[test]
fn the_api_answers_during_recovery_and_sigterm_stops_a_daemon_waiting_on_a_silent_guest() {
    const TEST: &str =
        "the_api_answers_during_recovery_and_sigterm_stops_a_daemon_waiting_on_a_silent_guest";
    if daemon::should_skip(TEST) {
        return;
    }
    if let Some(why) = support::departure::qemu_skip() {
        tenantvm_skip::skip!("{why}");
    }
    let kernel = support::departure::stock_kernel().unwrap();
    let mut d = TestDaemon::new().with_args(&[
        "--backend",
        "qemu-tcg",
        "--boot-timeout-s",
        "120",
        "--agent-timeout-s",
        AGENT_TIMEOUT_S,
    ]);
    install_silent_set(&d.dir.path().join("img"), &kernel);
    d.start(None);
    let name = daemon::unique("mute");
    let spec = d.dir.path().join("mute.toml");
    std::fs::write(
        &spec,
        format!("name = \"{name}\"\nmemory_mib = 128\ndisk_gib = 1\n[image]\nname = \"silent\"\n"),
    )
    .unwrap();
    let o = cli(&d, None, &["create", spec.to_str().unwrap(), "--no-wait"]);
    assert!(o.status.success(), "create: {}\n{}", text(&o), d.log());

    // The operation waits for an agent that never answers.
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let t = status_json(&d, &name);
        let waiting = t["steps"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["step"] == "await-agent" && s["status"] == "started");
        if waiting {
            break;
        }
        assert!(
            t["state"] == "provisioning" && Instant::now() < deadline,
            "{t:#}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // 1. SIGTERM stops the daemon in seconds although create is stuck in await-agent.
    let took = sigterm(&mut d);
    assert!(took < STOP_WITHIN, "SIGTERM took {took:?}\n{}", d.log());

    // 2. A restarted daemon serves at once while it resumes that create in the background:
    // the health check says recovery runs, the tenant says it is being recovered, and a
    // command on it is refused with that reason.
    let started = Instant::now();
    d.start_serving(None);
    let up = started.elapsed();
    eprintln!("socket answered {up:?} after the restart");
    assert!(up < Duration::from_secs(30), "API up only after {up:?}");
    let health = d.health().expect("health answers");
    assert_eq!(health["recovering"], true, "{health}");
    let t = status_json(&d, &name);
    assert_eq!(t["recovering"], true, "{t:#}");
    assert_eq!(t["state"], "provisioning", "{t:#}");
    let stop = cli(&d, None, &["stop", &name, "--no-wait"]);
    assert_eq!(stop.status.code(), Some(6), "{}", text(&stop));
    assert!(text(&stop).contains("being recovered"), "{}", text(&stop));
    let list = cli(&d, None, &["list", "--json"]);
    assert!(list.status.success(), "{}", text(&list));

    // 3. And it stops in seconds while recovering, too.
    let took = sigterm(&mut d);
    assert!(took < STOP_WITHIN, "SIGTERM took {took:?}\n{}", d.log());
}
