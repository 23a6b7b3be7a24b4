//! The GPU's steps: reserving a placement in the store's ledger, creating and destroying its
//! MIG instance, and, at departure, resetting the device and scrubbing its memory (a slice
//! whose scrub does not verify is quarantined). All no-ops for a tenant without a GPU.

use crate::gpu::scrub::departure::slice_id;
use crate::gpu::{GpuError, GpuHost};
use crate::receipt::{now_rfc3339, Assurance, DepartureStep, StepRecord, StepResult};
use crate::store::{GpuPlacement, QuarantinedSlice, Store};
use crate::tenant::context::{StepCtx, StepError, Tenant};
use crate::tenant::departure::{RescrubError, RescrubOutcome};
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

/// The steps whose failure quarantines a slice until an operator's re-scrub (the reason
/// starts with the step's name).
const DEVICE_STEPS: [&str; 2] = ["device-reset:", "rebind-gpu:"];

/// Refuses, before anything is recorded, a GPU request this host could never meet (an
/// unknown profile or model, a share of a GPU without a partition, more than any GPU holds),
/// and an mdev vGPU under a VMM that cannot pass one through (`vmm_passes_mdev` false).
/// Whether there is room now is reserve-gpu's question, asked under the ledger.
pub fn check_request(
    gpu: &dyn GpuHost,
    tenant: &str,
    request: &crate::domain::spec::GpuRequest,
    vmm_passes_mdev: bool,
) -> Result<(), GpuError> {
    let placement = gpu.place(tenant, request, &[])?;
    if !vmm_passes_mdev {
        if let Ok(crate::gpu::DeviceRecord::MdevVgpu { parent, .. }) = gpu.plan_device(&placement) {
            return Err(crate::gpu::error::plan_err(format!(
                "GPU {parent} gives MIG instances to VMs as mdev vGPUs (vGPU 16 and older), which tenantvm-vmm cannot pass through: run tenantvmd with --backend qemu-kvm, or ask for a whole GPU"
            )));
        }
    }
    Ok(())
}

/// Memory and utilisation of `placement`'s slice, as the GPU backend reads them (None
/// without a backend that measures).
pub fn usage(
    ctx: &StepCtx<'_>,
    placement: &GpuPlacement,
) -> Result<Option<tenantvm_gpu::backend::SliceUsage>, GpuError> {
    ctx.gpu.usage(placement)
}

/// The host's GPUs with their instances, as the GPU backend lists them.
pub fn host_gpus(ctx: &StepCtx<'_>) -> Result<Vec<tenantvm_gpu::backend::GpuInfo>, GpuError> {
    ctx.gpu.gpus()
}

