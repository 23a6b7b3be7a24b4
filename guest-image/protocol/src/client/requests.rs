//! The typed requests of [`AgentClient`]: one method per agent command, each a
//! [`AgentClient::call`] (or a stream of its own) with the reply checked for its kind.

use super::*;

impl AgentClient {
    /// The agent's state.
    pub fn status(&mut self, timeout: Duration) -> Result<StatusReply, AgentClientError> {
        match self.call(&Request::Status, timeout)? {
            Reply::Status(s) => Ok(s),
            _ => Err(AgentClientError::UnexpectedReply { what: "status" }),
        }
    }

    /// Delivers the disk key; the agent opens the dm-crypt mapping with it.
    pub fn unlock_disk(
        &mut self,
        key: &DiskKey,
        timeout: Duration,
    ) -> Result<(), AgentClientError> {
        match self.call(&Request::UnlockDisk { key: key.clone() }, timeout)? {
            Reply::Unlocked => Ok(()),
            _ => Err(AgentClientError::UnexpectedReply {
                what: "unlock-disk",
            }),
        }
    }

    /// Delivers the tenant's vGPU licence token ([`crate::licence`]); the agent writes it
    /// where NVIDIA's licensing client reads it. An agent older than the request answers
    /// `bad-request`, returned as [`AgentClientError::Unsupported`].
    pub fn install_licence(
        &mut self,
        token: &crate::licence::LicenceToken,
        timeout: Duration,
    ) -> Result<(), AgentClientError> {
        let what = "install-licence";
        let req = Request::InstallLicence {
            token: token.clone(),
        };
        match self.call(&req, timeout).map_err(|e| older_agent(what, e))? {
            Reply::LicenceInstalled => Ok(()),
            _ => Err(AgentClientError::UnexpectedReply { what }),
        }
    }

    /// Mounts the unlocked disk; returns whether a file system was created.
    pub fn mount(
        &mut self,
        format_if_missing: bool,
        timeout: Duration,
    ) -> Result<bool, AgentClientError> {
        match self.call(&Request::Mount { format_if_missing }, timeout)? {
            Reply::Mounted { formatted } => Ok(formatted),
            _ => Err(AgentClientError::UnexpectedReply { what: "mount" }),
        }
    }

    /// Starts the payload; returns its guest pid.
    pub fn start_payload(&mut self, timeout: Duration) -> Result<u32, AgentClientError> {
        match self.call(&Request::StartPayload, timeout)? {
            Reply::PayloadStarted { pid } => Ok(pid),
            _ => Err(AgentClientError::UnexpectedReply {
                what: "start-payload",
            }),
        }
    }

    /// Stops the payload and starts it again ([`Request::RestartPayload`]); returns the new
    /// guest pid (poll [`health`](Self::health) or [`wait_payload_ready`](Self::wait_payload_ready)
    /// for readiness). An agent older than the request answers `bad-request`, returned as
    /// [`AgentClientError::Unsupported`]. `timeout` should leave the agent its grace time
    /// for the old process (10 s) and some.
    pub fn restart_payload(&mut self, timeout: Duration) -> Result<u32, AgentClientError> {
        let what = "restart-payload";
        match self.call(&Request::RestartPayload, timeout) {
            Ok(Reply::PayloadStarted { pid }) => Ok(pid),
            Ok(_) => Err(AgentClientError::UnexpectedReply { what }),
            Err(AgentClientError::Agent { failure, .. })
                if failure.code == crate::message::ErrorCode::BadRequest =>
            {
                Err(AgentClientError::Unsupported { what })
            }
            Err(e) => Err(e),
        }
    }

    /// The payload's state and readiness.
    pub fn health(&mut self, timeout: Duration) -> Result<PayloadState, AgentClientError> {
        match self.call(&Request::Health, timeout)? {
            Reply::Health { payload } => Ok(payload),
            _ => Err(AgentClientError::UnexpectedReply { what: "health" }),
        }
    }

