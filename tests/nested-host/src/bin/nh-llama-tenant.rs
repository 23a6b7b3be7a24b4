//! The inference-tenant-llama scenario's program: a real serving engine in a tenant on
//! tenantvm-vmm (issue 22): Debian's llama-server in the llama-cpp guest-image variant,
//! booted by tenantvm-vmm under the outer guest's KVM, the agent over vsock, through a real
//! tenantvmd and the `tenantvm` CLI, with clients on the TLS front door.
//!
//! ```text
//! nh-llama-tenant
//! ```
//! env: NH_BIN (tenantvmd, tenantvm, tenantvm-vmm, tenantvm-jail), NH_LLAMA_IMAGE (the
//! variant's image set, guest-image/variants/llama-cpp/prepare.sh), NH_LLAMA_MODEL (the
//! generated test GGUF), NH_WORK; NH_NOTES (optional: figures). Runs as root with cgroup v2
//! at /sys/fs/cgroup (the scenario script mounts it).
//!
//! Checks, in order: `tenantvm create` of a llama tenant reaches `running` with no model
//! (the engine's `/v1/models` lists none); the test GGUF pushed with `tenantvm model push`
//! and `tenantvm payload restart` make the engine serve it; over the front door with a key
//! from `tenantvm key create`: `/v1/models` names it; a completion is answered by
//! llama-server's Debian build (its `system_fingerprint`, the build number the image's
//! manifest records) with a usage block the engine counted (its own `timings`); a streamed
//! chat completion ends in `data: [DONE]` with at least two chunks (random weights: byte
//! tokens that are not UTF-8 on their own); the same long prompt twice is served from the
//! engine's own prompt cache the second time (`cache_n`); the host's disk image never holds
//! the model's bytes in plaintext, while the same scan finds them in the pushed file
//! (positive control); `destroy` leaves a receipt whose agent shutdown is `ok` and whose
//! crypto-shred is `ok` and names the pushed model among the data it destroyed.

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;
use tenantvm_nested_host::inference::{
    events, file_contains, ok_step, Door, Tenantvmd, LIFECYCLE_TIMEOUT_S,
};
use tenantvm_nested_host::scenario::{env_path, note};

/// The name the model is pushed and served under.
const MODEL: &str = "tiny-llama";

