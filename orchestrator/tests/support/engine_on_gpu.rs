//! Whether a real engine serves from the GPU, judged from its own words (its log, through
//! `tenantvm logs`) and the guest's nvidia-smi (`tenantvm gpu-info --json`). An answer is
//! not enough: llama.cpp runs layers it cannot offload on the CPU without telling its
//! clients, and vLLM has a CPU platform. The GPU tests (gpu_llama_cpp.rs, gpu_vllm.rs) fail
//! on any verdict that is not `Ok`; the judges are tested on recorded lines in CI.

use serde_json::Value;

/// The guest's GPU memory in use and in all (MiB), from `tenantvm gpu-info --json`.
pub fn guest_gpu_memory(info: &Value) -> Result<(u64, u64), String> {
    let gpu = &info["guest"]["nvidia_smi"]["gpus"][0];
    let used = gpu["memory_used_mib"].as_u64().ok_or_else(|| {
        format!("no GPU memory in use reported by the guest's nvidia-smi: {info}")
    })?;
    let total = gpu["memory_total_mib"]
        .as_u64()
        .ok_or_else(|| format!("no GPU memory size reported by the guest's nvidia-smi: {info}"))?;
    Ok((used, total))
}

/// llama.cpp's last `offloaded N/M layers to GPU` line: (N, M).
pub fn llama_offloaded_layers(log: &str) -> Result<(u32, u32), String> {
    let line = log
        .lines()
        .rev()
        .find_map(|l| l.split("offloaded ").nth(1))
        .ok_or("llama-server never said it offloaded layers to the GPU")?;
    line.split_whitespace()
        .next()
        .and_then(|f| f.split_once('/'))
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        .ok_or_else(|| format!("unreadable offload line: offloaded {line}"))
}

/// llama.cpp on the GPU: every layer offloaded, in the engine's own words, and GPU memory
/// in use in the guest (64 MiB at least: a model's weights, not a driver's context).
pub fn llama_on_gpu(log: &str, info: &Value) -> Result<String, String> {
    let (done, total) = llama_offloaded_layers(log)?;
    if total == 0 || done != total {
        return Err(format!(
            "only {done}/{total} layers on the GPU: the engine runs (partly) on the CPU"
        ));
    }
    let (used, _) = guest_gpu_memory(info)?;
    if used < 64 {
        return Err(format!(
            "the guest's GPU holds {used} MiB while the model is served: not on the GPU"
        ));
    }
    Ok(format!(
        "{done}/{total} layers offloaded, {used} MiB of GPU memory in use"
    ))
}

/// vLLM's KV cache, in tokens, from its last log line that sizes it: `GPU KV cache size:
/// 123,456 tokens` (the V1 engine) or `# GPU blocks: N` / `# cuda blocks: N` (V0, in blocks).
pub fn vllm_kv_cache(log: &str) -> Result<u64, String> {
    let number = |s: &str| -> Option<u64> {
        let digits: String = s
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == ',')
            .filter(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    };
    log.lines()
        .rev()
        .find_map(|l| {
            l.split("GPU KV cache size:")
                .nth(1)
                .or_else(|| l.split("# GPU blocks:").nth(1))
                .or_else(|| l.split("# cuda blocks:").nth(1))
                .map(number)
        })
        .ok_or_else(|| {
            "vLLM never sized its GPU KV cache (no `GPU KV cache size` line)".to_string()
        })?
        .ok_or_else(|| "unreadable KV cache line".to_string())
}

/// vLLM on the GPU: a KV cache on it, and the GPU memory vLLM takes at start-up
/// (`--gpu-memory-utilization`, 0.9 of the GPU by default) in use in the guest: half of
/// the GPU at least. On its CPU platform vLLM also sizes a KV cache, but holds no GPU
/// memory.
pub fn vllm_on_gpu(log: &str, info: &Value) -> Result<String, String> {
    let kv = vllm_kv_cache(log)?;
    if kv == 0 {
        return Err("vLLM sized a KV cache of 0: nothing fits on the GPU".into());
    }
    let (used, total) = guest_gpu_memory(info)?;
    if total == 0 || used * 2 < total {
        return Err(format!(
            "the guest's GPU holds {used} of {total} MiB while vLLM serves: vLLM takes most \
             of the GPU when it runs on it, so it runs on the CPU"
        ));
    }
    Ok(format!(
        "a KV cache of {kv}, {used} of {total} MiB of GPU memory in use"
    ))
}

