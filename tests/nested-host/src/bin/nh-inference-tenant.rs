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

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tenantvm_nested_host::scenario::{env_path, note, Daemon};

/// Deadline of one CLI command that waits for the guest (create, start, stop, destroy).
const LIFECYCLE_TIMEOUT_S: u64 = 600;
/// Deadline of one HTTPS request (a completion under nested emulation).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// The marker word only the pushed model's corpus holds.
const MARKER: &str = "quokkazanzibarmarker";

struct Cli {
    bin: PathBuf,
    socket: PathBuf,
}

impl Cli {
    fn run(&self, token: &Path, args: &[&str]) -> Output {
        Command::new(&self.bin)
            .arg("--socket")
            .arg(&self.socket)
            .arg("--token-file")
            .arg(token)
            .args(args)
            .env_remove("TENANTVM_TOKEN")
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| Output {
                status: std::os::unix::process::ExitStatusExt::from_raw(127 << 8),
                stdout: Vec::new(),
                stderr: format!("cannot run {}: {e}", self.bin.display()).into_bytes(),
            })
    }

    /// Runs the command; an error with its output when it fails.
    fn ok(&self, token: &Path, args: &[&str], d: &Daemon) -> Result<Output, String> {
        let t = Instant::now();
        let o = self.run(token, args);
        if !o.status.success() {
            return Err(format!(
                "tenantvm {}: {}: {}{}\ndaemon log:\n{}",
                args.join(" "),
                o.status,
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr),
                d.log_tail()
            ));
        }
        println!(
            "ok: tenantvm {} ({:.1} s)",
            args.iter().take(2).copied().collect::<Vec<_>>().join(" "),
            t.elapsed().as_secs_f64()
        );
        Ok(o)
    }
}

/// A TLS client for the front door that trusts the throwaway certificate only.
struct Door {
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    key: String,
}

/// One answer: the status, the headers' content type and the decoded body.
struct Answer {
    status: u16,
    body: Vec<u8>,
}

impl Door {
    fn request(&self, method: &str, path: &str, body: Option<&str>) -> Result<Answer, String> {
        let tcp = TcpStream::connect(self.addr).map_err(|e| format!("connect: {e}"))?;
        tcp.set_read_timeout(Some(REQUEST_TIMEOUT))
            .map_err(|e| e.to_string())?;
        let name = "localhost".try_into().map_err(|_| "server name")?;
        let conn = rustls::ClientConnection::new(self.config.clone(), name)
            .map_err(|e| format!("TLS: {e}"))?;
        let mut s = rustls::StreamOwned::new(conn, tcp);
        let body = body.unwrap_or("");
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Authorization: Bearer {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            self.key,
            body.len()
        )
        .map_err(|e| format!("send: {e}"))?;
        s.flush().map_err(|e| format!("send: {e}"))?;
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line).map_err(|e| format!("read: {e}"))?;
        let status = line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("not an HTTP answer: {line:?}"))?;
        let (mut len, mut chunked) = (None, false);
        loop {
            let mut h = String::new();
            r.read_line(&mut h).map_err(|e| format!("read: {e}"))?;
            if h.trim().is_empty() {
                break;
            }
            if let Some((n, v)) = h.split_once(':') {
                if n.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().ok();
                } else if n.eq_ignore_ascii_case("transfer-encoding")
                    && v.trim().eq_ignore_ascii_case("chunked")
                {
                    chunked = true;
                }
            }
        }
        let mut out = Vec::new();
        if chunked {
            loop {
                let mut size = String::new();
                r.read_line(&mut size).map_err(|e| format!("read: {e}"))?;
                let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                    .map_err(|_| format!("bad chunk size {size:?}"))?;
                let mut chunk = vec![0u8; n + 2];
                r.read_exact(&mut chunk)
                    .map_err(|e| format!("read chunk: {e}"))?;
                if n == 0 {
                    break;
                }
                out.extend_from_slice(&chunk[..n]);
            }
        } else if let Some(n) = len {
            out.resize(n, 0);
            r.read_exact(&mut out).map_err(|e| format!("read: {e}"))?;
        } else {
            let _ = r.read_to_end(&mut out);
        }
        Ok(Answer { status, body: out })
    }

    fn json(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<serde_json::Value, String> {
        let a = self.request(method, path, body)?;
        let v: serde_json::Value = serde_json::from_slice(&a.body).map_err(|e| {
            format!(
                "{path}: {} with a body that is not JSON ({e}): {}",
                a.status,
                String::from_utf8_lossy(&a.body)
            )
        })?;
        if a.status != 200 {
            return Err(format!("{method} {path} answered {}: {v}", a.status));
        }
        Ok(v)
    }

    /// A greedy completion of `prompt` by `model`, not streamed.
    fn complete(&self, model: &str, prompt: &str) -> Result<String, String> {
        let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 8,
            "temperature": 0});
        let v = self.json("POST", "/v1/completions", Some(&body.to_string()))?;
        v["choices"][0]["text"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("no text in {v}"))
    }

    /// The same, streamed: the text of the events, which must end in `data: [DONE]`.
    fn stream(&self, model: &str, prompt: &str) -> Result<String, String> {
        let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 8,
            "temperature": 0, "stream": true});
        let a = self.request("POST", "/v1/completions", Some(&body.to_string()))?;
        let text = String::from_utf8_lossy(&a.body).to_string();
        if a.status != 200 {
            return Err(format!("streaming answered {}: {text}", a.status));
        }
        let mut out = String::new();
        let mut done = false;
        for line in text.lines() {
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            if done {
                return Err(format!("an event after [DONE]: {text}"));
            }
            let v: serde_json::Value =
                serde_json::from_str(data).map_err(|e| format!("event {data:?}: {e}"))?;
            out.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        }
        if !done {
            return Err(format!("the stream did not end in data: [DONE]: {text}"));
        }
        Ok(out)
    }
}

