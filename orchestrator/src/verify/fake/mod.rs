//! A fake host for the checks' tests, named as such: tenants, files, receipts and timings
//! held in memory, healthy by default, with [`Broken`] switches that give each check the
//! deliberately broken host it must fail on (issue 16's list).
//!
//! `broken.rs` lists the switches, `gpu.rs` places and releases GPU slices as the daemon
//! would, and `loads.rs` runs the in-guest test loads.

mod broken;
mod gpu;
mod loads;

pub use broken::Broken;
use gpu::SliceItems;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tenantvm_agent_protocol::{LoadKind, LoadReport, LoadSpec};

use super::checks::gpu_departure::GpuSnapshot;
use super::host::{Answered, Caller, CpuOverrun, Engine, GpuView, HostError, Overrun, VerifyHost};
use crate::api::types::{GpuSlice, LogStream, TenantView};
use crate::backend::ResourceLimits;
use crate::domain::lifecycle::LifecycleState;
use crate::domain::spec::TenantSpec;
use crate::receipt::{
    Assurance, DepartureStep, LogEntry, Receipt, StepRecord, StepResult, RECEIPT_VERSION,
};

#[derive(Debug)]
struct FakeTenant {
    view: TenantView,
    token: String,
    disk: Option<Vec<u8>>,
}

#[derive(Debug, Default)]
struct State {
    tenants: BTreeMap<String, FakeTenant>,
    /// Host files: path -> contents.
    files: BTreeMap<String, Vec<u8>>,
    keys: BTreeMap<String, Vec<u8>>,
    leftovers: BTreeMap<String, Vec<String>>,
    receipts: Vec<LogEntry>,
    next_uid: u32,
    /// Prefix caches: per server instance, the prompts' first 90 % seen.
    caches: BTreeMap<String, HashSet<String>>,
    last_noisy: Option<Instant>,
    tick: u64,
    /// Models pushed: tenant -> names.
    models: BTreeMap<String, Vec<String>>,
    /// Inference keys: key -> tenant.
    inference_keys: BTreeMap<String, String>,
    /// Payload restarts, in order.
    restarts: Vec<String>,
    /// Requests answered per tenant (its metric).
    requests: BTreeMap<String, u64>,
    /// In-guest loads: (tenant, kind) -> spec and start.
    loads: BTreeMap<(String, &'static str), (LoadSpec, Instant)>,
    /// The GPU state (check 10's snapshot).
    gpu: GpuSnapshot,
    /// What each tenant's slice put there.
    slices: BTreeMap<String, SliceItems>,
}

/// Which engine the fake host's tenants run (all of them alike).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum FakeEngine {
    /// The n-gram server: it describes itself (`instance_id`, scopes) and counts cached
    /// prompt tokens.
    #[default]
    Ngram,
    /// llama-server: `/props` (slots, context), no instance identity, cached prompt tokens
    /// counted in its answers.
    Llama,
    /// llama-server whose answers count no cached tokens (a build without the field).
    LlamaUncounted,
    /// An engine none of the known routes reads (a payload verify does not know).
    Unreadable,
}

/// The fake host.
#[derive(Debug, Default)]
pub struct FakeVerifyHost {
    /// What is broken.
    pub broken: Broken,
    /// The engine its tenants run.
    pub engine: FakeEngine,
    /// Its GPUs.
    pub gpus: Vec<GpuView>,
    state: Mutex<State>,
    /// Every tenant name ever created (to show the probes were cleaned up).
    pub created: Mutex<BTreeSet<String>>,
}

const LUKS2: &[u8] = b"LUKS\xba\xbe\x00\x02";

impl FakeVerifyHost {
    /// A healthy host, or one broken as `broken` says.
    pub fn new(broken: Broken) -> FakeVerifyHost {
        FakeVerifyHost {
            broken,
            ..FakeVerifyHost::default()
        }
    }

    /// A host broken as `broken` says whose tenants run `engine`.
    pub fn with_engine(broken: Broken, engine: FakeEngine) -> FakeVerifyHost {
        FakeVerifyHost {
            broken,
            engine,
            ..FakeVerifyHost::default()
        }
    }

