//! The guest agent in the lifecycle (docs/guest-image.md): tenants whose image is a guest
//! image set (`guest-image/build.sh` output, recognised by its `manifest.json`) boot the
//! set's kernel and initramfs, and once the VM runs, create and start
//!
//! 1. `await-agent`: wait until the agent answers `status` on its channel;
//! 2. `unlock-disk`: deliver the disk key (unwrapped from the tenant's wrapped key, zeroized
//!    after use) if the guest reports the disk locked, and mount it if it is not mounted;
//! 3. `start-payload`: start the inference server unless the guest reports it running;
//! 4. `await-payload`: wait until the payload answers its health check.
//!
//! Each step asks the guest first and skips what it reports done, so re-running one after a
//! daemon crash is safe. Stop and destroy ask the agent for a clean shutdown (payload
//! stopped, disk unmounted and closed, power-off) before the backend's own stop. Inference
//! requests reach the payload through [`infer`].
//!
//! The backend says where the channel is ([`crate::backend::VmBackend::agent_endpoint`]:
//! QEMU's virtio-serial port, tenantvm-vmm's hybrid vsock); every connection checks that
//! the socket is served by the tenant's uid (SO_PEERCRED), so a socket swapped for another
//! tenant's never receives this tenant's key. Everything the
//! guest sends is hostile: the protocol crate's client bounds frames and puts a deadline
//! on every connect, read and write, and
//! [`infer`] returns the payload's answer only if it is a JSON object.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tenantvm_agent_protocol::{
    AgentClient, AgentClientError, DiskKey as AgentDiskKey, DiskState, HttpRequest, ImageSet,
    PayloadState,
};

use crate::backend::{RunningVm, VmState};
use crate::receipt::{now_rfc3339, Assurance, DepartureStep, StepRecord, StepResult};
use crate::store::TenantRecord;
use crate::tenant::disk_steps;
use crate::tenant::service::{ServiceConfig, TenantService, TenantServiceError};
use crate::tenant::spec::TenantSpec;
use crate::tenant::steps::{recorded_vm, Step};

/// The file in a guest image set that marks it as one (with the hashes of its boot files).
pub const MANIFEST: &str = "manifest.json";
/// Largest completion request forwarded to a guest (the API's own cap is larger).
pub const MAX_INFER_BODY: usize = 16 * 1024;
/// How long one inference may take in the guest.
pub const INFER_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the agent gets to answer `shutdown` (it stops the payload: up to 10 s).
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long each agent call of a step may take once the agent answers.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one round of waiting for the agent lasts before the VM is checked again.
const AWAIT_ROUND: Duration = Duration::from_secs(5);
/// What the stop step left for the departure receipt.
const SHUTDOWN_RECORD: &str = "agent-shutdown.json";

/// The guest image set a spec names, if its image is one: a named image
/// (`<image-dir>/<name>/`) holding `manifest.json`.
pub fn image_set_dir(cfg: &ServiceConfig, spec: &TenantSpec) -> Option<PathBuf> {
    let (Some(name), None, Some(dir)) = (&spec.image.name, &spec.image.kernel, &cfg.image_dir)
    else {
        return None;
    };
    let base = dir.join(name);
    base.join(MANIFEST).is_file().then_some(base)
}

/// Whether a tenant's guest runs the agent.
pub fn uses_agent(cfg: &ServiceConfig, spec: &TenantSpec) -> bool {
    image_set_dir(cfg, spec).is_some()
}

/// The kernel (bzImage), initramfs and command line of a guest image set, after checking
/// them against its manifest (a modified or incomplete set is refused).
pub fn boot_files(dir: &Path) -> Result<(PathBuf, Option<PathBuf>, String), TenantServiceError> {
    let set = ImageSet::open(dir).map_err(|e| {
        TenantServiceError::Image(format!(
            "guest image set {}: {e}; rebuild it with guest-image/build.sh",
            dir.display()
        ))
    })?;
    Ok((
        dir.join("vmlinuz"),
        Some(dir.join("initramfs.cpio.gz")),
        set.cmdline,
    ))
}

