//! The real serving stack on a GPU host (issue 15, "A real serving stack"): the llama.cpp
//! guest-image variant (guest-image/variants/llama-cpp/build.sh) serves a GGUF model the
//! tenant pushed with `tenantvm model push`, on a whole GPU, through the TLS front door with
//! a key from `tenantvm key create`: `GET /v1/models` names the pushed model, a completion
//! and a streamed completion (ending in `data: [DONE]`) come back with text, then destroy.
//!
//! Gated: runs only with all of
//!   TENANTVM_TEST_GPU=<nvml index>          a GPU host (docs/gpu.md)
//!   TENANTVM_TEST_LLAMA_IMAGE=DIR           the variant's image set
//!   TENANTVM_TEST_LLAMA_MODEL=FILE.gguf     a small GGUF model (e.g. a 0.5B Q4 model)
//! and root; `TENANTVM_E2E_BACKEND` picks the backend (default `vmm`). Otherwise it prints
//! `SKIP` with the missing piece. Nothing is downloaded.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use support::daemon::{self, TestDaemon};

fn cli(d: &TestDaemon, token: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tenantvm"))
        .arg("--socket")
        .arg(d.socket())
        .arg("--token-file")
        .arg(token)
        .args(args)
        .env_remove("TENANTVM_TOKEN")
        .output()
        .unwrap()
}

fn must(o: Output, what: &str, d: &TestDaemon) -> Output {
    assert!(
        o.status.success(),
        "{what}: {:?}\n{}{}\n--- daemon ---\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
        d.log()
    );
    o
}

/// The gate: the three variables and root, or why not.
fn gate() -> Result<(PathBuf, PathBuf), String> {
    let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
    if var("TENANTVM_TEST_GPU").is_none() {
        return Err("set TENANTVM_TEST_GPU=<nvml index> on a GPU host (docs/gpu.md)".into());
    }
    let image = var("TENANTVM_TEST_LLAMA_IMAGE").ok_or(
        "set TENANTVM_TEST_LLAMA_IMAGE to the image set of guest-image/variants/llama-cpp/build.sh",
    )?;
    let model = var("TENANTVM_TEST_LLAMA_MODEL")
        .ok_or("set TENANTVM_TEST_LLAMA_MODEL to a small GGUF model file")?;
    if !image.join("manifest.json").is_file() {
        return Err(format!("{} holds no image set", image.display()));
    }
    if !model.is_file() {
        return Err(format!("{} is not a file", model.display()));
    }
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (jails set uids, cgroups and namespaces)".into());
    }
    Ok((image, model))
}

/// One HTTPS POST (Connection: close); the status and the body, de-chunked.
fn post(
    addr: SocketAddr,
    client: &Arc<rustls::ClientConfig>,
    key: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> (u16, String) {
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(300)))
        .unwrap();
    let conn =
        rustls::ClientConnection::new(client.clone(), "localhost".try_into().unwrap()).unwrap();
    let mut s = rustls::StreamOwned::new(conn, tcp);
    let (method, body) = match body {
        Some(b) => ("POST", b.to_string()),
        None => ("GET", String::new()),
    };
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Authorization: Bearer {key}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s.flush().unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line.split(' ').nth(1).unwrap().parse().unwrap();
    let mut chunked = false;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        if h.trim().is_empty() {
            break;
        }
        if h.to_ascii_lowercase().starts_with("transfer-encoding:") && h.contains("chunked") {
            chunked = true;
        }
    }
    let mut out = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            let mut chunk = vec![0u8; n + 2];
            r.read_exact(&mut chunk).unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&chunk[..n]);
        }
    } else {
        let _ = r.read_to_end(&mut out);
    }
    (status, String::from_utf8_lossy(&out).into_owned())
}

