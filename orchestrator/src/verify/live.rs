//! The live host: the daemon's API (admin token, and each probe's own token for the reads a
//! tenant makes), plus read-only looks at what the daemon keeps on the host: cgroup limits
//! (through [`crate::jail::Cgroups`], the same paths the jail writes), the state directory
//! (disk images, wrapped keys, logs, the store), `/proc`, and the GPU backend the operator
//! names. It must run on the daemon's host, as root, to see those.
//!
//! The checks are synchronous; the API client is async. [`LiveHost`] runs on a blocking
//! thread and drives each API call on the runtime through its handle.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hyper::Method;
use tenantvm_agent_protocol::{
    AgentClient, AgentEndpoint, HttpRequest, LoadKind, LoadReport, LoadSpec,
};

use super::host::{
    io_err, Answered, Caller, CpuOverrun, Engine, GpuView, HostError, Overrun, VerifyHost,
};
use super::procs::{busy_cpus, processes_of};
use super::scan::{scan, skip_real_disks};
use crate::api::types::{LogQuery, LogStream, TenantView};
use crate::backend::ResourceLimits;
use crate::client::{Client, ClientError};
use crate::domain::lifecycle::LifecycleState;
use crate::domain::spec::TenantSpec;
use crate::domain::GuestKind;
use crate::jail::Cgroups;
use crate::receipt::LogEntry;

/// How often a wait polls the daemon.
const POLL: Duration = Duration::from_millis(250);
/// Deadline of one agent exchange.
const AGENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the live host's parts are.
#[derive(Debug, Clone)]
pub struct LivePaths {
    /// The daemon's socket.
    pub socket: PathBuf,
    /// The daemon's state directory.
    pub state_dir: PathBuf,
    /// The cgroup filesystem root.
    pub cgroup_root: PathBuf,
    /// `nvml` or `sim:FILE`; none: the host's GPUs are not looked at.
    pub gpu_backend: Option<String>,
    /// The root the host's sysfs is mounted under (`/`), where check 10 reads VF vGPU
    /// types and vfio-pci bindings.
    pub gpu_sysfs_root: PathBuf,
    /// More files or directories the plaintext scan reads (the daemon's log file).
    pub scan_extra: Vec<PathBuf>,
    /// The daemon's key-encryption key (`tenantvmd --kek-file`; a systemd credential
    /// `tenantvm-kek` wins when present), read to unwrap probe disk keys (check 9).
    pub kek_file: PathBuf,
}

/// The live host.
pub struct LiveHost {
    admin: Client,
    rt: tokio::runtime::Handle,
    paths: LivePaths,
    door: Option<super::door::FrontDoorClient>,
    /// The daemon's store, where check 10 reads GPU reservations (default
    /// `<state-dir>/state.db`, where tenantvmd keeps it).
    store_db: PathBuf,
}

/// Deadline of one front-door request.
const DOOR_TIMEOUT: Duration = Duration::from_secs(30);

fn from_client(e: ClientError) -> HostError {
    match e {
        ClientError::Api {
            status, message, ..
        } => HostError::Api {
            status: status.as_u16(),
            message: crate::untrusted::one_line(&message),
        },
        ClientError::Connect { .. } => HostError::Unreachable(e.to_string()),
        other => HostError::Failed(crate::untrusted::one_line(&other.to_string())),
    }
}

impl LiveHost {
    /// A live host reached with the admin `token`; `rt` is the runtime the API calls run on
    /// (call the host's methods from a blocking thread of it, never from async code).
    pub fn new(token: &str, rt: tokio::runtime::Handle, paths: LivePaths) -> LiveHost {
        LiveHost {
            admin: Client::new(paths.socket.clone(), token),
            rt,
            store_db: paths.state_dir.join("state.db"),
            paths,
            door: None,
        }
    }

    /// The same host, reading the daemon's store at `db` (a test harness keeps it apart).
    pub fn with_store_db(mut self, db: PathBuf) -> LiveHost {
        self.store_db = db;
        self
    }

