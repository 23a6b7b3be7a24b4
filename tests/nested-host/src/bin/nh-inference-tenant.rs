//! The inference-tenant scenario's program: the whole lifecycle of an inference tenant on
//! the default backend (tenantvm-vmm, the agent over vsock), through a real tenantvmd and
//! the `tenantvm` CLI, with clients on the TLS front door.
//!
//! ```text
//! nh-inference-tenant
//! ```
//! env: NH_BIN (tenantvmd, tenantvm, tenantvm-vmm, tenantvm-jail), NH_GUEST_IMAGE, NH_WORK;
//! NH_NOTES (optional: figures); NH_BACKEND (optional): `vmm` (the default) or `qemu-kvm`,
//! which runs the same checks on QEMU with the agent over vhost-vsock
//! (`--qemu-agent-transport vhost-vsock`: the daemon refuses to start without
//! /dev/vhost-vsock) and also checks that `tenantvm status` names the tenant's CID. Runs as
//! root with cgroup v2 at /sys/fs/cgroup (the scenario script mounts it).
//!
//! Checks, in order: `tenantvm create` of a guest-image tenant reaches `running`; a key from
//! `tenantvm key create` opens the front door (TLS): `GET /v1/models`, a non-streaming
//! completion (the CI model continues the Gettysburg Address) and the same prompt streamed
//! (server-sent events ending in `data: [DONE]`, the same text); a model trained here on a
//! different corpus, pushed with `tenantvm model push`, is listed by `model list` and served
//! by name with a different completion (its own corpus's words) while the default model's
//! answer is unchanged; the host's disk image never holds the pushed model's marker word in
//! plaintext, while the same scan finds it in a plaintext copy (positive control); `stop`,
//! `start`, and both models answer again as before (the pushed one came back from the
//! encrypted disk); `destroy` leaves a receipt whose agent shutdown and crypto-shred are
//! `ok`; the tenant's directory is gone.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tenantvm_nested_host::cli::Cli;
use tenantvm_nested_host::inference::{
    file_contains, ok_step, wait_running, Tenantvmd, LIFECYCLE_TIMEOUT_S,
};
use tenantvm_nested_host::scenario::{env_path, note, Daemon};
/// The marker word only the pushed model's corpus holds.
const MARKER: &str = "quokkazanzibarmarker";

/// Which backend the daemon runs the tenant on (`NH_BACKEND`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    /// tenantvm-vmm, the agent over its hybrid vsock socket.
    Vmm,
    /// QEMU under KVM, the agent over vhost-vsock (AF_VSOCK to the guest's CID).
    QemuVhostVsock,
}

impl Backend {
    fn from_env() -> Result<Self, String> {
        match std::env::var("NH_BACKEND").as_deref() {
            Err(_) | Ok("vmm") => Ok(Self::Vmm),
            Ok("qemu-kvm") => Ok(Self::QemuVhostVsock),
            Ok(other) => Err(format!("NH_BACKEND={other:?}: use vmm or qemu-kvm")),
        }
    }

    fn daemon_args(self) -> Vec<&'static str> {
        match self {
            Self::Vmm => vec!["--backend", "vmm"],
            Self::QemuVhostVsock => vec![
                "--backend",
                "qemu-kvm",
                "--qemu-agent-transport",
                "vhost-vsock",
            ],
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Vmm => "tenantvm-vmm",
            Self::QemuVhostVsock => "qemu-kvm (vhost-vsock)",
        }
    }

    /// On QEMU: `tenantvm status` names vhost-vsock and a CID >= 3 (the streamed completion
    /// and the model push that follow need a connection per request, which a virtio-serial
    /// channel refuses).
    fn check_channel(self, cli: &Cli, token: &Path, name: &str, d: &Daemon) -> Result<(), String> {
        if self == Self::Vmm {
            return Ok(());
        }
        let o = cli.ok(token, &["status", name, "--json"], d)?;
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).map_err(|e| e.to_string())?;
        let cid = v["vsock_cid"].as_u64().unwrap_or(0);
        let channel = v["agent_channel"].as_str().unwrap_or_default();
        if cid < 3 || channel != format!("vhost-vsock (CID {cid})") {
            return Err(format!("{name} is not on vhost-vsock: {v}"));
        }
        println!("ok: {name} reaches its agent over {channel}");
        Ok(())
    }
}

/// The corpus of the tenant's own model: words the built-in model has never seen.
fn tenant_corpus() -> String {
    let line = format!(
        "the lighthouse keeper counted {MARKER} gulls over the harbour every morning \
         while the ferry waited by the old stone pier for the baker's cart."
    );
    std::iter::repeat_n(line, 4).collect::<Vec<_>>().join("\n")
}

