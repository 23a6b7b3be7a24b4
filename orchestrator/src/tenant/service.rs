//! The tenant service: the one place that changes tenants. The API turns requests into
//! [`TenantCommand`]s; [`TenantService::execute`] authorises them and runs them: state
//! changes in the store, then the operation's steps ([`super::steps`]) on a worker thread.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;

use crate::api::types::{CreateResponse, LogChunk, LogQuery, TenantList, TenantView};
use crate::auth::{self, Caller};
use crate::backend::{RunningVm, VmBackend};
use crate::store::{ResourceKind, Store, StoreError, TenantRecord, TokenOwner};
use crate::tenant::fault::{FaultError, FaultHook};
use crate::tenant::host::{GpuPlanError, GpuPlanner, JailCleaner};
use crate::tenant::lifecycle::{LifecycleError, LifecycleState};
use crate::tenant::spec::{TenantSpec, TenantSpecError};
use crate::tenant::steps::{self, Op};

/// Why a command failed.
#[derive(Debug, Error)]
pub enum TenantServiceError {
    /// The spec was refused.
    #[error(transparent)]
    Spec(#[from] TenantSpecError),
    /// The store failed or refused (duplicate name, ...).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// No such tenant, or not one the caller may see (the two are indistinguishable).
    #[error("No tenant named {0:?} (check `tenantvm list`)")]
    NotFound(String),
    /// Only the admin token may do this.
    #[error("Only the admin token may {0}")]
    AdminOnly(&'static str),
    /// Another operation on this tenant is in progress.
    #[error("Tenant {0:?} is busy with another operation; wait for it (`tenantvm status {0}`) and retry")]
    Busy(String),
    /// The state machine refused the command.
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
    /// The guest image cannot be found.
    #[error("Guest image: {0}")]
    Image(String),
    /// A step failed.
    #[error("Step {step} failed: {message}")]
    Step {
        /// The step.
        step: &'static str,
        /// Why.
        message: String,
    },
    /// The GPU planner refused.
    #[error(transparent)]
    Gpu(#[from] GpuPlanError),
    /// The test fault hook fired (in-process tests only).
    #[error(transparent)]
    Fault(#[from] FaultError),
    /// Reading a log failed.
    #[error("Cannot read the log: {0}")]
    Log(String),
    /// A request parameter is out of range.
    #[error("Bad request: {0}")]
    BadRequest(String),
    /// A re-scrub of a quarantined GPU slice was refused or could not run.
    #[error(transparent)]
    Rescrub(#[from] crate::tenant::departure::RescrubError),
    /// The tenant is not running, so its guest cannot serve requests.
    #[error("Tenant {0:?} is not running; start it (`tenantvm start {0}`) and retry")]
    NotServing(String),
    /// The tenant is over its request rate or concurrency quota.
    #[error(transparent)]
    QuotaExceeded(#[from] crate::tenant::admission::Refused),
    /// The host cannot hold the tenant (memory or vCPUs, after the other tenants).
    #[error(transparent)]
    Capacity(#[from] crate::tenant::admission::CapacityError),
    /// The guest agent or its payload could not answer.
    #[error("The tenant's guest could not answer: {0}")]
    AgentUnavailable(String),
    /// Reading the audit log failed.
    #[error(transparent)]
    Receipt(#[from] crate::receipt::ReceiptError),
}

/// What the API asks the service to do.
#[derive(Debug, Clone)]
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
    Created(CreateResponse),
    /// One tenant.
    Tenant(TenantView),
    /// Many tenants.
    Tenants(TenantList),
    /// A piece of a log.
    Log(LogChunk),
    /// Audit log entries.
    Receipts(Vec<crate::receipt::LogEntry>),
    /// Quarantined GPU slices.
    Quarantine(Vec<crate::store::QuarantinedSlice>),
    /// What a re-scrub found.
    Rescrubbed(crate::tenant::departure::RescrubOutcome),
    /// The inference server's JSON answer.
    Inferred(serde_json::Value),
}

/// Settings of the service.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// The daemon's state directory; tenants live in `<state_dir>/tenants/<name>`.
    pub state_dir: PathBuf,
    /// Named images: `<image_dir>/<name>/kernel` (+ `initramfs`, `cmdline`).
    pub image_dir: Option<PathBuf>,
    /// First uid handed to tenants.
    pub uid_first: u32,
    /// How many uids from `uid_first`.
    pub uid_count: u32,
    /// How long `stop` waits for a clean guest shutdown before killing.
    pub stop_grace: Duration,
    /// How long `await-running` waits for the VM to report running.
    pub boot_timeout: Duration,
    /// Memory added to guest memory for the VMM itself, in MiB.
    pub vmm_overhead_mib: u64,
    /// Disk keys, keyslot cost, receipts.
    pub departure: crate::tenant::departure::DepartureConfig,
    /// How long a guest-image tenant's agent, and then its payload, may take to answer.
    pub agent_timeout: Duration,
    /// What the host gives tenants; creates beyond it are refused.
    pub capacity: crate::tenant::admission::HostCapacity,
}

impl ServiceConfig {
    /// Defaults under `state_dir`.
    pub fn new(state_dir: PathBuf) -> ServiceConfig {
        ServiceConfig {
            image_dir: None,
            uid_first: 200_000,
            uid_count: 65_536,
            stop_grace: Duration::from_secs(5),
            boot_timeout: Duration::from_secs(30),
            vmm_overhead_mib: 64,
            departure: crate::tenant::departure::DepartureConfig::under(&state_dir),
            agent_timeout: Duration::from_secs(300),
            capacity: crate::tenant::admission::HostCapacity::detect(
                crate::tenant::admission::DEFAULT_HOST_RESERVED_MIB,
            )
            .unwrap_or_else(|e| {
                // Nothing is admitted on a host whose size cannot be read.
                tracing::error!(error = %e, "cannot read this host's memory size");
                crate::tenant::admission::HostCapacity::fixed(0, 0)
            }),
            state_dir,
        }
    }

    /// A tenant's directory.
    pub fn tenant_dir(&self, name: &str) -> PathBuf {
        self.state_dir.join("tenants").join(name)
    }
}

/// Runs tenant commands. Cheap to clone (all shared state is behind `Arc`s).
#[derive(Clone)]
pub struct TenantService {
    pub(crate) store: Arc<Store>,
    pub(crate) backend: Arc<dyn VmBackend>,
    pub(crate) jail: Arc<dyn JailCleaner>,
    pub(crate) gpu: Arc<dyn GpuPlanner>,
    pub(crate) config: Arc<ServiceConfig>,
    pub(crate) fault: Arc<FaultHook>,
    /// Per-tenant request rate and concurrency of inference requests.
    pub(crate) admission: Arc<crate::tenant::admission::Admission>,
    departure: Arc<Mutex<Option<Arc<crate::tenant::departure::DepartureKit>>>>,
    busy: Arc<Mutex<HashSet<String>>>,
    workers: Arc<Mutex<Vec<std::thread::JoinHandle<()>>>>,
}

/// Marks a tenant busy for as long as it lives.
pub(crate) struct BusyGuard {
    busy: Arc<Mutex<HashSet<String>>>,
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
        gpu: Arc<dyn GpuPlanner>,
        config: ServiceConfig,
        fault: FaultHook,
    ) -> TenantService {
        TenantService {
            store,
            backend,
            jail,
            gpu,
            config: Arc::new(config),
            fault: Arc::new(fault),
            admission: Arc::default(),
            departure: Arc::default(),
            busy: Arc::default(),
            workers: Arc::default(),
        }
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
    pub fn departure_kit(
        &self,
    ) -> Result<Arc<crate::tenant::departure::DepartureKit>, crate::tenant::departure::DepartureError>
    {
        let mut slot = lock(&self.departure);
        if let Some(kit) = slot.as_ref() {
            return Ok(kit.clone());
        }
        let kit = Arc::new(crate::tenant::departure::DepartureKit::open(
            &self.config.departure,
        )?);
        *slot = Some(kit.clone());
        Ok(kit)
    }

    /// Name of the backend, for `/v1/health`.
    pub fn backend_name(&self) -> String {
        format!("{:?}", self.backend.kind())
    }

    pub(crate) fn mark_busy(&self, name: &str) -> Result<BusyGuard, TenantServiceError> {
        let mut busy = lock(&self.busy);
        if !busy.insert(name.to_string()) {
            return Err(TenantServiceError::Busy(name.to_string()));
        }
        Ok(BusyGuard {
            busy: self.busy.clone(),
            name: name.to_string(),
        })
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
                Ok(CommandOutcome::Tenants(TenantList { tenants }))
            }
            TenantCommand::Status(name) => {
                let t = self.visible(caller, &name)?;
                Ok(CommandOutcome::Tenant(self.view(&t)?))
            }
            TenantCommand::Stop(name) => {
                let t = self.visible(caller, &name)?;
                self.begin(t, LifecycleState::Stopping, Op::Stop)
                    .map(CommandOutcome::Tenant)
            }
            TenantCommand::Start(name) => {
                let t = self.visible(caller, &name)?;
                self.begin(t, LifecycleState::Provisioning, Op::Start)
                    .map(CommandOutcome::Tenant)
            }
            TenantCommand::Destroy(name) => {
                let t = self.visible(caller, &name)?;
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
                crate::tenant::departure::rescrub(self, &slice).map(CommandOutcome::Rescrubbed)
            }
            TenantCommand::Infer(name, body) => {
                let t = self.visible(caller, &name)?;
                crate::tenant::agent_steps::infer(self, &t, body).map(CommandOutcome::Inferred)
            }
            TenantCommand::Logs(name, query) => {
                let t = self.visible(caller, &name)?;
                crate::tenant::logs::read(self, &t, &query).map(CommandOutcome::Log)
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
    ) -> Result<crate::tenant::admission::AdmittedInfer, TenantServiceError> {
        let tenant = self.visible(caller, name)?;
        let permit = crate::tenant::agent_steps::admit(self, &tenant)?;
        Ok(crate::tenant::admission::AdmittedInfer { tenant, permit })
    }

    /// Forwards an admitted inference request to the tenant's guest and returns its answer
    /// (blocks until the guest answers or its deadline passes).
    pub fn infer_admitted(
        &self,
        admitted: crate::tenant::admission::AdmittedInfer,
        body: serde_json::Value,
    ) -> Result<serde_json::Value, TenantServiceError> {
        let crate::tenant::admission::AdmittedInfer { tenant, permit } = admitted;
        crate::tenant::agent_steps::forward(self, &tenant, body, permit)
    }

    /// The live tenant `name` if the caller may see it; otherwise NotFound, whether or not
    /// it exists, so a tenant token cannot probe for other tenants' names.
    fn visible(&self, caller: &Caller, name: &str) -> Result<TenantRecord, TenantServiceError> {
        let not_found = || TenantServiceError::NotFound(name.to_string());
        if crate::tenant::spec::validate_name(name).is_err() {
            return Err(not_found());
        }
        match self.store.tenant(name)? {
            Some(t) if caller.may_see(t.id) => Ok(t),
            _ => Err(not_found()),
        }
    }

    fn create(&self, spec: TenantSpec) -> Result<CreateResponse, TenantServiceError> {
        spec.validate()?;
        // Fail fast on what can be checked before anything is recorded.
        steps::resolve_image(&self.config, &spec)?;
        crate::tenant::agent_steps::check_create(&self.config, &spec)?;
        if spec.gpu.wants_gpu() {
            self.gpu.candidates(&spec.gpu)?;
        }
        let guard = self.mark_busy(&spec.name)?;
        // Held until the tenant is recorded: two creates never take the same room.
        let _room = self.config.capacity.lock();
        crate::tenant::admission::check_room(
            &self.config.capacity,
            &self.store,
            self.config.vmm_overhead_mib,
            &spec,
        )?;
        let record = self.store.insert_tenant(&spec)?;
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
        Ok(CreateResponse { tenant, token })
    }

    /// Resumes a destroy that stopped at a failed step: same operation, same departure, from
    /// the first step not done.
    fn resume_destroy(&self, t: TenantRecord) -> Result<TenantView, TenantServiceError> {
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
                let own = self.store.tenant_by_id(*id)?.name;
                if name.is_some_and(|n| n != own) {
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
    ) -> Result<TenantView, TenantServiceError> {
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
    /// it ends in. Errors end in `failed`, except a simulated crash, which leaves the store
    /// exactly as a real crash would.
    pub(crate) fn finish_op(&self, record: &TenantRecord, op_id: i64, op: Op) {
        match steps::run(self, record, op_id, op) {
            Ok(()) => {
                if let Err(e) = self
                    .store
                    .transition(record.id, op.success_state(), None, None)
                {
                    tracing::error!(tenant = %record.name, error = %e, "cannot record success");
                }
            }
            Err(TenantServiceError::Fault(e)) => {
                tracing::warn!(tenant = %record.name, error = %e, "operation abandoned");
            }
            Err(e) if op == Op::Destroy => {
                // A departure never gives up half-way: the tenant stays `destroying` with the
                // error, and `destroy` again resumes from the failed step.
                let message = e.to_string();
                tracing::warn!(tenant = %record.name, error = %message, "destroy stopped at a failed step");
                if let Err(e2) = self.store.set_tenant_error(record.id, Some(&message)) {
                    tracing::error!(tenant = %record.name, error = %e2, "cannot record the error");
                }
            }
            Err(e) => {
                let message = e.to_string();
                tracing::warn!(tenant = %record.name, op = op.name(), error = %message, "operation failed");
                // A failed tenant keeps its resources for inspection until destroyed, but
                // never a running VMM.
                if let Err(kill_err) = steps::kill_vm(self, record) {
                    tracing::error!(tenant = %record.name, error = %kill_err, "cannot kill VM of failed tenant");
                }
                if let Err(e2) =
                    self.store
                        .transition(record.id, LifecycleState::Failed, None, Some(&message))
                {
                    tracing::error!(tenant = %record.name, error = %e2, "cannot record failure");
                }
            }
        }
    }

    /// Notices VMs that ended on their own (guest power-off, crash, OOM kill): a `running`
    /// tenant whose VM is no longer running becomes `failed` with the reason, so `running`
    /// always means a VM runs. Tenants busy with an operation are left to it. Returns the
    /// tenants it marked.
    pub fn check_vms(&self) -> Result<Vec<String>, TenantServiceError> {
        let mut marked = Vec::new();
        for t in self.store.list_tenants(false)? {
            if t.state != LifecycleState::Running || self.vm_is_up(&t)? {
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
            let why = match steps::recorded_vm(self, &t)?.map(|vm| self.backend.state(&vm)) {
                Some(Ok(crate::backend::VmState::Exited { status })) => {
                    format!("the VM exited on its own ({status:?})")
                }
                _ => "the VM process is gone".to_string(),
            };
            steps::kill_vm(self, &t)?;
            self.store
                .transition(t.id, LifecycleState::Failed, None, Some(&why))?;
            marked.push(t.name.clone());
        }
        Ok(marked)
    }

    /// Whether the tenant's recorded VM runs; a VM that does not answer its control socket
    /// counts as up (not answering is no proof of death; the next check looks again).
    fn vm_is_up(&self, t: &TenantRecord) -> Result<bool, TenantServiceError> {
        let Some(vm) = steps::recorded_vm(self, t)? else {
            return Ok(false);
        };
        Ok(!matches!(
            self.backend.state(&vm),
            Ok(crate::backend::VmState::Exited { .. } | crate::backend::VmState::Gone)
        ))
    }

    /// The API view of a tenant.
    pub fn view(&self, t: &TenantRecord) -> Result<TenantView, TenantServiceError> {
        let steps = match t.op_id {
            Some(op) => self.store.steps(op)?,
            None => Vec::new(),
        };
        let mut uid = None;
        let mut pid = None;
        for r in self.store.resources(Some(t.id))? {
            match r.kind {
                ResourceKind::Uid => uid = r.key.parse().ok(),
                ResourceKind::Process => {
                    pid = r
                        .detail
                        .as_deref()
                        .and_then(|d| serde_json::from_str::<RunningVm>(d).ok())
                        .map(|vm| vm.pid)
                }
                _ => {}
            }
        }
        Ok(TenantView {
            name: t.name.clone(),
            state: t.state,
            op: t.op.clone(),
            error: t.error.clone(),
            steps,
            spec: t.spec.clone(),
            uid,
            pid,
            gpu: self.store.gpu_placement(t.id)?,
            created_ms: t.created_ms,
            updated_ms: t.updated_ms,
        })
    }
}
