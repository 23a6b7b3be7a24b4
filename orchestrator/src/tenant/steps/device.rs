//! The steps that hand a tenant's GPU share to its VM and take it back
//! ([`crate::gpu::route`] says how each route does it):
//!
//! create: reserve-gpu → **prepare-gpu-host** (the route decided and recorded with the VM's
//! UUID, then the card prepared: vGPU needs MIG on and VFs enabled before any instance; a
//! whole card in MIG mode gets MIG off, since a guest's CUDA sees no device on it) →
//! create-gpu-instance → **bind-gpu** (whole: the IOMMU group on vfio-pci; vGPU: the type on
//! a VF, checked against the planned instance) → **attach-gpu** (the devices the VM gets,
//! recorded; launch-vm passes them and the UUID to the VMM);
//!
//! destroy: stop-vm → cleanup-jail → device-reset (checked; the VMM's exit report too) →
//! **rebind-gpu** (whole: host drivers back) → **detach-gpu** (vGPU: type 0) → scrub-gpu →
//! destroy-gpu-instance → release-gpu (the card leaves vGPU mode with its last vGPU tenant;
//! a whole card that was in MIG mode gets it back).
//!
//! Every step reads the stored record and does only what is not done yet, so a daemon killed
//! anywhere converges when the operation runs again. A reset or rebind that fails
//! quarantines the slice with the step's name as the reason (the receipt shows it); the
//! departure goes on.

use crate::backend::PassthroughDevice;
use crate::gpu::{AssignedGpu, DeviceRecord, MigRestore};
use crate::receipt::StepRecord;
use crate::store::{GpuDeviceRow, GpuPlacement};
use crate::tenant::context::{StepCtx, StepError, Tenant};
use crate::tenant::steps::Op;

/// The share the daemon assigned to tenant `t` (None: no GPU share), described by the
/// GPU wing from the ledger placement and the stored device record (`tenantvm gpu-info`).
pub fn assigned(ctx: &StepCtx<'_>, t: &Tenant) -> Result<Option<AssignedGpu>, StepError> {
    let Some(placement) = ctx.store.gpu_placement(t.id)? else {
        return Ok(None);
    };
    let record = stored(ctx, t)?.map(|(_, r)| r);
    Ok(Some(ctx.gpu.describe(&placement, record.as_ref())?))
}

fn corrupt(what: &str, e: impl std::fmt::Display) -> StepError {
    StepError::failed(format!("the stored GPU device {what} is unreadable: {e}"))
}

/// The tenant's stored device row and its record, if prepare-gpu-host ran.
pub fn stored(
    ctx: &StepCtx<'_>,
    t: &Tenant,
) -> Result<Option<(GpuDeviceRow, DeviceRecord)>, StepError> {
    let Some(row) = ctx.store.gpu_device(t.id)? else {
        return Ok(None);
    };
    let record = serde_json::from_str(&row.record).map_err(|e| corrupt("record", e))?;
    Ok(Some((row, record)))
}

fn save(
    ctx: &StepCtx<'_>,
    t: &Tenant,
    row: &GpuDeviceRow,
    record: &DeviceRecord,
) -> Result<(), StepError> {
    save_row(ctx, t.id, row, record)
}

fn save_row(
    ctx: &StepCtx<'_>,
    id: i64,
    row: &GpuDeviceRow,
    record: &DeviceRecord,
) -> Result<(), StepError> {
    let row = GpuDeviceRow {
        record: serde_json::to_string(record).map_err(StepError::failed)?,
        ..row.clone()
    };
    ctx.store.set_gpu_device(id, &row)?;
    Ok(())
}

/// What launch-vm passes to the VMM: the recorded devices and the VM's UUID (none without
/// a GPU device).
pub fn for_launch(
    ctx: &StepCtx<'_>,
    t: &Tenant,
) -> Result<(Vec<PassthroughDevice>, Option<tenantvm_vmm_api::VmUuid>), StepError> {
    let Some((row, record)) = stored(ctx, t)? else {
        return Ok((Vec::new(), None));
    };
    let devices: Vec<PassthroughDevice> = match &row.devices {
        Some(text) => serde_json::from_str(text).map_err(|e| corrupt("device list", e))?,
        None if record.attaches() => {
            return Err(StepError::failed(
                "the GPU device was bound but attach-gpu has not recorded the VM's devices",
            ))
        }
        None => Vec::new(),
    };
    let uuid = row.vm_uuid.parse().map_err(|e| corrupt("VM UUID", e))?;
    Ok((devices, Some(uuid)))
}

