//! The tenant service: the one place that changes tenants. The API turns requests into
//! [`TenantCommand`]s; [`TenantService::execute`] authorises them and runs them: state
//! changes in the store, then the operation's steps ([`super::runner`]) on a worker thread.
//! Steps never see the service: they get a [`StepCtx`] built from its parts.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::auth::{self, Caller};
use crate::backend::{RunningVm, VmBackend};
use crate::domain::lifecycle::LifecycleState;
use crate::domain::spec::TenantSpec;
use crate::gpu::card_lock::CardLocks;
use crate::gpu::GpuHost;
use crate::store::{ResourceKind, Store, TenantRecord, TokenOwner};
use crate::tenant::admission::Admission;
use crate::tenant::context::{StepCtx, StopFlag, Tenant};
use crate::tenant::departure::{DepartureError, DepartureKit, Kit};
#[cfg(any(test, feature = "test-hooks"))]
use crate::tenant::fault::FaultHook;
use crate::tenant::host::JailCleaner;
use crate::tenant::infer::AdmittedInfer;
use crate::tenant::logs::{LogQuery, LogRead};
use crate::tenant::runner::{self, Ended};
use crate::tenant::steps::{vm, OnFailure, Op};
use crate::tenant::view::{Created, TenantStatus};

pub use crate::tenant::config::ServiceConfig;
pub use crate::tenant::service_error::TenantServiceError;

/// What the API asks the service to do.
#[derive(Debug, Clone)]
#[expect(
    clippy::large_enum_variant,
    reason = "one command per API request, moved once; boxing the spec would touch every caller"
)]
pub enum TenantCommand {
    /// Create a tenant (admin).
    Create(TenantSpec),
    /// List the tenants the caller may see.
    List,
    /// Show one tenant.
    Status(String),
    /// Stop a running tenant's VM.
    Stop(String),
    /// Start a stopped tenant's VM.
    Start(String),
    /// Destroy a tenant.
    Destroy(String),
    /// Read a log.
    Logs(String, LogQuery),
    /// Departure receipts from the audit log: one tenant's (a tenant token: its own only) or
    /// all (admin).
    Receipts(Option<String>),
    /// Quarantined GPU slices (admin).
    Quarantine,
    /// Re-run the scrub of a quarantined GPU slice `<gpu>/<label>` (admin).
    Rescrub(String),
    /// Forward a completion request (a JSON object) to the tenant's inference server.
    Infer(String, serde_json::Value),
}

/// What a command returns.
#[derive(Debug, Clone)]
pub enum CommandOutcome {
    /// A new tenant and its token.
    Created(Created),
    /// One tenant.
    Tenant(TenantStatus),
    /// Many tenants.
    Tenants(Vec<TenantStatus>),
    /// A piece of a log.
    Log(LogRead),
    /// Audit log entries.
    Receipts(Vec<crate::receipt::LogEntry>),
    /// Quarantined GPU slices.
    Quarantine(Vec<crate::store::QuarantinedSlice>),
    /// What a re-scrub found.
    Rescrubbed(crate::tenant::departure::RescrubOutcome),
    /// The inference server's JSON answer.
    Inferred(serde_json::Value),
}

/// Runs tenant commands. Cheap to clone (all shared state is behind `Arc`s).
#[derive(Clone)]
pub struct TenantService {
    store: Arc<Store>,
    backend: Arc<dyn VmBackend>,
    jail: Arc<dyn JailCleaner>,
    gpu: Arc<dyn GpuHost>,
    config: Arc<ServiceConfig>,
    /// The crash hook (test builds only).
    #[cfg(any(test, feature = "test-hooks"))]
    fault: Arc<FaultHook>,
    /// Per-tenant request rate and concurrency of inference requests.
    admission: Arc<Admission>,
    kit: Arc<Kit>,
    stop: Arc<StopFlag>,
    /// One lock per GPU card for the steps that change its host mode.
    cards: Arc<CardLocks>,
    busy: Arc<Mutex<HashMap<String, BusyWith>>>,
    /// Set from the start of a daemon's recovery pass until it has gone through every tenant.
    recovering: Arc<AtomicBool>,
    workers: Arc<Mutex<Vec<std::thread::JoinHandle<()>>>>,
    /// Per-tenant metrics (the front door's requests, the VMs' cgroups).
    metrics: Arc<crate::metrics::Metrics>,
}

