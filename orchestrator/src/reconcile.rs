//! Recovery after a daemon start: make the host match the store again after a crash.
//!
//! It runs in the background once the API is up ([`plan`] marks every live tenant as
//! recovering before the socket serves; [`recover`] then goes through them), so a tenant
//! whose guest does not answer delays only itself: the API answers, the health check says
//! recovery is running, and tenants not yet recovered say `recovering` (commands on them
//! are refused with 409 `busy` until then).
//!
//! 1. Work a crash interrupted is finished: `provisioning`, `stopping` and `destroying`
//!    tenants resume their operation from the first step not recorded as done (every step is
//!    idempotent); `pending` tenants, whose creator never received a token, are rolled back
//!    (destroyed). Each tenant is recovered on its own thread.
//! 2. `running` tenants whose recorded VMM still runs (same pid *and* start time) are
//!    adopted; the others become `failed`.
//! 3. Leaks are released once every tenant is through: cgroups of tenants that should have
//!    no VM (their processes are SIGKILLed with the cgroup, which is how unrecorded VMMs
//!    die), tenant directories and resource records of tenants that are gone, and GPU
//!    reservations they held. Each name is held while it is looked at, so an operation the
//!    API started meanwhile is never swept.

use std::collections::HashMap;
use std::fs;
use std::sync::Mutex;

use thiserror::Error;

use crate::domain::lifecycle::LifecycleState;
use crate::domain::TenantName;
use crate::jail::error_chain;
use crate::store::{ResourceKind, StoreError, TenantRecord};
use crate::tenant::context::{StepError, Tenant};
use crate::tenant::service::{BusyGuard, TenantService, TenantServiceError};
use crate::tenant::steps::{vm::kill_vm, Op};

/// Reconciliation failures (individual tenants that cannot be fixed are logged and marked
/// failed instead).
#[derive(Debug, Error)]
pub enum ReconcileError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A tenant operation failed in a way that stops reconciliation.
    #[error(transparent)]
    Service(#[from] TenantServiceError),
    /// Killing a VM or loading a tenant failed.
    #[error(transparent)]
    Tenant(#[from] StepError),
    /// Listing cgroups or directories failed.
    #[error("Cannot list {what}: {message}")]
    List {
        /// What was listed.
        what: &'static str,
        /// Why.
        message: String,
    },
}

/// Options of a reconciliation.
#[derive(Debug, Clone)]
pub struct ReconcileOptions {
    /// Also remove tenant cgroups this store never recorded (another daemon's leftovers).
    /// Off only where several daemons share a host's cgroup tree (the tests).
    pub sweep_unknown_cgroups: bool,
}

impl Default for ReconcileOptions {
    fn default() -> Self {
        ReconcileOptions {
            sweep_unknown_cgroups: true,
        }
    }
}

/// What reconciliation did, by tenant name.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Operations resumed.
    pub resumed: Vec<String>,
    /// Pending creates rolled back.
    pub rolled_back: Vec<String>,
    /// Running VMMs adopted.
    pub adopted: Vec<String>,
    /// Tenants found broken and marked failed.
    pub failed: Vec<String>,
    /// Cgroups removed.
    pub cgroups_removed: Vec<String>,
    /// Tenant directories removed.
    pub dirs_removed: Vec<String>,
    /// Stale resource records and GPU reservations released.
    pub records_released: usize,
    /// Tenants whose recovery failed, with why (they are left as they were).
    pub errors: Vec<String>,
}

/// The tenants a recovery goes through, each already held as recovering.
pub struct RecoveryPlan {
    tenants: Vec<(TenantRecord, BusyGuard)>,
}

/// Marks every live tenant as recovering (and the service as in recovery). Quick: the
/// daemon calls it before its socket serves, so no command reaches a tenant before its
/// recovery, then runs [`recover`] in the background.
pub fn plan(svc: &TenantService) -> Result<RecoveryPlan, ReconcileError> {
    svc.set_recovering(true);
    let mut tenants = Vec::new();
    for mut t in svc.store().list_tenants(false)? {
        // A row from before the guest kind was stored gets it decided now, once, before
        // anything reads the tenant (reads never write: `Tenant::load` only decides it).
        if t.guest.is_none() {
            let guest = crate::tenant::image::guest_kind(svc.config(), &t.spec);
            svc.store().set_guest(t.id, guest)?;
            t.guest = Some(guest);
        }
        match svc.mark_recovering(&t.name) {
            Ok(guard) => tenants.push((t, guard)),
            // Already held by an operation: it is that operation's to finish.
            Err(e) => tracing::warn!(tenant = %t.name, error = %e, "not recovering a busy tenant"),
        }
    }
    Ok(RecoveryPlan { tenants })
}