/// Whether `needle` occurs in `file`, reading only its data extents (SEEK_DATA/SEEK_HOLE:
/// the tenant's image is a sparse GiB) in overlapping 8 MiB windows.
fn file_contains(file: &Path, needle: &[u8]) -> Result<bool, String> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let size = f.metadata().map_err(|e| e.to_string())?.len() as i64;
    let fd = f.as_raw_fd();
    let window = 8usize << 20;
    let mut buf = vec![0u8; window + needle.len()];
    let mut pos: i64 = 0;
    while pos < size {
        // SAFETY: lseek on an fd we own; no memory is touched.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: no data past pos
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 { size } else { hole };
        let mut at = data;
        while at < end {
            let want = ((end - at) as usize).min(window) + needle.len();
            let n = f
                .read_at(&mut buf[..want], at as u64)
                .map_err(|e| e.to_string())?;
            if n == 0 {
                break;
            }
            // SAFETY: both pointers are valid for the lengths given; memmem only reads them.
            let found = unsafe {
                libc::memmem(buf.as_ptr().cast(), n, needle.as_ptr().cast(), needle.len())
            };
            if !found.is_null() {
                return Ok(true);
            }
            at += window as i64;
        }
        pos = end;
    }
    Ok(false)
}

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

fn wait_running(cli: &Cli, token: &Path, name: &str, d: &Daemon) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(LIFECYCLE_TIMEOUT_S);
    loop {
        let o = cli.run(token, &["status", name, "--json"]);
        if o.status.success() {
            let v: serde_json::Value =
                serde_json::from_slice(&o.stdout).map_err(|e| e.to_string())?;
            match v["state"].as_str() {
                Some("running") => return Ok(()),
                Some("failed") => {
                    return Err(format!("{name} failed: {v}\n{}", d.log_tail()));
                }
                _ => {}
            }
        }
        if Instant::now() > deadline {
            return Err(format!("{name} not running in time:\n{}", d.log_tail()));
        }
        std::thread::sleep(Duration::from_millis(500));
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

    // The image directory: the guest image set installed as "linux".
    let img_dir = work.join("img").join("linux");
    std::fs::create_dir_all(&img_dir).map_err(|e| e.to_string())?;
    for f in std::fs::read_dir(&image).map_err(|e| format!("{}: {e}", image.display()))? {
        let f = f.map_err(|e| e.to_string())?;
        if f.file_type().map_err(|e| e.to_string())?.is_file() {
            std::fs::copy(f.path(), img_dir.join(f.file_name()))
                .map_err(|e| format!("{}: {e}", f.path().display()))?;
        }
    }

    // A throwaway certificate for the front door.
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()])
        .map_err(|e| format!("certificate: {e}"))?;
    let (cert_pem, key_pem) = (work.join("cert.pem"), work.join("key.pem"));
    std::fs::write(&cert_pem, cert.cert.pem()).map_err(|e| e.to_string())?;
    std::fs::write(&key_pem, cert.key_pair.serialize_pem()).map_err(|e| e.to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();

    let state = work.join("state");
    let socket = work.join("tenantvmd.sock");
    let log = work.join("daemon.log");
    let log_file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
    let child = Command::new(bin.join("tenantvmd"))
        .arg("--state-dir")
        .arg(&state)
        .arg("--socket")
        .arg(&socket)
        .args(backend.daemon_args())
        .arg("--image-dir")
        .arg(work.join("img"))
        .arg("--vmm-binary")
        .arg(bin.join("tenantvm-vmm"))
        .args(["--boot-timeout-s", "300", "--agent-timeout-s", "600"])
        // Nested KVM under TCG on a loaded host: a VMM took over 10 s to answer.
        .args(["--launch-timeout-s", "60"])
        .args(["--stop-grace-s", "60", "--host-reserved-memory-mib", "256"])
        .args(["--vcpu-overcommit", "8"])
        .arg("--listen")
        .arg(addr.to_string())
        .arg("--tls-cert")
        .arg(&cert_pem)
        .arg("--tls-key")
        .arg(&key_pem)
        .env("TENANTVMD_KEK_FILE", work.join("host-kek"))
        .env("TENANTVMD_KEYSLOT_COST", "test")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
        .stderr(log_file)
        .spawn()
        .map_err(|e| format!("starting tenantvmd: {e}"))?;
    let mut d = Daemon { child, log };
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        if let Ok(Some(st)) = d.child.try_wait() {
            return Err(format!(
                "tenantvmd exited at start ({st}):\n{}",
                d.log_tail()
            ));
        }
        if Instant::now() > deadline {
            return Err(format!("tenantvmd did not start:\n{}", d.log_tail()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "ok: tenantvmd up at {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let cli = Cli {
        bin: bin.join("tenantvm"),
        socket: socket.clone(),
    };
    let admin = state.join("admin.token");

    // Create.
    let name = "nh-infer";
    let spec = work.join("tenant.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"{name}\"\nvcpus = 1\nmemory_mib = 512\ndisk_gib = 1\n[image]\nname = \"linux\"\n"
        ),
    )
    .map_err(|e| e.to_string())?;
    let token = work.join("tenant.token");
    let t = Instant::now();
    let timeout = LIFECYCLE_TIMEOUT_S.to_string();
    cli.ok(
        &admin,
        &[
            "create",
            spec.to_str().unwrap_or_default(),
            "--token-out",
            token.to_str().unwrap_or_default(),
            "--timeout-s",
            &timeout,
        ],
        &d,
    )?;
    wait_running(&cli, &token, name, &d)?;
    note(&format!(
        "inference tenant on {}: create to running {:.1} s",
        backend.label(),
        t.elapsed().as_secs_f64()
    ));
    backend.check_channel(&cli, &token, name, &d)?;

    // A key, and the front door over TLS.
    let o = cli.ok(&token, &["key", "create", name], &d)?;
    let key = String::from_utf8_lossy(&o.stdout).trim().to_string();
    if !key.starts_with("tvk-") {
        return Err(format!("key create printed {key:?}"));
    }
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(cert.cert.der().clone())
        .map_err(|e| e.to_string())?;
    let config = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let door = Door { addr, config, key };
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
        &d,
    )?;
    let listed = cli.ok(&token, &["model", "list", name, "--json"], &d)?;
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
    cli.ok(&admin, &["stop", name, "--timeout-s", &timeout], &d)?;
    note(&format!("stop: {:.1} s", t.elapsed().as_secs_f64()));
    if file_contains(&disk, MARKER.as_bytes())? {
        return Err("after stop, the pushed model's marker is in the host image".into());
    }
    let t = Instant::now();
    cli.ok(&admin, &["start", name, "--timeout-s", &timeout], &d)?;
    wait_running(&cli, &token, name, &d)?;
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
    let t = Instant::now();
    cli.ok(&admin, &["destroy", name, "--timeout-s", &timeout], &d)?;
    note(&format!("destroy: {:.1} s", t.elapsed().as_secs_f64()));
    if state.join("tenants").join(name).exists() {
        return Err("the tenant's directory is still there after destroy".into());
    }
    let o = cli.ok(&admin, &["receipt", "show", name, "--json"], &d)?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).map_err(|e| e.to_string())?;
    let steps = v["receipts"][0]["receipt"]["steps"]
        .as_array()
        .ok_or_else(|| format!("no receipt steps: {v}"))?;
    for want in ["agent-shutdown", "crypto-shred"] {
        let step = steps
            .iter()
            .find(|s| s["step"] == want)
            .ok_or_else(|| format!("the receipt has no {want}: {v}"))?;
        if step["result"] != "ok" {
            return Err(format!("receipt step {want}: {step}"));
        }
    }
    println!("ok: destroyed; the receipt records agent-shutdown and crypto-shred ok");
    note(&format!(
        "inference tenant lifecycle on {}: {:.1} s",
        backend.label(),
        started.elapsed().as_secs_f64()
    ));
    drop(d);
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
