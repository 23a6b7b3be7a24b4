//! A fake host for the checks' tests, named as such: tenants, files, receipts and timings
//! held in memory, healthy by default, with [`Broken`] switches that give each check the
//! deliberately broken host it must fail on (issue 16's list).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tenantvm_agent_protocol::{LoadKind, LoadReport, LoadSpec, LoadState};

use super::checks::gpu_departure::GpuSnapshot;
use super::host::{Answered, Caller, CpuOverrun, Engine, GpuView, HostError, Overrun, VerifyHost};
use crate::api::types::{GpuSlice, LogStream, TenantView};
use crate::backend::ResourceLimits;
use crate::domain::lifecycle::LifecycleState;
use crate::domain::spec::TenantSpec;
use crate::receipt::{
    Assurance, DepartureStep, LogEntry, Receipt, StepRecord, StepResult, RECEIPT_VERSION,
};

/// What is broken on the fake host.
#[derive(Debug, Clone, Copy, Default)]
pub struct Broken {
    /// Tenants run without a memory limit in their cgroup.
    pub no_memory_limit: bool,
    /// The memory limit is written but not enforced (the controller is not really there).
    pub memory_not_enforced: bool,
    /// The CPU quota is written but not enforced.
    pub cpu_not_enforced: bool,
    /// Tenants run without a CPU quota, and a busy neighbour slows the others down.
    pub no_cpu_quota: bool,
    /// Disks are plaintext: what a payload writes is readable on the host.
    pub plaintext_disk: bool,
    /// The crypto-shred step of departures is disabled (the test-only hook).
    pub shred_disabled: bool,
    /// All tenants are routed to one payload with one shared prefix cache.
    pub shared_payload: bool,
    /// A debug mode logs every prompt to the daemon's log.
    pub logs_prompts: bool,
    /// A tenant's token reads every tenant's logs and receipts.
    pub cross_reads: bool,
    /// Metrics are served unscoped: a tenant's token or key reads every tenant's series.
    pub metrics_unscoped: bool,
    /// Metrics answer with no series at all, not even the reader's own: scoping cannot be
    /// judged from them.
    pub metrics_empty: bool,
    /// The plaintext scan is blind (reads nothing): what check 9's positive control is for.
    pub blind_scan: bool,
    /// A guest gets more memory than it was given (an in-guest overrun takes all it asks
    /// for), and the host's memory pressure slows its neighbours.
    pub guest_ram_unbounded: bool,
    /// The guest agents refuse test loads (an old guest image).
    pub guest_loads_refused: bool,
    /// Every tenant's disk opens with every tenant's key (one key for all).
    pub shared_disk_key: bool,
    /// No disk opens even with its own key (what check 9's key control is for).
    pub keys_open_nothing: bool,
    /// A guest touching more than its RAM gets its VMM killed by its own cgroup (the VMM
    /// overhead allowance is too small): the tenant fails, its neighbours do not notice.
    pub vmm_killed_by_overrun: bool,
    /// Receipts say nothing of the pushed models the shredded disk held.
    pub receipt_silent_on_models: bool,
    /// The GPU backend keeps a departed tenant's MIG instance (destroy-gpu-instance
    /// skipped).
    pub gpu_instance_left: bool,
    /// A departed tenant's VF keeps its vGPU type (`current_vgpu_type` not cleared).
    pub vf_type_left: bool,
    /// A departed tenant's device stays bound to vfio-pci (no rebind to its host driver).
    pub vfio_left_bound: bool,
    /// The store keeps a departed tenant's GPU reservation.
    pub reservation_left: bool,
    /// The receipt's GPU scrub step is recorded as skipped although a slice was held.
    pub gpu_scrub_skipped: bool,
    /// The scrub does not verify: the slice is quarantined (the receipt says so, the daemon
    /// lists it, its device stays bound): an honest outcome.
    pub gpu_quarantined: bool,
    /// The slice is quarantined but the receipt does not say so.
    pub quarantine_unrecorded: bool,
    /// The host's GPU view shows nothing, not even a running tenant's slice (what check
    /// 10's GPU control is for).
    pub gpu_view_blind: bool,
    /// A guest allocates GPU memory past its slice (the slice does not bound it).
    pub gpu_memory_unbounded: bool,
    /// An MPS control daemon runs on the host.
    pub gpu_mps: bool,
    /// A tenant GPU's VF carries a time-sliced vGPU type.
    pub gpu_time_sliced: bool,
    /// The CPU quota's control (busy processes outside any cgroup) cannot run.
    pub cpu_control_fails: bool,
    /// The probe image has no CUDA driver.
    pub no_cuda_in_guest: bool,
    /// No GPU slice is free: GPU requests are refused (409).
    pub gpu_full: bool,
    /// Slices share the GPU's compute (time-slicing, MPS): a slice's compute load runs at
    /// a quarter of its rate while another tenant's compute load runs.
    pub gpu_compute_shared: bool,
}