    /// Polls health until the payload is ready; fails early if it exits.
    pub fn wait_payload_ready(&mut self, timeout: Duration) -> Result<(), AgentClientError> {
        let deadline = Instant::now() + timeout;
        let mut last = PayloadState::NotStarted;
        while Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            last = self.health(left.max(Duration::from_secs(1)))?;
            match last {
                PayloadState::Running { ready: true, .. } => return Ok(()),
                PayloadState::Exited { .. } => break,
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
        Err(AgentClientError::PayloadNotReady { timeout, last })
    }

    /// Brings the guest from whatever state it is in to "payload ready": delivers the key
    /// if the disk is locked, mounts it (creating ext4 on first use), starts the payload if
    /// it is not running, and waits for readiness. Idempotent, so an orchestrator resuming
    /// an interrupted create can call it again.
    pub fn bring_up(
        &mut self,
        key: &DiskKey,
        timeout: Duration,
    ) -> Result<BringUp, AgentClientError> {
        let deadline = Instant::now() + timeout;
        let left = || {
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        let status = self.status(left())?;
        let mut done = BringUp::default();
        if status.disk == DiskState::Locked {
            self.unlock_disk(key, left())?;
            done.unlocked = true;
        }
        if status.disk != DiskState::Mounted {
            done.formatted = self.mount(true, left())?;
            done.mounted = true;
        }
        if !matches!(status.payload, PayloadState::Running { .. }) {
            self.start_payload(left())?;
            done.started = true;
        }
        self.wait_payload_ready(left())?;
        Ok(done)
    }

    /// Log lines after `after`, waiting up to `wait` (≤ 30 s) for a first new one; pass
    /// the returned cursor back to follow the log. `timeout` must exceed `wait`.
    pub fn logs(
        &mut self,
        after: u64,
        max: u32,
        wait: Duration,
        timeout: Duration,
    ) -> Result<(Vec<LogLine>, u64), AgentClientError> {
        let wait_ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX);
        match self.call(
            &Request::Logs {
                after,
                max,
                wait_ms,
            },
            timeout,
        )? {
            Reply::Logs { lines, next } => Ok((lines, next)),
            _ => Err(AgentClientError::UnexpectedReply { what: "logs" }),
        }
    }

    /// Forwards an HTTP request to the payload.
    pub fn infer(
        &mut self,
        req: HttpRequest,
        timeout: Duration,
    ) -> Result<HttpResponse, AgentClientError> {
        match self.call(&Request::Infer(req), timeout)? {
            Reply::Infer(resp) => Ok(resp),
            _ => Err(AgentClientError::UnexpectedReply { what: "infer" }),
        }
    }

    /// Forwards an HTTP request to the payload and streams its answer: returns the head
    /// (by `deadline`: a payload answering without streaming sends its head only with the
    /// whole answer), and the body as a reader that yields each data frame as the agent
    /// sends it. Every read of the body waits at most `idle` for the guest and none goes
    /// past `deadline`; a data frame over [`MAX_DATA_LEN`] bytes is refused before it is
    /// buffered. Consumes the connection (one request per connection).
    pub fn infer_stream(
        mut self,
        req: HttpRequest,
        idle: Duration,
        deadline: Instant,
    ) -> Result<(HttpHead, InferBody), AgentClientError> {
        let whole = deadline.saturating_duration_since(Instant::now());
        let id = self.send(
            &Request::InferStream(req),
            deadline.min(Instant::now() + idle),
            idle,
        )?;
        let resp = self.receive_any(&[id], deadline, whole)?;
        match resp.outcome {
            Outcome::Ok(Reply::InferHead(head)) => Ok((head, InferBody::new(self, idle, deadline))),
            Outcome::Ok(_) => Err(AgentClientError::UnexpectedReply {
                what: "infer-stream",
            }),
            Outcome::Err(failure) => Err(AgentClientError::Agent {
                what: "infer-stream",
                failure,
            }),
        }
    }

    /// Stores a model on the tenant's disk ([`Request::ModelPush`]): `size` bytes read from
    /// `data`, which must hash to `sha256`. Each agent answer is awaited at most
    /// `timeout`, each data frame's write too. Consumes the connection. Returns the bytes
    /// stored and their hash as the agent checked them.
    pub fn model_push(
        self,
        name: &str,
        size: u64,
        sha256: &str,
        data: &mut dyn io::Read,
        timeout: Duration,
    ) -> Result<(u64, String), AgentClientError> {
        let request = Request::ModelPush {
            name: name.to_string(),
            size,
            sha256: sha256.to_string(),
        };
        self.push_stream(&request, "model-push", data, timeout)
    }

    /// Stores a model directory ([`Request::ModelPushDir`]): the bytes of `files`, in order,
    /// read from `data` as one stream (`sha256` is the whole stream's). As
    /// [`AgentClient::model_push`] otherwise; an agent older than directories gives
    /// [`AgentClientError::Unsupported`].
    pub fn model_push_dir(
        self,
        name: &str,
        files: &[crate::model::ModelFile],
        sha256: &str,
        data: &mut dyn io::Read,
        timeout: Duration,
    ) -> Result<(u64, String), AgentClientError> {
        let what = "model-push-dir";
        let request = Request::ModelPushDir {
            name: name.to_string(),
            files: files.to_vec(),
            size: files.iter().map(|f| f.size).fold(0, u64::saturating_add),
            sha256: sha256.to_string(),
        };
        match self.push_stream(&request, what, data, timeout) {
            Err(AgentClientError::Agent { failure, .. })
                if failure.code == crate::message::ErrorCode::BadRequest
                    && failure.message.contains("unknown variant") =>
            {
                Err(AgentClientError::Unsupported { what })
            }
            other => other,
        }
    }

    /// Sends `request` (a push), waits for [`Reply::ModelReady`], streams `data` as data
    /// frames with the empty one at the end, and returns what [`Reply::ModelStored`] says.
    fn push_stream(
        mut self,
        request: &Request,
        what: &'static str,
        data: &mut dyn io::Read,
        timeout: Duration,
    ) -> Result<(u64, String), AgentClientError> {
        let by = || Instant::now() + timeout;
        let id = self.send(request, by(), timeout)?;
        match self.receive_any(&[id], by(), timeout)?.outcome {
            Outcome::Ok(Reply::ModelReady) => {}
            Outcome::Ok(_) => return Err(AgentClientError::UnexpectedReply { what }),
            Outcome::Err(failure) => return Err(AgentClientError::Agent { what, failure }),
        }
        let mut buf = vec![0u8; MAX_DATA_LEN as usize];
        loop {
            let n = match data.read(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Closing without the end frame: the agent drops the partial file.
                    self.broken = true;
                    return Err(AgentClientError::Io(e));
                }
            };
            let frame = crate::frame::encode_data(&buf[..n]).map_err(AgentClientError::Encode)?;
            if let Err(e) = channel::write_all_by(&mut self.stream, &frame, by()) {
                self.broken = true;
                return Err(match e {
                    ChannelError::TimedOut => AgentClientError::Timeout {
                        what: "model data",
                        timeout,
                    },
                    ChannelError::Io(e) => e.into(),
                });
            }
            if n == 0 {
                break;
            }
        }
        match self.receive_any(&[id], by(), timeout)?.outcome {
            Outcome::Ok(Reply::ModelStored { bytes, sha256, .. }) => Ok((bytes, sha256)),
            Outcome::Ok(_) => Err(AgentClientError::UnexpectedReply { what }),
            Outcome::Err(failure) => Err(AgentClientError::Agent { what, failure }),
        }
    }