/// The build number in the engine's version the image manifest records ("version: 0.7.0
/// (build 11669, commit Debian)" -> "11669"): llama-server answers with the fingerprint
/// `b<build>-Debian`.
fn engine_build(image: &Path) -> Result<String, String> {
    let path = image.join("manifest.json");
    let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let m: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let version = m["payload"]["engine"]["version"]
        .as_str()
        .ok_or_else(|| format!("{} records no engine version", path.display()))?;
    version
        .split("build ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .map(str::to_string)
        .ok_or_else(|| format!("no build number in the engine's version {version:?}"))
}

/// A POST through the front door whose answer must be 200 with a JSON body.
fn post(door: &Door, path: &str, body: &serde_json::Value) -> Result<serde_json::Value, String> {
    door.json("POST", path, Some(&body.to_string()))
}

/// The engine counted the usage block: prompt tokens are its fresh plus cached ones, and
/// the completion tokens are the ones it predicted.
fn usage_counted_by_engine(c: &serde_json::Value) -> Result<(u64, u64), String> {
    let usage = &c["usage"];
    let timings = &c["timings"];
    let (Some(prompt), Some(completion), Some(total)) = (
        usage["prompt_tokens"].as_u64(),
        usage["completion_tokens"].as_u64(),
        usage["total_tokens"].as_u64(),
    ) else {
        return Err(format!("no usage block: {c}"));
    };
    let (Some(fresh), Some(predicted)) = (
        timings["prompt_n"].as_u64(),
        timings["predicted_n"].as_u64(),
    ) else {
        return Err(format!("no engine timings (not llama-server?): {c}"));
    };
    let cached = timings["cache_n"].as_u64().unwrap_or(0);
    if prompt == 0 || completion == 0 || total != prompt + completion {
        return Err(format!("an inconsistent usage block: {usage}"));
    }
    if fresh + cached != prompt || predicted != completion {
        return Err(format!(
            "the usage {usage} is not what the engine counted {timings}"
        ));
    }
    Ok((prompt, completion))
}

/// 64 bytes from three quarters into the model (its random weights), which must not be
/// one repeated byte: what the disk-image scan looks for.
fn model_needle(model: &Path) -> Result<Vec<u8>, String> {
    let bytes = std::fs::read(model).map_err(|e| format!("{}: {e}", model.display()))?;
    let at = bytes.len() / 4 * 3;
    let needle = bytes
        .get(at..at + 64)
        .ok_or_else(|| format!("{} is too small to be the test model", model.display()))?
        .to_vec();
    if needle.iter().all(|b| *b == needle[0]) {
        return Err(format!(
            "the bytes at {at} of {} are one repeated value: no needle",
            model.display()
        ));
    }
    Ok(needle)
}

fn run() -> Result<(), String> {
    let bin = env_path("NH_BIN")?;
    let image = env_path("NH_LLAMA_IMAGE")?;
    let model = env_path("NH_LLAMA_MODEL")?;
    let work = env_path("NH_WORK")?;
    let started = Instant::now();
    let build = engine_build(&image)?;
    let tvmd = Tenantvmd::start(&bin, &work, &image, "llama", &["--backend", "vmm"])?;
    println!(
        "ok: tenantvmd up at {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let (cli, d) = (&tvmd.cli, &tvmd.daemon);
    let timeout = LIFECYCLE_TIMEOUT_S.to_string();

    // Create: the engine starts with no model.
    let name = "nh-llama";
    let t = Instant::now();
    let token = tvmd.create(&work, name, 1024, "llama")?;
    note(&format!(
        "llama tenant on tenantvm-vmm: create to running {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    let door = tvmd.door(&tvmd.key(&token, name)?)?;
    let models = door.json("GET", "/v1/models", None)?;
    if models["data"].as_array().is_none_or(|m| !m.is_empty()) {
        return Err(format!("a model before any was pushed: {models}"));
    }

    // The model onto the encrypted disk, and the engine restarted to serve it.
    let t = Instant::now();
    let model_arg = model.to_str().unwrap_or_default();
    cli.ok(
        &token,
        &["model", "push", name, model_arg, "--name", MODEL],
        d,
    )?;
    note(&format!(
        "model push ({} bytes): {:.1} s",
        std::fs::metadata(&model).map_or(0, |m| m.len()),
        t.elapsed().as_secs_f64()
    ));
    let t = Instant::now();
    cli.ok(
        &token,
        &["payload", "restart", name, "--timeout-s", &timeout],
        d,
    )?;
    note(&format!(
        "payload restart to serving: {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    let models = door.json("GET", "/v1/models", None)?;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .map(|m| m.iter().filter_map(|e| e["id"].as_str()).collect())
        .unwrap_or_default();
    if ids != [MODEL] {
        return Err(format!("/v1/models after the push: {models}"));
    }
    println!("ok: the engine serves the pushed {MODEL}");

    // A completion: llama-server's Debian build answers, and counted the usage itself.
    let t = Instant::now();
    let c = post(
        &door,
        "/v1/completions",
        &serde_json::json!({"model": MODEL, "prompt": "once upon a time", "max_tokens": 4,
            "temperature": 0}),
    )?;
    let client_s = t.elapsed().as_secs_f64();
    let fingerprint = format!("b{build}-Debian");
    if c["system_fingerprint"] != fingerprint.as_str() {
        return Err(format!(
            "not llama-server's Debian build {fingerprint} answering: {c}"
        ));
    }
    let (prompt, completion) = usage_counted_by_engine(&c)?;
    note(&format!(
        "completion of {prompt}+{completion} tokens: {client_s:.2} s at the client, engine \
         prefill {:.0} ms, decode {:.1} tokens/s",
        c["timings"]["prompt_ms"].as_f64().unwrap_or(f64::NAN),
        c["timings"]["predicted_per_second"]
            .as_f64()
            .unwrap_or(f64::NAN)
    ));
    println!("ok: {fingerprint} answered with a usage block it counted ({prompt}+{completion})");

    // A streamed chat completion: chunks, a finish reason, [DONE].
    let body = serde_json::json!({"model": MODEL, "max_tokens": 4, "temperature": 0,
        "stream": true, "messages": [{"role": "user", "content": "say something"}]});
    let a = door.request("POST", "/v1/chat/completions", Some(&body.to_string()))?;
    if a.status != 200 {
        return Err(format!(
            "streamed chat answered {}: {}",
            a.status,
            String::from_utf8_lossy(&a.body)
        ));
    }
    let chunks = events(&a.body)?;
    let finish = chunks
        .iter()
        .filter_map(|e| e["choices"][0]["finish_reason"].as_str())
        .next_back();
    if chunks.len() < 2 || !matches!(finish, Some("length" | "stop")) {
        return Err(format!(
            "the chat stream had {} chunks, finish reason {finish:?}: {}",
            chunks.len(),
            String::from_utf8_lossy(&a.body)
        ));
    }
    println!(
        "ok: a streamed chat completion: {} chunks, finished by {}",
        chunks.len(),
        finish.unwrap_or_default()
    );

    // The engine's own prompt cache: the same long prompt again finds its prefix cached.
    let words: Vec<String> = (0..40).map(|i| format!("w{}", i * 7919 % 1000)).collect();
    let long = serde_json::json!({"model": MODEL, "prompt": words.join(" "), "max_tokens": 1,
        "temperature": 0});
    let first = post(&door, "/v1/completions", &long)?;
    let again = post(&door, "/v1/completions", &long)?;
    let prompt_n = first["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = again["timings"]["cache_n"].as_u64().unwrap_or(0);
    if prompt_n < 100 || cached + 1 < prompt_n {
        return Err(format!(
            "the repeated prompt of {prompt_n} tokens found {cached} cached: {again}"
        ));
    }
    note(&format!(
        "prompt of {prompt_n} tokens: {:.0} ms fresh, {:.0} ms from the engine's cache",
        first["timings"]["prompt_ms"].as_f64().unwrap_or(f64::NAN),
        again["timings"]["prompt_ms"].as_f64().unwrap_or(f64::NAN)
    ));
    println!("ok: the repeated prompt came from the engine's cache ({cached} of {prompt_n})");

    // The host image: never the model's bytes in plaintext (the scan finds them in the
    // pushed file: positive control).
    let needle = model_needle(&model)?;
    if !file_contains(&model, &needle)? {
        return Err("positive control: the scan misses the needle in the model file".into());
    }
    let disk = tvmd.state.join("tenants").join(name).join("disk.img");
    if file_contains(&disk, &needle)? {
        return Err("the pushed model's bytes are in the host image in plaintext".into());
    }
    println!("ok: the host image holds no plaintext of the model (the control does)");

    // Destroy: the receipt covers the pushed model.
    let t = Instant::now();
    let steps = tvmd.destroy(name)?;
    note(&format!("destroy: {:.1} s", t.elapsed().as_secs_f64()));
    ok_step(&steps, "agent-shutdown")?;
    let shred = ok_step(&steps, "crypto-shred")?;
    let data = shred["evidence"]["tenant_data"]
        .as_str()
        .unwrap_or_default();
    if !data.contains("model") {
        return Err(format!(
            "the crypto-shred step does not name the pushed model: {shred}"
        ));
    }
    println!("ok: destroyed; the receipt's crypto-shred covers {data:?}");
    note(&format!(
        "llama tenant lifecycle on tenantvm-vmm: {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    drop(tvmd);
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nh-llama-tenant: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