    /// A healthy host with these GPUs.
    pub fn with_gpus(gpus: Vec<GpuView>) -> FakeVerifyHost {
        FakeVerifyHost {
            gpus,
            ..FakeVerifyHost::default()
        }
    }

    fn st(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    /// Names of the tenants that exist now.
    pub fn names(&self) -> Vec<String> {
        self.st().tenants.keys().cloned().collect()
    }

    /// Adds a tenant as if an operator had created it, with a GPU slice.
    pub fn add_tenant(&self, spec: TenantSpec, gpu: Option<GpuSlice>) {
        let name = spec.name.to_string();
        let mut view = view_of(&spec, 0);
        view.gpu = gpu;
        self.st().tenants.insert(
            name,
            FakeTenant {
                view,
                token: "real".into(),
                disk: None,
            },
        );
    }

    /// Adds a running tenant whose guest is a plain kernel (no agent, no engine), as an
    /// operator's test guest would be.
    pub fn add_plain_tenant(&self, spec: TenantSpec) {
        let name = spec.name.to_string();
        self.add_tenant(spec, None);
        if let Some(t) = self.st().tenants.get_mut(&name) {
            t.view.guest = Some(crate::domain::GuestKind::Plain);
        }
    }

    /// A completion's answer after `ms`: one token per word, the first 90 % cached on a hit
    /// (as the fake's caches key prompts), counted as the engine kind counts.
    fn answer(&self, ms: f64, prompt: &str, hit: bool) -> Answered {
        let words = prompt.split(' ').count() as u64;
        let cached = if hit { words * 9 / 10 } else { 0 };
        let usage = match self.engine {
            FakeEngine::LlamaUncounted => {
                serde_json::json!({"prompt_tokens": words, "completion_tokens": 1})
            }
            _ => serde_json::json!({"prompt_tokens": words, "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": cached}}),
        };
        Answered {
            elapsed: Duration::from_secs_f64(ms / 1e3),
            body: serde_json::json!({"object": "text_completion", "usage": usage}),
        }
    }

    /// Tenants whose payload was restarted, in order.
    pub fn restarts(&self) -> Vec<String> {
        self.st().restarts.clone()
    }

    fn instance(&self, name: &str) -> String {
        if self.broken.shared_payload {
            "shared-instance".into()
        } else {
            format!("instance-{name}")
        }
    }
}

/// A view of `spec` as a running tenant with `uid`.
pub fn view_of(spec: &TenantSpec, uid: u32) -> TenantView {
    TenantView {
        name: spec.name.to_string(),
        state: LifecycleState::Running,
        op: Some("create".into()),
        error: None,
        steps: Vec::new(),
        spec: spec.clone(),
        uid: Some(uid),
        pid: Some(1000 + uid as i32),
        gpu: None,
        created_ms: 0,
        updated_ms: 0,
        recovering: false,
        agent_channel: None,
        vsock_cid: None,
        guest: Some(crate::domain::GuestKind::Agent),
    }
}

fn step(step: DepartureStep, assurance: Assurance) -> StepRecord {
    StepRecord::new(
        step,
        "fake",
        StepResult::Ok,
        assurance,
        "2026-01-01T00:00:00Z".into(),
        "2026-01-01T00:00:01Z".into(),
    )
}

fn refused() -> HostError {
    HostError::Api {
        status: 404,
        message: "No such tenant".into(),
    }
}

impl VerifyHost for FakeVerifyHost {
    fn tenants(&self) -> Result<Vec<TenantView>, HostError> {
        Ok(self.st().tenants.values().map(|t| t.view.clone()).collect())
    }

    fn tenant(&self, name: &str) -> Result<Option<TenantView>, HostError> {
        Ok(self.st().tenants.get(name).map(|t| t.view.clone()))
    }