/// Re-runs the scrub of a quarantined slice (`<gpu>/<label>`): recreates its MIG instance,
/// scrubs it, destroys it again, and lifts the quarantine only if the scrub passed.
pub fn rescrub(
    store: &Store,
    gpu: &dyn GpuHost,
    slice: &str,
) -> Result<RescrubOutcome, RescrubError> {
    let q: QuarantinedSlice = store
        .quarantined()?
        .into_iter()
        .find(|q| q.id() == slice)
        .ok_or_else(|| RescrubError::NotQuarantined(slice.into()))?;
    let p = q.placement();
    let failed = |e: &dyn std::fmt::Display| RescrubError::Failed {
        slice: slice.to_string(),
        message: e.to_string(),
    };
    gpu.materialize(&p).map_err(|e| failed(&e))?;
    let outcome = gpu.scrub(&p);
    gpu.release(&p).map_err(|e| failed(&e))?;
    let outcome = outcome.map_err(|e| failed(&e))?;
    let lifted = outcome.passed && store.lift_quarantine(&p)? > 0;
    Ok(RescrubOutcome {
        slice: slice.to_string(),
        lifted,
        scrub: outcome,
    })
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

/// create-gpu-instance: makes the reserved placement real (its MIG instance), under the
/// card's lock; when that turns the card's MIG mode on, the tenant's device record says so
/// first (see [`crate::tenant::steps::device::record_mig_turned_on`]).
pub fn create_instance(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    if let Some(p) = ctx.store.gpu_placement(t.id)? {
        let _card = ctx.hold_card(&p.gpu)?;
        crate::tenant::steps::device::record_mig_turned_on(ctx, t, &p)?;
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
    let record = crate::tenant::steps::device::stored(ctx, t)?.map(|(_, r)| r);
    // What the VMM said about its devices' resets as it ended (tenantvm-vmm's exit report;
    // a compromised VMM wrote it, so it is evidence, never the only check).
    let mut vmm_evidence = std::collections::BTreeMap::new();
    let mut vmm_failed = Vec::new();
    match crate::backend::vmm::Vmm::read_exit_report(&ctx.config.tenant_dir(&t.name)) {
        Ok(Some(report)) => {
            for d in &report.devices {
                let path = crate::logs::sanitize(&d.path.display().to_string());
                let outcome = crate::logs::sanitize(&format!("{:?}", d.reset_at_detach));
                if matches!(
                    d.reset_at_detach,
                    tenantvm_vmm_api::ResetOutcome::Failed { .. }
                ) {
                    vmm_failed.push(format!("{path}: {outcome}"));
                }
                vmm_evidence.insert(format!("vmm reset at detach {path}"), outcome);
            }
        }
        Ok(None) => {}
        Err(e) => {
            vmm_evidence.insert(
                "vmm exit report".into(),
                crate::logs::sanitize(&e.to_string()),
            );
        }
    }
    let routed = match &record {
        Some(r) => match ctx.gpu.reset_device(r) {
            Ok(out) => out,
            Err(e) => {
                let why = format!("device-reset: {e}");
                ctx.store.quarantine_gpu(&p, &why)?;
                let mut rec = StepRecord::new(
                    DepartureStep::DeviceReset,
                    "PCI function reset through sysfs",
                    StepResult::Failed,
                    Assurance::Unverified,
                    started,
                    now_rfc3339(),
                )
                .with_evidence("quarantined", true)
                .with_evidence("slice", slice_id(&p))
                .failed(why);
                rec.evidence.extend(vmm_evidence);
                return Ok(Some(rec));
            }
        },
        None => None,
    };
    let out = match routed {
        Some(out) => out,
        None => ctx.gpu.reset(&p)?,
    };
    let mut rec = StepRecord::new(
        DepartureStep::DeviceReset,
        &out.method,
        out.result,
        out.assurance,
        started,
        now_rfc3339(),
    );
    rec.evidence = out.evidence;
    if let Some(r) = &record {
        rec.evidence.insert("route".into(), r.route().into());
    }
    rec.evidence.extend(vmm_evidence);
    if !vmm_failed.is_empty() {
        let why = format!(
            "device-reset: the VMM's reset failed: {}",
            vmm_failed.join("; ")
        );
        ctx.store.quarantine_gpu(&p, &why)?;
        rec = rec.with_evidence("quarantined", true).failed(why);
    }
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
                // verifies is what lifts a quarantine, but not one a failed reset or rebind
                // of this departure set (the device was not given back clean).
                let held_by_device_step = ctx.store.quarantined()?.iter().any(|q| {
                    q.gpu == p.gpu
                        && q.label == p.label
                        && DEVICE_STEPS.iter().any(|s| q.reason.starts_with(s))
                });
                if !held_by_device_step {
                    ctx.store.lift_quarantine(p)?;
                }
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
    // A reset or rebind that failed quarantined the slice: the receipt names that step.
    let quarantined = ctx
        .store
        .quarantined()?
        .into_iter()
        .find(|q| q.gpu == p.gpu && q.label == p.label);
    let rec = StepRecord::new(
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
    .with_evidence("slice", slice_id(&p));
    let rec = with_drivers(ctx, t, rec)?;
    let rec = with_route_parts(ctx, t, rec)?;
    Ok(Some(match quarantined {
        Some(q) => rec.with_evidence("quarantined", crate::logs::sanitize(&q.reason)),
        None => rec,
    }))
}

/// A whole GPU's devices after rebind-gpu: for each, the driver sysfs shows now and the
/// one recorded before the bind (`none`: unbound), as the gpu-release line's evidence.
fn with_drivers(ctx: &StepCtx<'_>, t: &Tenant, rec: StepRecord) -> Result<StepRecord, StepError> {
    let Some((_, record)) = crate::tenant::steps::device::stored(ctx, t)? else {
        return Ok(rec);
    };
    let crate::gpu::DeviceRecord::Whole { binding, .. } = &record else {
        return Ok(rec);
    };
    let mut rec = rec;
    let now = match ctx.gpu.device_drivers(&record) {
        Ok(now) => now,
        Err(e) => {
            return Ok(rec.with_evidence(
                "drivers",
                crate::logs::sanitize(&format!("unreadable: {e}")),
            ))
        }
    };
    for (address, driver) in now {
        let before = binding
            .devices
            .iter()
            .find(|d| d.address == address)
            .and_then(|d| d.previous_driver.clone());
        rec = rec.with_evidence(
            &format!("driver {address}"),
            format!(
                "{} (before the bind: {})",
                driver.as_deref().unwrap_or("none"),
                before.as_deref().unwrap_or("none")
            ),
        );
    }
    Ok(rec)
}

/// The route's parts (which ran on the real host, which were SIMULATED; a vGPU's VF and
/// its type), as the gpu-release line's evidence.
fn with_route_parts(
    ctx: &StepCtx<'_>,
    t: &Tenant,
    mut rec: StepRecord,
) -> Result<StepRecord, StepError> {
    if let Some((_, record)) = crate::tenant::steps::device::stored(ctx, t)? {
        for (key, value) in ctx.gpu.route_evidence(&record) {
            rec = rec.with_evidence(&key, crate::logs::sanitize(&value));
        }
    }
    Ok(rec)
}

/// release-gpu: the card's host mode back as the tenant found it (its last tenant), then
/// the placement's slots back to the ledger. In that order: the mode's restoration reads the
/// placement, so a crash between the two leaves what the re-run needs. A departure's
/// gpu-release line then gets what the card's functions are after it (a vGPU card's VF
/// count: 0 once its last vGPU tenant left).
pub fn release(ctx: &StepCtx<'_>, t: &mut Tenant, op: Op) -> Result<Option<StepRecord>, StepError> {
    let record = crate::tenant::steps::device::stored(ctx, t)?.map(|(_, r)| r);
    crate::tenant::steps::device::release(ctx, t)?;
    ctx.store.release_gpu(t.id)?;
    if let (true, Some(record)) = (op.keeps_receipt(), record) {
        amend_release_line(ctx, t, &record)?;
    }
    Ok(None)
}

/// Adds the functions' state after release-gpu to the receipt's gpu-release line (written
/// by destroy-gpu-instance, before the card's mode was restored).
fn amend_release_line(
    ctx: &StepCtx<'_>,
    t: &Tenant,
    record: &crate::gpu::DeviceRecord,
) -> Result<(), StepError> {
    let after: Vec<(String, String)> = ctx
        .gpu
        .route_evidence(record)
        .into_iter()
        .filter(|(k, _)| k.starts_with("vfs of "))
        .collect();
    if after.is_empty() {
        return Ok(());
    }
    let Some((receipt, false)) = ctx.store.departure(t.id)? else {
        return Ok(());
    };
    let Some(mut line) = receipt
        .steps
        .into_iter()
        .find(|s| s.step == DepartureStep::GpuRelease)
    else {
        return Ok(());
    };
    for (key, value) in after {
        line = line.with_evidence(
            &format!("{key} after release-gpu"),
            crate::logs::sanitize(&value),
        );
    }
    ctx.store.record_departure_step(t.id, &t.name, line)?;
    Ok(())
}