    /// The same host, with the front door reached at `target` (checks 7 and 9 read a
    /// probe's metrics and models there, with an inference key).
    pub fn with_front_door(
        mut self,
        target: super::door::FrontDoorTarget,
    ) -> Result<LiveHost, HostError> {
        self.door = Some(super::door::FrontDoorClient::new(target)?);
        Ok(self)
    }

    fn as_tenant(&self, token: &str) -> Client {
        Client::new(self.paths.socket.clone(), token)
    }

    /// The daemon's version and backend.
    pub fn daemon(&self) -> Result<String, HostError> {
        let h = self.rt.block_on(self.admin.health()).map_err(from_client)?;
        Ok(format!("{} ({})", h.version, h.backend))
    }

    fn tenant_dir(&self, name: &str) -> PathBuf {
        self.paths.state_dir.join("tenants").join(name)
    }

    fn cgroups(&self) -> Result<Cgroups, HostError> {
        Cgroups::detect_at(&self.paths.cgroup_root)
            .and_then(|c| c.for_state_dir(&self.paths.state_dir))
            .map_err(|e| HostError::Unsupported(format!("cgroups: {e}")))
    }

    /// A connection to the tenant's guest agent, straight to its socket (the peer's uid
    /// checked where the socket has one): what it reads is that VM's own, whatever the
    /// daemon's routing does.
    fn agent_of(&self, view: &TenantView) -> Result<AgentClient, HostError> {
        let name = &view.name;
        let run = self.tenant_dir(name).join(crate::backend::runner::RUN_DIR);
        let endpoint = match view.vsock_cid {
            Some(cid) => AgentEndpoint::vhost_vsock(cid),
            None => [
                AgentEndpoint::vsock(run.join(crate::backend::vmm::VSOCK_SOCK)),
                AgentEndpoint::Serial(run.join(crate::backend::qemu::AGENT_SOCK)),
            ]
            .into_iter()
            .find(|e| e.path().is_some_and(Path::exists))
            .ok_or_else(|| {
                HostError::Unsupported(format!("{name}: no agent socket under {}", run.display()))
            })?,
        };
        match view.uid {
            Some(uid) => AgentClient::connect_checked(&endpoint, uid, AGENT_TIMEOUT),
            None => AgentClient::connect(&endpoint, AGENT_TIMEOUT),
        }
        .map_err(agent_err(name))
    }

    fn wait(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut(Option<&TenantView>) -> Result<bool, HostError>,
    ) -> Result<(), HostError> {
        let deadline = Instant::now() + timeout;
        loop {
            let t = self.tenant(name)?;
            if done(t.as_ref())? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(HostError::Timeout {
                    what: format!("{what} of {name}"),
                    seconds: timeout.as_secs(),
                });
            }
            std::thread::sleep(POLL);
        }
    }
}

/// llama-server's configuration route.
const LLAMA_PROPS: &str = "/props";
/// The n-gram server's description of itself.
const NGRAM_SERVING: &str = "/v1/tenantvm/serving";

fn agent_err(name: &str) -> impl Fn(tenantvm_agent_protocol::AgentClientError) -> HostError + '_ {
    move |e| {
        HostError::Failed(format!(
            "{name}: agent: {}",
            crate::untrusted::one_line(&e.to_string())
        ))
    }
}

/// `GET path` of the tenant's engine through its agent: the status and the body.
fn agent_get(agent: &mut AgentClient, name: &str, path: &str) -> Result<(u16, String), HostError> {
    let answer = agent
        .infer(
            HttpRequest {
                method: "GET".into(),
                path: path.into(),
                headers: Vec::new(),
                body: String::new(),
            },
            AGENT_TIMEOUT,
        )
        .map_err(agent_err(name))?;
    Ok((answer.status, answer.body))
}

fn failed_op(t: &TenantView) -> bool {
    t.error.is_some() && t.steps.last().is_some_and(|s| s.status == "failed")
}

impl VerifyHost for LiveHost {
    fn tenants(&self) -> Result<Vec<TenantView>, HostError> {
        Ok(self
            .rt
            .block_on(self.admin.list())
            .map_err(from_client)?
            .tenants)
    }

