//! The agent's state machine: one [`Agent`] owns the disk and payload state and answers
//! each [`Request`]. Channels (server.rs) only move frames.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tenantvm_agent_protocol::{
    encode_data, AgentFailure, DiskKey, DiskState, ErrorCode, HttpHead, HttpRequest, LicenceToken,
    ModelFile, Outcome, PayloadState, Reply, Request, ResponseFrame, ShutdownReport, StatusReply,
    MAX_BODY_LEN, MAX_DATA_LEN, PROTOCOL_VERSION,
};

use crate::config::AgentConfig;
use crate::disk::{self, DiskError};
use crate::http1;
use crate::logbuf::LogBuffer;
use crate::models;
use crate::reaper::Reaper;

/// Most log lines returned by one `logs` request.
const MAX_LOG_LINES: u32 = 1000;
/// Longest a `logs` request may wait for new lines.
const MAX_LOG_WAIT_MS: u32 = 30_000;
/// How long the payload gets to exit after SIGTERM.
const PAYLOAD_STOP_GRACE: Duration = Duration::from_secs(10);
/// How long one forwarded request may take (generation under emulation is slow).
const INFER_TIMEOUT: Duration = Duration::from_secs(300);
/// Largest payload answer forwarded (leaves room for the JSON envelope and escaping).
const MAX_INFER_BODY: usize = (MAX_BODY_LEN as usize) / 2;

/// What the channel must do after sending the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// Keep serving.
    Continue,
    /// Power the machine off.
    PowerOff,
}

struct State {
    disk: DiskState,
    shutting_down: bool,
}

/// The guest agent.
pub struct Agent {
    cfg: AgentConfig,
    reaper: Reaper,
    logs: Arc<LogBuffer>,
    started: Instant,
    channel: Mutex<String>,
    state: Mutex<State>,
    /// Starts, restarts and stops the payload.
    payload: crate::payload::Supervisor,
    /// Kept-alive connections to the payload for streamed requests.
    payload_conns: crate::payload_pool::PayloadPool,
    /// The bounded test loads (`load`, `load-status`).
    loads: crate::load::Loads,
    /// Reads the guest's devices (`gpu-info`).
    gpu: crate::gpu::GpuProbe,
    /// Where `install-licence` writes the vGPU licence token.
    licence_dir: std::path::PathBuf,
}

fn failure(code: ErrorCode, message: impl Into<String>) -> Outcome {
    Outcome::Err(AgentFailure {
        code,
        message: message.into(),
    })
}

fn disk_failure(e: DiskError) -> Outcome {
    let code = match e {
        DiskError::BadKey(_) => ErrorCode::BadKey,
        DiskError::NoFileSystem => ErrorCode::WrongState,
        _ => ErrorCode::Internal,
    };
    failure(code, e.to_string())
}

impl Agent {
    /// An agent for `cfg`, spawning children through `reaper`.
    pub fn new(cfg: AgentConfig, reaper: Reaper, logs: Arc<LogBuffer>) -> Self {
        let payload_addr = SocketAddr::from(([127, 0, 0, 1], cfg.payload.port));
        Self {
            payload_conns: crate::payload_pool::PayloadPool::new(payload_addr),
            loads: crate::load::Loads::default(),
            gpu: crate::gpu::GpuProbe::guest(&cfg.payload.env),
            payload: crate::payload::Supervisor::new(
                cfg.payload.clone(),
                cfg.disk.mount_point.clone(),
                reaper.clone(),
                Arc::clone(&logs),
            ),
            licence_dir: tenantvm_agent_protocol::LICENCE_DIR.into(),
            cfg,
            reaper,
            logs,
            started: Instant::now(),
            channel: Mutex::new("none".into()),
            state: Mutex::new(State {
                disk: DiskState::Locked,
                shutting_down: false,
            }),
        }
    }

    /// Replaces the device probe (tests point it at a fake sysfs tree and `nvidia-smi`).
    pub fn set_gpu_probe(&mut self, probe: crate::gpu::GpuProbe) {
        self.gpu = probe;
    }

    /// Replaces where the vGPU licence token is written (tests point it at a temp dir).
    pub fn set_licence_dir(&mut self, dir: &std::path::Path) {
        self.licence_dir = dir.to_path_buf();
    }

    /// Records which channel serves requests (reported by `status`).
    pub fn set_channel(&self, name: &str) {
        *self.channel.lock().unwrap_or_else(|p| p.into_inner()) = name.to_string();
    }