#[test]
fn llama_cpp_variant_serves_a_pushed_model_through_the_front_door() {
    let (image, model) = match gate() {
        Ok(v) => v,
        Err(why) => tenantvm_skip::skip!("{why}"),
    };
    let backend = std::env::var("TENANTVM_E2E_BACKEND").unwrap_or_else(|_| "vmm".into());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let certs = tempfile::tempdir().unwrap();
    let (cert_pem, key_pem) = (certs.path().join("c.pem"), certs.path().join("k.pem"));
    std::fs::write(&cert_pem, cert.cert.pem()).unwrap();
    std::fs::write(&key_pem, cert.key_pair.serialize_pem()).unwrap();
    let mut d = TestDaemon::new().with_args(&[
        "--backend",
        &backend,
        "--gpu-backend",
        "nvml",
        "--boot-timeout-s",
        "300",
        "--agent-timeout-s",
        "900",
        "--listen",
        &addr.to_string(),
        "--tls-cert",
        cert_pem.to_str().unwrap(),
        "--tls-key",
        key_pem.to_str().unwrap(),
    ]);
    let dst = d.dir.path().join("img").join("llama");
    std::fs::create_dir_all(&dst).unwrap();
    for f in [
        "vmlinuz",
        "vmlinux",
        "initramfs.cpio.gz",
        "cmdline",
        "manifest.json",
    ] {
        std::fs::copy(image.join(f), dst.join(f)).unwrap();
    }
    d.start(None);
    let admin = d.state_dir().join("admin.token");
    let name = daemon::unique("llama");
    // The disk holds the model twice at most (the pushed copy and its temporary name).
    let size = std::fs::metadata(&model).unwrap().len();
    let disk_gib = 2 + 2 * size.div_ceil(1 << 30);
    let spec = d.dir.path().join("t.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"{name}\"\nvcpus = 4\nmemory_mib = 16384\ndisk_gib = {disk_gib}\n\
             gpu = {{ kind = \"whole\" }}\n[image]\nname = \"llama\"\n"
        ),
    )
    .unwrap();
    let token = d.dir.path().join("t.token");
    // No model yet: the payload answers its health probe and an empty model list, so the
    // tenant reaches running; the pushed model is served after a stop and start.
    let created = cli(
        &d,
        &admin,
        &[
            "create",
            spec.to_str().unwrap(),
            "--token-out",
            token.to_str().unwrap(),
            "--timeout-s",
            "900",
        ],
    );
    must(created, "create", &d);
    must(
        cli(
            &d,
            &token,
            &[
                "model",
                "push",
                &name,
                model.to_str().unwrap(),
                "--name",
                "pushed",
            ],
        ),
        "model push",
        &d,
    );
    must(
        cli(&d, &admin, &["stop", &name, "--timeout-s", "600"]),
        "stop",
        &d,
    );
    must(
        cli(&d, &admin, &["start", &name, "--timeout-s", "900"]),
        "start",
        &d,
    );
    let key = must(cli(&d, &token, &["key", "create", &name]), "key create", &d);
    let key = String::from_utf8(key.stdout).unwrap().trim().to_string();

    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let client = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let (s, models) = post(addr, &client, &key, "/v1/models", None);
    assert_eq!(s, 200, "{models}");
    assert!(models.contains("\"pushed\""), "{models}");
    let body = serde_json::json!({"model": "pushed", "prompt": "The capital of France is",
        "max_tokens": 8, "temperature": 0});
    let (s, answer) = post(addr, &client, &key, "/v1/completions", Some(&body));
    assert_eq!(s, 200, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
    let text = v["choices"][0]["text"].as_str().unwrap_or_default();
    assert!(!text.trim().is_empty(), "{answer}");
    eprintln!("llama.cpp completion: {text:?}");
    let mut body = body;
    body["stream"] = true.into();
    let (s, events) = post(addr, &client, &key, "/v1/completions", Some(&body));
    assert_eq!(s, 200, "{events}");
    assert!(
        events.trim_end().ends_with("data: [DONE]"),
        "the stream must end in data: [DONE]: {events}"
    );
    must(
        cli(&d, &admin, &["destroy", &name, "--timeout-s", "600"]),
        "destroy",
        &d,
    );
    d.stop();
}
