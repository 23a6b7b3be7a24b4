//! The tenant's encrypted disk in the lifecycle: create-disk makes it, launch-vm attaches it,
//! and the guest agent will receive its key (the seam is [`disk_key_for_agent`]).
//!
//! The image is `<tenant dir>/disk.img`: LUKS2 on a sparse file of `disk_gib` GiB whose only
//! keyslot opens with the tenant's random key, stored only wrapped by the host KEK
//! (docs/disks-and-departure.md). crypto-shred (in [`super::departure`]) destroys it.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use crate::backend::{DiskAttachment, DiskRateLimit};
use crate::disk::create_image;
use crate::domain::spec::TenantSpec;
use crate::keys::DiskKey;
use crate::store::{ResourceKind, TenantRecord};
use crate::tenant::departure::kit;
use crate::tenant::service::{ServiceConfig, TenantService, TenantServiceError};
use crate::tenant::steps::Step;

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

fn step_err(message: impl std::fmt::Display) -> TenantServiceError {
    TenantServiceError::Step {
        step: Step::CreateDisk.name(),
        message: message.to_string(),
    }
}

/// create-disk: the tenant key (created once, stored wrapped) and the LUKS2 image, owned by
/// the tenant's uid (the VMM opens it inside the jail). Idempotent: an existing key is reused,
/// and an image the key already opens is kept.
pub(crate) fn create_disk(svc: &TenantService, t: &TenantRecord) -> Result<(), TenantServiceError> {
    if t.spec.disk_gib == 0 {
        return Ok(());
    }
    let kit = kit(svc, Step::CreateDisk)?;
    let key = kit.keys.create(&t.name).map_err(step_err)?;
    let path = image_path(&svc.config, &t.name);
    let size = u64::from(t.spec.disk_gib) << 30;
    create_image(&path, size, &key, kit.cost)
        .map_err(|e| step_err(crate::tenant::steps::error_chain(&e)))?;
    drop(key);
    let uid = svc
        .store
        .resources(Some(t.id))?
        .into_iter()
        .find(|r| r.kind == ResourceKind::Uid)
        .and_then(|r| r.key.parse::<u32>().ok())
        .ok_or_else(|| step_err("no uid allocated"))?;
    std::os::unix::fs::chown(&path, Some(uid), Some(uid))
        .and_then(|()| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)))
        .map_err(|e| step_err(format!("{}: {e}", path.display())))?;
    Ok(())
}

/// THE SEAM FOR ISSUE 7: the tenant's unwrapped disk key, for the guest agent's control
/// channel to deliver at boot (the guest then runs `cryptsetup open --key-file`). Nothing
/// calls it yet: the agent channel client (crate tenantvm-agent) lives on another branch. The
/// key is zeroized when the returned value drops; never log or serialize it.
pub fn disk_key_for_agent(
    svc: &TenantService,
    tenant: &str,
) -> Result<DiskKey, TenantServiceError> {
    let kit = kit(svc, Step::LaunchVm)?;
    kit.keys
        .unwrap(tenant)
        .map_err(|e| TenantServiceError::Step {
            step: Step::LaunchVm.name(),
            message: e.to_string(),
        })
}