    fn tenant(&self, name: &str) -> Result<Option<TenantView>, HostError> {
        match self.rt.block_on(self.admin.status(name)) {
            Ok(t) => Ok(Some(t)),
            Err(ClientError::Api { status, .. }) if status.as_u16() == 404 => Ok(None),
            Err(e) => Err(from_client(e)),
        }
    }

    fn create(&self, spec: &TenantSpec, timeout: Duration) -> Result<String, HostError> {
        let created = self
            .rt
            .block_on(self.admin.create(spec))
            .map_err(from_client)?;
        let name = spec.name.as_str();
        self.wait(name, "create", timeout, |t| match t {
            Some(t) if t.state == LifecycleState::Running => Ok(true),
            Some(t) if t.state == LifecycleState::Failed || failed_op(t) => {
                Err(HostError::Failed(format!(
                    "probe {name} did not start: {}",
                    crate::untrusted::one_line(t.error.as_deref().unwrap_or("failed"))
                )))
            }
            Some(_) => Ok(false),
            None => Err(HostError::Failed(format!(
                "probe {name} vanished while starting"
            ))),
        })?;
        Ok(created.token)
    }

    fn destroy(&self, name: &str, timeout: Duration) -> Result<(), HostError> {
        // A tenant still busy (being created) is waited for, then destroyed.
        let deadline = Instant::now() + timeout;
        loop {
            match self.rt.block_on(self.admin.destroy(name)) {
                Ok(_) => break,
                Err(ClientError::Api { status, .. }) if status.as_u16() == 404 => return Ok(()),
                Err(ClientError::Api { status, .. })
                    if status.as_u16() == 409 && Instant::now() < deadline =>
                {
                    std::thread::sleep(POLL);
                }
                Err(e) => return Err(from_client(e)),
            }
        }
        self.wait(name, "destroy", timeout, |t| match t {
            None => Ok(true),
            Some(t) if t.state == LifecycleState::Destroying && failed_op(t) => {
                Err(HostError::Failed(format!(
                    "destroy of {name} stopped: {}",
                    crate::untrusted::one_line(t.error.as_deref().unwrap_or("failed"))
                )))
            }
            Some(_) => Ok(false),
        })
    }

    fn cgroup_limits(&self, name: &str) -> Result<Option<ResourceLimits>, HostError> {
        let handle = self
            .cgroups()?
            .handle(name)
            .map_err(|e| HostError::Failed(e.to_string()))?;
        if handle.dirs().iter().all(|d| !d.exists()) {
            return Ok(None);
        }
        handle
            .read_limits()
            .map(Some)
            .map_err(|e| HostError::Failed(format!("cgroup of {name}: {e}")))
    }