/// Refuses, before anything is recorded, a guest-image tenant this daemon cannot run.
pub(crate) fn check_create(
    cfg: &ServiceConfig,
    spec: &TenantSpec,
) -> Result<(), TenantServiceError> {
    let Some(dir) = image_set_dir(cfg, spec) else {
        return Ok(());
    };
    if spec.disk_gib == 0 {
        return Err(TenantServiceError::Image(format!(
            "{} is a guest image set: its agent unlocks and mounts the tenant's encrypted disk before it starts the payload; set disk_gib = 1 or more",
            dir.display()
        )));
    }
    boot_files(&dir).map(|_| ())
}

fn step_err(step: Step, message: impl std::fmt::Display) -> TenantServiceError {
    TenantServiceError::Step {
        step: step.name(),
        message: message.to_string(),
    }
}

/// Connects to the agent channel of `vm` where its backend says it is, within `timeout`,
/// refusing a socket not served by the tenant's uid.
fn connect(
    svc: &TenantService,
    vm: &RunningVm,
    timeout: Duration,
) -> Result<AgentClient, AgentClientError> {
    AgentClient::connect_checked(&svc.backend.agent_endpoint(vm), vm.uid, timeout)
}

fn running_vm(
    svc: &TenantService,
    t: &TenantRecord,
    step: Step,
) -> Result<RunningVm, TenantServiceError> {
    recorded_vm(svc, t)?.ok_or_else(|| step_err(step, "no VM is recorded for this tenant"))
}

