//! What a step gets: a narrow [`StepCtx`] (the parts of the daemon steps may touch) and the
//! [`Tenant`] it works on, with the facts decided once and stored (its guest kind, its uid,
//! its recorded VM) loaded once per operation instead of re-derived by every step.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use thiserror::Error;

use crate::backend::{RunningVm, VmBackend};
use crate::domain::spec::TenantSpec;
use crate::domain::{GuestKind, TenantName};
use crate::gpu::{GpuError, GpuHost};
use crate::store::{ResourceKind, Store, StoreError, TenantRecord};
use crate::tenant::admission::Admission;
use crate::tenant::config::ServiceConfig;
use crate::tenant::departure::{DepartureKit, Kit};
use crate::tenant::host::JailCleaner;

/// Why a step did not complete.
#[derive(Debug, Error)]
pub enum StepError {
    /// The step failed; the message says why and what to do.
    #[error("{0}")]
    Failed(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The GPU planner refused or failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// The daemon is stopping: the step gave up waiting. Nothing is recorded as failed; the
    /// operation resumes at the next start, as after a crash.
    #[error("the daemon is stopping; the operation resumes when it starts again")]
    Cancelled,
}

impl StepError {
    /// A failure with this message.
    pub fn failed(message: impl std::fmt::Display) -> StepError {
        StepError::Failed(message.to_string())
    }
}

/// Set when the daemon is stopping: long waits in steps check it and give up.
#[derive(Debug, Default)]
pub struct StopFlag(AtomicBool);

impl StopFlag {
    /// Asks every wait to give up.
    pub fn set(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether the daemon is stopping.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// [`StepError::Cancelled`] once the daemon is stopping.
    pub fn check(&self) -> Result<(), StepError> {
        if self.is_set() {
            Err(StepError::Cancelled)
        } else {
            Ok(())
        }
    }

    /// Sleeps `d` (in slices of at most 100 ms), giving up as soon as the daemon stops.
    pub fn sleep(&self, d: Duration) -> Result<(), StepError> {
        let end = std::time::Instant::now() + d;
        loop {
            self.check()?;
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            std::thread::sleep(left.min(Duration::from_millis(100)));
        }
    }
}

/// What a step may use: the store, the VM backend, the jail cleaner, the GPU planner, the
/// disk keys and receipt log, the inference gate, the settings, the daemon's stop flag and
/// its per-card locks.
/// Nothing else of the daemon is reachable from a step.
#[derive(Clone, Copy)]
pub struct StepCtx<'a> {
    /// Durable state.
    pub store: &'a Store,
    /// Runs VMs.
    pub backend: &'a dyn VmBackend,
    /// Tears down jails and cgroups.
    pub jail: &'a dyn JailCleaner,
    /// GPU placements.
    pub gpu: &'a dyn GpuHost,
    /// Disk keys, receipt signer, audit log (loaded on first use).
    pub keys: &'a Kit,
    /// Per-tenant inference gates (route-off closes one).
    pub admission: &'a std::sync::Arc<Admission>,
    /// Settings.
    pub config: &'a ServiceConfig,
    /// Set when the daemon stops.
    pub stop: &'a StopFlag,
    /// One lock per GPU card: held by the steps that change a card's host mode.
    pub cards: &'a crate::gpu::card_lock::CardLocks,
}

impl StepCtx<'_> {
    /// Holds GPU card `gpu` (a ledger id) for a step that changes its host mode, waiting
    /// at most [`crate::gpu::card_lock::CARD_LOCK_WAIT`].
    pub fn hold_card(&self, gpu: &str) -> Result<crate::gpu::card_lock::CardGuard<'_>, StepError> {
        self.cards
            .hold(gpu, crate::gpu::card_lock::CARD_LOCK_WAIT)
            .map_err(StepError::failed)
    }
}

impl StepCtx<'_> {
    /// The departure kit (disk keys, receipt signer, audit log), its load failure as the
    /// step's error.
    pub fn kit(&self) -> Result<std::sync::Arc<DepartureKit>, StepError> {
        self.keys.get().map_err(StepError::failed)
    }
}

/// A tenant as steps see it: its row, and the facts stored for it, loaded once.
#[derive(Debug, Clone)]
pub struct Tenant {
    /// Row id.
    pub id: i64,
    /// Its name.
    pub name: TenantName,
    /// The spec it was created with.
    pub spec: TenantSpec,
    /// What runs in its guest (decided at create).
    pub guest: GuestKind,
    /// Its uid, once allocate-uid ran.
    pub uid: Option<u32>,
    /// Its recorded VM, if one is recorded; steps that launch or stop it keep this current.
    pub vm: Option<RunningVm>,
}

impl Tenant {
    /// Loads the facts of `record` from the store (one read of its resources; it writes
    /// nothing). A row from before the guest kind was stored has it stored by the recovery
    /// plan at the daemon's start ([`crate::reconcile::plan`]); until then it is decided
    /// here the same way, without storing it.
    pub fn load(ctx: &StepCtx<'_>, record: &TenantRecord) -> Result<Tenant, StepError> {
        let guest = record
            .guest
            .unwrap_or_else(|| crate::tenant::image::guest_kind(ctx.config, &record.spec));
        let mut uid = None;
        let mut vm = None;
        for r in ctx.store.resources(Some(record.id))? {
            match r.kind {
                ResourceKind::Uid => {
                    uid = Some(
                        r.key
                            .parse::<u32>()
                            .map_err(|_| StoreError::Corrupt(format!("uid record {:?}", r.key)))?,
                    );
                }
                ResourceKind::Process => {
                    let detail = r.detail.unwrap_or_default();
                    vm = Some(serde_json::from_str(&detail).map_err(|e| {
                        StoreError::Corrupt(format!("process record {}: {e}", r.key))
                    })?);
                }
                ResourceKind::Cgroup | ResourceKind::File => {}
            }
        }
        Ok(Tenant {
            id: record.id,
            name: record.name.clone(),
            spec: record.spec.clone(),
            guest,
            uid,
            vm,
        })
    }

    /// The tenant's uid, or the step's error if allocate-uid has not run.
    pub fn uid(&self) -> Result<u32, StepError> {
        self.uid
            .ok_or_else(|| StepError::failed("no uid is allocated to this tenant"))
    }

    /// Whether its guest runs the tenantvm agent.
    pub fn has_agent(&self) -> bool {
        self.guest == GuestKind::Agent
    }
}