#[derive(Debug)]
struct FakeTenant {
    view: TenantView,
    token: String,
    disk: Option<Vec<u8>>,
}

/// What a slice put into the fake host's GPU state: its MIG instance, reservation, VF type
/// and vfio binding (each `None` where it has none).
#[derive(Debug, Default, Clone)]
struct SliceItems {
    instance: Option<String>,
    reservation: String,
    vf_type: Option<String>,
    bound: String,
    id: String,
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

    /// Places a GPU request as the daemon would: a MIG profile on the first GPU that has
    /// it (its instance, a VF with a vGPU type, bound to vfio-pci), or a whole non-MIG GPU
    /// no tenant holds (bound to vfio-pci).
    fn place(
        &self,
        st: &mut State,
        name: &str,
        req: &crate::domain::spec::GpuRequest,
    ) -> Result<GpuSlice, HostError> {
        let n = st.slices.len() as u32;
        let none_free = || HostError::Api {
            status: 409,
            message: "no GPU slice free for this request".into(),
        };
        let (gpu, label, items) = match &req.profile {
            Some(profile) => {
                let (g, p) = self
                    .gpus
                    .iter()
                    .find_map(|g| g.model.profile(profile).ok().map(|p| (g, p)))
                    .ok_or_else(none_free)?;
                let label = format!("{}@{n}", p.name);
                let vf = format!("{}.{}", &g.pci_address[..g.pci_address.len() - 2], n + 4);
                let items = SliceItems {
                    instance: Some(format!(
                        "{} gi {} profile {} @{n}",
                        g.pci_address,
                        n + 1,
                        p.id
                    )),
                    reservation: format!("{}/{label}", g.pci_address),
                    vf_type: Some(format!("{vf} current_vgpu_type 557")),
                    bound: vf,
                    id: format!("{}/{label}", g.pci_address),
                };
                (g.pci_address.clone(), label, items)
            }
            None => {
                let held: BTreeSet<&str> = st
                    .tenants
                    .values()
                    .filter_map(|t| t.view.gpu.as_ref().map(|s| s.gpu.as_str()))
                    .collect();
                let g = self
                    .gpus
                    .iter()
                    .find(|g| !g.model.has_mig() && !held.contains(g.pci_address.as_str()))
                    .ok_or_else(none_free)?;
                let items = SliceItems {
                    instance: None,
                    reservation: format!("{}/whole", g.pci_address),
                    vf_type: None,
                    bound: g.pci_address.clone(),
                    id: format!("{}/whole", g.pci_address),
                };
                (g.pci_address.clone(), "whole".to_string(), items)
            }
        };
        let gs = &mut st.gpu;
        gs.instances.extend(items.instance.clone());
        gs.reservations.insert(items.reservation.clone());
        gs.vf_types.extend(items.vf_type.clone());
        gs.vfio_bound.insert(items.bound.clone());
        st.slices.insert(name.to_string(), items);
        Ok(GpuSlice {
            gpu,
            slots: vec![n],
            label,
        })
    }

    /// A departure's GPU steps on the fake: each undone unless [`Broken`] says otherwise,
    /// and recorded in the receipt.
    fn release_slice(&self, st: &mut State, items: &SliceItems, steps: &mut Vec<StepRecord>) {
        let b = self.broken;
        let gs = &mut st.gpu;
        if !b.gpu_instance_left {
            if let Some(i) = &items.instance {
                gs.instances.remove(i);
            }
        }
        if !b.vf_type_left {
            if let Some(t) = &items.vf_type {
                gs.vf_types.remove(t);
            }
        }
        if !b.reservation_left {
            gs.reservations.remove(&items.reservation);
        }
        let quarantined = b.gpu_quarantined || b.quarantine_unrecorded;
        if !b.vfio_left_bound && !quarantined {
            gs.vfio_bound.remove(&items.bound);
        }
        if quarantined {
            gs.quarantined.insert(items.id.clone());
        }
        steps.push(step(DepartureStep::DeviceReset, Assurance::Simulated));
        let scrub = if b.gpu_scrub_skipped {
            StepRecord::new(
                DepartureStep::GpuScrub,
                "fake",
                StepResult::Skipped,
                Assurance::NotApplicable,
                "2026-01-01T00:00:00Z".into(),
                "2026-01-01T00:00:01Z".into(),
            )
        } else if b.gpu_quarantined {
            StepRecord::new(
                DepartureStep::GpuScrub,
                "fake",
                StepResult::Failed,
                Assurance::Unverified,
                "2026-01-01T00:00:00Z".into(),
                "2026-01-01T00:00:01Z".into(),
            )
            .with_evidence("quarantined", true)
            .failed("fake: residue found after the scrub")
        } else {
            step(DepartureStep::GpuScrub, Assurance::Simulated)
        };
        steps.push(scrub);
        steps.push(step(DepartureStep::GpuRelease, Assurance::Simulated));
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
        let mut st = self.st();
        if !st.tenants.contains_key(name) {
            return Err(refused());
        }
        if self.broken.guest_loads_refused {
            return Err(HostError::Api {
                status: 502,
                message: "the agent answered load with bad-request: unknown variant `load`".into(),
            });
        }
        if self.broken.vmm_killed_by_overrun && spec.kind == LoadKind::Memory {
            if let Some(t) = st.tenants.get_mut(name) {
                t.view.state = LifecycleState::Failed;
            }
            return Ok(());
        }
        st.loads.insert(
            (name.to_string(), spec.kind.as_str()),
            (spec, Instant::now()),
        );
        Ok(())
    }

