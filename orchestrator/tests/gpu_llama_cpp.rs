//! The real serving stack on a GPU host (issue 15, "A real serving stack"): the llama.cpp
//! guest-image variant (guest-image/variants/llama-cpp/build.sh) serves a GGUF model the
//! tenant pushed with `tenantvm model push`, on a whole GPU, through the TLS front door with
//! a key from `tenantvm key create`: `GET /v1/models` names the pushed model, a completion
//! and a streamed completion (ending in `data: [DONE]`) come back with text, then destroy.
//! An answer is not enough: llama.cpp falls back to the CPU silently when it cannot use the
//! GPU, so the test also requires the engine's own log line that it offloaded every layer
//! to a CUDA device (`offloaded N/N layers to GPU`, on the guest's console) and, from the
//! guest's `nvidia-smi` (`tenantvm gpu-info`), GPU memory in use while it serves. The image
//! is the variant built with `--cuda`.
//!
//! Gated: runs only with all of
//!   TENANTVM_TEST_GPU=<nvml index>          a GPU host (docs/gpu.md)
//!   TENANTVM_TEST_LLAMA_IMAGE=DIR           the variant's image set
//!   TENANTVM_TEST_LLAMA_MODEL=FILE.gguf     a small GGUF model (e.g. a 0.5B Q4 model)
//! and root; `TENANTVM_E2E_BACKEND` picks the backend (default `vmm`). Otherwise it prints
//! `SKIP` with the missing piece. Nothing is downloaded.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use support::cli::{must, tenantvm};
use support::daemon::{self, TestDaemon};
use support::guest_image::install_image;
use support::tls::FrontDoorTls;

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

/// One HTTPS request with `key` (a `POST` of `body`, or a `GET` without one); the status
/// and the body, de-chunked.
fn post(
    door: &FrontDoorTls,
    key: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> (u16, String) {
    let (status, out) = door.request(path, Some(key), body, Duration::from_secs(300));
    (status, String::from_utf8_lossy(&out).into_owned())
}

#[test]
fn llama_cpp_variant_serves_a_pushed_model_through_the_front_door() {
    let (image, model) = match gate() {
        Ok(v) => v,
        Err(why) => tenantvm_skip::skip!("{why}"),
    };
    let backend = std::env::var("TENANTVM_E2E_BACKEND").unwrap_or_else(|_| "vmm".into());
    let door = FrontDoorTls::new();
    let mut d = TestDaemon::new()
        .with_args(&[
            "--backend",
            &backend,
            "--gpu-backend",
            "nvml",
            "--boot-timeout-s",
            "300",
            "--agent-timeout-s",
            "900",
        ])
        .with_front_door(&door);
    install_image(&image, &d.dir.path().join("img"), "llama");
    d.start(None);
    let admin = d.admin_token_file();
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
    // tenant reaches running; the pushed model is served after a payload restart.
    let created = tenantvm(
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
        tenantvm(
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
        tenantvm(
            &d,
            &admin,
            &["payload", "restart", &name, "--timeout-s", "900"],
        ),
        "payload restart",
        &d,
    );
    let key = must(
        tenantvm(&d, &token, &["key", "create", &name]),
        "key create",
        &d,
    );
    let key = String::from_utf8(key.stdout).unwrap().trim().to_string();

    let (s, models) = post(&door, &key, "/v1/models", None);
    assert_eq!(s, 200, "{models}");
    assert!(models.contains("\"pushed\""), "{models}");
    let body = serde_json::json!({"model": "pushed", "prompt": "The capital of France is",
        "max_tokens": 8, "temperature": 0});
    let (s, answer) = post(&door, &key, "/v1/completions", Some(&body));
    assert_eq!(s, 200, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
    let text = v["choices"][0]["text"].as_str().unwrap_or_default();
    assert!(!text.trim().is_empty(), "{answer}");
    eprintln!("llama.cpp completion: {text:?}");
    let mut body = body;
    body["stream"] = true.into();
    let (s, events) = post(&door, &key, "/v1/completions", Some(&body));
    assert_eq!(s, 200, "{events}");
    assert!(
        events.trim_end().ends_with("data: [DONE]"),
        "the stream must end in data: [DONE]: {events}"
    );
    // On the GPU, not beside it: every layer offloaded (the engine's own words) ...
    let log = must(
        tenantvm(&d, &admin, &["logs", &name, "--tail", "2000"]),
        "logs",
        &d,
    );
    let log = String::from_utf8_lossy(&log.stdout).into_owned();
    let offload = log
        .lines()
        .rev()
        .find_map(|l| l.split("offloaded ").nth(1))
        .unwrap_or_else(|| panic!("llama-server never said it offloaded layers:\n{log}"));
    let (done, total) = offload
        .split_whitespace()
        .next()
        .and_then(|f| f.split_once('/'))
        .map_or_else(
            || panic!("unreadable offload line: {offload}"),
            |(a, b)| (a.parse::<u32>().unwrap(), b.parse::<u32>().unwrap()),
        );
    assert!(
        total > 0 && done == total,
        "only {done}/{total} layers on the GPU: the engine runs (partly) on the CPU"
    );
    // ... and GPU memory in use while it serves, from the guest's nvidia-smi.
    let info = must(
        tenantvm(&d, &admin, &["gpu-info", &name, "--json"]),
        "gpu-info",
        &d,
    );
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    let used = info["guest"]["nvidia_smi"]["gpus"][0]["memory_used_mib"]
        .as_u64()
        .unwrap_or_else(|| panic!("no GPU memory figure from the guest: {info}"));
    assert!(
        used >= 64,
        "the guest's GPU holds {used} MiB while the model is served: not on the GPU"
    );
    must(
        tenantvm(&d, &admin, &["destroy", &name, "--timeout-s", "600"]),
        "destroy",
        &d,
    );
    d.stop();
}
