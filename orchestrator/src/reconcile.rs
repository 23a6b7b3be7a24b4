//! Reconciliation at daemon start: make the host match the store again after a crash.
//!
//! 1. Work a crash interrupted is finished: `provisioning`, `stopping` and `destroying`
//!    tenants resume their operation from the first step not recorded as done (every step is
//!    idempotent); `pending` tenants, whose creator never received a token, are rolled back
//!    (destroyed).
//! 2. `running` tenants whose recorded VMM still runs (same pid *and* start time) are
//!    adopted; the others become `failed`.
//! 3. Leaks are released: cgroups of tenants that should have no VM (their processes are
//!    SIGKILLed with the cgroup, which is how unrecorded VMMs die), tenant directories and
//!    resource records of tenants that are gone, and GPU reservations they held.

use std::collections::HashMap;
use std::fs;

use thiserror::Error;

use crate::domain::lifecycle::LifecycleState;
use crate::store::{ResourceKind, StoreError};
use crate::tenant::context::{error_chain, StepError, Tenant};
use crate::tenant::service::{TenantService, TenantServiceError};
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
}

/// Reconciles the host with the store. Runs before the API serves requests.
pub fn reconcile(
    svc: &TenantService,
    opts: &ReconcileOptions,
) -> Result<ReconcileReport, ReconcileError> {
    let mut report = ReconcileReport::default();
    let store = svc.store();
    let ctx = svc.ctx();
    for t in store.list_tenants(false)? {
        let _guard = svc.mark_busy(&t.name)?;
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
                svc.finish_op(&t, op_id, Op::Destroy);
                report.rolled_back.push(t.name.to_string());
            }
            LifecycleState::Provisioning
            | LifecycleState::Stopping
            | LifecycleState::Destroying => {
                let op = t.op.as_deref().and_then(Op::parse);
                match (op, t.op_id) {
                    (Some(op), Some(op_id)) => {
                        tracing::info!(tenant = %t.name, op = op.name(), "resuming interrupted operation");
                        svc.finish_op(&t, op_id, op);
                        report.resumed.push(t.name.to_string());
                    }
                    _ => {
                        kill_vm(&ctx, &mut Tenant::load(&ctx, &t)?)?;
                        store.transition(
                            t.id,
                            LifecycleState::Failed,
                            None,
                            Some("interrupted operation not recorded; destroy and recreate"),
                        )?;
                        report.failed.push(t.name.to_string());
                    }
                }
            }
            LifecycleState::Running => match Tenant::load(&ctx, &t)?.vm {
                Some(vm) => match ctx.backend.state(&vm) {
                    Ok(crate::backend::VmState::Running | crate::backend::VmState::Paused) => {
                        store.add_event(
                            Some(t.id),
                            "adopt",
                            &format!("adopted VMM pid {}", vm.pid),
                        )?;
                        report.adopted.push(t.name.to_string());
                    }
                    other => {
                        let why = match other {
                            Ok(s) => format!("the VM ended while tenantvmd was down ({s:?})"),
                            Err(e) => format!("the recorded VM cannot be reached: {e}"),
                        };
                        kill_vm(&ctx, &mut Tenant::load(&ctx, &t)?)?;
                        store.transition(t.id, LifecycleState::Failed, None, Some(&why))?;
                        report.failed.push(t.name.to_string());
                    }
                },
                None => {
                    store.transition(
                        t.id,
                        LifecycleState::Failed,
                        None,
                        Some("running, but no VM is recorded"),
                    )?;
                    report.failed.push(t.name.to_string());
                }
            },
            LifecycleState::Stopped | LifecycleState::Failed | LifecycleState::Destroyed => {
                kill_vm(&ctx, &mut Tenant::load(&ctx, &t)?)?;
            }
        }
    }
    release_leaks(svc, opts, &mut report)?;
    Ok(report)
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
        let dir = svc.config().tenant_dir(&name);
        match ctx.jail.cleanup(&name, &dir) {
            Ok(()) => {
                store.remove_resource(ResourceKind::Cgroup, &name)?;
                report.cgroups_removed.push(name);
            }
            Err(e) => {
                tracing::error!(tenant = %name, error = %error_chain(&e), "cannot remove leaked cgroup")
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