/// What holds a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BusyWith {
    /// An operation (or a VM check) runs on it.
    Operation,
    /// The daemon's recovery after a restart has not finished with it.
    Recovery,
}

/// Marks a tenant busy for as long as it lives.
pub(crate) struct BusyGuard {
    busy: Arc<Mutex<HashMap<String, BusyWith>>>,
    name: String,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        lock(&self.busy).remove(&self.name);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl TenantService {
    /// A service over these parts.
    pub fn new(
        store: Arc<Store>,
        backend: Arc<dyn VmBackend>,
        jail: Arc<dyn JailCleaner>,
        gpu: Arc<dyn GpuHost>,
        config: ServiceConfig,
    ) -> TenantService {
        TenantService {
            store,
            backend,
            jail,
            gpu,
            kit: Arc::new(Kit::new(config.departure.clone())),
            config: Arc::new(config),
            #[cfg(any(test, feature = "test-hooks"))]
            fault: Arc::default(),
            admission: Arc::default(),
            stop: Arc::default(),
            cards: Arc::default(),
            busy: Arc::default(),
            recovering: Arc::default(),
            workers: Arc::default(),
            metrics: Arc::default(),
        }
    }

    /// Per-tenant metrics.
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.metrics
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The configuration.
    pub fn config(&self) -> &ServiceConfig {
        &self.config
    }

    /// The departure machinery (host KEK, key store, receipt signer, audit log), loaded and
    /// created on first use; the daemon calls this at start so that the KEK exists from
    /// initialisation on and a bad KEK stops the daemon before it serves.
    pub fn departure_kit(&self) -> Result<Arc<DepartureKit>, DepartureError> {
        self.kit.get()
    }

    /// Arms the crash hook (test builds only): the daemon from `TENANTVM_TEST_CRASH_AT`,
    /// in-process tests with [`FaultHook::fail_at`].
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn with_fault_hook(mut self, hook: FaultHook) -> TenantService {
        self.fault = Arc::new(hook);
        self
    }

    /// Runs `op`'s remaining steps with this build's boundary hook.
    fn run_steps(&self, ctx: &StepCtx<'_>, t: &mut Tenant, op_id: i64, op: Op) -> Ended {
        #[cfg(any(test, feature = "test-hooks"))]
        {
            let fault = self.fault.clone();
            let hook = move |op: &str, step: &str, side: runner::Boundary| {
                fault.check(op, step, side).map_err(|e| e.to_string())
            };
            runner::run(ctx, &hook, t, op_id, op)
        }
        #[cfg(not(any(test, feature = "test-hooks")))]
        {
            runner::run(ctx, &runner::no_hook, t, op_id, op)
        }
    }

    /// What steps (and reconciliation) may use of this service.
    pub(crate) fn ctx(&self) -> StepCtx<'_> {
        StepCtx {
            store: &self.store,
            backend: self.backend.as_ref(),
            jail: self.jail.as_ref(),
            gpu: self.gpu.as_ref(),
            keys: &self.kit,
            admission: &self.admission,
            config: &self.config,
            stop: &self.stop,
            cards: &self.cards,
        }
    }

    /// Asks every running operation to give up at its next wait (the daemon is stopping);
    /// each is left as a crash would leave it and resumes at the next start.
    pub fn request_stop(&self) {
        self.stop.set();
    }

    /// Name of the backend, for `/v1/health`.
    pub fn backend_name(&self) -> String {
        self.backend.kind().to_string()
    }