    fn overrun_memory(
        &self,
        name: &str,
        bytes: u64,
        timeout: Duration,
    ) -> Result<Overrun, HostError> {
        let handle = self
            .cgroups()?
            .handle(name)
            .map_err(|e| HostError::Failed(e.to_string()))?;
        let memory = match &handle {
            crate::jail::CgroupHandle::V1 { memory, .. } => memory.clone(),
            crate::jail::CgroupHandle::V2 { path } => path.clone(),
        };
        if !memory.exists() {
            return Err(HostError::Failed(format!("{name} has no memory cgroup")));
        }
        // The shell makes itself the OOM killer's first choice (so the cgroup's OOM kill
        // takes it, not the tenant's VMM), joins the cgroup, then becomes dd, whose one block
        // of `bytes` is allocated and written (zeroes read into it) inside the cgroup. No code
        // runs between fork and exec here; the path is an argument, never shell text.
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(r#"echo 1000 > /proc/$$/oom_score_adj; echo $$ > "$1/cgroup.procs" || exit 97; exec dd if=/dev/zero of=/dev/null bs="$2" count=1 status=none"#)
            .arg("tenantvm-verify-overrun")
            .arg(&memory)
            .arg(bytes.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| HostError::Failed(format!("cannot run sh and dd: {e}")))?;
        let deadline = Instant::now() + timeout;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    use std::os::unix::process::ExitStatusExt;
                    return match (status.signal(), status.code()) {
                        (Some(libc::SIGKILL), _) => Ok(Overrun::Killed),
                        (_, Some(0)) => Ok(Overrun::Completed),
                        (_, Some(97)) => Err(HostError::Failed(format!(
                            "cannot join the memory cgroup {}",
                            memory.display()
                        ))),
                        _ => Err(HostError::Failed(format!(
                            "the overrun process ended with {status}"
                        ))),
                    };
                }
                Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL / 5),
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Ok(Overrun::TimedOut);
                }
                Err(e) => return Err(HostError::Failed(format!("waiting for dd: {e}"))),
            }
        }
    }

    fn overrun_cpu(
        &self,
        name: &str,
        workers: u32,
        wall: Duration,
    ) -> Result<CpuOverrun, HostError> {
        let handle = self
            .cgroups()?
            .handle(name)
            .map_err(|e| HostError::Failed(e.to_string()))?;
        let cpu = match &handle {
            crate::jail::CgroupHandle::V1 { cpu, .. } => cpu.clone(),
            crate::jail::CgroupHandle::V2 { path } => path.clone(),
        };
        if !cpu.exists() {
            return Err(HostError::Failed(format!("{name} has no CPU cgroup")));
        }
        let outside_cpus = busy_cpus(None, workers, wall)?;
        let inside_cpus = busy_cpus(Some(&cpu), workers, wall)?;
        Ok(CpuOverrun {
            workers,
            outside_cpus,
            inside_cpus,
        })
    }

    fn engine(&self, name: &str) -> Result<Engine, HostError> {
        let view = self
            .tenant(name)?
            .ok_or_else(|| HostError::Failed(format!("{name}: no such tenant")))?;
        if view.guest == Some(GuestKind::Plain) {
            return Ok(Engine::None);
        }
        let mut agent = self.agent_of(&view)?;
        // llama.cpp's llama-server describes its configuration at /props; the project's
        // n-gram server at /v1/tenantvm/serving. Each answers 404 to the other's route.
        let mut refused = Vec::new();
        for path in [LLAMA_PROPS, NGRAM_SERVING] {
            let (status, body) = agent_get(&mut agent, name, path)?;
            if status != 200 {
                refused.push(format!("{status} to GET {path}"));
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| {
                HostError::Failed(format!("{name}: GET {path} answered no JSON: {e}"))
            })?;
            return Ok(if path == LLAMA_PROPS {
                Engine::LlamaServer(v)
            } else {
                Engine::Ngram(v)
            });
        }
        Err(HostError::Failed(format!(
            "{name}: its engine answered {}: not an engine verify can read (llama-server, the n-gram server)",
            refused.join(" and ")
        )))
    }

    fn completion(
        &self,
        name: &str,
        caller: Caller<'_>,
        body: &serde_json::Value,
    ) -> Result<Answered, HostError> {
        let started = Instant::now();
        let body = match caller {
            Caller::Token(token) => self
                .rt
                .block_on(self.as_tenant(token).infer(name, body))
                .map_err(from_client)?,
            Caller::Key(key) => {
                let (status, text) = self.front_door(key, "/v1/completions", Some(body))?;
                if status != 200 {
                    return Err(HostError::Api {
                        status,
                        message: crate::untrusted::one_line(&text),
                    });
                }
                serde_json::from_str(&text).map_err(|e| {
                    HostError::Failed(format!("the front door's answer is no JSON: {e}"))
                })?
            }
        };
        Ok(Answered {
            elapsed: started.elapsed(),
            body,
        })
    }

    fn restart_payload(&self, name: &str, token: &str, wait: Duration) -> Result<(), HostError> {
        let body = serde_json::to_vec(&crate::api::payload::RestartRequest {
            wait_s: Some(wait.as_secs().max(1)),
        })
        .map_err(|e| HostError::Failed(e.to_string()))?;
        let _: crate::api::payload::PayloadRestarted = self
            .rt
            .block_on(self.as_tenant(token).call(
                Method::POST,
                &format!("/v1/tenants/{name}/payload/restart"),
                Some(body),
            ))
            .map_err(from_client)?;
        Ok(())
    }

    fn gpus(&self) -> Result<Vec<GpuView>, HostError> {
        let Some(arg) = &self.paths.gpu_backend else {
            return Ok(Vec::new());
        };
        let unsupported =
            |e: &dyn std::fmt::Display| HostError::Unsupported(format!("GPU backend {arg}: {e}"));
        let spec: tenantvm_gpu::backend::BackendSpec = arg.parse().map_err(|e| unsupported(&e))?;
        let backend = tenantvm_gpu::backend::open(&spec).map_err(|e| unsupported(&e))?;
        let gpus = backend.gpus().map_err(|e| unsupported(&e))?;
        Ok(gpus
            .into_iter()
            .map(|g| GpuView {
                index: g.index.to_string(),
                pci_address: g.pci_address.clone(),
                // The same rule the planner and `host check` use to name the model.
                model: tenantvm_gpu::mig::decide(&g.facts()).model,
                name: g.name,
            })
            .collect())
    }

    fn disk_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        let path = self
            .tenant_dir(name)
            .join(crate::tenant::steps::disk::IMAGE_FILE);
        let mut f = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&path)(e)),
        };
        let mut buf = Vec::with_capacity(4096);
        f.by_ref()
            .take(4096)
            .read_to_end(&mut buf)
            .map_err(io_err(&path))?;
        Ok(Some(buf))
    }

    fn wrapped_key(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        let path = self
            .paths
            .state_dir
            .join("keys")
            .join(format!("{name}.wrapped"));
        match std::fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&path)(e)),
        }
    }

    fn files_holding(&self, marker: &[u8]) -> Result<Vec<String>, HostError> {
        let mut roots = vec![self.paths.state_dir.clone()];
        roots.extend(self.paths.scan_extra.iter().cloned());
        let mut found = Vec::new();
        for root in roots {
            scan(&root, marker, &mut found, &skip_real_disks)?;
        }
        Ok(found)
    }

    fn leftovers(&self, name: &str, uid: Option<u32>) -> Result<Vec<String>, HostError> {
        let mut out = Vec::new();
        let dir = self.tenant_dir(name);
        if dir.exists() {
            out.push(format!("its directory {}", dir.display()));
        }
        if let Some(key) = self.wrapped_key(name)? {
            out.push(format!("its wrapped disk key ({} bytes)", key.len()));
        }
        if let Ok(cg) = self.cgroups() {
            if let Ok(handle) = cg.handle(name) {
                for d in handle.dirs() {
                    if d.exists() {
                        out.push(format!("its cgroup {}", d.display()));
                    }
                }
            }
        }
        if let Some(uid) = uid {
            for pid in processes_of(uid) {
                out.push(format!("process {pid} still runs as its uid {uid}"));
            }
        }
        Ok(out)
    }

    fn receipts(&self, tenant: &str) -> Result<Vec<LogEntry>, HostError> {
        Ok(self
            .rt
            .block_on(self.admin.receipts(Some(tenant)))
            .map_err(from_client)?
            .receipts
            .into_iter()
            .filter(|e| e.receipt.tenant == tenant)
            .collect())
    }

    fn logs_with(&self, name: &str, token: &str, stream: LogStream) -> Result<String, HostError> {
        let q = LogQuery {
            stream,
            tail: Some(100),
            ..LogQuery::default()
        };
        let chunk = self
            .rt
            .block_on(self.as_tenant(token).logs(name, &q))
            .map_err(from_client)?;
        let mut text = chunk.text;
        for e in chunk.events {
            text.push_str(&e.message);
            text.push('\n');
        }
        Ok(text)
    }

    fn metrics_with(&self, token: Option<&str>) -> Result<String, HostError> {
        let client = match token {
            Some(t) => self.as_tenant(t),
            None => self.admin.clone(),
        };
        let (status, bytes) = self
            .rt
            .block_on(client.raw(Method::GET, "/v1/metrics", None))
            .map_err(from_client)?;
        answer(status, &bytes)
    }

    fn models_with(&self, name: &str, token: &str) -> Result<Vec<String>, HostError> {
        let list: crate::api::models::ModelList = self
            .rt
            .block_on(self.as_tenant(token).call(
                Method::GET,
                &format!("/v1/tenants/{name}/models"),
                None,
            ))
            .map_err(from_client)?;
        Ok(list.models.into_iter().map(|m| m.name).collect())
    }

    fn push_model(
        &self,
        name: &str,
        token: &str,
        model: &str,
        bytes: &[u8],
    ) -> Result<(), HostError> {
        let (status, answer) =
            self.rt
                .block_on(put_model(&self.paths.socket, token, name, model, bytes))?;
        answer_json::<crate::api::models::ModelStored>(status, &answer).map(|_| ())
    }

    fn inference_key(&self, name: &str, token: &str) -> Result<String, HostError> {
        let created: crate::api::keys::KeyCreated = self
            .rt
            .block_on(self.as_tenant(token).call(
                Method::POST,
                &format!("/v1/tenants/{name}/keys"),
                None,
            ))
            .map_err(from_client)?;
        Ok(created.key)
    }

    fn front_door(
        &self,
        key: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<(u16, String), HostError> {
        match &self.door {
            Some(door) => door.request(key, path, body, DOOR_TIMEOUT),
            None => Err(HostError::Unsupported(
                "no front door named (--front-door ADDR --front-door-ca PEM)".into(),
            )),
        }
    }

    fn guest_load(&self, name: &str, spec: LoadSpec) -> Result<(), HostError> {
        let body = serde_json::to_vec(&spec).map_err(|e| HostError::Failed(e.to_string()))?;
        let _: crate::api::load::LoadStarted = self
            .rt
            .block_on(self.admin.call(
                Method::POST,
                &format!("/v1/tenants/{name}/load"),
                Some(body),
            ))
            .map_err(from_client)?;
        Ok(())
    }

    fn guest_load_status(&self, name: &str, kind: LoadKind) -> Result<LoadReport, HostError> {
        let status: crate::api::load::LoadStatus = self
            .rt
            .block_on(self.admin.call(
                Method::GET,
                &format!("/v1/tenants/{name}/load/{}", kind.as_str()),
                None,
            ))
            .map_err(from_client)?;
        Ok(status.report)
    }

    fn disk_opens_with(&self, disk_of: &str, key_of: &str) -> Result<bool, HostError> {
        use crate::keys::{HostKek, KekSource, KeyStore};
        let source = KekSource::detect(&self.paths.kek_file);
        // Loading a KEK file creates it when absent: never here.
        if let KekSource::File(p) = &source {
            if !p.exists() {
                return Err(HostError::Unsupported(format!(
                    "no KEK at {} (give the daemon's --kek-file)",
                    p.display()
                )));
            }
        }
        let unsupported = |e: crate::keys::KeyError| HostError::Unsupported(format!("keys: {e}"));
        let kek = HostKek::load(&source).map_err(unsupported)?;
        let key = KeyStore::new(&self.paths.state_dir.join("keys"), kek)
            .and_then(|ks| ks.unwrap(key_of))
            .map_err(unsupported)?;
        let image = self
            .tenant_dir(disk_of)
            .join(crate::tenant::steps::disk::IMAGE_FILE);
        let scratch = self.paths.state_dir.join("verify").join("key-scratch");
        super::cross_key::snapshot_opens(
            &image,
            &key,
            &scratch,
            crate::disk::KeyslotCost::PRODUCTION,
        )
        .map_err(|e| match e {
            super::cross_key::CrossKeyError::Refused(_) => HostError::Unsupported(e.to_string()),
            _ => HostError::Failed(e.to_string()),
        })
    }

    fn gpu_soft_sharing(&self, gpus: &[String]) -> Result<Vec<String>, HostError> {
        Ok(super::live_gpu::soft_sharing(
            &self.paths.gpu_sysfs_root,
            gpus,
        ))
    }

    fn gpu_snapshot(&self) -> Result<super::checks::gpu_departure::GpuSnapshot, HostError> {
        let quarantined = self
            .rt
            .block_on(self.admin.quarantine())
            .map_err(from_client)?
            .slices
            .iter()
            .map(crate::api::types::QuarantinedSliceView::id)
            .collect();
        super::live_gpu::snapshot(
            self.paths.gpu_backend.as_deref(),
            &self.store_db,
            &self.paths.gpu_sysfs_root,
            quarantined,
        )
    }

    fn scan_finds(&self, content: &[u8], marker: &[u8]) -> Result<bool, HostError> {
        // In the state directory itself, where the scan looks, and gone when this returns.
        let dir = self.paths.state_dir.join(format!(
            "verify-scan-control-{:016x}",
            rand::random::<u64>()
        ));
        std::fs::create_dir(&dir).map_err(io_err(&dir))?;
        let file = dir.join("plaintext-copy");
        // The same scan as files_holding, over the scratch directory only (it lies inside
        // the state directory, a root of files_holding): a second full scan would double
        // the check's time for nothing.
        let mut found = Vec::new();
        let found = std::fs::write(&file, content)
            .map_err(io_err(&file))
            .and_then(|()| scan(&dir, marker, &mut found, &skip_real_disks))
            .map(|()| found);
        let removed = std::fs::remove_dir_all(&dir).map_err(io_err(&dir));
        let found = found?;
        removed?;
        Ok(found.iter().any(|p| Path::new(p) == file))
    }

    fn receipts_with(&self, tenant: &str, token: &str) -> Result<usize, HostError> {
        Ok(self
            .rt
            .block_on(self.as_tenant(token).receipts(Some(tenant)))
            .map_err(from_client)?
            .receipts
            .iter()
            .filter(|e| e.receipt.tenant == tenant)
            .count())
    }
}