    fn create(&self, spec: &TenantSpec, _timeout: Duration) -> Result<String, HostError> {
        let name = spec.name.to_string();
        let mut st = self.st();
        if st.tenants.contains_key(&name) {
            return Err(HostError::Api {
                status: 409,
                message: "name taken".into(),
            });
        }
        let slice = if spec.gpu.wants_gpu() {
            if self.broken.gpu_full {
                return Err(HostError::Api {
                    status: 409,
                    message: "no GPU slice free for this request".into(),
                });
            }
            Some(self.place(&mut st, &name, &spec.gpu)?)
        } else {
            None
        };
        st.next_uid += 1;
        let uid = 50_000 + st.next_uid;
        let token = format!("token-{name}");
        let disk = (spec.disk_gib > 0).then(|| {
            if self.broken.plaintext_disk {
                b"\x53\xef plaintext ext4".to_vec()
            } else {
                let mut d = LUKS2.to_vec();
                d.extend_from_slice(&[0xa5; 64]);
                d
            }
        });
        if disk.is_some() {
            let mut key = b"TVMWK1\0\0".to_vec();
            key.extend((0..crate::keys::WRAPPED_BYTES - 8).map(|i| (i as u8) ^ (uid as u8)));
            st.keys.insert(name.clone(), key);
        }
        let mut view = view_of(spec, uid);
        view.gpu = slice;
        st.tenants.insert(
            name.clone(),
            FakeTenant {
                view,
                token: token.clone(),
                disk,
            },
        );
        self.created.lock().unwrap().insert(name);
        Ok(token)
    }

    fn destroy(&self, name: &str, _timeout: Duration) -> Result<(), HostError> {
        let mut st = self.st();
        let Some(t) = st.tenants.remove(name) else {
            return Ok(());
        };
        // Its VM is gone, and its loads with it.
        st.loads.retain(|(t, _), _| t != name);
        let mut steps = vec![
            // As the daemon records it: the guest's own report.
            step(DepartureStep::AgentShutdown, Assurance::Unverified),
            step(DepartureStep::LogsRemoved, Assurance::Verified),
        ];
        if self.broken.shred_disabled {
            if t.disk.is_some() {
                st.leftovers.insert(
                    name.to_string(),
                    vec![
                        format!("its disk image {name}/disk.img"),
                        "its wrapped disk key".into(),
                    ],
                );
            }
        } else {
            st.keys.remove(name);
            st.files.retain(|p, _| !p.starts_with(&format!("{name}/")));
            let mut shred = step(DepartureStep::CryptoShred, Assurance::Verified);
            if !self.broken.receipt_silent_on_models {
                // As the daemon's crypto-shred step says it for tenants with an agent.
                shred.evidence.insert(
                    "tenant_data".into(),
                    "the disk held the tenant's data, its pushed models included".into(),
                );
            }
            steps.push(shred);
        }
        match st.slices.remove(name) {
            Some(items) => self.release_slice(&mut st, &items, &mut steps),
            None => steps.push(step(DepartureStep::GpuScrub, Assurance::Simulated)),
        }
        let seq = st.receipts.len() as u64;
        st.receipts.push(LogEntry {
            seq,
            prev_hash: String::new(),
            appended_at: String::new(),
            key_id: String::new(),
            receipt: Receipt {
                version: RECEIPT_VERSION,
                departure_id: format!("{name}-1"),
                tenant: name.to_string(),
                started_at: String::new(),
                finished_at: String::new(),
                steps,
                verification: None,
            },
            signature: String::new(),
        });
        Ok(())
    }

    fn cgroup_limits(&self, name: &str) -> Result<Option<ResourceLimits>, HostError> {
        let st = self.st();
        let Some(t) = st.tenants.get(name) else {
            return Ok(None);
        };
        let spec = &t.view.spec;
        Ok(Some(ResourceLimits {
            memory_bytes: if self.broken.no_memory_limit {
                u64::MAX
            } else {
                (u64::from(spec.memory_mib) + 64) << 20
            },
            cpu_quota_us: if self.broken.no_cpu_quota {
                u64::MAX
            } else {
                u64::from(spec.vcpus) * 100_000
            },
            cpu_period_us: 100_000,
            pids_max: 256,
        }))
    }

    fn overrun_memory(
        &self,
        name: &str,
        _bytes: u64,
        _timeout: Duration,
    ) -> Result<Overrun, HostError> {
        if !self.st().tenants.contains_key(name) {
            return Err(refused());
        }
        Ok(
            if self.broken.no_memory_limit || self.broken.memory_not_enforced {
                Overrun::Completed
            } else {
                Overrun::Killed
            },
        )
    }