    /// How the backend reaches guest agents (`GET /v1/health`).
    pub fn agent_transport(&self) -> &'static str {
        self.backend.agent_transport()
    }

    fn hold(&self, name: &str, with: BusyWith) -> Result<BusyGuard, TenantServiceError> {
        let mut busy = lock(&self.busy);
        match busy.get(name) {
            Some(BusyWith::Operation) => Err(TenantServiceError::Busy(name.to_string())),
            Some(BusyWith::Recovery) => Err(TenantServiceError::Recovering(name.to_string())),
            None => {
                busy.insert(name.to_string(), with);
                Ok(BusyGuard {
                    busy: self.busy.clone(),
                    name: name.to_string(),
                })
            }
        }
    }

    /// Holds a tenant for an operation; refused while another holds it.
    pub(crate) fn mark_busy(&self, name: &str) -> Result<BusyGuard, TenantServiceError> {
        self.hold(name, BusyWith::Operation)
    }

    /// Holds a tenant for the recovery pass after a restart: commands on it are refused
    /// (saying so) and its view says `recovering` until the guard drops.
    pub(crate) fn mark_recovering(&self, name: &str) -> Result<BusyGuard, TenantServiceError> {
        self.hold(name, BusyWith::Recovery)
    }

    /// Whether anything holds the tenant now.
    pub(crate) fn is_busy(&self, name: &str) -> bool {
        lock(&self.busy).contains_key(name)
    }

    /// Whether the recovery pass holds the tenant now.
    pub(crate) fn is_recovering(&self, name: &str) -> bool {
        lock(&self.busy).get(name) == Some(&BusyWith::Recovery)
    }

    /// Whether the daemon's recovery after a restart is still going through tenants
    /// (`GET /v1/health` says so).
    pub fn recovering(&self) -> bool {
        self.recovering.load(Ordering::SeqCst)
    }

    pub(crate) fn set_recovering(&self, on: bool) {
        self.recovering.store(on, Ordering::SeqCst);
    }

    /// Keeps a background thread of the daemon (the recovery pass) among those that
    /// [`TenantService::wait_idle`] waits for.
    pub(crate) fn track(&self, handle: std::thread::JoinHandle<()>) {
        lock(&self.workers).push(handle);
    }

    /// Waits up to `timeout` for every operation started so far (shutdown); false if some
    /// still run (they are left as a crash would leave them, and resume at the next start).
    pub fn wait_idle_for(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut workers = lock(&self.workers);
                workers.retain(|h| !h.is_finished());
                if workers.is_empty() {
                    return true;
                }
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for every operation started so far (tests and shutdown).
    pub fn wait_idle(&self) {
        loop {
            let handles: Vec<_> = lock(&self.workers).drain(..).collect();
            if handles.is_empty() {
                return;
            }
            for h in handles {
                let _ = h.join();
            }
        }
    }

    /// Authorises and runs one command.
    pub fn execute(
        &self,
        caller: &Caller,
        command: TenantCommand,
    ) -> Result<CommandOutcome, TenantServiceError> {
        match command {
            TenantCommand::Create(spec) => {
                if !matches!(caller, Caller::Admin) {
                    return Err(TenantServiceError::AdminOnly("create tenants"));
                }
                self.create(spec).map(CommandOutcome::Created)
            }
            TenantCommand::List => {
                let tenants = self
                    .store
                    .list_tenants(false)?
                    .into_iter()
                    .filter(|t| caller.may_see(t.id))
                    .map(|t| self.view(&t))
                    .collect::<Result<_, _>>()?;
                Ok(CommandOutcome::Tenants(tenants))
            }
            TenantCommand::Status(name) => {
                let t = self.tenant_to_see(caller, &name)?;
                Ok(CommandOutcome::Tenant(self.view(&t)?))
            }
            TenantCommand::Stop(name) => {
                // The busy guard (taken by the operation) refuses a recovering tenant.
                let t = self.tenant_to_see(caller, &name)?;
                self.begin(t, LifecycleState::Stopping, Op::Stop)
                    .map(CommandOutcome::Tenant)
            }
            TenantCommand::Start(name) => {
                // The busy guard (taken by the operation) refuses a recovering tenant.
                let t = self.tenant_to_see(caller, &name)?;
                self.begin(t, LifecycleState::Provisioning, Op::Start)
                    .map(CommandOutcome::Tenant)
            }
            TenantCommand::Destroy(name) => {
                // The busy guard (taken by the operation) refuses a recovering tenant.
                let t = self.tenant_to_see(caller, &name)?;
                if t.state == LifecycleState::Destroying {
                    // A destroy that stopped on a failed step: resume it where it stopped.
                    return self.resume_destroy(t).map(CommandOutcome::Tenant);
                }
                self.begin(t, LifecycleState::Destroying, Op::Destroy)
                    .map(CommandOutcome::Tenant)
            }
            TenantCommand::Receipts(name) => self.receipts(caller, name.as_deref()),
            TenantCommand::Quarantine => {
                if !matches!(caller, Caller::Admin) {
                    return Err(TenantServiceError::AdminOnly("list quarantined GPU slices"));
                }
                Ok(CommandOutcome::Quarantine(self.store.quarantined()?))
            }
            TenantCommand::Rescrub(slice) => {
                if !matches!(caller, Caller::Admin) {
                    return Err(TenantServiceError::AdminOnly("scrub GPU slices"));
                }
                crate::tenant::steps::gpu::rescrub(&self.store, self.gpu.as_ref(), &slice)
                    .map(CommandOutcome::Rescrubbed)
                    .map_err(TenantServiceError::from)
            }
            TenantCommand::Infer(name, body) => {
                let t = self.tenant_to_act(caller, &name)?;
                crate::tenant::infer::infer(&self.ctx(), &t, body)
                    .map(CommandOutcome::Inferred)
                    .map_err(TenantServiceError::from)
            }
            TenantCommand::Logs(name, query) => {
                let t = self.tenant_to_see(caller, &name)?;
                crate::tenant::logs::read(&self.store, &self.config, &t, &query)
                    .map(CommandOutcome::Log)
                    .map_err(TenantServiceError::from)
            }
        }
    }

    /// Admits an inference request of `caller` to tenant `name` without blocking work (one
    /// store read and the tenant's admission gate): the API calls this before it starts a
    /// thread for the request, so a refused request costs nothing.
    pub fn admit_infer(
        &self,
        caller: &Caller,
        name: &str,
    ) -> Result<AdmittedInfer, TenantServiceError> {
        let tenant = self.tenant_to_act(caller, name)?;
        Ok(crate::tenant::infer::admit(&self.ctx(), tenant)?)
    }

    /// Forwards an admitted inference request to the tenant's guest and returns its answer
    /// (blocks until the guest answers or its deadline passes).
    pub fn infer_admitted(
        &self,
        admitted: AdmittedInfer,
        body: serde_json::Value,
    ) -> Result<serde_json::Value, TenantServiceError> {
        Ok(crate::tenant::infer::forward(&self.ctx(), admitted, body)?)
    }

    fn create(&self, mut spec: TenantSpec) -> Result<Created, TenantServiceError> {
        spec.validate()?;
        // The vGPU licence is write-only: out of the spec before anything is recorded,
        // sealed under the host KEK below.
        let licence = spec.vgpu_licence.take();
        // Fail fast on what can be checked before anything is recorded. What runs in the
        // guest is decided here, once, and stored with the tenant.
        let guest = crate::tenant::image::guest_kind(&self.config, &spec);
        crate::tenant::image::check_create(&self.config, &spec, guest, self.backend.kind())
            .map_err(|e| TenantServiceError::Image(e.to_string()))?;
        if licence.is_some() && guest != crate::domain::GuestKind::Agent {
            return Err(TenantServiceError::Image(
                "vgpu_licence is installed by the guest agent: give a guest image set (a named image with manifest.json, guest-image/build.sh), not a plain kernel".into(),
            ));
        }
        if spec.gpu.wants_gpu() {
            // A request this host could never meet (an unknown profile or model, a share of
            // a GPU without a partition, more than any GPU holds) is refused before anything
            // is recorded. Whether there is room now is reserve-gpu's question, asked under
            // the ledger.
            crate::tenant::steps::gpu::check_request(
                self.gpu.as_ref(),
                spec.name.as_str(),
                &spec.gpu,
                // An mdev vGPU reaches a VM only through QEMU: refused now, not at launch.
                self.backend.kind() != crate::backend::BackendKind::TenantvmVmm,
            )?;
        }
        let guard = self.mark_busy(&spec.name)?;
        // Held until the tenant is recorded: two creates never take the same room.
        let _room = self.config.capacity.lock();
        let others = self.store.list_tenants(false)?;
        self.config.capacity.check_room(
            others.iter().map(|t| &t.spec),
            self.config.vmm_overhead_mib,
            &spec,
        )?;
        // The name is free (a live tenant of that name keeps its own licence): the sealed
        // licence is written, or a stale one a crashed create left behind is removed, before
        // the tenant is recorded, so its steps never see another create's.
        if self.store.tenant(&spec.name)?.is_some() {
            return Err(crate::store::StoreError::DuplicateName(spec.name.to_string()).into());
        }
        self.seal_licence(&spec.name, licence.as_ref())?;
        drop(licence);
        let record = match self.store.insert_tenant(&spec, guest) {
            Ok(r) => r,
            Err(e) => {
                let _ = self.seal_licence(&spec.name, None);
                return Err(e.into());
            }
        };
        let token = auth::new_token();
        self.store
            .insert_token(&auth::token_hash(&token), &TokenOwner::Tenant(record.id))?;
        let op_id = self
            .store
            .transition(
                record.id,
                LifecycleState::Provisioning,
                Some(Op::Create.name()),
                None,
            )?
            .expect("transition with an op returns its id");
        let record = self.store.tenant_by_id(record.id)?;
        let tenant = self.view(&record)?;
        self.spawn_op(guard, record, op_id, Op::Create);
        Ok(Created { tenant, token })
    }

    /// Stores `tenant`'s vGPU licence sealed under the host KEK, or removes a sealed one
    /// when `licence` is `None`.
    fn seal_licence(
        &self,
        tenant: &str,
        licence: Option<&crate::domain::licence::VgpuLicence>,
    ) -> Result<(), TenantServiceError> {
        let done = match (licence, self.departure_kit()) {
            (Some(l), kit) => kit?.keys.store_licence(tenant, l.expose()),
            (None, Ok(kit)) => kit.keys.delete_licence(tenant).map(drop),
            // Without the key store there is no sealed licence to remove either.
            (None, Err(_)) => Ok(()),
        };
        done.map_err(|e| TenantServiceError::Step {
            step: "seal-vgpu-licence",
            message: e.to_string(),
        })
    }

    /// Resumes a destroy that stopped at a failed step: same operation, same departure, from
    /// the first step not done.
    fn resume_destroy(&self, t: TenantRecord) -> Result<TenantStatus, TenantServiceError> {
        let guard = self.mark_busy(&t.name)?;
        let op_id = match (t.op.as_deref().and_then(Op::parse), t.op_id) {
            (Some(Op::Destroy), Some(id)) => id,
            _ => {
                return Err(TenantServiceError::Step {
                    step: "destroy",
                    message: "no destroy operation is recorded for this destroying tenant".into(),
                })
            }
        };
        self.store.set_tenant_error(t.id, None)?;
        self.store
            .add_event(Some(t.id), "state", "destroy resumed")?;
        let record = self.store.tenant_by_id(t.id)?;
        let view = self.view(&record)?;
        self.spawn_op(guard, record, op_id, Op::Destroy);
        Ok(view)
    }

    /// Receipts from the audit log. The admin sees all (or one tenant's); a tenant token only
    /// its own tenant's, whatever name it asks for.
    fn receipts(
        &self,
        caller: &Caller,
        name: Option<&str>,
    ) -> Result<CommandOutcome, TenantServiceError> {
        let only = match caller {
            Caller::Admin => name.map(str::to_string),
            Caller::Tenant(id) => {
                // The tenant row may be destroyed: a departed tenant reads its own receipt.
                let own = self.store.tenant_by_id(*id)?.name.to_string();
                if name.is_some_and(|n| own != n) {
                    return Err(TenantServiceError::NotFound(
                        name.unwrap_or_default().into(),
                    ));
                }
                Some(own)
            }
        };
        let kit = self
            .departure_kit()
            .map_err(|e| TenantServiceError::Log(e.to_string()))?;
        let mut entries = kit.log.entries()?;
        if let Some(n) = &only {
            entries.retain(|e| e.receipt.tenant == *n);
        }
        if let Caller::Tenant(id) = caller {
            // A later tenant may reuse the name: keep only this tenant's departure.
            let departure = self.store.departure(*id)?.map(|(r, _)| r.departure_id);
            entries.retain(|e| Some(&e.receipt.departure_id) == departure.as_ref());
        }
        Ok(CommandOutcome::Receipts(entries))
    }

    fn begin(
        &self,
        t: TenantRecord,
        to: LifecycleState,
        op: Op,
    ) -> Result<TenantStatus, TenantServiceError> {
        let guard = self.mark_busy(&t.name)?;
        let op_id = self
            .store
            .transition(t.id, to, Some(op.name()), None)?
            .expect("transition with an op returns its id");
        let record = self.store.tenant_by_id(t.id)?;
        let view = self.view(&record)?;
        self.spawn_op(guard, record, op_id, op);
        Ok(view)
    }

    fn spawn_op(&self, guard: BusyGuard, record: TenantRecord, op_id: i64, op: Op) {
        let service = self.clone();
        let handle = std::thread::spawn(move || {
            let _guard = guard;
            service.finish_op(&record, op_id, op);
        });
        lock(&self.workers).push(handle);
    }

    /// Runs (or resumes) an operation's remaining steps and moves the tenant to the state
    /// it ends in. What a failure leaves is the operation's [`OnFailure`]; an abandoned run
    /// (a simulated crash, the daemon stopping) leaves the store exactly as a crash would.
    pub(crate) fn finish_op(&self, record: &TenantRecord, op_id: i64, op: Op) {
        let ctx = self.ctx();
        let ended = match Tenant::load(&ctx, record) {
            Ok(mut t) => {
                let ended = self.run_steps(&ctx, &mut t, op_id, op);
                if let Ended::Failed { .. } = ended {
                    if op.on_failure() == OnFailure::Fail {
                        // A failed tenant keeps its resources for inspection until
                        // destroyed, but never a running VMM.
                        if let Err(e) = vm::kill_vm(&ctx, &mut t) {
                            tracing::error!(tenant = %record.name, error = %e, "cannot kill VM of failed tenant");
                        }
                    }
                }
                ended
            }
            Err(e) => Ended::Failed {
                step: op.name(),
                message: format!("cannot load the tenant: {e}"),
            },
        };
        let result = match ended {
            Ended::Done => self
                .store
                .transition(record.id, op.success_state(), None, None)
                .map(|_| ()),
            Ended::Abandoned(why) => {
                tracing::warn!(tenant = %record.name, op = op.name(), why, "operation abandoned; it resumes at the next start");
                Ok(())
            }
            Ended::Failed { step, message } => {
                let message = TenantServiceError::Step { step, message }.to_string();
                tracing::warn!(tenant = %record.name, op = op.name(), error = %message, "operation failed");
                match op.on_failure() {
                    // The tenant stays where it is with the error; the same operation
                    // again resumes from the failed step.
                    OnFailure::Resume => self.store.set_tenant_error(record.id, Some(&message)),
                    OnFailure::Fail => self
                        .store
                        .transition(record.id, LifecycleState::Failed, None, Some(&message))
                        .map(|_| ()),
                }
            }
        };
        if let Err(e) = result {
            tracing::error!(tenant = %record.name, error = %e, "cannot record how the operation ended");
        }
    }

    /// Notices VMs that ended on their own (guest power-off, crash, OOM kill): a `running`
    /// tenant whose VM is no longer running becomes `failed` with the reason, so `running`
    /// always means a VM runs. Tenants busy with an operation are left to it. Returns the
    /// tenants it marked.
    pub fn check_vms(&self) -> Result<Vec<String>, TenantServiceError> {
        let mut marked = Vec::new();
        for t in self.store.list_tenants(false)? {
            // Tenants held by an operation or by the recovery pass are theirs to check.
            if t.state != LifecycleState::Running || self.is_busy(&t.name) || self.vm_is_up(&t)? {
                continue;
            }
            // Only a VM that looked dead takes the tenant's guard (so user operations are
            // not refused as busy while healthy VMs are checked); then look again.
            let Ok(_guard) = self.mark_busy(&t.name) else {
                continue;
            };
            let t = self.store.tenant_by_id(t.id)?;
            if t.state != LifecycleState::Running || self.vm_is_up(&t)? {
                continue;
            }
            let ctx = self.ctx();
            let mut tenant = Tenant::load(&ctx, &t)?;
            let why = match tenant.vm.as_ref().map(|vm| self.backend.ended(vm)) {
                Some(Ok(Some(crate::backend::VmState::Exited { status }))) => {
                    format!("the VM exited on its own ({status:?})")
                }
                _ => "the VM process is gone".to_string(),
            };
            vm::kill_vm(&ctx, &mut tenant)?;
            self.store
                .transition(t.id, LifecycleState::Failed, None, Some(&why))?;
            marked.push(t.name.to_string());
        }
        Ok(marked)
    }

    /// Whether the tenant's recorded VM process runs. Only the process table is read, never
    /// the VMM's socket: a wedged VMM counts as up (not answering is no proof of death), and
    /// checking it costs no more than checking a healthy one, so one wedged tenant cannot
    /// delay the checks and log caps of every other.
    fn vm_is_up(&self, t: &TenantRecord) -> Result<bool, TenantServiceError> {
        let Some(vm) = Tenant::load(&self.ctx(), t)?.vm else {
            return Ok(false);
        };
        Ok(matches!(self.backend.ended(&vm), Ok(None) | Err(_)))
    }

    /// What a caller may see of a tenant (the API projects it: `api/project.rs`).
    pub fn view(&self, t: &TenantRecord) -> Result<TenantStatus, TenantServiceError> {
        let steps = match t.op_id {
            Some(op) => self.store.steps(op)?,
            None => Vec::new(),
        };
        let mut uid = None;
        let mut pid = None;
        let mut agent_channel = None;
        let mut vsock_cid = None;
        for r in self.store.resources(Some(t.id))? {
            match r.kind {
                ResourceKind::Uid => uid = r.key.parse().ok(),
                ResourceKind::Process => {
                    let vm = r
                        .detail
                        .as_deref()
                        .and_then(|d| serde_json::from_str::<RunningVm>(d).ok());
                    pid = vm.as_ref().map(|vm| vm.pid);
                    vsock_cid = vm.as_ref().and_then(|vm| vm.vsock_cid);
                    agent_channel = vm.as_ref().map(|vm| {
                        let endpoint = self.backend.agent_endpoint(vm);
                        match endpoint {
                            tenantvm_agent_protocol::AgentEndpoint::Vsock { cid, .. } => {
                                format!("vhost-vsock (CID {cid})")
                            }
                            other => other.transport().to_string(),
                        }
                    });
                }
                _ => {}
            }
        }
        Ok(TenantStatus {
            record: t.clone(),
            steps,
            uid,
            pid,
            gpu: self.store.gpu_placement(t.id)?,
            recovering: self.is_recovering(&t.name),
            agent_channel,
            vsock_cid,
        })
    }
}