    /// The stored models.
    pub fn model_list(&mut self, timeout: Duration) -> Result<Vec<ModelEntry>, AgentClientError> {
        match self.call(&Request::ModelList, timeout)? {
            Reply::Models { models } => Ok(models),
            _ => Err(AgentClientError::UnexpectedReply { what: "model-list" }),
        }
    }

    /// Removes a stored model.
    pub fn model_remove(&mut self, name: &str, timeout: Duration) -> Result<(), AgentClientError> {
        match self.call(
            &Request::ModelRemove {
                name: name.to_string(),
            },
            timeout,
        )? {
            Reply::ModelRemoved => Ok(()),
            _ => Err(AgentClientError::UnexpectedReply {
                what: "model-remove",
            }),
        }
    }

    /// Starts a bounded test load (checked against the caps before it is sent); returns
    /// the worker's pid in the guest.
    pub fn load_start(
        &mut self,
        spec: crate::load::LoadSpec,
        timeout: Duration,
    ) -> Result<u32, AgentClientError> {
        spec.check().map_err(|e| AgentClientError::Agent {
            what: "load",
            failure: AgentFailure {
                code: crate::message::ErrorCode::BadRequest,
                message: e.to_string(),
            },
        })?;
        match self.call(&Request::Load(spec), timeout)? {
            Reply::LoadStarted { pid } => Ok(pid),
            _ => Err(AgentClientError::UnexpectedReply { what: "load" }),
        }
    }

    /// The latest load of `kind`.
    pub fn load_status(
        &mut self,
        kind: crate::load::LoadKind,
        timeout: Duration,
    ) -> Result<crate::load::LoadReport, AgentClientError> {
        match self.call(&Request::LoadStatus { kind }, timeout)? {
            Reply::Load(report) => Ok(report),
            _ => Err(AgentClientError::UnexpectedReply {
                what: "load-status",
            }),
        }
    }

    /// The guest's devices as it sees them ([`Request::GpuInfo`]): its PCI functions and
    /// `nvidia-smi`'s GPUs, checked against [`crate::gpu`]'s caps before they are returned.
    /// An agent older than the request answers `bad-request`, returned as
    /// [`AgentClientError::Unsupported`]. `timeout` should leave the agent its
    /// [`crate::gpu::NVIDIA_SMI_DEADLINE_SECS`] and some.
    pub fn gpu_info(
        &mut self,
        timeout: Duration,
    ) -> Result<crate::gpu::GpuInfoReply, AgentClientError> {
        let what = "gpu-info";
        match self
            .call(&Request::GpuInfo, timeout)
            .map_err(|e| older_agent(what, e))?
        {
            Reply::GpuInfo(reply) => {
                reply.check().map_err(|e| AgentClientError::RefusedReply {
                    what,
                    reason: e.to_string(),
                })?;
                Ok(reply)
            }
            _ => Err(AgentClientError::UnexpectedReply { what }),
        }
    }

    /// Asks for a clean shutdown; the guest powers off after answering.
    pub fn shutdown(&mut self, timeout: Duration) -> Result<ShutdownReport, AgentClientError> {
        match self.call(&Request::Shutdown, timeout)? {
            Reply::ShuttingDown(report) => Ok(report),
            _ => Err(AgentClientError::UnexpectedReply { what: "shutdown" }),
        }
    }
}

/// An agent's `bad-request` to a request it does not know (an agent older than it) as
/// [`AgentClientError::Unsupported`]; other errors as they are.
fn older_agent(what: &'static str, e: AgentClientError) -> AgentClientError {
    match e {
        AgentClientError::Agent { failure, .. }
            if failure.code == crate::message::ErrorCode::BadRequest =>
        {
            AgentClientError::Unsupported { what }
        }
        e => e,
    }
}

#[cfg(test)]
#[path = "gpu_info_tests.rs"]
mod gpu_info_tests;
