//! The tenant's files: its directory, its encrypted disk (create-disk makes it, launch-vm
//! attaches it, unlock-disk hands its key to the guest agent, crypto-shred destroys it) and
//! the removal of everything left at departure.
//!
//! The image is `<tenant dir>/disk.img`: LUKS2 on a sparse file of `disk_gib` GiB whose only
//! keyslot opens with the tenant's random key, stored only wrapped by the host KEK
//! (docs/disks-and-departure.md).

use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::PathBuf;

use crate::backend::{DiskAttachment, DiskRateLimit};
use crate::disk::create_image;
use crate::domain::spec::TenantSpec;
use crate::jail::error_chain;
use crate::keys::DiskKey;
use crate::receipt::{now_rfc3339, Assurance, DepartureStep, StepRecord, StepResult};
use crate::store::ResourceKind;
use crate::tenant::config::ServiceConfig;
use crate::tenant::context::{StepCtx, StepError, Tenant};
use crate::tenant::steps::Op;

/// File name of the image in the tenant directory.
pub const IMAGE_FILE: &str = "disk.img";

/// Where a tenant's disk image lives.
pub fn image_path(cfg: &ServiceConfig, tenant: &str) -> PathBuf {
    cfg.tenant_dir(tenant).join(IMAGE_FILE)
}

/// The disks launch-vm attaches: the tenant's image, read-write, when it has one.
pub fn attachments(cfg: &ServiceConfig, spec: &TenantSpec) -> Vec<DiskAttachment> {
    if spec.disk_gib == 0 {
        return Vec::new();
    }
    vec![DiskAttachment {
        path: image_path(cfg, &spec.name),
        read_only: false,
        limit: Some(DiskRateLimit {
            bytes_per_s: u64::from(spec.quotas.disk_mib_per_s) << 20,
            ops_per_s: u64::from(spec.quotas.disk_iops),
        }),
    }]
}

/// The tenant's unwrapped disk key, for unlock-disk to hand to the guest agent. Zeroized
/// when the returned value drops; never log or serialize it.
pub fn disk_key(ctx: &StepCtx<'_>, tenant: &str) -> Result<DiskKey, StepError> {
    ctx.kit()?.keys.unwrap(tenant).map_err(StepError::failed)
}

/// prepare-dir: the tenant directory, mode 0700, recorded as the tenant's.
pub fn prepare_dir(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let parent = ctx.config.tenants_dir();
    let dir = ctx.config.tenant_dir(&t.name);
    let io = |p: &PathBuf, e: std::io::Error| StepError::failed(format!("{}: {e}", p.display()));
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&parent)
        .map_err(|e| io(&parent, e))?;
    match fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(&dir, e)),
    }
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).map_err(|e| io(&dir, e))?;
    ctx.store
        .add_resource(t.id, ResourceKind::File, &dir.to_string_lossy(), None)?;
    Ok(None)
}

/// create-disk: the tenant key (created once, stored wrapped) and the LUKS2 image, owned by
/// the tenant's uid (the VMM opens it inside the jail). Idempotent: an existing key is reused,
/// and an image the key already opens is kept. A no-op with `disk_gib = 0`.
pub fn create_disk(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    if t.spec.disk_gib == 0 {
        return Ok(None);
    }
    let kit = ctx.kit()?;
    let key = kit.keys.create(&t.name).map_err(StepError::failed)?;
    let path = image_path(ctx.config, &t.name);
    let size = u64::from(t.spec.disk_gib) << 30;
    create_image(&path, size, &key, kit.cost).map_err(|e| StepError::failed(error_chain(&e)))?;
    drop(key);
    let uid = t.uid()?;
    std::os::unix::fs::chown(&path, Some(uid), Some(uid))
        .and_then(|()| fs::set_permissions(&path, fs::Permissions::from_mode(0o600)))
        .map_err(|e| StepError::failed(format!("{}: {e}", path.display())))?;
    Ok(None)
}