/// `PUT /v1/tenants/{tenant}/models/{model}` with the model in memory, its length and hash.
async fn put_model(
    socket: &Path,
    token: &str,
    tenant: &str,
    model: &str,
    bytes: &[u8],
) -> Result<(hyper::StatusCode, Vec<u8>), HostError> {
    use http_body_util::{BodyExt, Full};
    use sha2::Digest;
    let http = |e: String| HostError::Failed(format!("model push: {e}"));
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| HostError::Unreachable(format!("{}: {e}", socket.display())))?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| http(e.to_string()))?;
    let conn_task = tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(Method::PUT)
        .uri(format!(
            "http://localhost/v1/tenants/{tenant}/models/{model}"
        ))
        .header("host", "localhost")
        .header("authorization", format!("Bearer {token}"))
        .header("content-length", bytes.len())
        .header("x-model-sha256", hex::encode(sha2::Sha256::digest(bytes)))
        .body(Full::new(hyper::body::Bytes::copy_from_slice(bytes)))
        .map_err(|e| http(e.to_string()))?;
    let resp = tokio::time::timeout(DOOR_TIMEOUT, async {
        let resp = sender.send_request(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok::<_, hyper::Error>((status, body.to_vec()))
    })
    .await;
    conn_task.abort();
    match resp {
        Ok(r) => r.map_err(|e| http(e.to_string())),
        Err(_) => Err(HostError::Timeout {
            what: format!("the model push to {tenant}"),
            seconds: DOOR_TIMEOUT.as_secs(),
        }),
    }
}

/// A successful answer decoded, or the refusal with the daemon's message.
fn answer_json<T: serde::de::DeserializeOwned>(
    status: hyper::StatusCode,
    bytes: &[u8],
) -> Result<T, HostError> {
    let text = answer(status, bytes)?;
    serde_json::from_str(&text).map_err(|e| HostError::Failed(format!("undecodable answer: {e}")))
}

/// A successful answer's body as text, or the refusal.
fn answer(status: hyper::StatusCode, bytes: &[u8]) -> Result<String, HostError> {
    if status.is_success() {
        return Ok(String::from_utf8_lossy(bytes).into_owned());
    }
    Err(HostError::Api {
        status: status.as_u16(),
        message: crate::untrusted::one_line(&String::from_utf8_lossy(bytes)),
    })
}
