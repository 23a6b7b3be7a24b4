//! What the checks may ask of the host: [`VerifyHost`]. The live implementation is
//! [`super::live::LiveHost`] (the daemon's API as admin, plus read-only looks at the
//! host's cgroups and files); tests use a fake host described in memory.

use std::path::Path;
use std::time::Duration;

use tenantvm_agent_protocol::{LoadKind, LoadReport, LoadSpec};

use crate::api::types::{LogStream, TenantView};
use crate::backend::ResourceLimits;
use crate::domain::spec::TenantSpec;
use crate::receipt::LogEntry;

/// Why the host could not answer.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The daemon refused or failed a request.
    #[error("the daemon answered {status}: {message}")]
    Api {
        /// HTTP status.
        status: u16,
        /// Its message.
        message: String,
    },
    /// The daemon cannot be reached.
    #[error("the daemon cannot be reached: {0}")]
    Unreachable(String),
    /// An operation did not finish in time.
    #[error("{what} did not finish within {seconds} s")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The deadline.
        seconds: u64,
    },
    /// A tenant operation ended failed.
    #[error("{0}")]
    Failed(String),
    /// A host file could not be read.
    #[error("cannot read {path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
    /// This host cannot answer that at all (no GPU backend given, no agent reachable, ...).
    #[error("{0}")]
    Unsupported(String),
}

/// Turns an I/O error on the host file at `path` into [`HostError::Io`].
pub(super) fn io_err(path: &Path) -> impl Fn(std::io::Error) -> HostError + '_ {
    move |e| HostError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

impl HostError {
    /// The HTTP status, for API refusals.
    pub fn status(&self) -> Option<u16> {
        match self {
            HostError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A GPU as the checks see it: its index, its database model and whether the SKU has MIG.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuView {
    /// Index on the host (what a tenant's `gpu.gpu` names in ledger rows written before
    /// placements named GPUs by PCI address).
    pub index: String,
    /// PCI address (what a tenant's `gpu.gpu` names).
    pub pci_address: String,
    /// Product name.
    pub name: String,
    /// Database model key (`h100-80gb`, `l40s`, `10de-xxxx` for an unknown SKU).
    pub model: &'static tenantvm_gpu::mig::GpuModel,
}

impl GpuView {
    /// Whether a tenant's slice GPU id (a PCI address, or an index in older rows) is this GPU.
    pub fn is(&self, id: &str) -> bool {
        self.pci_address.eq_ignore_ascii_case(id) || self.index == id
    }
}

/// What became of a process that allocated past a tenant's memory limit inside its cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overrun {
    /// The kernel killed it (the limit is enforced).
    Killed,
    /// It finished: the memory was there to take (the limit is not enforced).
    Completed,
    /// It neither finished nor died in time (swapping?); it was killed.
    TimedOut,
}

/// CPU taken by busy processes, in CPUs (CPU seconds per second of wall time): the same
/// number of them outside any tenant cgroup (the control: what the host would give) and
/// inside a tenant's CPU cgroup.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuOverrun {
    /// Busy processes run in each phase.
    pub workers: u32,
    /// CPUs they took outside (the control).
    pub outside_cpus: f64,
    /// CPUs they took inside the tenant's cgroup.
    pub inside_cpus: f64,
}

/// Who sends an inference request, and through which door.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller<'a> {
    /// The tenant's own token on the daemon's API (`POST /v1/tenants/{name}/infer`).
    Token(&'a str),
    /// An inference key at the front door (`POST /v1/completions`), as a tenant's clients
    /// call: the front door, not the caller, picks the tenant, from the key.
    Key(&'a str),
}

/// A completion's answer, and how long the caller waited for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Answered {
    /// From the request's first byte sent to the answer read whole.
    pub elapsed: Duration,
    /// The answer (an OpenAI completion object).
    pub body: serde_json::Value,
}

impl Answered {
    /// Prompt tokens the engine counted (`usage.prompt_tokens`).
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.body["usage"]["prompt_tokens"].as_u64()
    }

    /// Of those, the ones the engine took from its prompt cache: OpenAI's
    /// `usage.prompt_tokens_details.cached_tokens` (llama-server, vLLM, the n-gram server),
    /// else llama-server's own `timings.cache_n`.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .or_else(|| self.body["timings"]["cache_n"].as_u64())
    }
}