/// crypto-shred: destroys the disk's header and wrapped key and discards the image, with
/// the evidence that the old key no longer opens it.
pub fn crypto_shred(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let started = now_rfc3339();
    let kit = ctx.kit()?;
    let image = image_path(ctx.config, &t.name);
    let has_key = kit.keys.exists(&t.name).map_err(StepError::failed)?;
    if t.spec.disk_gib == 0 && !has_key && !image.exists() {
        // The sealed vGPU licence token gets the disk key's treatment, named in the
        // receipt whether or not there is a disk.
        let licence = shred_licence(&kit.keys, &t.name)?;
        let record = match licence {
            None => StepRecord::new(
                DepartureStep::CryptoShred,
                "no disk: the tenant had disk_gib = 0",
                StepResult::Skipped,
                Assurance::NotApplicable,
                started,
                now_rfc3339(),
            ),
            Some(absent) => StepRecord::new(
                DepartureStep::CryptoShred,
                "no disk (disk_gib = 0); the sealed vGPU licence token destroyed",
                StepResult::Ok,
                Assurance::checked(absent),
                started,
                now_rfc3339(),
            ),
        };
        return Ok(Some(with_licence_evidence(record, licence)));
    }
    let report = crate::disk::crypto_shred(&kit.keys, &t.name, &image)
        .map_err(|e| StepError::failed(error_chain(&e)))?;
    let licence = shred_licence(&kit.keys, &t.name)?;
    let mut record = with_licence_evidence(report.step_record(started, now_rfc3339()), licence);
    if t.has_agent() {
        // What the shredded disk held, in the receipt's words.
        record.evidence.insert(
            "tenant_data".into(),
            "the disk held the tenant's data, its models pushed with `tenantvm model push` \
             (fine-tuned weights) included: shredded with it"
                .into(),
        );
    }
    Ok(Some(record))
}

/// Destroys `tenant`'s sealed vGPU licence token: `None` when none was held (and none is
/// left), else whether it is gone now. Idempotent: a step resumed after this ran finds
/// none, and its receipt line says it may have been an earlier run's work.
fn shred_licence(keys: &crate::keys::KeyStore, tenant: &str) -> Result<Option<bool>, StepError> {
    let deleted = keys.delete_licence(tenant).map_err(StepError::failed)?;
    let absent = !keys.has_licence(tenant).map_err(StepError::failed)?;
    Ok((deleted || !absent).then_some(absent))
}

/// The receipt's words on the vGPU licence token.
fn with_licence_evidence(record: StepRecord, licence: Option<bool>) -> StepRecord {
    match licence {
        None => record.with_evidence(
            "vgpu_licence",
            "none held: no vGPU licence token was given (or an earlier run of this step destroyed it)",
        ),
        Some(absent) => record
            .with_evidence(
                "vgpu_licence",
                "the vGPU licence token, sealed under the host KEK, overwritten and removed; its only plaintext copy left was in the guest's RAM, gone with the VM",
            )
            .with_evidence("vgpu_licence_absent", absent),
    }
}

/// remove-files: removes the tenant directory (serial, VMM and event logs, sockets, jail
/// root) and checks that it is gone.
pub fn remove_files(
    ctx: &StepCtx<'_>,
    t: &mut Tenant,
    _op: Op,
) -> Result<Option<StepRecord>, StepError> {
    let started = now_rfc3339();
    let dir = ctx.config.tenant_dir(&t.name);
    match fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(StepError::failed(format!("{}: {e}", dir.display()))),
    }
    ctx.store
        .remove_resource(ResourceKind::File, &dir.to_string_lossy())?;
    let absent = !dir.exists();
    Ok(Some(
        StepRecord::new(
            DepartureStep::LogsRemoved,
            "tenant directory removed: serial, VMM and event logs, sockets, jail root",
            StepResult::Ok,
            Assurance::checked(absent),
            started,
            now_rfc3339(),
        )
        .with_evidence("directory_absent", absent),
    ))
}
