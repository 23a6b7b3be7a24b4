//! The guest agent's steps (docs/guest-image.md). Tenants whose guest runs the agent (a
//! guest image set) boot, and once the VM runs, create and start
//!
//! 1. `await-agent`: wait until the agent answers `status` on its channel;
//! 2. `deliver-licence`: hand the tenant's vGPU licence token (unsealed from the key store,
//!    zeroized after use) to the agent, which writes it where NVIDIA's licensing client
//!    reads it; at every boot, since the token lives in guest RAM; a no-op without one;
//! 3. `unlock-disk`: deliver the disk key (unwrapped from the tenant's wrapped key, zeroized
//!    after use) if the guest reports the disk locked, and mount it if it is not mounted;
//! 4. `start-payload`: start the inference server unless the guest reports it running;
//! 5. `await-payload`: wait until the payload answers its health check.
//!
//! For other tenants each is a no-op. Each asks the guest first and skips what it reports
//! done, so re-running one after a daemon crash is safe. Stop and destroy ask the agent for
//! a clean shutdown ([`shutdown`]) before the backend's own stop.
//!
//! How the agent is reached is decided in one place, [`agent_endpoint`], which asks the
//! backend (QEMU: its virtio-serial port behind `<tenant dir>/run/agent.sock`; tenantvm-vmm:
//! its hybrid vsock `<tenant dir>/run/vsock.sock`). Every connection goes through
//! [`connect`], which puts a deadline on the connect and checks that the socket is served by
//! the tenant's uid (SO_PEERCRED), so a socket swapped for another tenant's never receives
//! this tenant's key. Everything the guest sends is hostile: the protocol crate's client
//! bounds frames and puts a deadline on every read and write.

use std::time::{Duration, Instant};

use tenantvm_agent_protocol::{
    AgentClient, AgentClientError, AgentEndpoint, DiskKey as AgentDiskKey, DiskState, LicenceToken,
    PayloadState, ShutdownReport,
};

use crate::backend::{BackendError, RunningVm, VmBackend, VmState};
use crate::receipt::StepRecord;
use crate::tenant::agent_mux;
use crate::tenant::context::{StepCtx, StepError, Tenant};
use crate::tenant::steps::{disk, Op};

/// How long the agent gets to answer `shutdown` (it stops the payload: up to 10 s).
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long each agent call of a step may take once the agent answers.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one round of waiting lasts before the VM and the stop flag are checked again.
const AWAIT_ROUND: Duration = Duration::from_secs(1);
/// How long connecting to the channel may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the agent of `vm` listens: the one place the tenant layer decides how to reach a
/// guest's agent. The backend says where its channel is.
pub fn agent_endpoint(backend: &dyn VmBackend, vm: &RunningVm) -> AgentEndpoint {
    backend.agent_endpoint(vm)
}

/// Connects to the agent of `vm` within `timeout`, checking the peer is the tenant's:
/// a virtio-serial or hybrid-vsock socket must be served by the tenant's uid; on
/// vhost-vsock the peer is the VM holding the tenant's CID, and the kernel keeps a CID to
/// one VM at a time, so the tenant's VM process (which set the CID when it started and
/// holds it while it lives) must still be alive once the connection is made. Otherwise
/// the CID may have passed to another VM and the connection is dropped unused.
///
/// Over virtio-serial the client is a stream of the VM's multiplexed channel
/// ([`agent_mux`]), opened and negotiated on first use with the same peer check; with an
/// agent that has no mux, the plain connection (one request at a time).
pub fn connect(
    backend: &dyn VmBackend,
    vm: &RunningVm,
    timeout: Duration,
) -> Result<AgentClient, AgentClientError> {
    let endpoint = agent_endpoint(backend, vm);
    if let AgentEndpoint::Serial(socket) = &endpoint {
        let key = mux_key(socket, vm);
        return agent_mux::channels().client(
            &key,
            || AgentClient::connect_checked(&endpoint, vm.uid, timeout),
            timeout,
        );
    }
    let client = AgentClient::connect_checked(&endpoint, vm.uid, timeout)?;
    vsock_peer_alive(backend, vm, &endpoint)?;
    Ok(client)
}

