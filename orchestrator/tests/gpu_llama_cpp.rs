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

use support::daemon;
use support::engine_on_gpu::{gpu_daemon, llama_on_gpu, EngineTenant};
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
    let door = FrontDoorTls::new();
    let mut d = gpu_daemon(&door, &image, "llama", "900");
    let name = daemon::unique("llama");
    // The disk holds the model twice at most (the pushed copy and its temporary name).
    let size = std::fs::metadata(&model).unwrap().len();
    let disk_gib = 2 + 2 * size.div_ceil(1 << 30);
    let spec = format!(
        "name = \"{name}\"\nvcpus = 4\nmemory_mib = 16384\ndisk_gib = {disk_gib}\n\
         gpu = {{ kind = \"whole\" }}\n[image]\nname = \"llama\"\n"
    );
    let tenant = EngineTenant::serve(&d, &name, &spec, &model, "900");
    let key = tenant.key.clone();

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
    // On the GPU, not beside it: every layer offloaded (the engine's own words), and GPU
    // memory in use while it serves (the guest's nvidia-smi).
    let log = tenant.log(2000);
    match llama_on_gpu(&log, &tenant.gpu_info()) {
        Ok(evidence) => eprintln!("llama.cpp on the GPU: {evidence}"),
        Err(why) => panic!("{why}\n{log}"),
    }
    tenant.destroy();
    d.stop();
}

/// The judge the gated test applies, on llama-server's own lines (CI, no GPU needed): it
/// must refuse an engine that kept layers on the CPU or holds no GPU memory.
#[test]
fn the_gpu_judge_refuses_a_llama_server_that_fell_back_to_the_cpu() {
    let smi = |used: u64| {
        serde_json::json!({"guest": {"nvidia_smi": {"gpus": [
            {"memory_used_mib": used, "memory_total_mib": 24_576}]}}})
    };
    let all = "load_tensors: offloading 32 repeating layers to GPU\n\
               load_tensors: offloaded 33/33 layers to GPU\n";
    llama_on_gpu(all, &smi(4_812)).unwrap();
    let partial = "load_tensors: offloaded 20/33 layers to GPU\n";
    let why = llama_on_gpu(partial, &smi(4_812)).unwrap_err();
    assert!(why.contains("20/33"), "{why}");
    // No GPU backend at all: llama.cpp says nothing of offloading.
    let cpu = "load_tensors: CPU_Mapped model buffer size = 4685.30 MiB\n";
    llama_on_gpu(cpu, &smi(0)).unwrap_err();
    // Every layer offloaded, yet nothing on the guest's GPU: not believed.
    llama_on_gpu(all, &smi(3)).unwrap_err();
    // No nvidia-smi figure: not a pass.
    llama_on_gpu(all, &serde_json::json!({"guest": {}})).unwrap_err();
}
