//! The whole path of a Linux guest tenant through the real daemon (issue 7, "End to end in
//! CI"): the guest image set (guest-image/build.sh) under `tenantvmd --backend qemu-tcg`,
//! a tenant with an encrypted disk created through the CLI, its agent unlocking and
//! mounting the disk and starting the CI inference server, a completion through
//! `tenantvm infer` with the tenant's token (the prompt carries a marker the payload
//! records on the encrypted disk), then destroy. On the host: the disk image never holds
//! the marker in plaintext, and after destroy nothing of the tenant remains (directory,
//! cgroup, processes, image, wrapped key) while a signed receipt records the agent's clean
//! shutdown and the crypto-shred.
//!
//! Skips with a printed reason without root, qemu-system-x86_64, `.cache/kernel` or the
//! image tools. Set `TENANTVM_GUEST_IMAGE=DIR` to boot an image set built elsewhere; else
//! it is built into `target/guest-image-test` (reused when already there and intact).
//! On a KVM host: `TENANTVM_E2E_BACKEND=qemu-kvm`, or `TENANTVM_E2E_BACKEND=vmm` for
//! tenantvm-vmm (the agent over vsock) on a host where KVM runs a stock Linux kernel.

mod support;

use std::process::Output;
use std::time::{Duration, Instant};

use tenantvm_agent_protocol::{AgentClient, AgentEndpoint};

use support::daemon::{self, TestDaemon};
use support::departure::{cli, ok, text};
use support::guest_image::{file_contains, have, image_set, image_set_missing, install_image};
use tenantvm::receipt::{DepartureStep, StepResult};

fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (jails set uids, cgroups and namespaces)".into());
    }
    if !have("qemu-system-x86_64") {
        return Some("qemu-system-x86_64 is not installed (run scripts/setup.sh)".into());
    }
    image_set_missing()
}