fn placement(ctx: &StepCtx<'_>, t: &Tenant) -> Result<Option<GpuPlacement>, StepError> {
    Ok(ctx.store.gpu_placement(t.id)?)
}

/// prepare-gpu-host: decides the route of the reserved placement and records it with a new
/// VM UUID (once), then prepares the card (vGPU: MIG on, then VFs on).
pub fn prepare_host(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let Some(p) = placement(ctx, t)? else {
        return Ok(None);
    };
    // Recording the route (and what this tenant turns on) and preparing the card happen
    // under the card's lock, never between a departing tenant's look for heirs and its
    // turning the card's mode back off.
    let _card = ctx.hold_card(&p.gpu)?;
    let record = match stored(ctx, t)? {
        Some((_, record)) => record,
        None => {
            let record = ctx.gpu.plan_device(&p)?;
            let row = GpuDeviceRow {
                vm_uuid: uuid::Uuid::new_v4().hyphenated().to_string(),
                record: String::new(),
                devices: None,
            };
            save(ctx, t, &row, &record)?;
            record
        }
    };
    ctx.gpu.prepare_device(&p, &record)?;
    Ok(None)
}

/// bind-gpu: whole: the GPU's IOMMU group onto vfio-pci; vGPU: the vGPU type on a free VF,
/// whose instance must be the planned one; mdev: the mdev of the profile's type, chosen and
/// recorded first, then created. The record (with the typed VF) is stored.
pub fn bind(ctx: &StepCtx<'_>, t: &mut Tenant, _op: Op) -> Result<Option<StepRecord>, StepError> {
    let (Some(p), Some((row, record))) = (placement(ctx, t)?, stored(ctx, t)?) else {
        return Ok(None);
    };
    // What binding will do is recorded before it is done (mdev: its type and UUID).
    let planned = ctx.gpu.plan_bind(&p, &record)?;
    if planned != record {
        save(ctx, t, &row, &planned)?;
    }
    let bound = ctx.gpu.bind_device(&p, &planned)?;
    if bound != planned {
        save(ctx, t, &row, &bound)?;
    }
    Ok(None)
}

/// attach-gpu: records the devices the VM gets (each with its IOMMU group), for every
/// launch of the tenant's VM.
pub fn attach(ctx: &StepCtx<'_>, t: &mut Tenant, _op: Op) -> Result<Option<StepRecord>, StepError> {
    let Some((row, record)) = stored(ctx, t)? else {
        return Ok(None);
    };
    let devices = ctx.gpu.devices(&record)?;
    let row = GpuDeviceRow {
        devices: Some(serde_json::to_string(&devices).map_err(StepError::failed)?),
        ..row
    };
    ctx.store.set_gpu_device(t.id, &row)?;
    Ok(None)
}

/// rebind-gpu: whole: every device of the group back on its recorded host driver (checked).
/// A failure quarantines the slice (reason `rebind-gpu: ...`) and the departure goes on.
pub fn rebind(ctx: &StepCtx<'_>, t: &mut Tenant, _op: Op) -> Result<Option<StepRecord>, StepError> {
    let (Some(p), Some((_, record))) = (placement(ctx, t)?, stored(ctx, t)?) else {
        return Ok(None);
    };
    if let Err(e) = ctx.gpu.rebind_device(&record) {
        ctx.store.quarantine_gpu(&p, &format!("rebind-gpu: {e}"))?;
    }
    Ok(None)
}

/// detach-gpu: vGPU: type 0 on every VF serving the tenant's instance; mdev: the mdev
/// removed (before the scrub and the instance's destruction).
pub fn detach(ctx: &StepCtx<'_>, t: &mut Tenant, _op: Op) -> Result<Option<StepRecord>, StepError> {
    let (Some(p), Some((_, record))) = (placement(ctx, t)?, stored(ctx, t)?) else {
        return Ok(None);
    };
    ctx.gpu.detach_device(&p, &record)?;
    Ok(None)
}