/// Runs one of the agent steps of create and start (a no-op for tenants without an agent).
pub(crate) fn run_step(
    svc: &TenantService,
    t: &TenantRecord,
    step: Step,
) -> Result<(), TenantServiceError> {
    if !uses_agent(&svc.config, &t.spec) {
        return Ok(());
    }
    let vm = running_vm(svc, t, step)?;
    let fail = |e: AgentClientError| step_err(step, e);
    match step {
        Step::AwaitAgent => {
            let started = Instant::now();
            let deadline = started + svc.config.agent_timeout;
            let waited = |e: &dyn std::fmt::Display| {
                step_err(
                    step,
                    format!(
                        "{e} (waited {:.0?}; see `tenantvm logs {} --stream serial`)",
                        started.elapsed(),
                        t.name
                    ),
                )
            };
            let status = loop {
                // A VM that ended will never answer: stop waiting at once.
                if let Ok(VmState::Exited { status }) = svc.backend.state(&vm) {
                    return Err(waited(&format!(
                        "the VM ended ({status:?}) before its agent answered"
                    )));
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(waited(&"the guest agent did not answer in time"));
                }
                match AgentClient::wait_for_ready_with(
                    &mut |timeout| connect(svc, &vm, timeout),
                    left.min(AWAIT_ROUND),
                ) {
                    Ok((_, status)) => break status,
                    Err(e) if Instant::now() >= deadline => return Err(waited(&e)),
                    Err(e) => {
                        tracing::debug!(tenant = %t.name, error = %e, "agent not answering yet")
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
        }
        Step::UnlockDisk => {
            let mut agent = connect(svc, &vm, CALL_TIMEOUT).map_err(fail)?;
            let status = agent.status(CALL_TIMEOUT).map_err(fail)?;
            if status.disk == DiskState::Locked {
                let key = disk_steps::disk_key_for_agent(svc, &t.name)?;
                let key = AgentDiskKey::new(key.expose()).map_err(|e| step_err(step, e))?;
                agent.unlock_disk(&key, CALL_TIMEOUT).map_err(fail)?;
                // `key` (and the orchestrator's copy above) are zeroized when dropped here.
            }
            if status.disk != DiskState::Mounted {
                let formatted = agent.mount(true, CALL_TIMEOUT).map_err(fail)?;
                tracing::info!(tenant = %t.name, formatted, "tenant disk mounted in the guest");
            }
        }
        Step::StartPayload => {
            let mut agent = connect(svc, &vm, CALL_TIMEOUT).map_err(fail)?;
            let status = agent.status(CALL_TIMEOUT).map_err(fail)?;
            if !matches!(status.payload, PayloadState::Running { .. }) {
                agent.start_payload(CALL_TIMEOUT).map_err(fail)?;
            }
        }
        Step::AwaitPayload => {
            let mut agent = connect(svc, &vm, CALL_TIMEOUT).map_err(fail)?;
            agent
                .wait_payload_ready(svc.config.agent_timeout)
                .map_err(fail)?;
        }
        other => return Err(step_err(other, "not an agent step")),
    }
    Ok(())
}

/// What the agent reported when asked to shut down, kept for the departure receipt.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct ShutdownOutcome {
    /// The agent answered `shutdown`.
    answered: bool,
    payload_stopped: bool,
    unmounted: bool,
    disk_closed: bool,
    /// The VM exited by itself afterwards (power-off).
    powered_off: bool,
    /// Why the agent could not be asked, if it could not.
    error: Option<String>,
}

/// Before the backend stops a guest-image VM: ask the agent for a clean shutdown (payload
/// stopped, disk unmounted, dm-crypt closed, power-off) and wait up to `grace` for the VM
/// to exit. Never fails: whatever is left, the backend's stop and kill end it.
pub(crate) fn shutdown_before_stop(
    svc: &TenantService,
    t: &TenantRecord,
    vm: &RunningVm,
    grace: Duration,
) {
    if !uses_agent(&svc.config, &t.spec) {
        return;
    }
    if !matches!(
        svc.backend.state(vm),
        Ok(VmState::Running | VmState::Paused)
    ) {
        return;
    }
    let mut outcome = ShutdownOutcome {
        answered: false,
        payload_stopped: false,
        unmounted: false,
        disk_closed: false,
        powered_off: false,
        error: None,
    };
    match connect(svc, vm, Duration::from_secs(5)).and_then(|mut a| a.shutdown(SHUTDOWN_TIMEOUT)) {
        Ok(report) => {
            outcome.answered = true;
            outcome.payload_stopped = report.payload_stopped;
            outcome.unmounted = report.unmounted;
            outcome.disk_closed = report.disk_closed;
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if let Ok(VmState::Exited { .. } | VmState::Gone) = svc.backend.state(vm) {
                    outcome.powered_off = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Err(e) => {
            tracing::warn!(tenant = %t.name, error = %e, "the guest agent did not shut down cleanly; stopping the VM");
            outcome.error = Some(e.to_string());
        }
    }
    let path = vm.tenant_dir.join(SHUTDOWN_RECORD);
    if let Ok(json) = serde_json::to_vec(&outcome) {
        if let Err(e) = std::fs::write(&path, json) {
            tracing::warn!(tenant = %t.name, error = %e, "cannot record the agent shutdown");
        }
    }
}

/// Forgets the shutdown report of an earlier run of the VM, so a departure never reports
/// how a previous boot ended as its own (launch-vm calls it before a new boot).
pub(crate) fn forget_shutdown(tenant_dir: &Path) {
    let _ = std::fs::remove_file(tenant_dir.join(SHUTDOWN_RECORD));
}

/// The receipt record of the stop step of a guest-image tenant's departure, from what
/// [`shutdown_before_stop`] found; `None` for tenants without an agent.
pub(crate) fn shutdown_record(
    svc: &TenantService,
    t: &TenantRecord,
    started_at: &str,
) -> Option<StepRecord> {
    if !uses_agent(&svc.config, &t.spec) {
        return None;
    }
    let path = svc.config.tenant_dir(&t.name).join(SHUTDOWN_RECORD);
    let outcome: Option<ShutdownOutcome> = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let rec = |method: &str, result, assurance| {
        StepRecord::new(
            DepartureStep::AgentShutdown,
            method,
            result,
            assurance,
            started_at.to_string(),
            now_rfc3339(),
        )
    };
    Some(match outcome {
        Some(o) if o.answered => rec(
            "guest agent shutdown over the control channel (payload stopped, disk unmounted, dm-crypt closed, power-off), then the VMM stopped",
            StepResult::Ok,
            // The guest reports it; the host cannot check inside the guest.
            Assurance::Unverified,
        )
        .with_evidence("payload_stopped", o.payload_stopped)
        .with_evidence("unmounted", o.unmounted)
        .with_evidence("disk_closed", o.disk_closed)
        .with_evidence("powered_off", o.powered_off),
        Some(o) => rec(
            "the guest agent did not answer shutdown; VM stopped through the VMM, SIGKILL after 500 ms",
            StepResult::Ok,
            Assurance::Unverified,
        )
        .with_evidence("agent_error", o.error.unwrap_or_default()),
        None => rec(
            "the VM was not running; nothing to shut down",
            StepResult::Skipped,
            Assurance::NotApplicable,
        ),
    })
}

/// The admission state's key for `t`: its row id and name, so that a new tenant under a
/// destroyed one's name starts afresh.
pub(crate) fn admission_key(t: &TenantRecord) -> String {
    format!("{}:{}", t.id, t.name)
}

/// Forwards an OpenAI-style completion request (a JSON object) to the tenant's payload
/// and returns its JSON answer: [`admit`], then [`forward`].
pub(crate) fn infer(
    svc: &TenantService,
    t: &TenantRecord,
    body: serde_json::Value,
) -> Result<serde_json::Value, TenantServiceError> {
    let permit = admit(svc, t)?;
    forward(svc, t, body, permit)
}

/// The quota gate, first and without blocking: every request counts, whether or not it
/// would succeed, and a refused one costs nothing further. Hold the permit until the answer
/// is back.
pub(crate) fn admit(
    svc: &TenantService,
    t: &TenantRecord,
) -> Result<crate::tenant::admission::Permit, TenantServiceError> {
    Ok(svc
        .admission
        .admit(&admission_key(t), &t.name, &t.spec.quotas, Instant::now())?)
}

/// Forwards an admitted completion request to the tenant's payload (blocks until the guest
/// answers or its deadline passes). The body is never logged: it is the tenant's data.
pub(crate) fn forward(
    svc: &TenantService,
    t: &TenantRecord,
    body: serde_json::Value,
    _permit: crate::tenant::admission::Permit,
) -> Result<serde_json::Value, TenantServiceError> {
    if !uses_agent(&svc.config, &t.spec) {
        return Err(TenantServiceError::BadRequest(format!(
            "tenant {:?} does not run a guest image with an inference server",
            t.name
        )));
    }
    if t.state != crate::tenant::lifecycle::LifecycleState::Running {
        return Err(TenantServiceError::NotServing(t.name.clone()));
    }
    if !body.is_object() {
        return Err(TenantServiceError::BadRequest(
            "send a JSON object such as {\"prompt\": \"...\", \"max_tokens\": 16}".into(),
        ));
    }
    let body = body.to_string();
    if body.len() > MAX_INFER_BODY {
        return Err(TenantServiceError::BadRequest(format!(
            "the completion request is {} bytes; at most {MAX_INFER_BODY} are forwarded",
            body.len()
        )));
    }
    let vm = recorded_vm(svc, t)?.ok_or_else(|| TenantServiceError::NotServing(t.name.clone()))?;
    let started = Instant::now();
    let unavailable = |e: AgentClientError| TenantServiceError::AgentUnavailable(e.to_string());
    let mut agent = connect(svc, &vm, Duration::from_secs(5)).map_err(unavailable)?;
    let answer = agent
        .infer(
            HttpRequest {
                method: "POST".into(),
                path: "/v1/completions".into(),
                headers: vec![("Content-Type".into(), "application/json".into())],
                body,
            },
            INFER_TIMEOUT,
        )
        .map_err(unavailable)?;
    tracing::info!(
        tenant = %t.name,
        status = answer.status,
        ms = started.elapsed().as_millis() as u64,
        "inference forwarded"
    );
    let json: serde_json::Value = serde_json::from_str(&answer.body).map_err(|_| {
        TenantServiceError::AgentUnavailable(format!(
            "the payload answered status {} with a body that is not JSON",
            answer.status
        ))
    })?;
    if answer.status != 200 {
        return Err(TenantServiceError::AgentUnavailable(format!(
            "the payload answered status {}: {}",
            answer.status,
            crate::logs::sanitize(
                &json["error"]["message"]
                    .as_str()
                    .or_else(|| json["error"].as_str())
                    .unwrap_or("no message")
                    .chars()
                    .take(200)
                    .collect::<String>()
            )
        )));
    }
    if !json.is_object() {
        return Err(TenantServiceError::AgentUnavailable(
            "the payload's answer is not a JSON object".into(),
        ));
    }
    Ok(json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant::spec::TenantSpec;

    fn spec(name: &str, disk_gib: u32) -> TenantSpec {
        TenantSpec::from_toml(&format!(
            "name = \"{name}\"\nvcpus = 1\nmemory_mib = 512\ndisk_gib = {disk_gib}\n[image]\nname = \"linux\"\n"
        ))
        .unwrap()
    }

    fn image_dir(with_manifest: bool) -> (tempfile::TempDir, ServiceConfig) {
        let tmp = tempfile::tempdir().unwrap();
        let set = tmp.path().join("images/linux");
        std::fs::create_dir_all(&set).unwrap();
        if with_manifest {
            std::fs::write(set.join(MANIFEST), "{}").unwrap();
        }
        let mut cfg = ServiceConfig::new(tmp.path().join("state"));
        cfg.image_dir = Some(tmp.path().join("images"));
        (tmp, cfg)
    }

    #[test]
    fn only_named_images_with_a_manifest_use_the_agent() {
        let (_tmp, cfg) = image_dir(true);
        assert!(uses_agent(&cfg, &spec("a", 1)));
        let (_tmp2, plain) = image_dir(false);
        assert!(!uses_agent(&plain, &spec("a", 1)));
    }

    #[test]
    fn a_guest_image_tenant_without_a_disk_is_refused() {
        let (_tmp, cfg) = image_dir(true);
        let err = check_create(&cfg, &spec("a", 0)).unwrap_err().to_string();
        assert!(err.contains("disk_gib = 1"), "{err}");
    }

    #[test]
    fn a_tampered_image_set_is_refused_before_anything_runs() {
        // A manifest that lists nothing: the boot files are not vouched for.
        let (_tmp, cfg) = image_dir(true);
        let err = check_create(&cfg, &spec("a", 1)).unwrap_err().to_string();
        assert!(
            err.contains("rebuild it with guest-image/build.sh"),
            "{err}"
        );
    }

    #[test]
    fn infer_is_refused_for_unknown_foreign_and_agentless_tenants() {
        use crate::auth::Caller;
        use crate::tenant::fault::FaultHook;
        use crate::tenant::service::{CommandOutcome, TenantCommand};
        use crate::tenant::test_utils::Harness;
        let h = Harness::new(FaultHook::default());
        let mut ids = Vec::new();
        for name in ["a", "b"] {
            let spec =
                TenantSpec::from_toml(&format!("name = \"{name}\"\n[image]\nname = \"hello\"\n"))
                    .unwrap();
            match h.svc.execute(&Caller::Admin, TenantCommand::Create(spec)) {
                Ok(CommandOutcome::Created(c)) => ids.push(c.tenant.name),
                other => panic!("{other:?}"),
            }
        }
        h.svc.wait_idle();
        let body = serde_json::json!({"prompt": "secret prompt"});
        let infer = |caller: &Caller, name: &str| {
            h.svc
                .execute(caller, TenantCommand::Infer(name.into(), body.clone()))
                .unwrap_err()
        };
        assert!(matches!(
            infer(&Caller::Admin, "nobody"),
            TenantServiceError::NotFound(_)
        ));
        let a = h.svc.store().tenant("a").unwrap().unwrap();
        // Tenant a's token cannot reach b: answered like a missing tenant.
        assert!(matches!(
            infer(&Caller::Tenant(a.id), "b"),
            TenantServiceError::NotFound(_)
        ));
        // The test guest runs no agent: a clear refusal that never echoes the prompt.
        let err = infer(&Caller::Tenant(a.id), "a");
        assert!(matches!(err, TenantServiceError::BadRequest(_)), "{err}");
        assert!(
            err.to_string().contains("does not run a guest image"),
            "{err}"
        );
        assert!(!err.to_string().contains("secret prompt"));
    }
}
