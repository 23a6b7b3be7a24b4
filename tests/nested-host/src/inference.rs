//! An inference tenant through a real tenantvmd, shared by the scenario programs that serve
//! completions (`nh-inference-tenant`: the CI n-gram payload; `nh-llama-tenant`: Debian's
//! llama-server): the daemon with its TLS front door, the `tenantvm` CLI against it, an
//! HTTPS client for the front door, and a scan of the tenant's disk image for plaintext.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cli::Cli;
use crate::scenario::Daemon;

/// Deadline of one CLI command that waits for the guest (create, start, stop, destroy).
pub const LIFECYCLE_TIMEOUT_S: u64 = 600;
/// Deadline of one HTTPS request (a completion under nested emulation).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// A TLS client for the front door that trusts the throwaway certificate only.
pub struct Door {
    /// Where the front door listens.
    pub addr: SocketAddr,
    /// TLS that trusts the throwaway certificate only.
    pub config: Arc<rustls::ClientConfig>,
    /// The inference key.
    pub key: String,
}

/// One answer: the status and the decoded body.
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// The body, chunked encoding undone.
    pub body: Vec<u8>,
}

impl Door {
    /// One request on a new TLS connection (`Connection: close`), read to its end.
    pub fn request(&self, method: &str, path: &str, body: Option<&str>) -> Result<Answer, String> {
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

    /// A request whose answer must be 200 with a JSON body.
    pub fn json(
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
    pub fn complete(&self, model: &str, prompt: &str) -> Result<String, String> {
        let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 8,
            "temperature": 0});
        let v = self.json("POST", "/v1/completions", Some(&body.to_string()))?;
        v["choices"][0]["text"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("no text in {v}"))
    }

    /// The same, streamed: the text of the events, which must end in `data: [DONE]`.
    pub fn stream(&self, model: &str, prompt: &str) -> Result<String, String> {
        let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 8,
            "temperature": 0, "stream": true});
        let a = self.request("POST", "/v1/completions", Some(&body.to_string()))?;
        if a.status != 200 {
            return Err(format!(
                "streaming answered {}: {}",
                a.status,
                String::from_utf8_lossy(&a.body)
            ));
        }
        Ok(events(&a.body)?
            .iter()
            .filter_map(|v| v["choices"][0]["text"].as_str())
            .collect())
    }
}

/// The events of a server-sent-event stream: the JSON of each `data:` line before
/// `data: [DONE]`, which must end it (nothing may follow it).
pub fn events(body: &[u8]) -> Result<Vec<serde_json::Value>, String> {
    let text = String::from_utf8_lossy(body);
    let mut out = Vec::new();
    let mut done = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if done {
            return Err(format!("an event after [DONE]: {text}"));
        }
        if data == "[DONE]" {
            done = true;
            continue;
        }
        out.push(serde_json::from_str(data).map_err(|e| format!("event {data:?}: {e}"))?);
    }
    if !done {
        return Err(format!("the stream did not end in data: [DONE]: {text}"));
    }
    Ok(out)
}