    /// Logs an agent line to the console and the log buffer. Never pass secrets.
    pub fn log(&self, msg: &str) {
        eprintln!("tenantvm-agent: {msg}");
        self.logs.push("agent", msg);
    }

    /// The log buffer (agent and payload lines).
    pub fn logs(&self) -> &LogBuffer {
        &self.logs
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Answers one request.
    pub fn handle(&self, req: Request) -> (Outcome, After) {
        if self.state().shutting_down && !matches!(req, Request::Status) {
            return (
                failure(ErrorCode::WrongState, "The guest is shutting down"),
                After::Continue,
            );
        }
        match req {
            Request::Status => (Outcome::Ok(Reply::Status(self.status())), After::Continue),
            Request::UnlockDisk { key } => (self.unlock(&key), After::Continue),
            Request::InstallLicence { token } => (self.install_licence(&token), After::Continue),
            Request::Mount { format_if_missing } => {
                (self.mount(format_if_missing), After::Continue)
            }
            Request::StartPayload => (self.start_payload(), After::Continue),
            Request::RestartPayload => (self.restart_payload(), After::Continue),
            Request::Health => (
                Outcome::Ok(Reply::Health {
                    payload: self.payload_state(),
                }),
                After::Continue,
            ),
            Request::Logs {
                after,
                max,
                wait_ms,
            } => {
                let wait = Duration::from_millis(u64::from(wait_ms.min(MAX_LOG_WAIT_MS)));
                let (lines, next) =
                    self.logs
                        .wait_since(after, max.min(MAX_LOG_LINES) as usize, wait);
                (Outcome::Ok(Reply::Logs { lines, next }), After::Continue)
            }
            Request::Infer(http) => (self.infer(&http), After::Continue),
            Request::ModelList => (self.model_list(), After::Continue),
            Request::ModelRemove { name } => (self.model_remove(&name), After::Continue),
            Request::Load(spec) => (self.start_load(spec), After::Continue),
            Request::LoadStatus { kind } => (
                Outcome::Ok(Reply::Load(self.loads.report(kind))),
                After::Continue,
            ),
            Request::GpuInfo => (
                Outcome::Ok(Reply::GpuInfo(self.gpu.report(&self.reaper))),
                After::Continue,
            ),
            // Answered by `infer_stream` / `model_push` on the connection itself (server.rs).
            Request::InferStream(_) | Request::ModelPush { .. } | Request::ModelPushDir { .. } => (
                failure(
                    ErrorCode::BadRequest,
                    "infer-stream and model-push take a connection of their own (vsock)",
                ),
                After::Continue,
            ),
            // Answered by `serve_serial` at the start of a virtio-serial channel only.
            Request::Mux { .. } => (
                failure(
                    ErrorCode::BadRequest,
                    "mux is offered only as the first request on the virtio-serial port",
                ),
                After::Continue,
            ),
            Request::Shutdown => (
                Outcome::Ok(Reply::ShuttingDown(self.shutdown())),
                After::PowerOff,
            ),
        }
    }

    fn status(&self) -> StatusReply {
        let payload = self.payload_state();
        StatusReply {
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            protocol: PROTOCOL_VERSION,
            channel: self
                .channel
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            disk: self.state().disk,
            payload,
        }
    }

    fn unlock(&self, key: &DiskKey) -> Outcome {
        if self.state().disk != DiskState::Locked {
            return failure(ErrorCode::WrongState, "The disk is already unlocked");
        }
        self.log("unlocking the data disk");
        match disk::unlock(&self.cfg.disk, &self.reaper, key) {
            Ok(()) => {
                self.state().disk = DiskState::Unlocked;
                self.log("data disk unlocked");
                Outcome::Ok(Reply::Unlocked)
            }
            Err(e) => {
                self.log(&format!("unlock failed: {e}"));
                disk_failure(e)
            }
        }
    }

    fn install_licence(&self, token: &LicenceToken) -> Outcome {
        match crate::licence::install(&self.licence_dir, token) {
            Ok(path) => {
                self.log(&format!(
                    "vGPU licence token installed at {}",
                    path.display()
                ));
                Outcome::Ok(Reply::LicenceInstalled)
            }
            Err(e) => {
                self.log(&format!("installing the vGPU licence token failed: {e}"));
                failure(ErrorCode::Internal, e.to_string())
            }
        }
    }

    fn mount(&self, format_if_missing: bool) -> Outcome {
        match self.state().disk {
            DiskState::Locked => {
                return failure(ErrorCode::WrongState, "Unlock the disk before mounting it")
            }
            DiskState::Mounted => return Outcome::Ok(Reply::Mounted { formatted: false }),
            DiskState::Unlocked => {}
        }
        match disk::mount_data(&self.cfg.disk, &self.reaper, format_if_missing) {
            Ok(formatted) => {
                self.state().disk = DiskState::Mounted;
                self.log(&format!(
                    "data disk mounted at {} (formatted: {formatted})",
                    self.cfg.disk.mount_point.display()
                ));
                Outcome::Ok(Reply::Mounted { formatted })
            }
            Err(e) => {
                self.log(&format!("mount failed: {e}"));
                disk_failure(e)
            }
        }
    }

    fn start_payload(&self) -> Outcome {
        if self.state().disk != DiskState::Mounted {
            return failure(
                ErrorCode::WrongState,
                "Mount the data disk before starting the payload",
            );
        }
        match self.payload.start() {
            Ok(pid) => {
                self.log(&format!("payload started, pid {pid}"));
                Outcome::Ok(Reply::PayloadStarted { pid })
            }
            Err(e @ crate::payload::PayloadError::Running) => {
                failure(ErrorCode::WrongState, e.to_string())
            }
            Err(e) => {
                self.log(&e.to_string());
                failure(ErrorCode::Internal, e.to_string())
            }
        }
    }

    fn restart_payload(&self) -> Outcome {
        if self.state().disk != DiskState::Mounted {
            return failure(
                ErrorCode::WrongState,
                "Mount the data disk before starting the payload",
            );
        }
        // Kept connections lead to the old process.
        self.payload_conns.clear();
        match self.payload.restart(PAYLOAD_STOP_GRACE) {
            Ok(pid) => {
                self.log(&format!("payload restarted on request, pid {pid}"));
                Outcome::Ok(Reply::PayloadStarted { pid })
            }
            Err(e) => {
                self.log(&e.to_string());
                failure(ErrorCode::Internal, e.to_string())
            }
        }
    }

    /// The payload's state, probing readiness with a GET of the health path.
    fn payload_state(&self) -> PayloadState {
        let (pid, restarts) = match self.payload.observe() {
            crate::payload::Observed::NotStarted => return PayloadState::NotStarted,
            crate::payload::Observed::Exited {
                code,
                restarts,
                restart_in,
            } => {
                return PayloadState::Exited {
                    code,
                    restarts,
                    restart_in_ms: restart_in.map(|d| d.as_millis() as u64),
                }
            }
            crate::payload::Observed::Running { pid, restarts } => (pid, restarts),
        };
        let probe = HttpRequest {
            method: "GET".into(),
            path: self.cfg.payload.health_path.clone(),
            headers: vec![],
            body: String::new(),
        };
        let ready = self
            .exchange(&probe, Duration::from_secs(2))
            .is_ok_and(|r| r.status == 200);
        PayloadState::Running {
            pid,
            ready,
            restarts,
        }
    }

    fn exchange(
        &self,
        req: &HttpRequest,
        timeout: Duration,
    ) -> Result<tenantvm_agent_protocol::HttpResponse, String> {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.cfg.payload.port));
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
            .map_err(|e| format!("Cannot connect to the payload on {addr}: {e}"))?;
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|e| e.to_string())?;
        http1::exchange(stream, &addr.to_string(), req, MAX_INFER_BODY).map_err(|e| e.to_string())
    }

    fn infer(&self, req: &HttpRequest) -> Outcome {
        match self.payload_state() {
            PayloadState::Running { .. } => {}
            other => {
                return failure(
                    ErrorCode::PayloadUnavailable,
                    format!("The payload is not running ({other:?}); start it first"),
                )
            }
        }
        match self.exchange(req, INFER_TIMEOUT) {
            Ok(resp) => Outcome::Ok(Reply::Infer(resp)),
            Err(e) => failure(ErrorCode::PayloadUnavailable, e),
        }
    }

    /// Answers [`Request::InferStream`] on `w`: the payload's head as a
    /// [`Reply::InferHead`] frame, then its body as data frames of at most
    /// [`MAX_DATA_LEN`] bytes, each sent as soon as the payload produced it, and an empty
    /// one at the end. A payload that fails before its head gets an error answer; one that
    /// breaks off mid-body gets the connection closed without the empty frame (the host
    /// tells a cut stream from a complete one). The connection serves nothing else
    /// afterwards (one request per connection).
    pub fn infer_stream(&self, id: u64, req: &HttpRequest, w: &mut impl Write) {
        let send = |w: &mut dyn Write, outcome: Outcome| {
            crate::answer::send(w, &ResponseFrame { id, outcome })
        };
        if !matches!(self.payload_state(), PayloadState::Running { .. })
            || self.state().shutting_down
        {
            send(
                w,
                failure(
                    ErrorCode::PayloadUnavailable,
                    "The payload is not running; start it first",
                ),
            );
            return;
        }
        let opened = self.payload_conns.stream(req, INFER_TIMEOUT);
        let (status, headers, mut body) = match opened {
            Ok(parts) => parts,
            Err(e) => {
                send(w, failure(ErrorCode::PayloadUnavailable, e));
                return;
            }
        };
        if !send(
            w,
            Outcome::Ok(Reply::InferHead(HttpHead { status, headers })),
        ) {
            return;
        }
        let mut buf = vec![0u8; MAX_DATA_LEN as usize];
        loop {
            let n = match body.next_piece(&mut buf) {
                Ok(n) => n,
                Err(e) => {
                    self.log(&format!("a streamed answer broke off: {e}"));
                    return;
                }
            };
            let Ok(frame) = encode_data(&buf[..n]) else {
                return;
            };
            if n == 0 {
                // Read to its end: the connection may serve the next request (kept before
                // the host learns the answer ended, so its next request can use it).
                self.payload_conns.give_back(body);
                let _ = w.write_all(&frame).and_then(|()| w.flush());
                return;
            }
            if w.write_all(&frame).and_then(|()| w.flush()).is_err() {
                return;
            }
        }
    }

    /// The models directory, if the data disk is mounted.
    fn models_dir(&self) -> Result<std::path::PathBuf, Outcome> {
        if self.state().disk != DiskState::Mounted {
            return Err(failure(
                ErrorCode::WrongState,
                "The data disk is not mounted; start the tenant first",
            ));
        }
        Ok(self.cfg.disk.mount_point.join(models::MODELS_DIR))
    }

    fn start_load(&self, spec: tenantvm_agent_protocol::LoadSpec) -> Outcome {
        let data =
            (self.state().disk == DiskState::Mounted).then(|| self.cfg.disk.mount_point.clone());
        match self.loads.start(&self.reaper, spec, data.as_deref()) {
            Ok(pid) => {
                self.log(&format!(
                    "{} load started: {} {} for {} s (pid {pid})",
                    spec.kind.as_str(),
                    spec.amount,
                    spec.kind.unit(),
                    spec.seconds
                ));
                Outcome::Ok(Reply::LoadStarted { pid })
            }
            Err(e) => {
                use crate::load::LoadError;
                let code = match e {
                    LoadError::Spec(_) => ErrorCode::BadRequest,
                    LoadError::Busy(_) | LoadError::NotMounted => ErrorCode::WrongState,
                    LoadError::NoSpace { .. } => ErrorCode::NoSpace,
                    LoadError::Spawn(_) => ErrorCode::Internal,
                };
                failure(code, e.to_string())
            }
        }
    }

    fn model_list(&self) -> Outcome {
        let dir = match self.models_dir() {
            Ok(d) => d,
            Err(o) => return o,
        };
        match models::list(&dir) {
            Ok(models) => Outcome::Ok(Reply::Models { models }),
            Err(e) => failure(e.code(), e.to_string()),
        }
    }

    fn model_remove(&self, name: &str) -> Outcome {
        let dir = match self.models_dir() {
            Ok(d) => d,
            Err(o) => return o,
        };
        match models::remove(&dir, name) {
            Ok(()) => {
                self.log(&format!("model {name} removed"));
                Outcome::Ok(Reply::ModelRemoved)
            }
            Err(e) => failure(e.code(), e.to_string()),
        }
    }

    /// Answers [`Request::ModelPush`] on its connection: checks, [`Reply::ModelReady`], the
    /// data frames from `r`, then [`Reply::ModelStored`] or the error (nothing stored).
    pub fn model_push(
        &self,
        id: u64,
        (name, size, sha256): (&str, u64, &str),
        r: &mut impl std::io::Read,
        w: &mut impl Write,
    ) {
        self.store_model(
            id,
            name,
            |dir, free| models::check(dir, name, size, sha256, free),
            |dir, r| models::receive(dir, name, size, sha256, r),
            r,
            w,
        );
    }

    /// Answers [`Request::ModelPushDir`] on its connection, as [`Agent::model_push`] does
    /// for one file.
    pub fn model_push_dir(
        &self,
        id: u64,
        (name, files, size, sha256): (&str, &[ModelFile], u64, &str),
        r: &mut impl std::io::Read,
        w: &mut impl Write,
    ) {
        self.store_model(
            id,
            name,
            |dir, free| models::check_dir(dir, name, files, size, sha256, free),
            |dir, r| models::receive_dir(dir, name, files, sha256, r),
            r,
            w,
        );
    }

    /// A push: `check` before the data is asked for, then `receive` of the data frames.
    fn store_model<R: std::io::Read>(
        &self,
        id: u64,
        name: &str,
        check: impl FnOnce(&std::path::Path, u64) -> Result<(), models::ModelError>,
        receive: impl FnOnce(&std::path::Path, &mut R) -> Result<(u64, String), models::ModelError>,
        r: &mut R,
        w: &mut impl Write,
    ) {
        let send = |w: &mut dyn Write, outcome: Outcome| {
            crate::answer::send(w, &ResponseFrame { id, outcome })
        };
        let dir = match self.models_dir() {
            Ok(d) => d,
            Err(o) => {
                send(w, o);
                return;
            }
        };
        let free = models::free_bytes(&self.cfg.disk.mount_point).unwrap_or(0);
        if let Err(e) = check(&dir, free) {
            self.log(&format!("model {name} refused: {e}"));
            send(w, failure(e.code(), e.to_string()));
            return;
        }
        if !send(w, Outcome::Ok(Reply::ModelReady)) {
            return;
        }
        let outcome = match receive(&dir, r) {
            Ok((bytes, sha256)) => {
                self.log(&format!("model {name} stored ({bytes} bytes)"));
                Outcome::Ok(Reply::ModelStored {
                    name: name.to_string(),
                    bytes,
                    sha256,
                })
            }
            Err(e) => {
                self.log(&format!("model {name} not stored: {e}"));
                failure(e.code(), e.to_string())
            }
        };
        send(w, outcome);
    }

    /// Stops the payload, unmounts, closes dm-crypt and syncs. The caller powers off.
    pub fn shutdown(&self) -> ShutdownReport {
        let disk = {
            let mut st = self.state();
            st.shutting_down = true;
            st.disk
        };
        self.log("shutdown requested");
        // A disk load holds a file on the data disk: stop every load before unmounting.
        self.loads.stop_all(Duration::from_secs(5));
        let was_running = matches!(
            self.payload.observe(),
            crate::payload::Observed::Running { .. }
        );
        let code = self.payload.stop(PAYLOAD_STOP_GRACE);
        let payload_stopped = was_running && code.is_some();
        let mut unmounted = false;
        if disk == DiskState::Mounted {
            match disk::unmount_data(&self.cfg.disk) {
                Ok(()) => {
                    unmounted = true;
                    self.state().disk = DiskState::Unlocked;
                }
                Err(e) => self.log(&format!("unmount failed: {e}")),
            }
        }
        let mut disk_closed = false;
        if self.state().disk == DiskState::Unlocked {
            match disk::close(&self.cfg.disk, &self.reaper) {
                Ok(()) => {
                    disk_closed = true;
                    self.state().disk = DiskState::Locked;
                }
                Err(e) => self.log(&format!("closing the disk failed: {e}")),
            }
        }
        // SAFETY: sync(2) has no memory effects.
        unsafe { libc::sync() };
        self.log(&format!(
            "shutdown done: payload_stopped={payload_stopped} unmounted={unmounted} disk_closed={disk_closed}"
        ));
        ShutdownReport {
            payload_stopped,
            unmounted,
            disk_closed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DiskConfig, PayloadConfig};

    fn agent(dir: &std::path::Path) -> Agent {
        let cfg = AgentConfig {
            modules: vec![],
            disk: DiskConfig {
                device: dir.join("disk.img"),
                mapper_name: "t".into(),
                mount_point: dir.join("data"),
                cryptsetup: "/bin/false".into(),
                mkfs: "/bin/false".into(),
            },
            payload: PayloadConfig {
                command: vec!["/bin/true".into()],
                env: Default::default(),
                workdir: dir.to_path_buf(),
                port: 1,
                health_path: "/health".into(),
                confine: None,
            },
        };
        Agent::new(cfg, Reaper::start().unwrap(), Arc::new(LogBuffer::new(100)))
    }

    #[test]
    fn after_shutdown_only_status_is_answered() {
        let dir = tempfile::tempdir().unwrap();
        let a = agent(dir.path());
        let (outcome, after) = a.handle(Request::Shutdown);
        assert_eq!(after, After::PowerOff);
        assert_eq!(
            outcome,
            Outcome::Ok(Reply::ShuttingDown(ShutdownReport {
                payload_stopped: false,
                unmounted: false,
                disk_closed: false,
            }))
        );
        let (outcome, _) = a.handle(Request::Health);
        assert!(matches!(
            outcome,
            Outcome::Err(AgentFailure {
                code: ErrorCode::WrongState,
                ..
            })
        ));
        assert!(matches!(
            a.handle(Request::Status).0,
            Outcome::Ok(Reply::Status(_))
        ));
    }

    #[test]
    fn install_licence_writes_the_token_and_logs_only_where() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = agent(dir.path());
        let tokens = dir.path().join("etc/nvidia/ClientConfigToken");
        a.set_licence_dir(&tokens);
        let secret = b"licence-secret-4f1c9e\n";
        let token = LicenceToken::new(secret).unwrap();
        let (outcome, after) = a.handle(Request::InstallLicence { token });
        assert_eq!(outcome, Outcome::Ok(Reply::LicenceInstalled));
        assert_eq!(after, After::Continue);
        let file = tokens.join(tenantvm_agent_protocol::LICENCE_FILE);
        assert_eq!(std::fs::read(&file).unwrap(), secret);
        let (lines, _) = a.logs().wait_since(0, 100, Duration::ZERO);
        assert!(lines
            .iter()
            .any(|l| l.line.contains("licence token installed")));
        assert!(
            lines.iter().all(|l| !l.line.contains("licence-secret")),
            "{lines:?}"
        );
        // A directory that cannot be made is an internal error, not a panic.
        std::fs::write(dir.path().join("blocker"), b"").unwrap();
        a.set_licence_dir(&dir.path().join("blocker/sub"));
        let token = LicenceToken::new(secret).unwrap();
        let (outcome, _) = a.handle(Request::InstallLicence { token });
        assert!(
            matches!(
                &outcome,
                Outcome::Err(AgentFailure { code: ErrorCode::Internal, message })
                    if !message.contains("licence-secret")
            ),
            "{outcome:?}"
        );
    }

    #[test]
    fn status_reports_the_channel_and_a_locked_disk_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let a = agent(dir.path());
        a.set_channel("vsock");
        let Outcome::Ok(Reply::Status(s)) = a.handle(Request::Status).0 else {
            panic!("status failed")
        };
        assert_eq!(s.channel, "vsock");
        assert_eq!(s.disk, DiskState::Locked);
        assert_eq!(s.payload, PayloadState::NotStarted);
        assert_eq!(s.protocol, PROTOCOL_VERSION);
    }

    #[test]
    fn gpu_info_answers_from_the_probe_and_the_payload_env_reaches_nvidia_smi() {
        let dir = tempfile::tempdir().unwrap();
        let mut payload_env = std::collections::BTreeMap::new();
        payload_env.insert("LD_LIBRARY_PATH".to_string(), "/payload/lib".to_string());
        payload_env.insert("SECRET".to_string(), "not passed".to_string());
        let real = crate::gpu::GpuProbe::guest(&payload_env);
        assert_eq!(real.sys_root, std::path::Path::new("/sys"));
        assert!(real
            .env
            .contains(&("LD_LIBRARY_PATH".to_string(), "/payload/lib".to_string())));
        assert!(real.env.iter().all(|(k, _)| k != "SECRET"));
        let mut a = agent(dir.path());
        a.set_gpu_probe(crate::gpu::GpuProbe {
            sys_root: dir.path().to_path_buf(),
            nvidia_smi: vec![dir.path().join("no-nvidia-smi")],
            ..real
        });
        let Outcome::Ok(Reply::GpuInfo(info)) = a.handle(Request::GpuInfo).0 else {
            panic!("gpu-info failed")
        };
        assert!(info.pci.is_empty());
        assert!(matches!(
            info.nvidia_smi,
            tenantvm_agent_protocol::NvidiaSmi::Absent { .. }
        ));
    }
}