    fn overrun_cpu(
        &self,
        name: &str,
        workers: u32,
        _wall: Duration,
    ) -> Result<CpuOverrun, HostError> {
        let st = self.st();
        let t = st.tenants.get(name).ok_or_else(refused)?;
        if self.broken.cpu_control_fails {
            return Err(HostError::Unsupported(
                "busy processes cannot be started here".into(),
            ));
        }
        let quota = f64::from(t.view.spec.vcpus);
        Ok(CpuOverrun {
            workers,
            outside_cpus: f64::from(workers),
            inside_cpus: if self.broken.no_cpu_quota || self.broken.cpu_not_enforced {
                f64::from(workers)
            } else {
                quota.min(f64::from(workers))
            },
        })
    }

    fn engine(&self, name: &str) -> Result<Engine, HostError> {
        let st = self.st();
        let t = st.tenants.get(name).ok_or_else(refused)?;
        if t.view.guest == Some(crate::domain::GuestKind::Plain) {
            return Ok(Engine::None);
        }
        match self.engine {
            FakeEngine::Ngram => Ok(Engine::Ngram(serde_json::json!({
                "server": "tenantvm-ngram (fake)",
                "instance_id": self.instance(name),
                "prefix_cache": {"enabled": true, "scope": "this server only (one server per VM)"},
                "batching": {"max_concurrency": 4, "scope": "one server per VM: requests of this VM only"},
            }))),
            FakeEngine::Llama | FakeEngine::LlamaUncounted => {
                Ok(Engine::LlamaServer(serde_json::json!({
                    "total_slots": 2,
                    "default_generation_settings": {"n_ctx": 4096},
                    "build_info": "b11669-fake",
                    "model_alias": "probe",
                })))
            }
            FakeEngine::Unreadable => Err(HostError::Failed(format!(
                "{name}: its engine answered 404 to GET /props and 404 to GET /v1/tenantvm/serving"
            ))),
        }
    }

    fn restart_payload(&self, name: &str, token: &str, _wait: Duration) -> Result<(), HostError> {
        let mut st = self.st();
        match st.tenants.get(name) {
            Some(t) if t.token == token => {}
            _ => return Err(refused()),
        }
        st.restarts.push(name.to_string());
        Ok(())
    }

    fn completion(
        &self,
        name: &str,
        caller: Caller<'_>,
        body: &serde_json::Value,
    ) -> Result<Answered, HostError> {
        let prompt = body["prompt"].as_str().unwrap_or_default();
        let mut st = self.st();
        // The front door picks the tenant from the key, as the real one does.
        let name = match caller {
            Caller::Token(token) => match st.tenants.get(name) {
                Some(t) if t.token == token => name.to_string(),
                _ => return Err(refused()),
            },
            Caller::Key(key) => match st.inference_keys.get(key) {
                Some(n) => n.clone(),
                None => {
                    return Err(HostError::Api {
                        status: 401,
                        message: "invalid key".into(),
                    })
                }
            },
        };
        let name = name.as_str();
        let instance = self.instance(name);
        st.tick += 1;
        *st.requests.entry(name.to_string()).or_default() += 1;
        let jitter = (st.tick * 7919 % 13) as f64 * 0.1;
        if self.broken.logs_prompts {
            st.files
                .entry("daemon.log".into())
                .or_default()
                .extend_from_slice(prompt.as_bytes());
        }
        if self.broken.plaintext_disk {
            st.files
                .entry(format!("{name}/disk.img"))
                .or_default()
                .extend_from_slice(prompt.as_bytes());
        }
        if name.contains("-noisy") {
            st.last_noisy = Some(Instant::now());
            drop(st);
            std::thread::sleep(Duration::from_millis(1));
            return Ok(self.answer(2.0, prompt, false));
        }
        let words: Vec<&str> = prompt.split(' ').collect();
        let key = words[..words.len() * 9 / 10].join(" ");
        let hit = !st.caches.entry(instance).or_default().insert(key);
        let mut ms = if hit { 5.0 } else { 50.0 } + jitter;
        let busy = st
            .last_noisy
            .is_some_and(|t| t.elapsed() < Duration::from_millis(100));
        // A CPU or disk load running in another guest.
        let guest_busy = st.loads.iter().any(|((t, kind), (spec, at))| {
            t != name
                && *kind != "memory"
                && at.elapsed() < Duration::from_secs(u64::from(spec.seconds))
        });
        if self.broken.no_cpu_quota && (busy || guest_busy) {
            ms *= 10.0;
        }
        // A guest that took more memory than it was given, moments ago.
        let pressure = st.loads.iter().any(|((t, kind), (_, at))| {
            t != name && *kind == "memory" && at.elapsed() < Duration::from_secs(5)
        });
        if self.broken.guest_ram_unbounded && pressure {
            ms *= 10.0;
        }
        Ok(self.answer(ms, prompt, hit))
    }