    fn guest_load_status(&self, name: &str, kind: LoadKind) -> Result<LoadReport, HostError> {
        let st = self.st();
        let t = st.tenants.get(name).ok_or_else(refused)?;
        if t.view.state != LifecycleState::Running {
            return Err(HostError::Api {
                status: 409,
                message: format!("Tenant {name:?} is not running"),
            });
        }
        let guest = u64::from(t.view.spec.memory_mib);
        let mut r = LoadReport {
            spec: None,
            state: LoadState::Idle,
            elapsed_ms: 0,
            progress: 0,
            exit_code: None,
            oom_kills: 0,
            guest_mem_total_mib: guest - 8,
            error: None,
        };
        let Some((spec, at)) = st.loads.get(&(name.to_string(), kind.as_str())) else {
            return Ok(r);
        };
        r.spec = Some(*spec);
        r.elapsed_ms = at.elapsed().as_millis() as u64;
        let ran_out = at.elapsed() >= Duration::from_secs(u64::from(spec.seconds));
        match kind {
            LoadKind::Memory
                if self.broken.guest_ram_unbounded || u64::from(spec.amount) < guest =>
            {
                r.state = LoadState::Finished;
                r.exit_code = Some(0);
                r.progress = u64::from(spec.amount);
            }
            LoadKind::GpuMemory if self.broken.no_cuda_in_guest => {
                r.state = LoadState::Failed;
                r.exit_code = Some(1);
                r.error = Some("no CUDA driver in the guest: cannot load libcuda.so.1: libcuda.so.1: cannot open shared object file: No such file or directory".into());
            }
            LoadKind::GpuMemory => {
                let slice_mib = t
                    .view
                    .gpu
                    .as_ref()
                    .and_then(|s| super::gpu_probe::slice_memory_mib(&self.gpus, s))
                    .unwrap_or(0);
                r.state = LoadState::Finished;
                r.exit_code = Some(0);
                // The driver's own context takes a little of the slice.
                r.progress = if self.broken.gpu_memory_unbounded {
                    u64::from(spec.amount)
                } else {
                    slice_mib.saturating_sub(400)
                };
            }
            LoadKind::GpuCompute if self.broken.no_cuda_in_guest => {
                r.state = LoadState::Failed;
                r.exit_code = Some(1);
                r.error = Some("no CUDA driver in the guest: cannot load libcuda.so.1: libcuda.so.1: cannot open shared object file: No such file or directory".into());
            }
            LoadKind::GpuCompute => {
                let run = at
                    .elapsed()
                    .min(Duration::from_secs(u64::from(spec.seconds)));
                // Another tenant's compute load running during this one's.
                let start = *at;
                let end = start + run;
                let contended = st.loads.iter().any(|((n, k), (s, t))| {
                    n != name
                        && *k == LoadKind::GpuCompute.as_str()
                        && *t < end
                        && *t + Duration::from_secs(u64::from(s.seconds)) > start
                });
                // A slice's own rate: 1000 million multiply-adds per second per block
                // batch, a quarter of it when its compute is shared with a busy neighbour.
                let per_s: u64 = if self.broken.gpu_compute_shared && contended {
                    250
                } else {
                    1000
                };
                r.elapsed_ms = run.as_millis() as u64;
                r.progress = r.elapsed_ms * per_s / 1000 + 1;
                r.state = if ran_out {
                    LoadState::Finished
                } else {
                    LoadState::Running
                };
                r.exit_code = ran_out.then_some(0);
            }
            LoadKind::Memory => {
                r.state = LoadState::Killed;
                r.exit_code = Some(137);
                r.progress = guest - 24;
                r.oom_kills = 1;
            }
            _ => {
                r.state = if ran_out {
                    LoadState::Finished
                } else {
                    LoadState::Running
                };
                r.exit_code = ran_out.then_some(0);
                r.progress = r.elapsed_ms / 10 + 1;
            }
        }
        Ok(r)
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