/// What serves a tenant's inference, read from the engine itself through the tenant's
/// guest agent.
#[derive(Debug, Clone, PartialEq)]
pub enum Engine {
    /// Its guest runs no agent, so no inference engine: a plain kernel or a test guest.
    None,
    /// llama.cpp's llama-server: its `GET /props` (slots, context per slot, build).
    LlamaServer(serde_json::Value),
    /// The project's n-gram server: its own description (`GET /v1/tenantvm/serving`).
    Ngram(serde_json::Value),
}

/// What the checks ask of the host. Every wait has a deadline inside the implementation.
pub trait VerifyHost: Sync {
    /// Every tenant (admin view).
    fn tenants(&self) -> Result<Vec<TenantView>, HostError>;
    /// One tenant, `None` when it does not exist.
    fn tenant(&self, name: &str) -> Result<Option<TenantView>, HostError>;
    /// Creates a tenant and waits until it runs; returns its token.
    fn create(&self, spec: &TenantSpec, timeout: Duration) -> Result<String, HostError>;
    /// Destroys a tenant and waits until it is gone (a tenant already gone is fine).
    fn destroy(&self, name: &str, timeout: Duration) -> Result<(), HostError>;
    /// The limits in the tenant's cgroup as the kernel holds them (`u64::MAX`: no limit),
    /// `None` when it has no cgroup.
    fn cgroup_limits(&self, name: &str) -> Result<Option<ResourceLimits>, HostError>;
    /// Runs a process inside the tenant's memory cgroup that touches `bytes` of memory, and
    /// says what became of it within `timeout`.
    fn overrun_memory(
        &self,
        name: &str,
        bytes: u64,
        timeout: Duration,
    ) -> Result<Overrun, HostError>;
    /// Runs `workers` busy processes for `wall`, first outside any tenant cgroup, then in
    /// the tenant's CPU cgroup, and measures the CPU they took in each.
    fn overrun_cpu(
        &self,
        name: &str,
        workers: u32,
        wall: Duration,
    ) -> Result<CpuOverrun, HostError>;
    /// What serves the tenant's inference, read from the engine through its agent
    /// ([`Engine`]). An engine the verifier cannot read (none of the routes it knows
    /// answers, the payload is down) is an error, never a guess.
    fn engine(&self, name: &str) -> Result<Engine, HostError>;
    /// Sends the completion `body` to tenant `name` as `caller`; the answer and its time.
    fn completion(
        &self,
        name: &str,
        caller: Caller<'_>,
        body: &serde_json::Value,
    ) -> Result<Answered, HostError>;
    /// [`VerifyHost::completion`], retrying (up to `within`) while the tenant's request
    /// rate refuses it (429): a timing sample is the answered attempt, never a refusal.
    fn completion_paced(
        &self,
        name: &str,
        caller: Caller<'_>,
        body: &serde_json::Value,
        within: Duration,
    ) -> Result<Answered, HostError> {
        let deadline = std::time::Instant::now() + within;
        loop {
            match self.completion(name, caller, body) {
                Err(e) if e.status() == Some(429) && std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                other => return other,
            }
        }
    }
    /// Sends a completion with the tenant's own token; returns the time to the answer.
    fn complete(
        &self,
        name: &str,
        token: &str,
        prompt: &str,
        max_tokens: u32,
    ) -> Result<Duration, HostError> {
        let body = serde_json::json!({
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        });
        Ok(self.completion(name, Caller::Token(token), &body)?.elapsed)
    }
    /// [`VerifyHost::complete`], retrying (up to `within`) while the tenant's request rate
    /// refuses it (429).
    fn complete_paced(
        &self,
        name: &str,
        token: &str,
        prompt: &str,
        max_tokens: u32,
        within: Duration,
    ) -> Result<Duration, HostError> {
        let body = serde_json::json!({
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        });
        Ok(self
            .completion_paced(name, Caller::Token(token), &body, within)?
            .elapsed)
    }
    /// Restarts the tenant's inference server (with its own `token`) and waits up to
    /// `wait` until it answers its health check (to serve a model just pushed).
    fn restart_payload(&self, name: &str, token: &str, wait: Duration) -> Result<(), HostError>;
    /// The GPUs of the host (from the GPU backend the operator named); empty when the host
    /// has none or none was named.
    fn gpus(&self) -> Result<Vec<GpuView>, HostError>;
    /// The first bytes (up to 4 KiB) of the tenant's disk image, `None` when it has none.
    fn disk_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError>;
    /// The tenant's wrapped disk key file, `None` when it has none.
    fn wrapped_key(&self, name: &str) -> Result<Option<Vec<u8>>, HostError>;
    /// Host files (the daemon's state directory, its store, logs and tenant disks) that hold
    /// `marker` in plaintext.
    fn files_holding(&self, marker: &[u8]) -> Result<Vec<String>, HostError>;
    /// What of a tenant is still on the host: files, key, cgroup, processes of its uid,
    /// each in words (empty: nothing).
    fn leftovers(&self, name: &str, uid: Option<u32>) -> Result<Vec<String>, HostError>;
    /// The audit log entries of a tenant.
    fn receipts(&self, tenant: &str) -> Result<Vec<LogEntry>, HostError>;
    /// Reads a tenant's log with `token` (a probe's own token, or another probe's): the text,
    /// or the refusal as an error with its status.
    fn logs_with(&self, name: &str, token: &str, stream: LogStream) -> Result<String, HostError>;
    /// Reads a tenant's receipts with `token`: the count, or the refusal.
    fn receipts_with(&self, tenant: &str, token: &str) -> Result<usize, HostError>;
    /// Reads the per-tenant metrics (`GET /v1/metrics`, Prometheus text) with `token`
    /// (`None`: the admin's, every tenant's series).
    fn metrics_with(&self, token: Option<&str>) -> Result<String, HostError>;
    /// Lists a tenant's models with `token` (`GET /v1/tenants/{name}/models`): the model
    /// names, or the refusal.
    fn models_with(&self, name: &str, token: &str) -> Result<Vec<String>, HostError>;
    /// Pushes `bytes` as model `model` to the tenant with its own `token`.
    fn push_model(
        &self,
        name: &str,
        token: &str,
        model: &str,
        bytes: &[u8],
    ) -> Result<(), HostError>;
    /// Gives the tenant an inference key for the front door (with its own `token`).
    fn inference_key(&self, name: &str, token: &str) -> Result<String, HostError>;
    /// One request at the front door with an inference key: `GET path` (`body` `None`) or
    /// `POST path` with a JSON body; the status and the body as text.
    /// [`HostError::Unsupported`] when the operator named no front door.
    fn front_door(
        &self,
        key: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<(u16, String), HostError>;
    /// Starts a bounded load inside the tenant's guest (its agent's `load` command, which
    /// the daemon forwards for the admin only).
    fn guest_load(&self, name: &str, spec: LoadSpec) -> Result<(), HostError>;
    /// The latest load of `kind` in the tenant's guest.
    fn guest_load_status(&self, name: &str, kind: LoadKind) -> Result<LoadReport, HostError>;
    /// Whether the disk of tenant `disk_of` opens with the key of tenant `key_of` (the
    /// keyslot is only checked, nothing is mapped). [`HostError::Unsupported`] when the
    /// host cannot try it (no KEK readable, a header declaring a KDF cost above what the
    /// daemon writes).
    fn disk_opens_with(&self, disk_of: &str, key_of: &str) -> Result<bool, HostError>;
    /// What shares the GPUs at `gpus` (PCI addresses) without a hardware partition, in
    /// words: MPS processes on the host, VFs with a time-sliced vGPU type
    /// (`tenantvm_gpu::host::soft_sharing`). Empty when nothing does.
    fn gpu_soft_sharing(&self, gpus: &[String]) -> Result<Vec<String>, HostError>;
    /// The host's GPU state for check 10 (MIG instances from the GPU backend, reservations
    /// and quarantined slices from the daemon, VF vGPU types and vfio-pci bindings from
    /// sysfs); an empty snapshot on a host without `--gpu-backend`.
    fn gpu_snapshot(&self) -> Result<super::checks::gpu_departure::GpuSnapshot, HostError>;
    /// Positive control of [`VerifyHost::files_holding`]: writes `content` to a scratch file
    /// where the scan looks, says whether the scan finds `marker` there, and removes it.
    fn scan_finds(&self, content: &[u8], marker: &[u8]) -> Result<bool, HostError>;
}