/// create-gpu-instance's first half: when the tenant's MIG instance is about to turn its
/// card's MIG mode on and the record does not say so yet (the mode changed since
/// prepare-gpu-host looked), the record takes it over first, so that the card's last MIG
/// tenant turns it off again. Runs under the card's lock.
pub fn record_mig_turned_on(
    ctx: &StepCtx<'_>,
    t: &Tenant,
    p: &GpuPlacement,
) -> Result<(), StepError> {
    if !p.label.contains('@') || ctx.gpu.mig_enabled(&p.gpu)? != Some(false) {
        return Ok(());
    }
    let Some((row, mut record)) = stored(ctx, t)? else {
        return Ok(());
    };
    if record.mig_turned_on().is_none() {
        record.take_mig_turned_on(&p.gpu);
        save(ctx, t, &row, &record)?;
    }
    Ok(())
}

/// The other tenant (row id, row, record) whose MIG share is on `card`, if any: it
/// inherits the duty to turn MIG off again.
fn mig_heir(
    ctx: &StepCtx<'_>,
    t: &Tenant,
    card: &str,
) -> Result<Option<(i64, GpuDeviceRow, DeviceRecord)>, StepError> {
    for (id, row) in ctx.store.gpu_devices()? {
        if id == t.id {
            continue;
        }
        let on_card = ctx
            .store
            .gpu_placement(id)?
            .is_some_and(|p| p.gpu.eq_ignore_ascii_case(card) && p.label.contains('@'));
        if !on_card {
            continue;
        }
        if let Ok(record) = serde_json::from_str::<DeviceRecord>(&row.record) {
            return Ok(Some((id, row, record)));
        }
    }
    Ok(None)
}

/// Part of release-gpu, under the card's lock: the card leaves vGPU mode when this was its
/// last vGPU tenant, and its MIG mode goes back off when this tenant's record turned it on
/// and no other MIG tenant of the card is left (else another of its tenants inherits what
/// this one turned on); then the row is removed. Each part reads the card again, so a
/// re-run after a crash converges.
pub fn release(ctx: &StepCtx<'_>, t: &Tenant) -> Result<(), StepError> {
    let Some((_, record)) = stored(ctx, t)? else {
        return Ok(());
    };
    let card = match (placement(ctx, t)?, &record) {
        (Some(p), _) => p.gpu,
        (None, DeviceRecord::SriovVgpu { host, .. }) => host.pf.clone(),
        (None, other) => other.mig_turned_on().unwrap_or_default().to_string(),
    };
    let _card = ctx.hold_card(&card)?;
    if let (false, Some(gpu)) = (
        matches!(record, DeviceRecord::SriovVgpu { .. }),
        record.mig_turned_on(),
    ) {
        match mig_heir(ctx, t, gpu)? {
            Some((id, row, mut other)) => {
                other.take_mig_turned_on(gpu);
                save_row(ctx, id, &row, &other)?;
            }
            None => {
                if let MigRestore::LeftOn(why) = ctx.gpu.restore_mig_off(gpu)? {
                    tracing::warn!(tenant = %t.name, gpu, "MIG mode stays on: {why}");
                }
            }
        }
    }
    if let DeviceRecord::SriovVgpu { host, .. } = &record {
        let mut heir = None;
        for (id, row) in ctx.store.gpu_devices()? {
            if id == t.id {
                continue;
            }
            if let Ok(DeviceRecord::SriovVgpu { host: other, .. }) =
                serde_json::from_str::<DeviceRecord>(&row.record)
            {
                if other.pf == host.pf {
                    heir = Some((id, row));
                    break;
                }
            }
        }
        match heir {
            Some((id, row)) => {
                let Ok(DeviceRecord::SriovVgpu {
                    host: mut other,
                    attachment,
                }) = serde_json::from_str::<DeviceRecord>(&row.record)
                else {
                    unreachable!("checked above")
                };
                other.enables_mig |= host.enables_mig;
                other.enables_vfs |= host.enables_vfs;
                let rec = DeviceRecord::SriovVgpu {
                    host: other,
                    attachment,
                };
                let row = GpuDeviceRow {
                    record: serde_json::to_string(&rec).map_err(StepError::failed)?,
                    ..row
                };
                ctx.store.set_gpu_device(id, &row)?;
            }
            None => ctx.gpu.leave_device_mode(&card, &record)?,
        }
    }
    // A whole card that was in MIG mode gets it back (its only tenant: no heir).
    if let DeviceRecord::Whole {
        mig_turned_off: true,
        ..
    } = &record
    {
        ctx.gpu.leave_device_mode(&card, &record)?;
    }
    ctx.store.remove_gpu_device(t.id)?;
    Ok(())
}
