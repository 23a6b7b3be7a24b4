//! `tenantvm create`'s spec: from a TOML file or from the flags, with `--vgpu-licence`'s
//! token.

use super::{exit, fail, CliFailure, CreateArgs, GpuKind};
use crate::domain::spec::{GpuRequest, GuestImage, Quotas, TenantSpec};
use crate::domain::TenantName;

/// Builds the spec of `create` from a file or the flags, with `--vgpu-licence`'s token.
pub fn spec_from_args(a: &CreateArgs) -> Result<TenantSpec, CliFailure> {
    let mut spec = base_spec(a)?;
    if let Some(path) = &a.vgpu_licence {
        let cap = crate::domain::licence::MAX_VGPU_LICENCE_BYTES as u64 + 1;
        let mut text = zeroize::Zeroizing::new(String::new());
        std::fs::File::open(path)
            .and_then(|f| {
                std::io::Read::read_to_string(&mut std::io::Read::take(f, cap), &mut text)
            })
            .map_err(|e| {
                fail(
                    exit::INVALID,
                    format!("Cannot read the vGPU licence token {}: {e}", path.display()),
                )
            })?;
        let licence = crate::domain::licence::VgpuLicence::new(&text)
            .map_err(|e| fail(exit::INVALID, format!("{}: {e}", path.display())))?;
        spec.vgpu_licence = Some(licence);
        spec.validate()
            .map_err(|e| fail(exit::INVALID, e.to_string()))?;
    }
    Ok(spec)
}

fn base_spec(a: &CreateArgs) -> Result<TenantSpec, CliFailure> {
    if let Some(path) = &a.spec_file {
        let text = std::fs::read_to_string(path).map_err(|e| {
            fail(
                exit::INVALID,
                format!("Cannot read {}: {e}", path.display()),
            )
        })?;
        return TenantSpec::from_toml(&text)
            .map_err(|e| fail(exit::INVALID, format!("{}: {e}", path.display())));
    }
    let name = a.name.clone().ok_or_else(|| {
        fail(
            exit::INVALID,
            "Give a spec file (tenantvm create alice.toml) or at least --name and --image/--kernel",
        )
    })?;
    let gpu = match a.gpu {
        GpuKind::None => GpuRequest::default(),
        GpuKind::Whole => GpuRequest {
            whole_gpu: true,
            ..Default::default()
        },
        GpuKind::Mig => GpuRequest {
            profile: Some(a.mig_profile.clone().ok_or_else(|| {
                fail(
                    exit::INVALID,
                    "--gpu mig needs --mig-profile (e.g. 1g.10gb)",
                )
            })?),
            ..Default::default()
        },
        GpuKind::Model => GpuRequest {
            model: Some(a.model.clone().ok_or_else(|| {
                fail(exit::INVALID, "--gpu model needs --model (e.g. llama-3-8b)")
            })?),
            ..Default::default()
        },
    };
    let name = TenantName::new(name).map_err(|e| fail(exit::INVALID, e.to_string()))?;
    let spec = TenantSpec {
        name,
        vcpus: a.vcpus,
        memory_mib: a.memory_mib,
        disk_gib: a.disk_gib,
        gpu,
        image: GuestImage {
            name: a.image.clone(),
            kernel: a.kernel.clone(),
            initramfs: a.initramfs.clone(),
            cmdline: a.cmdline.clone(),
        },
        quotas: Quotas::default(),
        hugepages: None,
        vgpu_licence: None,
    };
    spec.validate()
        .map_err(|e| fail(exit::INVALID, e.to_string()))?;
    Ok(spec)
}