fn mux_key(socket: &std::path::Path, vm: &RunningVm) -> agent_mux::ChannelKey {
    agent_mux::ChannelKey {
        socket: socket.to_path_buf(),
        pid: vm.pid,
        start_time_ticks: vm.start_time_ticks,
    }
}

/// Whether each request to `vm`'s agent gets a connection or stream of its own (so it may
/// take it for a stream: `infer-stream`, `model-push`): vsock always; virtio-serial once
/// the port is multiplexed (negotiated now, within `timeout`, if it is not yet).
pub fn streams_per_request(backend: &dyn VmBackend, vm: &RunningVm, timeout: Duration) -> bool {
    let endpoint = agent_endpoint(backend, vm);
    match &endpoint {
        AgentEndpoint::Serial(socket) => {
            let key = mux_key(socket, vm);
            if !agent_mux::channels().is_multiplexed(&key) {
                // Opening a client negotiates; the client itself is not needed.
                let _ = connect(backend, vm, timeout);
            }
            agent_mux::channels().is_multiplexed(&key)
        }
        _ => endpoint.connection_per_request(),
    }
}

/// Over AF_VSOCK there are no peer credentials: the connection is the tenant's only while
/// the VM the CID was given to still runs, which is checked after connecting (a CID is
/// handed to another VM only after this one ends).
fn vsock_peer_alive(
    backend: &dyn VmBackend,
    vm: &RunningVm,
    endpoint: &AgentEndpoint,
) -> Result<(), AgentClientError> {
    if let AgentEndpoint::Vsock { cid, .. } = *endpoint {
        match backend.ended(vm) {
            Ok(None) => {}
            Ok(Some(_)) => return Err(vsock_peer_gone(cid, "the tenant's VM has ended")),
            Err(e) => return Err(vsock_peer_gone(cid, &e.to_string())),
        }
    }
    Ok(())
}

/// The error for a vsock connection whose CID is no longer proven to be the tenant's VM.
fn vsock_peer_gone(cid: u32, why: &str) -> AgentClientError {
    AgentClientError::Connect {
        endpoint: format!("vsock CID {cid}"),
        source: std::io::Error::other(format!(
            "{why}; the CID may belong to another VM now, so the connection was dropped unused"
        )),
    }
}

/// [`connect`] for one request sent at once: over hybrid vsock the request follows the
/// `CONNECT` line without waiting for its `OK`, which is read (and checked, within
/// `timeout`) before the answer ([`AgentClient::connect_checked_pipelined`]): one round
/// trip to the guest less before the answer's first byte.
pub fn connect_pipelined(
    backend: &dyn VmBackend,
    vm: &RunningVm,
    timeout: Duration,
) -> Result<AgentClient, AgentClientError> {
    let endpoint = agent_endpoint(backend, vm);
    if matches!(endpoint, AgentEndpoint::Serial(_)) {
        return connect(backend, vm, timeout);
    }
    let client = AgentClient::connect_checked_pipelined(&endpoint, vm.uid, timeout)?;
    vsock_peer_alive(backend, vm, &endpoint)?;
    Ok(client)
}

/// The VM of an agent step, or `None` for a tenant whose guest runs no agent.
fn agent_vm(t: &Tenant) -> Result<Option<&RunningVm>, StepError> {
    if !t.has_agent() {
        return Ok(None);
    }
    t.vm.as_ref()
        .map(Some)
        .ok_or_else(|| StepError::failed("no VM is recorded for this tenant"))
}

/// await-agent: waits (up to the agent timeout) until the agent answers `status`.
pub fn await_agent(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let Some(vm) = agent_vm(t)? else {
        return Ok(None);
    };
    let started = Instant::now();
    let deadline = started + ctx.config.agent_timeout;
    let waited = |e: &dyn std::fmt::Display| {
        StepError::failed(format!(
            "{e} (waited {:.0?}; see `tenantvm logs {} --stream serial`)",
            started.elapsed(),
            t.name
        ))
    };
    let status = loop {
        ctx.stop.check()?;
        // A VM that ended will never answer: stop waiting at once.
        if let Ok(VmState::Exited { status }) = ctx.backend.state(vm) {
            return Err(waited(&format!(
                "the VM ended ({status:?}) before its agent answered"
            )));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(waited(&"the guest agent did not answer in time"));
        }
        match AgentClient::wait_for_ready_with(
            &mut |timeout| connect(ctx.backend, vm, timeout),
            left.min(AWAIT_ROUND),
        ) {
            Ok((_, status)) => break status,
            Err(e) if Instant::now() >= deadline => return Err(waited(&e)),
            Err(e) => {
                tracing::debug!(tenant = %t.name, error = %e, "agent not answering yet");
                // A refused connection returns at once: do not spin.
                ctx.stop.sleep(Duration::from_millis(200))?;
            }
        }
    };
    tracing::info!(
        tenant = %t.name,
        agent = %status.agent_version,
        channel = %status.channel,
        after_ms = started.elapsed().as_millis() as u64,
        "guest agent ready"
    );
    Ok(None)
}