/// Recovers every tenant of `plan`, each on its own thread (one silent guest delays only
/// itself), then releases leaks. Each tenant's guard drops when its own recovery is done.
pub fn recover(
    svc: &TenantService,
    plan: RecoveryPlan,
    opts: &ReconcileOptions,
) -> Result<ReconcileReport, ReconcileError> {
    let report = Mutex::new(ReconcileReport::default());
    std::thread::scope(|scope| {
        for (t, guard) in plan.tenants {
            let report = &report;
            scope.spawn(move || {
                let _guard = guard;
                if let Err(e) = recover_one(svc, &t, report) {
                    tracing::error!(tenant = %t.name, error = %e, "recovery failed");
                    lock(report).errors.push(format!("{}: {e}", t.name));
                }
            });
        }
    });
    let mut report = report.into_inner().unwrap_or_else(|p| p.into_inner());
    let swept = release_leaks(svc, opts, &mut report);
    svc.set_recovering(false);
    swept?;
    for v in [
        &mut report.resumed,
        &mut report.rolled_back,
        &mut report.adopted,
        &mut report.failed,
        &mut report.cgroups_removed,
        &mut report.dirs_removed,
    ] {
        v.sort();
    }
    Ok(report)
}

/// Reconciles the host with the store in one call ([`plan`], then [`recover`]).
pub fn reconcile(
    svc: &TenantService,
    opts: &ReconcileOptions,
) -> Result<ReconcileReport, ReconcileError> {
    let plan = plan(svc)?;
    recover(svc, plan, opts)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Recovers one tenant (its recovery guard is held by the caller).
fn recover_one(
    svc: &TenantService,
    t: &TenantRecord,
    report: &Mutex<ReconcileReport>,
) -> Result<(), ReconcileError> {
    let store = svc.store();
    let ctx = svc.ctx();
    let name = t.name.to_string();
    match t.state {
        LifecycleState::Pending => {
            let op_id = store
                .transition(
                    t.id,
                    LifecycleState::Destroying,
                    Some(Op::Destroy.name()),
                    None,
                )?
                .expect("op id");
            svc.finish_op(t, op_id, Op::Destroy);
            lock(report).rolled_back.push(name);
        }
        LifecycleState::Provisioning | LifecycleState::Stopping | LifecycleState::Destroying => {
            let op = t.op.as_deref().and_then(Op::parse);
            match (op, t.op_id) {
                (Some(op), Some(op_id)) => {
                    tracing::info!(tenant = %t.name, op = op.name(), "resuming interrupted operation");
                    svc.finish_op(t, op_id, op);
                    lock(report).resumed.push(name);
                }
                _ => {
                    kill_vm(&ctx, &mut Tenant::load(&ctx, t)?)?;
                    store.transition(
                        t.id,
                        LifecycleState::Failed,
                        None,
                        Some("interrupted operation not recorded; destroy and recreate"),
                    )?;
                    lock(report).failed.push(name);
                }
            }
        }
        LifecycleState::Running => {
            let mut tenant = Tenant::load(&ctx, t)?;
            let why = match &tenant.vm {
                None => Some("running, but no VM is recorded".to_string()),
                Some(vm) => match ctx.backend.state(vm) {
                    Ok(crate::backend::VmState::Running | crate::backend::VmState::Paused) => {
                        store.add_event(
                            Some(t.id),
                            "adopt",
                            &format!("adopted VMM pid {}", vm.pid),
                        )?;
                        None
                    }
                    Ok(s) => Some(format!("the VM ended while tenantvmd was down ({s:?})")),
                    // A VMM that does not answer its socket may only be paused a while (load,
                    // swap, a debugger): as long as its recorded process lives it is adopted,
                    // and shown as unresponsive; killing it would end a running tenant.
                    Err(e) => match ctx.backend.ended(vm) {
                        Ok(None) => {
                            let note = format!(
                                "unresponsive: its VMM (pid {}) did not answer its control socket when tenantvmd recovered ({}); adopted, as its process runs",
                                vm.pid,
                                error_chain(&e)
                            );
                            tracing::warn!(tenant = %t.name, %note, "adopting an unresponsive VMM");
                            store.add_event(Some(t.id), "adopt", &note)?;
                            store.set_tenant_error(t.id, Some(&note))?;
                            None
                        }
                        Ok(Some(s)) => {
                            Some(format!("the VM ended while tenantvmd was down ({s:?})"))
                        }
                        Err(_) => Some(format!("the recorded VM cannot be reached: {e}")),
                    },
                },
            };
            match why {
                None => lock(report).adopted.push(name),
                Some(why) => {
                    kill_vm(&ctx, &mut tenant)?;
                    store.transition(t.id, LifecycleState::Failed, None, Some(&why))?;
                    lock(report).failed.push(name);
                }
            }
        }
        LifecycleState::Stopped | LifecycleState::Failed | LifecycleState::Destroyed => {
            kill_vm(&ctx, &mut Tenant::load(&ctx, t)?)?;
        }
    }
    Ok(())
}

fn release_leaks(
    svc: &TenantService,
    opts: &ReconcileOptions,
    report: &mut ReconcileReport,
) -> Result<(), ReconcileError> {
    let store = svc.store();
    let ctx = svc.ctx();
    let all = store.list_tenants(true)?;
    let live: HashMap<&str, LifecycleState> = all
        .iter()
        .filter(|t| t.state != LifecycleState::Destroyed)
        .map(|t| (t.name.as_str(), t.state))
        .collect();
    let known: std::collections::HashSet<&str> = all.iter().map(|t| t.name.as_str()).collect();

    // Cgroups: only a running tenant may have one with processes in it.
    let cgroups = ctx.jail.list().map_err(|e| ReconcileError::List {
        what: "tenant cgroups",
        message: error_chain(&e),
    })?;
    for name in cgroups {
        let state = live.get(name.as_str()).copied();
        let wanted = matches!(state, Some(LifecycleState::Running));
        let ours = known.contains(name.as_str()) || opts.sweep_unknown_cgroups;
        if wanted || !ours {
            continue;
        }
        // Held while looked at: an operation the API started since the list was read owns
        // its tenant's cgroup, and a tenant that became running keeps it.
        let Ok(_guard) = svc.mark_busy(&name) else {
            continue;
        };
        if store
            .tenant(&name)?
            .is_some_and(|t| t.state == LifecycleState::Running)
        {
            continue;
        }
        let dir = svc.config().tenant_dir(&name);
        match ctx.jail.cleanup(&name, &dir) {
            Ok(()) => {
                store.remove_resource(ResourceKind::Cgroup, &name)?;
                report.cgroups_removed.push(name);
            }
            Err(e) => {
                tracing::error!(tenant = %name, error = %error_chain(&e), "cannot remove leaked cgroup");
            }
        }
    }

    // Tenant directories of tenants that are gone.
    let tenants_dir = svc.config().state_dir.join("tenants");
    if let Ok(entries) = fs::read_dir(&tenants_dir) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if live.contains_key(name.as_str()) {
                continue;
            }
            // A directory with a tenant's name is held while looked at (a create the API
            // started since may own it); no tenant can have any other name.
            let _guard = if TenantName::check(&name).is_ok() {
                let Ok(guard) = svc.mark_busy(&name) else {
                    continue;
                };
                if store.tenant(&name)?.is_some() {
                    continue;
                }
                Some(guard)
            } else {
                None
            };
            if let Err(e) = fs::remove_dir_all(entry.path()) {
                tracing::error!(dir = %entry.path().display(), error = %e, "cannot remove leaked tenant directory");
            } else {
                report.dirs_removed.push(name);
            }
        }
    }

    // Records held by tenants that are gone.
    let gone: std::collections::HashSet<i64> = all
        .iter()
        .filter(|t| t.state == LifecycleState::Destroyed)
        .map(|t| t.id)
        .collect();
    for r in store.resources(None)? {
        if gone.contains(&r.tenant_id) {
            if r.kind == ResourceKind::Process {
                if let Some(t) = all.iter().find(|t| t.id == r.tenant_id) {
                    kill_vm(&ctx, &mut Tenant::load(&ctx, t)?)?;
                }
            }
            store.remove_resource(r.kind, &r.key)?;
            report.records_released += 1;
        }
    }
    for (_, _, tenant_id) in store.gpu_reservations()? {
        if gone.contains(&tenant_id) {
            report.records_released += store.release_gpu(tenant_id)?;
        }
    }
    Ok(())
}