fn run() -> Result<(), String> {
    let bin = env_path("NH_BIN")?;
    let backend = Backend::from_env()?;
    let image = env_path("NH_GUEST_IMAGE")?;
    let work = env_path("NH_WORK")?;
    let started = Instant::now();
    let tvmd = Tenantvmd::start(&bin, &work, &image, "linux", &backend.daemon_args())?;
    println!(
        "ok: tenantvmd up at {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let (cli, d, admin, state) = (&tvmd.cli, &tvmd.daemon, &tvmd.admin, &tvmd.state);
    let timeout = LIFECYCLE_TIMEOUT_S.to_string();

    // Create.
    let name = "nh-infer";
    let created = Instant::now();
    let token = tvmd.create(&work, name, 512, "linux")?;
    note(&format!(
        "inference tenant on {}: create to running {:.1} s",
        backend.label(),
        created.elapsed().as_secs_f64()
    ));
    backend.check_channel(cli, &token, name, d)?;

    // A key, and the front door over TLS.
    let door = tvmd.door(&tvmd.key(&token, name)?)?;
    let models = door.json("GET", "/v1/models", None)?;
    let default_model = models["data"][0]["id"]
        .as_str()
        .ok_or_else(|| format!("no model in {models}"))?
        .to_string();
    let prompt = "four score and seven years";
    let t = Instant::now();
    let plain = door.complete(&default_model, prompt)?;
    note(&format!(
        "one completion through the front door (TLS, vsock): {:.2} s",
        t.elapsed().as_secs_f64()
    ));
    if !plain.starts_with(" ago our fathers") {
        return Err(format!("unexpected completion {plain:?}"));
    }
    let streamed = door.stream(&default_model, prompt)?;
    if streamed != plain {
        return Err(format!("streamed {streamed:?}, not streamed {plain:?}"));
    }
    println!("ok: front door: {default_model} completes {plain:?}, streamed the same");

    // The tenant's own weights: trained here on another corpus, pushed, served by name.
    let model = tenantvm_ngram::model::NgramModel::train(&tenant_corpus(), 3)
        .map_err(|e| format!("training: {e}"))?;
    let model_file = work.join("harbour.json");
    std::fs::write(
        &model_file,
        serde_json::to_vec(&model).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    cli.ok(
        &token,
        &[
            "model",
            "push",
            name,
            model_file.to_str().unwrap_or_default(),
            "--name",
            "harbour",
        ],
        d,
    )?;
    let listed = cli.ok(&token, &["model", "list", name, "--json"], d)?;
    if !String::from_utf8_lossy(&listed.stdout).contains("harbour") {
        return Err(format!(
            "model list does not show the pushed model: {}",
            String::from_utf8_lossy(&listed.stdout)
        ));
    }
    // The payload rescans its models directory about once a second.
    let own_prompt = "the lighthouse keeper counted";
    let deadline = Instant::now() + Duration::from_secs(60);
    let own = loop {
        match door.complete("harbour", own_prompt) {
            Ok(text) => break text,
            Err(e) if Instant::now() > deadline => return Err(format!("pushed model: {e}")),
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    };
    if !own.contains(MARKER) {
        return Err(format!(
            "the pushed model's completion {own:?} is not from its corpus"
        ));
    }
    let default_own = door.complete(&default_model, own_prompt)?;
    if default_own == own || default_own.contains(MARKER) {
        return Err(format!(
            "the default model answers {default_own:?} like the pushed one ({own:?})"
        ));
    }
    if door.complete(&default_model, prompt)? != plain {
        return Err("pushing a model changed the default model's answer".into());
    }
    println!("ok: the pushed model completes {own:?}; the default {default_own:?}");

    // The host image: never the pushed model's bytes in plaintext; the same scan finds the
    // marker in a plaintext copy (positive control).
    let disk = state.join("tenants").join(name).join("disk.img");
    if !file_contains(&model_file, MARKER.as_bytes())? {
        return Err("positive control: the scan misses the marker in the plaintext model".into());
    }
    if file_contains(&disk, MARKER.as_bytes())? {
        return Err("the pushed model's marker is in the host image in plaintext".into());
    }
    println!("ok: the host image holds no plaintext of the pushed model (the control does)");

    // Stop and start: both models answer as before.
    let t = Instant::now();
    cli.ok(admin, &["stop", name, "--timeout-s", &timeout], d)?;
    note(&format!("stop: {:.1} s", t.elapsed().as_secs_f64()));
    if file_contains(&disk, MARKER.as_bytes())? {
        return Err("after stop, the pushed model's marker is in the host image".into());
    }
    let t = Instant::now();
    cli.ok(admin, &["start", name, "--timeout-s", &timeout], d)?;
    wait_running(cli, &token, name, d)?;
    note(&format!(
        "start to running: {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    let again = door.complete(&default_model, prompt)?;
    if again != plain {
        return Err(format!("after start {again:?}, before {plain:?}"));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match door.complete("harbour", own_prompt) {
            Ok(text) if text == own => break,
            Ok(text) => return Err(format!("after start the pushed model says {text:?}")),
            Err(e) if Instant::now() > deadline => {
                return Err(format!("after start, the pushed model: {e}"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
    println!("ok: after stop and start both models answer as before");

    // Destroy, and its receipt.
    let destroyed = Instant::now();
    let steps = tvmd.destroy(name)?;
    note(&format!(
        "destroy: {:.1} s",
        destroyed.elapsed().as_secs_f64()
    ));
    for want in ["agent-shutdown", "crypto-shred"] {
        ok_step(&steps, want)?;
    }
    println!("ok: destroyed; the receipt records agent-shutdown and crypto-shred ok");
    note(&format!(
        "inference tenant lifecycle on {}: {:.1} s",
        backend.label(),
        started.elapsed().as_secs_f64()
    ));
    drop(tvmd);
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nh-inference-tenant: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