/// deliver-licence: hands the tenant's vGPU licence token to the guest agent, which writes
/// it where NVIDIA's licensing client reads it (before the payload starts). Runs at every
/// boot (the token lives in guest RAM) and again on a resumed create (the agent replaces
/// the file). A no-op for a tenant without a licence or without an agent.
pub fn deliver_licence(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let Some(vm) = agent_vm(t)? else {
        return Ok(None);
    };
    let Some(sealed) = ctx
        .kit()?
        .keys
        .licence(&t.name)
        .map_err(StepError::failed)?
    else {
        return Ok(None);
    };
    let token = LicenceToken::new(&sealed).map_err(StepError::failed)?;
    drop(sealed);
    let mut agent = connect(ctx.backend, vm, CALL_TIMEOUT).map_err(StepError::failed)?;
    agent
        .install_licence(&token, CALL_TIMEOUT)
        .map_err(StepError::failed)?;
    // `token` and the unsealed copy are zeroized when dropped.
    tracing::info!(tenant = %t.name, "vGPU licence token delivered to the guest");
    Ok(None)
}

/// unlock-disk: delivers the disk key if the guest reports its disk locked, and has it
/// mounted unless it is.
pub fn unlock_disk(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let Some(vm) = agent_vm(t)? else {
        return Ok(None);
    };
    let mut agent = connect(ctx.backend, vm, CALL_TIMEOUT).map_err(StepError::failed)?;
    let status = agent.status(CALL_TIMEOUT).map_err(StepError::failed)?;
    if status.disk == DiskState::Locked {
        let key = disk::disk_key(ctx, &t.name)?;
        let key = AgentDiskKey::new(key.expose()).map_err(StepError::failed)?;
        agent
            .unlock_disk(&key, CALL_TIMEOUT)
            .map_err(StepError::failed)?;
        // `key` (and the orchestrator's copy above) are zeroized when dropped here.
    }
    if status.disk != DiskState::Mounted {
        let formatted = agent.mount(true, CALL_TIMEOUT).map_err(StepError::failed)?;
        tracing::info!(tenant = %t.name, formatted, "tenant disk mounted in the guest");
    }
    Ok(None)
}

/// start-payload: starts the inference server unless the guest reports it running.
pub fn start_payload(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let Some(vm) = agent_vm(t)? else {
        return Ok(None);
    };
    let mut agent = connect(ctx.backend, vm, CALL_TIMEOUT).map_err(StepError::failed)?;
    let status = agent.status(CALL_TIMEOUT).map_err(StepError::failed)?;
    if !matches!(status.payload, PayloadState::Running { .. }) {
        agent
            .start_payload(CALL_TIMEOUT)
            .map_err(StepError::failed)?;
    }
    Ok(None)
}

/// await-payload: waits (up to the agent timeout) until the payload reports ready.
pub fn await_payload(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let Some(vm) = agent_vm(t)? else {
        return Ok(None);
    };
    let deadline = Instant::now() + ctx.config.agent_timeout;
    let mut agent = connect(ctx.backend, vm, CALL_TIMEOUT).map_err(StepError::failed)?;
    loop {
        ctx.stop.check()?;
        let left = deadline.saturating_duration_since(Instant::now());
        match agent.wait_payload_ready(left.min(AWAIT_ROUND)) {
            Ok(()) => return Ok(None),
            Err(AgentClientError::PayloadNotReady { last, .. })
                if !left.is_zero()
                    && !matches!(last, PayloadState::Exited { .. })
                    && Instant::now() < deadline => {}
            // One health answer took longer than a round (the agent probes the payload;
            // slow under emulation): not a failure before the deadline. Its late answer
            // would sit on this connection, so take a fresh one.
            Err(AgentClientError::Timeout { .. }) if Instant::now() < deadline => {
                agent = connect(ctx.backend, vm, CALL_TIMEOUT).map_err(StepError::failed)?;
            }
            Err(AgentClientError::PayloadNotReady { last, .. }) => {
                return Err(StepError::failed(AgentClientError::PayloadNotReady {
                    timeout: ctx.config.agent_timeout,
                    last,
                }))
            }
            Err(e) => return Err(StepError::failed(e)),
        }
    }
}