/// A tenant of a GPU test serving a pushed model: created from `spec` (TOML), the model (a
/// file or a directory) pushed as `pushed`, the payload restarted to serve it, and an
/// inference key made for the front door.
pub struct EngineTenant<'d> {
    d: &'d super::daemon::TestDaemon,
    admin: std::path::PathBuf,
    /// The tenant's name.
    pub name: String,
    /// An inference key of the tenant.
    pub key: String,
}

impl<'d> EngineTenant<'d> {
    /// Creates the tenant `name` from `spec` and serves `model` as `pushed`; each step may
    /// take `timeout_s`.
    pub fn serve(
        d: &'d super::daemon::TestDaemon,
        name: &str,
        spec: &str,
        model: &std::path::Path,
        timeout_s: &str,
    ) -> EngineTenant<'d> {
        use super::cli::{must, tenantvm};
        let admin = d.admin_token_file();
        let spec_file = d.dir.path().join(format!("{name}.toml"));
        std::fs::write(&spec_file, spec).unwrap();
        let token = d.dir.path().join(format!("{name}.token"));
        // No model yet: the payload answers its health probe and an empty model list, so
        // the tenant reaches running; the pushed model is served after a payload restart.
        let create = [
            "create",
            spec_file.to_str().unwrap(),
            "--token-out",
            token.to_str().unwrap(),
            "--timeout-s",
            timeout_s,
        ];
        must(tenantvm(d, &admin, &create), "create", d);
        let push = [
            "model",
            "push",
            name,
            model.to_str().unwrap(),
            "--name",
            "pushed",
        ];
        must(tenantvm(d, &token, &push), "model push", d);
        let restart = ["payload", "restart", name, "--timeout-s", timeout_s];
        must(tenantvm(d, &admin, &restart), "payload restart", d);
        let key = must(
            tenantvm(d, &token, &["key", "create", name]),
            "key create",
            d,
        );
        EngineTenant {
            d,
            admin,
            name: name.to_string(),
            key: String::from_utf8(key.stdout).unwrap().trim().to_string(),
        }
    }

    /// The last `lines` lines of the tenant's log (the engine's words among them).
    pub fn log(&self, lines: u32) -> String {
        let tail = lines.to_string();
        let out = super::cli::must(
            super::cli::tenantvm(self.d, &self.admin, &["logs", &self.name, "--tail", &tail]),
            "logs",
            self.d,
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `tenantvm gpu-info --json` of the tenant.
    pub fn gpu_info(&self) -> Value {
        let out = super::cli::must(
            super::cli::tenantvm(self.d, &self.admin, &["gpu-info", &self.name, "--json"]),
            "gpu-info",
            self.d,
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Destroys the tenant.
    pub fn destroy(self) {
        let destroy = ["destroy", &self.name, "--timeout-s", "600"];
        super::cli::must(
            super::cli::tenantvm(self.d, &self.admin, &destroy),
            "destroy",
            self.d,
        );
    }
}

/// A started daemon for a GPU test: the NVML GPU backend, the backend
/// `TENANTVM_E2E_BACKEND` names (default `vmm`), long boot and agent deadlines (an engine
/// loads its model at start), the front door `door`, and the image set `image` installed
/// as `image_name`.
pub fn gpu_daemon(
    door: &super::tls::FrontDoorTls,
    image: &std::path::Path,
    image_name: &str,
    agent_timeout_s: &str,
) -> super::daemon::TestDaemon {
    let backend = std::env::var("TENANTVM_E2E_BACKEND").unwrap_or_else(|_| "vmm".into());
    let mut d = super::daemon::TestDaemon::new()
        .with_args(&[
            "--backend",
            &backend,
            "--gpu-backend",
            "nvml",
            "--boot-timeout-s",
            "600",
            "--agent-timeout-s",
            agent_timeout_s,
        ])
        .with_front_door(door);
    super::guest_image::install_image(image, &d.dir.path().join("img"), image_name);
    d.start(None);
    d
}