/// The daemon's log without terminal colour sequences (`ESC [ ... m`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Polls `tenantvm status` until the tenant is `running`; panics if it fails or times out.
fn wait_running(d: &TestDaemon, name: &str, timeout: std::time::Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let o = cli(d, None, &["status", name, "--json"]);
        if o.status.success() {
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            match v["state"].as_str() {
                Some("running") => return,
                Some("failed") => panic!("{name} failed: {v}\n{}", serial_tail(d, name)),
                _ => {}
            }
        }
        assert!(
            Instant::now() < deadline,
            "{name} not running in time:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn serial_tail(d: &TestDaemon, name: &str) -> String {
    let o = cli(d, None, &["logs", name, "--stream", "serial"]);
    text(&o)
}

fn must(o: Output, what: &str, d: &TestDaemon, name: &str) -> Output {
    if !o.status.success() {
        eprintln!("--- serial console ---\n{}", serial_tail(d, name));
    }
    ok(o, what, d)
}

#[test]
fn linux_guest_tenant_serves_inference_keeps_its_disk_encrypted_and_leaves_nothing() {
    if let Some(why) = skip_reason() {
        tenantvm_skip::skip!("{why}");
    }
    if daemon::skip_without_crash_hook(
        "linux_guest_tenant_serves_inference_keeps_its_disk_encrypted_and_leaves_nothing",
    ) {
        return;
    }
    let set = image_set();
    let backend = std::env::var("TENANTVM_E2E_BACKEND").unwrap_or_else(|_| "qemu-tcg".into());
    let mut d = TestDaemon::new().with_args(&[
        "--backend",
        &backend,
        "--boot-timeout-s",
        "120",
        "--agent-timeout-s",
        "600",
        "--stop-grace-s",
        "30",
    ]);
    install_image(&set, &d.dir.path().join("img"), "linux");
    // The daemon dies right after the key was delivered and the disk mounted; the next
    // daemon adopts the VM and resumes create at start-payload.
    d.start(Some("create:unlock-disk:after"));

    let name = daemon::unique("lnx");
    let spec = d.dir.path().join("linux.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"{name}\"\nvcpus = 1\nmemory_mib = 512\ndisk_gib = 1\n[image]\nname = \"linux\"\n"
        ),
    )
    .unwrap();
    let token = d.dir.path().join("linux.token");
    let started = Instant::now();
    // The answer (202, with the token) comes before the steps run; the wait then fails
    // when the daemon dies.
    let created = cli(
        &d,
        None,
        &[
            "create",
            spec.to_str().unwrap(),
            "--token-out",
            token.to_str().unwrap(),
            "--timeout-s",
            "900",
        ],
    );
    eprintln!("create with the crash hook armed: {:?}", created.status);
    d.wait_for_death(Duration::from_secs(900));
    assert!(
        token.is_file(),
        "create answered with the token before the crash"
    );
    d.start(None);
    wait_running(&d, &name, Duration::from_secs(900));
    eprintln!(
        "create (crashed after unlock-disk, resumed) to payload ready ({backend}): {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let status = must(
        cli(&d, Some(&token), &["status", &name, "--json"]),
        "status",
        &d,
        &name,
    );
    let view: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(view["state"], "running", "{view}");
    for step in [
        "await-agent",
        "unlock-disk",
        "start-payload",
        "await-payload",
    ] {
        assert!(
            view.to_string().contains(step),
            "create must record {step}: {view}"
        );
    }

    // A real completion, through the API with the tenant's own token. The prompt starts
    // with a marker that the payload appends to /data/completions.jsonl (the encrypted disk).
    let marker = format!(
        "TVMMARK{:x}{:x}",
        std::process::id(),
        started.elapsed().as_nanos()
    );
    let prompt = format!("{marker} four score and seven years");
    let t = Instant::now();
    let out = must(
        cli(
            &d,
            Some(&token),
            &["infer", &name, &prompt, "--max-tokens", "8"],
        ),
        "infer",
        &d,
        &name,
    );
    eprintln!(
        "one completion through tenantvmd: {:.2} s",
        t.elapsed().as_secs_f64()
    );
    let completion = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        completion.contains("ago our fathers"),
        "the n-gram model continues the Gettysburg address: {completion:?}"
    );
    // The whole answer is the server's JSON: a real model output, not an echo.
    let json = must(
        cli(
            &d,
            Some(&token),
            &["infer", &name, "all men are", "--max-tokens", "4", "--json"],
        ),
        "infer --json",
        &d,
        &name,
    );
    let answer: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert!(answer["choices"][0]["text"].is_string(), "{answer}");
    // Another tenant's name is not found for this token; a missing body field is refused.
    let other = cli(&d, Some(&token), &["infer", "nobody-here", "x"]);
    assert_eq!(other.status.code(), Some(5), "{}", text(&other));

    // The image on the host while the VM runs: ciphertext only.
    let img = d.state_dir().join("tenants").join(&name).join("disk.img");
    assert!(
        !file_contains(&img, &marker),
        "the marker reached the host disk image in plaintext"
    );
    assert!(!file_contains(&img, "four score and seven"));
    // Positive control: grep does find text that is in the file (the LUKS2 header's JSON).
    assert!(file_contains(&img, "aes-xts-plain64"));

    // Stop (agent shutdown first) and start again: boot, key delivery, the existing file
    // system mounted without formatting, the payload back, and the recorded completions
    // still there in the guest (the payload counts them at start).
    must(
        cli(&d, None, &["stop", &name, "--timeout-s", "300"]),
        "stop",
        &d,
        &name,
    );
    assert!(
        !file_contains(&img, &marker),
        "the marker reached the host disk image in plaintext"
    );
    // A stopped tenant serves nothing: 409, CLI exit 6, with what to do.
    let stopped = cli(&d, Some(&token), &["infer", &name, &prompt]);
    assert_eq!(stopped.status.code(), Some(6), "{}", text(&stopped));
    assert!(
        text(&stopped).contains("tenantvm start"),
        "{}",
        text(&stopped)
    );
    let t = Instant::now();
    must(
        cli(&d, None, &["start", &name, "--timeout-s", "900"]),
        "start",
        &d,
        &name,
    );
    eprintln!(
        "start (boot to payload ready through tenantvmd, {backend}): {:.1} s",
        t.elapsed().as_secs_f64()
    );
    // The guest's own account, read over the agent channel (the daemon holds no connection
    // between requests): the two completions made before the stop were on the disk.
    let run = d.state_dir().join("tenants").join(&name).join("run");
    let endpoint = if backend == "vmm" {
        AgentEndpoint::vsock(run.join("vsock.sock"))
    } else {
        AgentEndpoint::Serial(run.join("agent.sock"))
    };
    let mut agent =
        AgentClient::connect(&endpoint, Duration::from_secs(10)).expect("connect to the agent");
    let (lines, _) = agent
        .logs(0, 1000, Duration::ZERO, Duration::from_secs(30))
        .expect("agent logs");
    drop(agent);
    assert!(
        lines
            .iter()
            .any(|l| l.line.contains("history: 2 completions on record")),
        "the payload found the completions written before the stop: {lines:?}"
    );
    let log = strip_ansi(&d.log());
    assert!(
        log.contains("formatted=true") && log.contains("formatted=false"),
        "formatted on first use only:\n{log}"
    );
    let again = must(
        cli(
            &d,
            Some(&token),
            &["infer", &name, &prompt, "--max-tokens", "8"],
        ),
        "infer after restart",
        &d,
        &name,
    );
    assert_eq!(
        String::from_utf8_lossy(&again.stdout),
        completion,
        "deterministic"
    );

    let uid = d
        .store()
        .resources(None)
        .unwrap()
        .into_iter()
        .find(|r| r.kind == tenantvm::store::ResourceKind::Uid)
        .and_then(|r| r.key.parse::<u32>().ok())
        .expect("the tenant holds a uid");

    let t = Instant::now();
    must(
        cli(&d, None, &["destroy", &name, "--timeout-s", "600"]),
        "destroy",
        &d,
        &name,
    );
    eprintln!(
        "destroy (agent shutdown + departure): {:.1} s",
        t.elapsed().as_secs_f64()
    );

    // Nothing of the tenant remains.
    assert!(
        !d.state_dir().join("tenants").join(&name).exists(),
        "tenant dir"
    );
    assert!(!img.exists(), "disk image");
    assert!(
        !d.state_dir()
            .join("keys")
            .join(format!("{name}.wrapped"))
            .exists(),
        "wrapped key"
    );
    assert!(!daemon::cgroup_exists(&name), "cgroup");
    assert!(
        daemon::processes_in_cgroup_of(&name).is_empty(),
        "processes in its cgroup"
    );
    assert!(
        daemon::processes_of_uid(uid).is_empty(),
        "processes of its uid"
    );

    // A receipt: the agent shut the guest down cleanly, the disk was crypto-shredded.
    let receipts = support::departure::receipts_of(&d, &name);
    assert_eq!(receipts.len(), 1, "one receipt");
    let steps = &receipts[0].receipt.steps;
    // The inference route was closed first (the daemon's admission gate refuses from then).
    let route = steps
        .iter()
        .find(|s| s.step == DepartureStep::GatewayRouteOff)
        .expect("gateway-route-off recorded");
    assert_eq!(route.result, StepResult::Ok, "{route:?}");
    let shutdown = steps
        .iter()
        .find(|s| s.step == DepartureStep::AgentShutdown)
        .expect("agent-shutdown recorded");
    assert_eq!(shutdown.result, StepResult::Ok, "{shutdown:?}");
    assert_eq!(
        shutdown.evidence.get("disk_closed").map(String::as_str),
        Some("true"),
        "{shutdown:?}"
    );
    assert_eq!(
        shutdown.evidence.get("unmounted").map(String::as_str),
        Some("true"),
        "{shutdown:?}"
    );
    let shred = steps
        .iter()
        .find(|s| s.step == DepartureStep::CryptoShred)
        .expect("crypto-shred recorded");
    assert_eq!(shred.result, StepResult::Ok, "{shred:?}");
    let shown = must(
        cli(&d, None, &["receipt", "show", &name]),
        "receipt show",
        &d,
        &name,
    );
    assert!(text(&shown).contains(&name));
    ok(support::departure::verify(&d), "receipt verify", &d);
    d.stop();
}
