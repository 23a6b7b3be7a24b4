//! vLLM in a tenant on a GPU host (issue 22, "The engine is any OpenAI-compatible
//! server"): an image set built with the vLLM recipe (docs/guest-image.md, "GPU hosts:
//! vLLM"; guest-image/variants/vllm) serves a Hugging-Face model directory the tenant
//! pushed with `tenantvm model push`, on a whole GPU, through the TLS front door:
//! `GET /v1/models` names the pushed model and a completion comes back with text. An
//! answer is not enough: vLLM also runs on its CPU platform, so the test fails unless vLLM
//! sized a KV cache and the guest's nvidia-smi (`tenantvm gpu-info`) shows the GPU memory
//! vLLM takes when it runs on the GPU (half of the GPU at least;
//! support::engine_on_gpu::vllm_on_gpu, tested below on recorded lines).
//!
//! Gated: runs only with all of
//!   TENANTVM_TEST_GPU=<nvml index>       a GPU host (docs/gpu.md)
//!   TENANTVM_TEST_VLLM_IMAGE=DIR         the image set built with the vLLM recipe
//!   TENANTVM_TEST_VLLM_MODEL=DIR         a small Hugging-Face model directory (config.json,
//!                                        tokenizer, safetensors), e.g. a 0.5B model
//! and root; `TENANTVM_E2E_BACKEND` picks the backend (default `vmm`). Otherwise it prints
//! `SKIP` with the missing piece. Nothing is downloaded.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use support::daemon;
use support::engine_on_gpu::{gpu_daemon, vllm_on_gpu, EngineTenant};
use support::tls::FrontDoorTls;

/// The gate: the three variables and root, or why not.
fn gate() -> Result<(PathBuf, PathBuf), String> {
    let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
    if var("TENANTVM_TEST_GPU").is_none() {
        return Err("set TENANTVM_TEST_GPU=<nvml index> on a GPU host (docs/gpu.md)".into());
    }
    let image = var("TENANTVM_TEST_VLLM_IMAGE").ok_or(
        "set TENANTVM_TEST_VLLM_IMAGE to an image set built with the vLLM recipe (docs/guest-image.md)",
    )?;
    let model = var("TENANTVM_TEST_VLLM_MODEL")
        .ok_or("set TENANTVM_TEST_VLLM_MODEL to a small Hugging-Face model directory")?;
    if !image.join("manifest.json").is_file() {
        return Err(format!("{} holds no image set", image.display()));
    }
    if !model.join("config.json").is_file() {
        return Err(format!(
            "{} is not a Hugging-Face model directory (no config.json)",
            model.display()
        ));
    }
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (jails set uids, cgroups and namespaces)".into());
    }
    Ok((image, model))
}

/// Bytes of the files under `dir`.
fn size_of_dir(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let meta = e.metadata().unwrap();
            if meta.is_dir() {
                size_of_dir(&e.path())
            } else {
                meta.len()
            }
        })
        .sum()
}

#[test]
fn vllm_serves_a_pushed_model_directory_from_the_gpu() {
    let (image, model) = match gate() {
        Ok(v) => v,
        Err(why) => tenantvm_skip::skip!("{why}"),
    };
    let door = FrontDoorTls::new();
    let mut d = gpu_daemon(&door, &image, "vllm", "1800");
    let name = daemon::unique("vllm");
    // The disk holds the model twice at most (the pushed copy and its temporary names).
    let disk_gib = 4 + 2 * size_of_dir(&model).div_ceil(1 << 30);
    let spec = format!(
        "name = \"{name}\"\nvcpus = 8\nmemory_mib = 32768\ndisk_gib = {disk_gib}\n\
         gpu = {{ kind = \"whole\" }}\n[image]\nname = \"vllm\"\n"
    );
    let tenant = EngineTenant::serve(&d, &name, &spec, &model, "1800");
    let key = tenant.key.clone();
    let request = |path: &str, body: Option<&serde_json::Value>| {
        let (status, out) = door.request(path, Some(&key), body, Duration::from_secs(600));
        (status, String::from_utf8_lossy(&out).into_owned())
    };
    let (s, models) = request("/v1/models", None);
    assert_eq!(s, 200, "{models}");
    assert!(models.contains("\"pushed\""), "{models}");
    let body = serde_json::json!({"model": "pushed", "prompt": "The capital of France is",
        "max_tokens": 8, "temperature": 0});
    let (s, answer) = request("/v1/completions", Some(&body));
    assert_eq!(s, 200, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
    let text = v["choices"][0]["text"].as_str().unwrap_or_default();
    assert!(!text.trim().is_empty(), "{answer}");
    eprintln!("vLLM completion: {text:?}");
    // On the GPU, not on vLLM's CPU platform.
    let log = tenant.log(5000);
    match vllm_on_gpu(&log, &tenant.gpu_info()) {
        Ok(evidence) => eprintln!("vLLM on the GPU: {evidence}"),
        Err(why) => panic!("{why}\n{log}"),
    }
    tenant.destroy();
    d.stop();
}

/// The judge the gated test applies, on vLLM's own lines (CI, no GPU needed): it must
/// refuse vLLM on its CPU platform, which also sizes a KV cache.
#[test]
fn the_gpu_judge_refuses_vllm_on_the_cpu() {
    let smi = |used: u64, total: u64| {
        serde_json::json!({"guest": {"nvidia_smi": {"gpus": [
            {"memory_used_mib": used, "memory_total_mib": total}]}}})
    };
    let v1 = "(EngineCore_DP0 pid=211) INFO 11-02 10:12:01 [kv_cache_utils.py:1087] GPU KV cache size: 1,017,792 tokens\n\
              INFO [kv_cache_utils.py:1091] Maximum concurrency for 32,768 tokens per request: 31.06x\n";
    vllm_on_gpu(v1, &smi(73_418, 81_559)).unwrap();
    let v0 =
        "INFO 06-01 09:00:00 executor_base.py:111] # cuda blocks: 27,306, # CPU blocks: 4,681\n";
    vllm_on_gpu(v0, &smi(36_000, 40_960)).unwrap();
    // The CPU platform: a KV cache, and the GPU (if the guest has one) idle.
    let why = vllm_on_gpu(v1, &smi(0, 81_559)).unwrap_err();
    assert!(why.contains("CPU"), "{why}");
    // A slice of the GPU that vLLM did not take most of.
    vllm_on_gpu(v1, &smi(2_048, 9_984)).unwrap_err();
    // No KV cache sized, or sized 0: not a pass.
    vllm_on_gpu("INFO starting\n", &smi(73_418, 81_559)).unwrap_err();
    let zero = "INFO [kv_cache_utils.py:1087] GPU KV cache size: 0 tokens\n";
    vllm_on_gpu(zero, &smi(73_418, 81_559)).unwrap_err();
    // No nvidia-smi in the guest: not a pass.
    vllm_on_gpu(v1, &serde_json::json!({"guest": {}})).unwrap_err();
}
