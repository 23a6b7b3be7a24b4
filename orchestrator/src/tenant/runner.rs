//! Runs an operation's steps from [`super::steps::TABLE`], recording each in the store
//! before and after it runs, so that a daemon killed at any point resumes where it was:
//! steps recorded `done` are skipped, a step recorded `started` runs again (every step is
//! idempotent). In an operation that keeps a receipt (destroy), each step's receipt record
//! is persisted as soon as the step returns, before the step is recorded done.
//!
//! The runner knows no step by name and no operation by kind: what an operation runs, what
//! a failure leaves behind and whether it keeps a receipt are all data of [`Op`].

use crate::receipt::{now_rfc3339, Assurance, StepRecord, StepResult};
use crate::tenant::context::{StepCtx, StepError, Tenant};
use crate::tenant::steps::Op;

/// Which side of a step a boundary is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boundary {
    /// Just before the step is recorded as started.
    Before,
    /// Just after the step is recorded as done.
    After,
}

/// Called at every step boundary with (op, step, side); an error abandons the run there, as
/// a crash would (the test builds' fault hook; production passes [`no_hook`]).
pub type BoundaryHook<'a> = &'a dyn Fn(&str, &str, Boundary) -> Result<(), String>;

/// The boundary hook of production: nothing happens at a boundary.
pub fn no_hook(_op: &str, _step: &str, _side: Boundary) -> Result<(), String> {
    Ok(())
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// Every step is done.
    Done,
    /// Given up without recording a failure (a simulated crash, or the daemon stopping):
    /// the store is left as a crash would leave it, and the next start resumes.
    Abandoned(String),
    /// A step failed (or recording it did); the store says which and why.
    Failed {
        /// The step.
        step: &'static str,
        /// Why.
        message: String,
    },
}

/// Runs the steps of `op` not yet recorded as done, on `t` (whose facts the steps keep
/// current).
pub fn run(
    ctx: &StepCtx<'_>,
    at_boundary: BoundaryHook<'_>,
    t: &mut Tenant,
    op_id: i64,
    op: Op,
) -> Ended {
    let failed = |step: &'static str, e: &dyn std::fmt::Display| Ended::Failed {
        step,
        message: e.to_string(),
    };
    let done: Vec<String> = match ctx.store.steps(op_id) {
        Ok(steps) => steps
            .into_iter()
            .filter(|s| s.status == "done" || s.status == "skipped")
            .map(|s| s.step)
            .collect(),
        Err(e) => return failed(op.name(), &e),
    };
    for &step in op.steps() {
        let def = step.def();
        if done.iter().any(|d| d == def.name) {
            continue;
        }
        if let Err(e) = at_boundary(op.name(), def.name, Boundary::Before) {
            return Ended::Abandoned(e);
        }
        if let Err(e) = ctx.store.step_started(t.id, op_id, def.name) {
            return failed(def.name, &e);
        }
        let started_at = now_rfc3339();
        // Nothing to do for this tenant: a GPU step of a tenant that wants no GPU (it runs
        // anyway, as a no-op), or a step whose receipt line says skipped.
        let mut skipped = def.step.is_gpu() && !t.spec.gpu.wants_gpu();
        let result = match (def.run)(ctx, t, op) {
            Err(StepError::Cancelled) => {
                return Ended::Abandoned(StepError::Cancelled.to_string());
            }
            Ok(record) => {
                skipped |= record
                    .as_ref()
                    .is_some_and(|r| r.result == StepResult::Skipped);
                match record {
                    Some(rec) if op.keeps_receipt() => ctx
                        .store
                        .record_departure_step(t.id, &t.name, rec)
                        .map(|_| ())
                        .map_err(StepError::from),
                    _ => Ok(()),
                }
            }
            Err(e) => {
                if let (true, Some(line)) = (op.keeps_receipt(), def.receipt) {
                    // The receipt says the step failed, and why, until a resumed run of it
                    // replaces the line.
                    let rec = StepRecord::new(
                        line,
                        "did not complete",
                        StepResult::Failed,
                        Assurance::Unverified,
                        started_at,
                        now_rfc3339(),
                    )
                    .failed(&e);
                    if let Err(e2) = ctx.store.record_departure_step(t.id, &t.name, rec) {
                        tracing::error!(tenant = %t.name, error = %e2, "cannot record the failed step in the receipt");
                    }
                }
                Err(e)
            }
        };
        let error = result.err().map(|e| e.to_string());
        let recorded = if skipped && error.is_none() {
            ctx.store.step_skipped(t.id, op_id, def.name)
        } else {
            ctx.store
                .step_finished(t.id, op_id, def.name, error.as_deref())
        };
        if let Err(e) = recorded {
            return failed(def.name, &e);
        }
        if let Some(message) = error {
            return Ended::Failed {
                step: def.name,
                message,
            };
        }
        if let Err(e) = at_boundary(op.name(), def.name, Boundary::After) {
            return Ended::Abandoned(e);
        }
    }
    Ended::Done
}