/// What happened when the agent was asked to shut down: measured, for the receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentShutdown {
    /// It was not asked (the VM had already ended, or the daemon is stopping).
    NotAsked(String),
    /// The channel could not be reached or did not answer `shutdown`.
    NotReached {
        /// Why.
        error: String,
        /// How long trying took.
        after_ms: u64,
    },
    /// It answered.
    Answered {
        /// What the guest reports it did.
        report: ShutdownReport,
        /// When its answer came.
        after_ms: u64,
        /// When the VM was then seen to end on its own (power-off), if it did within the
        /// grace period.
        powered_off_ms: Option<u64>,
    },
}

impl AgentShutdown {
    /// One line for the receipt.
    pub fn describe(&self) -> String {
        match self {
            AgentShutdown::NotAsked(why) => format!("not asked: {why}"),
            AgentShutdown::NotReached { error, after_ms } => {
                format!("not reached after {after_ms} ms: {error}")
            }
            AgentShutdown::Answered {
                report,
                after_ms,
                powered_off_ms,
            } => format!(
                "answered shutdown after {after_ms} ms (reported: payload stopped {}, disk unmounted {}, dm-crypt closed {}); {}",
                report.payload_stopped,
                report.unmounted,
                report.disk_closed,
                match powered_off_ms {
                    Some(ms) => format!("the VM powered off after {ms} ms"),
                    None => "the VM did not power off within the grace period".into(),
                }
            ),
        }
    }
}

