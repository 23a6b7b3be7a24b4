//! The GPU's steps: reserving a placement in the store's ledger, creating and destroying its
//! MIG instance, and, at departure, resetting the device and scrubbing its memory (a slice
//! whose scrub does not verify is quarantined). All no-ops for a tenant without a GPU.

use crate::receipt::{now_rfc3339, Assurance, DepartureStep, StepRecord, StepResult};
use crate::store::GpuPlacement;
use crate::tenant::context::{StepCtx, StepError, Tenant};
use crate::tenant::gpu_scrub::slice_id;
use crate::tenant::steps::Op;

fn no_device(step: DepartureStep, started: String) -> StepRecord {
    StepRecord::new(
        step,
        "no device: the tenant had no GPU",
        StepResult::Skipped,
        Assurance::NotApplicable,
        started,
        now_rfc3339(),
    )
}

/// What the ledger holds: every tenant's placement and every quarantined slice.
pub fn held_shares(store: &crate::store::Store) -> Result<Vec<GpuPlacement>, StepError> {
    let mut held = store.gpu_placements()?;
    held.extend(store.quarantined()?.into_iter().map(|q| GpuPlacement {
        gpu: q.gpu,
        slots: q.slots,
        label: q.label,
    }));
    Ok(held)
}

/// How often reserve-gpu places again when a concurrent create reserved the same slots
/// between its placement and its reservation.
const RESERVE_ATTEMPTS: usize = 8;

/// reserve-gpu: the exact planner places the request around everything the ledger holds
/// (reservations and quarantined slices) and the host's instances; the placement is then
/// reserved atomically. A concurrent create that took those slots first makes it place
/// again.
pub fn reserve(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    if !t.spec.gpu.wants_gpu() {
        return Ok(None);
    }
    if ctx.store.gpu_placement(t.id)?.is_some() {
        return Ok(None);
    }
    for _ in 0..RESERVE_ATTEMPTS {
        let held = held_shares(ctx.store)?;
        let quarantined = ctx.store.quarantined()?;
        let placement = ctx
            .gpu
            .place(t.name.as_str(), &t.spec.gpu, &held)
            .map_err(|e| {
                if quarantined.is_empty() {
                    StepError::from(e)
                } else {
                    StepError::failed(format!(
                        "{e} ({} slice(s) are quarantined because a scrub did not verify: see `tenantvm gpu quarantine`, re-scrub with `tenantvm gpu scrub`)",
                        quarantined.len()
                    ))
                }
            })?;
        if ctx.store.reserve_gpu(t.id, &[placement])?.is_some() {
            return Ok(None);
        }
    }
    Err(StepError::failed(
        "the GPU placement was taken by concurrent creates every time; create the tenant again",
    ))
}

/// create-gpu-instance: makes the reserved placement real (its MIG instance).
pub fn create_instance(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    if let Some(p) = ctx.store.gpu_placement(t.id)? {
        ctx.gpu.materialize(&p)?;
    }
    Ok(None)
}

/// device-reset: resets the placement's device.
pub fn device_reset(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let started = now_rfc3339();
    let Some(p) = ctx.store.gpu_placement(t.id)? else {
        return Ok(Some(no_device(DepartureStep::DeviceReset, started)));
    };
    let out = ctx.gpu.reset(&p)?;
    let mut rec = StepRecord::new(
        DepartureStep::DeviceReset,
        &out.method,
        out.result,
        out.assurance,
        started,
        now_rfc3339(),
    );
    rec.evidence = out.evidence;
    Ok(Some(rec))
}

/// scrub-gpu: zeroes and reads back the placement's memory. A scrub that did not pass, or
/// could not run, quarantines the slice and says so; the departure goes on.
pub fn scrub(ctx: &StepCtx<'_>, t: &mut Tenant, _op: Op) -> Result<Option<StepRecord>, StepError> {
    let started = now_rfc3339();
    let Some(p) = ctx.store.gpu_placement(t.id)? else {
        return Ok(Some(no_device(DepartureStep::GpuScrub, started)));
    };
    scrub_or_quarantine(ctx, &p, started).map(Some)
}

fn scrub_or_quarantine(
    ctx: &StepCtx<'_>,
    p: &GpuPlacement,
    started: String,
) -> Result<StepRecord, StepError> {
    match ctx.gpu.scrub(p) {
        Ok(outcome) => {
            let mut rec = outcome.step_record(started, now_rfc3339());
            if outcome.passed {
                // A re-run after a crash may pass where the first run did not: a scrub that
                // verifies is what lifts a quarantine.
                ctx.store.lift_quarantine(p)?;
            } else {
                ctx.store
                    .quarantine_gpu(p, rec.error.as_deref().unwrap_or("scrub did not pass"))?;
            }
            rec.evidence
                .insert("quarantined".into(), (!outcome.passed).to_string());
            rec.evidence.insert("slice".into(), slice_id(p));
            Ok(rec)
        }
        Err(e) => {
            let why = format!("the scrub could not run: {e}");
            ctx.store.quarantine_gpu(p, &why)?;
            Ok(StepRecord::new(
                DepartureStep::GpuScrub,
                "not run",
                StepResult::Failed,
                Assurance::Unverified,
                started,
                now_rfc3339(),
            )
            .with_evidence("quarantined", true)
            .with_evidence("slice", slice_id(p))
            .failed(why))
        }
    }
}

/// destroy-gpu-instance: destroys the placement's MIG instance (found again by GPU, profile
/// and start).
pub fn destroy_instance(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let started = now_rfc3339();
    let Some(p) = ctx.store.gpu_placement(t.id)? else {
        return Ok(Some(no_device(DepartureStep::GpuRelease, started)));
    };
    ctx.gpu.release(&p)?;
    Ok(Some(
        StepRecord::new(
            DepartureStep::GpuRelease,
            if p.label.contains('@') {
                "MIG compute and GPU instance destroyed, found again by GPU, profile and start"
            } else {
                "whole GPU released (no MIG instance)"
            },
            StepResult::Ok,
            Assurance::Verified,
            started,
            now_rfc3339(),
        )
        .with_evidence("slice", slice_id(&p)),
    ))
}

/// release-gpu: returns the placement's slots to the ledger.
pub fn release(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    ctx.store.release_gpu(t.id)?;
    Ok(None)
}