    fn gpus(&self) -> Result<Vec<GpuView>, HostError> {
        Ok(self.gpus.clone())
    }

    fn disk_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        Ok(self.st().tenants.get(name).and_then(|t| t.disk.clone()))
    }

    fn wrapped_key(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        Ok(self.st().keys.get(name).cloned())
    }

    fn files_holding(&self, marker: &[u8]) -> Result<Vec<String>, HostError> {
        if self.broken.blind_scan {
            return Ok(Vec::new());
        }
        Ok(self
            .st()
            .files
            .iter()
            .filter(|(_, c)| c.windows(marker.len()).any(|w| w == marker))
            .map(|(p, _)| p.clone())
            .collect())
    }

    fn leftovers(&self, name: &str, _uid: Option<u32>) -> Result<Vec<String>, HostError> {
        Ok(self.st().leftovers.get(name).cloned().unwrap_or_default())
    }

    fn receipts(&self, tenant: &str) -> Result<Vec<LogEntry>, HostError> {
        Ok(self
            .st()
            .receipts
            .iter()
            .filter(|e| e.receipt.tenant == tenant)
            .cloned()
            .collect())
    }

    fn logs_with(&self, name: &str, token: &str, stream: LogStream) -> Result<String, HostError> {
        let st = self.st();
        match st.tenants.get(name) {
            Some(t) if t.token == token || self.broken.cross_reads => {
                Ok(format!("{stream:?} log of {name}\n"))
            }
            _ => Err(refused()),
        }
    }

    fn metrics_with(&self, token: Option<&str>) -> Result<String, HostError> {
        let st = self.st();
        let only = match token {
            None => None,
            Some(token) => match st.tenants.iter().find(|(_, t)| t.token == token) {
                Some(_) if self.broken.metrics_unscoped => None,
                Some((name, _)) => Some(name.clone()),
                None => return Err(refused()),
            },
        };
        if self.broken.metrics_empty {
            return Ok(String::new());
        }
        Ok(render_metrics(&st, only.as_deref()))
    }

    fn models_with(&self, name: &str, token: &str) -> Result<Vec<String>, HostError> {
        let st = self.st();
        match st.tenants.get(name) {
            Some(t) if t.token == token || self.broken.cross_reads => {
                Ok(st.models.get(name).cloned().unwrap_or_default())
            }
            _ => Err(refused()),
        }
    }

    fn push_model(
        &self,
        name: &str,
        token: &str,
        model: &str,
        bytes: &[u8],
    ) -> Result<(), HostError> {
        let mut st = self.st();
        match st.tenants.get(name) {
            Some(t) if t.token == token => {}
            _ => return Err(refused()),
        }
        st.models
            .entry(name.to_string())
            .or_default()
            .push(model.to_string());
        if self.broken.plaintext_disk {
            st.files
                .entry(format!("{name}/disk.img"))
                .or_default()
                .extend_from_slice(bytes);
        }
        Ok(())
    }

    fn inference_key(&self, name: &str, token: &str) -> Result<String, HostError> {
        let mut st = self.st();
        match st.tenants.get(name) {
            Some(t) if t.token == token => {}
            _ => return Err(refused()),
        }
        let key = format!("tvmk-fake-{name}-{}", st.inference_keys.len());
        st.inference_keys.insert(key.clone(), name.to_string());
        Ok(key)
    }

    fn front_door(
        &self,
        key: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<(u16, String), HostError> {
        let Some(name) = self.st().inference_keys.get(key).cloned() else {
            return Ok((401, "invalid key".into()));
        };
        match (path, body) {
            ("/metrics", None) if self.broken.metrics_empty => Ok((200, String::new())),
            ("/metrics", None) => {
                let st = self.st();
                let only = (!self.broken.metrics_unscoped).then_some(name.as_str());
                Ok((200, render_metrics(&st, only)))
            }
            ("/v1/models", None) => {
                let st = self.st();
                let models = st.models.get(&name).cloned().unwrap_or_default();
                Ok((200, serde_json::json!({ "data": models }).to_string()))
            }
            ("/v1/completions", Some(b)) => {
                let a = self.completion(&name, Caller::Key(key), b)?;
                Ok((200, a.body.to_string()))
            }
            _ => Ok((404, "unknown route".into())),
        }
    }

    fn guest_load(&self, name: &str, spec: LoadSpec) -> Result<(), HostError> {
        self.start_load(name, spec)
    }

    fn guest_load_status(&self, name: &str, kind: LoadKind) -> Result<LoadReport, HostError> {
        self.load_status(name, kind)
    }

    fn disk_opens_with(&self, disk_of: &str, key_of: &str) -> Result<bool, HostError> {
        let st = self.st();
        let has_disk = |n: &str| st.tenants.get(n).is_some_and(|t| t.disk.is_some());
        if !has_disk(disk_of) || !st.keys.contains_key(key_of) {
            return Err(HostError::Unsupported(format!(
                "{disk_of} has no disk or {key_of} no key"
            )));
        }
        Ok(!self.broken.keys_open_nothing && (disk_of == key_of || self.broken.shared_disk_key))
    }

    fn scan_finds(&self, content: &[u8], marker: &[u8]) -> Result<bool, HostError> {
        const SCRATCH: &str = "verify-scan-control";
        self.st().files.insert(SCRATCH.into(), content.to_vec());
        let found = self.files_holding(marker);
        self.st().files.remove(SCRATCH);
        Ok(found?.iter().any(|p| p == SCRATCH))
    }

    fn gpu_soft_sharing(&self, gpus: &[String]) -> Result<Vec<String>, HostError> {
        let mut out = Vec::new();
        if self.broken.gpu_mps {
            out.push("an MPS process runs (nvidia-cuda-mps-control, pid 77)".to_string());
        }
        if self.broken.gpu_time_sliced {
            out.extend(gpus.iter().map(|g| {
                format!("VF of GPU {g} carries vGPU type 1056 on no GPU instance (time-sliced)")
            }));
        }
        Ok(out)
    }

    fn gpu_snapshot(&self) -> Result<GpuSnapshot, HostError> {
        if self.broken.gpu_view_blind {
            return Ok(GpuSnapshot::default());
        }
        Ok(self.st().gpu.clone())
    }

    fn receipts_with(&self, tenant: &str, token: &str) -> Result<usize, HostError> {
        let st = self.st();
        let own = st.tenants.get(tenant).is_some_and(|t| t.token == token);
        if own || self.broken.cross_reads {
            // The fake's probes have no receipts while alive; a leaky host shows one.
            Ok(usize::from(self.broken.cross_reads))
        } else {
            Ok(0)
        }
    }
}

/// The fake's per-tenant metrics in the Prometheus text format: every tenant's, or `only`'s.
fn render_metrics(st: &State, only: Option<&str>) -> String {
    let mut out = String::from("# TYPE tenantvm_requests_total counter\n");
    for name in st
        .tenants
        .keys()
        .filter(|n| only.is_none_or(|o| o == n.as_str()))
    {
        let n = st.requests.get(name).copied().unwrap_or(0);
        out.push_str(&format!(
            "tenantvm_requests_total{{tenant=\"{name}\"}} {n}\n"
        ));
    }
    out
}