/// Before the backend stops a guest-image VM: asks the agent for a clean shutdown (payload
/// stopped, disk unmounted, dm-crypt closed, power-off) and waits up to `grace` for the VM
/// to exit. `found` is what the backend said of the VM just before: an agent is asked
/// unless the VM had ended (a VMM that does not answer its control socket may still run a
/// guest that answers). Never fails: whatever is left, the backend's stop and kill end it.
pub fn shutdown(
    ctx: &StepCtx<'_>,
    t: &Tenant,
    vm: &RunningVm,
    found: &Result<VmState, BackendError>,
    grace: Duration,
) -> AgentShutdown {
    if let Ok(VmState::Exited { .. } | VmState::Gone) = found {
        return AgentShutdown::NotAsked("the VM had already ended".into());
    }
    if ctx.stop.is_set() {
        return AgentShutdown::NotAsked("the daemon is stopping".into());
    }
    let clock = Instant::now();
    let ms = |c: Instant| c.elapsed().as_millis() as u64;
    match connect(ctx.backend, vm, CONNECT_TIMEOUT).and_then(|mut a| a.shutdown(SHUTDOWN_TIMEOUT)) {
        Ok(report) => {
            let after_ms = ms(clock);
            let deadline = Instant::now() + grace;
            let mut powered_off_ms = None;
            while Instant::now() < deadline && !ctx.stop.is_set() {
                if let Ok(VmState::Exited { .. } | VmState::Gone) = ctx.backend.state(vm) {
                    powered_off_ms = Some(ms(clock));
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            AgentShutdown::Answered {
                report,
                after_ms,
                powered_off_ms,
            }
        }
        Err(e) => {
            tracing::warn!(tenant = %t.name, error = %e, "the guest agent did not shut down cleanly; stopping the VM");
            AgentShutdown::NotReached {
                error: e.to_string(),
                after_ms: ms(clock),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendKind;

    #[test]
    fn a_channel_served_by_another_uid_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("run")).unwrap();
        let me = nix::unistd::getuid().as_raw();
        let vm = RunningVm {
            vsock_cid: None,
            backend: BackendKind::Qemu {
                accel: crate::backend::QemuAccel::Tcg,
            },
            tenant: "a".into(),
            pid: 1,
            start_time_ticks: 0,
            api_sock: tmp.path().join("run/qmp.sock"),
            tenant_dir: tmp.path().to_path_buf(),
            cgroup: crate::jail::CgroupHandle::V1 {
                memory: "/nonexistent".into(),
                cpu: "/nonexistent".into(),
                pids: "/nonexistent".into(),
                blkio: None,
                devices: None,
                cpuacct: None,
            },
            uid: me.wrapping_add(1),
        };
        let host = crate::tenant::test_utils::FakeHost::default();
        let backend = crate::tenant::test_utils::FakeBackend(host);
        // Where the backend says the agent is: connect goes there, and only there.
        let AgentEndpoint::Serial(sock) = agent_endpoint(&backend, &vm) else {
            panic!("the fake backend serves a serial endpoint");
        };
        let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let err = connect(&backend, &vm, Duration::from_secs(1))
            .err()
            .unwrap();
        assert!(
            matches!(err, AgentClientError::PeerMismatch { .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("refusing to talk to it"), "{err}");
        // Served by the tenant's uid: the mux hello goes out (an agent without mux refuses
        // it) and the plain connection is the client.
        std::thread::spawn(move || {
            use std::io::Write;
            // The refused connection above came first and carries nothing.
            let (mut s, body) = loop {
                let (mut s, _) = _listener.accept().unwrap();
                if let Ok(body) = tenantvm_agent_protocol::read_frame(&mut s) {
                    break (s, body);
                }
            };
            let req: tenantvm_agent_protocol::RequestFrame =
                tenantvm_agent_protocol::decode_body(&body).unwrap();
            assert!(matches!(
                req.request,
                tenantvm_agent_protocol::Request::Mux { .. }
            ));
            let refusal = tenantvm_agent_protocol::ResponseFrame {
                id: req.id,
                outcome: tenantvm_agent_protocol::Outcome::Err(
                    tenantvm_agent_protocol::AgentFailure {
                        code: tenantvm_agent_protocol::ErrorCode::BadRequest,
                        message: "unknown variant `mux`".into(),
                    },
                ),
            };
            s.write_all(&tenantvm_agent_protocol::encode_frame(&refusal).unwrap())
                .unwrap();
            std::thread::sleep(Duration::from_millis(500));
        });
        let ok = RunningVm { uid: me, ..vm };
        connect(&backend, &ok, Duration::from_secs(5)).unwrap();
    }

    #[test]
    fn a_hybrid_vsock_channel_is_reached_through_its_connect_handshake() {
        use std::io::{BufRead, BufReader, Write};
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("run")).unwrap();
        let me = nix::unistd::getuid().as_raw();
        let vm = RunningVm {
            vsock_cid: None,
            backend: BackendKind::TenantvmVmm,
            tenant: "a".into(),
            pid: 1,
            start_time_ticks: 0,
            api_sock: tmp.path().join("run/api.sock"),
            tenant_dir: tmp.path().to_path_buf(),
            cgroup: crate::jail::CgroupHandle::V1 {
                memory: "/nonexistent".into(),
                cpu: "/nonexistent".into(),
                pids: "/nonexistent".into(),
                blkio: None,
                devices: None,
                cpuacct: None,
            },
            uid: me,
        };
        let host = crate::tenant::test_utils::FakeHost::default();
        host.state().agent_vsock = true;
        let backend = crate::tenant::test_utils::FakeBackend(host);
        let AgentEndpoint::HybridVsock { path, port } = agent_endpoint(&backend, &vm) else {
            panic!("the backend named a vsock channel");
        };
        // The VMM's side: the CONNECT line for the agent's port, then OK.
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let vmm = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut line = String::new();
            BufReader::new(stream.try_clone().unwrap())
                .read_line(&mut line)
                .unwrap();
            (&stream).write_all(b"OK 1073741824\n").unwrap();
            line
        });
        connect(&backend, &vm, Duration::from_secs(5)).unwrap();
        assert_eq!(vmm.join().unwrap(), format!("CONNECT {port}\n"));
    }
}