/// Whether `needle` occurs in `file`, reading only its data extents (SEEK_DATA/SEEK_HOLE:
/// the tenant's image is a sparse GiB) in overlapping 8 MiB windows.
pub fn file_contains(file: &Path, needle: &[u8]) -> Result<bool, String> {
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

/// Waits until `tenantvm status NAME` says running (an error when it says failed, or at
/// the lifecycle deadline).
pub fn wait_running(cli: &Cli, token: &Path, name: &str, d: &Daemon) -> Result<(), String> {
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

/// A started tenantvmd with its front door and what its clients need.
pub struct Tenantvmd {
    /// The daemon (stopped when dropped).
    pub daemon: Daemon,
    /// The CLI against it.
    pub cli: Cli,
    /// Its state directory.
    pub state: PathBuf,
    /// The admin token file.
    pub admin: PathBuf,
    /// Where the front door listens.
    pub addr: SocketAddr,
    /// The front door's throwaway certificate (DER), the only one the clients trust.
    pub cert_der: Vec<u8>,
}

impl Tenantvmd {
    /// Copies the image set in `image` (its plain files) into `work/img/NAME` and starts
    /// tenantvmd with it and `backend_args`, deadlines for nested KVM under TCG, and a TLS
    /// front door on a free loopback port; waits until its socket answers.
    pub fn start(
        bin: &Path,
        work: &Path,
        image: &Path,
        image_name: &str,
        backend_args: &[&str],
    ) -> Result<Self, String> {
        let img_dir = work.join("img").join(image_name);
        std::fs::create_dir_all(&img_dir).map_err(|e| e.to_string())?;
        for f in std::fs::read_dir(image).map_err(|e| format!("{}: {e}", image.display()))? {
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
            .args(backend_args)
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
        let mut daemon = Daemon { child, log };
        daemon.wait_ready(&socket)?;
        Ok(Self {
            daemon,
            cli: Cli {
                bin: bin.join("tenantvm"),
                socket,
            },
            admin: state.join("admin.token"),
            state,
            addr,
            cert_der: cert.cert.der().to_vec(),
        })
    }

    /// A front-door client with the inference key `key`.
    pub fn door(&self, key: &str) -> Result<Door, String> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(self.cert_der.clone().into())
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
        Ok(Door {
            addr: self.addr,
            config,
            key: key.to_string(),
        })
    }

    /// Writes a tenant spec for the image `image_name` and creates the tenant with the admin
    /// token; its token goes to `work/NAME.token`, returned. Waits until it is running.
    pub fn create(
        &self,
        work: &Path,
        name: &str,
        memory_mib: u32,
        image_name: &str,
    ) -> Result<PathBuf, String> {
        let spec = work.join(format!("{name}.toml"));
        std::fs::write(
            &spec,
            format!(
                "name = \"{name}\"\nvcpus = 1\nmemory_mib = {memory_mib}\ndisk_gib = 1\n\
                 [image]\nname = \"{image_name}\"\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        let token = work.join(format!("{name}.token"));
        let timeout = LIFECYCLE_TIMEOUT_S.to_string();
        self.cli.ok(
            &self.admin,
            &[
                "create",
                spec.to_str().unwrap_or_default(),
                "--token-out",
                token.to_str().unwrap_or_default(),
                "--timeout-s",
                &timeout,
            ],
            &self.daemon,
        )?;
        wait_running(&self.cli, &token, name, &self.daemon)?;
        Ok(token)
    }

    /// `tenantvm key create NAME` with the tenant's token: the new inference key.
    pub fn key(&self, token: &Path, name: &str) -> Result<String, String> {
        let o = self.cli.ok(token, &["key", "create", name], &self.daemon)?;
        let key = String::from_utf8_lossy(&o.stdout).trim().to_string();
        if !key.starts_with("tvk-") {
            return Err(format!("key create printed {key:?}"));
        }
        Ok(key)
    }

    /// Destroys the tenant with the admin token; its directory must be gone. Returns the
    /// steps of its receipt (`tenantvm receipt show NAME --json`).
    pub fn destroy(&self, name: &str) -> Result<Vec<serde_json::Value>, String> {
        let timeout = LIFECYCLE_TIMEOUT_S.to_string();
        self.cli.ok(
            &self.admin,
            &["destroy", name, "--timeout-s", &timeout],
            &self.daemon,
        )?;
        if self.state.join("tenants").join(name).exists() {
            return Err("the tenant's directory is still there after destroy".into());
        }
        let o = self.cli.ok(
            &self.admin,
            &["receipt", "show", name, "--json"],
            &self.daemon,
        )?;
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).map_err(|e| e.to_string())?;
        v["receipts"][0]["receipt"]["steps"]
            .as_array()
            .cloned()
            .ok_or_else(|| format!("no receipt steps: {v}"))
    }
}

/// The receipt step named `want`, which must say `ok`.
pub fn ok_step<'a>(
    steps: &'a [serde_json::Value],
    want: &str,
) -> Result<&'a serde_json::Value, String> {
    let step = steps
        .iter()
        .find(|s| s["step"] == want)
        .ok_or_else(|| format!("the receipt has no {want}: {steps:?}"))?;
    if step["result"] != "ok" {
        return Err(format!("receipt step {want}: {step}"));
    }
    Ok(step)
}

#[cfg(test)]
mod tests {
    use super::events;

    #[test]
    fn events_are_the_data_lines_before_done_and_nothing_else_passes() {
        let good = b"data: {\"n\":1}\n\n: a comment\ndata: {\"n\":2}\n\ndata: [DONE]\n\n";
        let v = events(good).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[1]["n"], 2);
        for (bad, why) in [
            (&b"data: {\"n\":1}\n\n"[..], "did not end"),
            (b"data: [DONE]\n\ndata: {\"n\":1}\n\n", "after [DONE]"),
            (b"data: [DONE]\n\ndata: [DONE]\n\n", "after [DONE]"),
            (b"data: {not json\n\ndata: [DONE]\n\n", "event"),
            (b"", "did not end"),
        ] {
            let e = events(bad).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }
}
