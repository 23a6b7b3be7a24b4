//! What a tenant boots: a named image (`<image-dir>/<name>/kernel`, `initramfs`, `cmdline`),
//! host files, or a guest image set (`guest-image/build.sh` output, recognised by its
//! `manifest.json`, whose guest runs the tenantvm agent). Checked at create, before anything
//! is recorded; resolved again at each launch (a set's files are checked against their
//! manifest every time, so a modified set never boots).

use std::fs;
use std::path::{Path, PathBuf};

use tenantvm_agent::image::ImageSet;
use thiserror::Error;

use crate::backend::BackendKind;
use crate::domain::spec::TenantSpec;
use crate::domain::GuestKind;
use crate::tenant::config::ServiceConfig;

/// The file in a guest image set that marks it as one (with the hashes of its boot files).
pub const MANIFEST: &str = "manifest.json";

/// Why a spec's image cannot be booted.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ImageError(pub String);

/// The files a VM boots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootFiles {
    /// Kernel (ELF vmlinux or bzImage).
    pub kernel: PathBuf,
    /// Initramfs, if any.
    pub initramfs: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
}

/// The guest image set a spec names, if its image is one: a named image
/// (`<image-dir>/<name>/`) holding `manifest.json`.
fn image_set_dir(cfg: &ServiceConfig, spec: &TenantSpec) -> Option<PathBuf> {
    let (Some(name), None, Some(dir)) = (&spec.image.name, &spec.image.kernel, &cfg.image_dir)
    else {
        return None;
    };
    let base = dir.join(name);
    base.join(MANIFEST).is_file().then_some(base)
}

/// What runs in the guest a spec boots: decided once, at create, and stored.
pub fn guest_kind(cfg: &ServiceConfig, spec: &TenantSpec) -> GuestKind {
    if image_set_dir(cfg, spec).is_some() {
        GuestKind::Agent
    } else {
        GuestKind::Plain
    }
}

/// The kernel (bzImage), initramfs and command line of a guest image set, after checking
/// them against its manifest (a modified or incomplete set is refused).
fn set_files(dir: &Path) -> Result<BootFiles, ImageError> {
    let set = ImageSet::open(dir).map_err(|e| {
        ImageError(format!(
            "guest image set {}: {e}; rebuild it with guest-image/build.sh",
            dir.display()
        ))
    })?;
    Ok(BootFiles {
        kernel: dir.join("vmlinuz"),
        initramfs: Some(dir.join("initramfs.cpio.gz")),
        cmdline: set.cmdline,
    })
}

/// The files a spec boots, checked to exist (and, for a guest image set, against its
/// manifest). `guest` is the stored guest kind: a tenant created from an image set keeps
/// booting it as one.
pub fn boot_files(
    cfg: &ServiceConfig,
    spec: &TenantSpec,
    guest: GuestKind,
) -> Result<BootFiles, ImageError> {
    let img = &spec.image;
    let default_cmdline = "console=ttyS0 reboot=k panic=1".to_string();
    if guest == GuestKind::Agent {
        let dir = match (&img.name, &cfg.image_dir) {
            (Some(name), Some(dir)) => dir.join(name),
            _ => {
                return Err(ImageError(
                    "the tenant boots a guest image set, but tenantvmd runs without --image-dir; restart it with the --image-dir it was created under".into(),
                ))
            }
        };
        return set_files(&dir);
    }
    let (kernel, initramfs, cmdline) = match (&img.name, &img.kernel) {
        (Some(name), None) => {
            let Some(image_dir) = &cfg.image_dir else {
                return Err(ImageError(format!(
                    "named image {name:?} asked for, but tenantvmd runs without --image-dir; give image.kernel or restart the daemon with --image-dir"
                )));
            };
            let base = image_dir.join(name);
            let initramfs = base.join("initramfs");
            let cmdline = match &img.cmdline {
                Some(c) => c.clone(),
                None => fs::read_to_string(base.join("cmdline"))
                    .map(|s| s.trim().to_string())
                    .unwrap_or(default_cmdline),
            };
            (
                base.join("kernel"),
                img.initramfs
                    .clone()
                    .or_else(|| initramfs.exists().then_some(initramfs)),
                cmdline,
            )
        }
        (None, Some(kernel)) => (
            kernel.clone(),
            img.initramfs.clone(),
            img.cmdline.clone().unwrap_or(default_cmdline),
        ),
        _ => {
            return Err(ImageError(
                crate::domain::spec::TenantSpecError::ImageChoice.to_string(),
            ))
        }
    };
    if !kernel.is_file() {
        return Err(ImageError(format!(
            "kernel {} does not exist or is not a file",
            kernel.display()
        )));
    }
    if let Some(i) = &initramfs {
        if !i.is_file() {
            return Err(ImageError(format!(
                "initramfs {} does not exist or is not a file",
                i.display()
            )));
        }
    }
    Ok(BootFiles {
        kernel,
        initramfs,
        cmdline,
    })
}

/// Refuses, before anything is recorded, a tenant this daemon cannot boot: missing or
/// modified image files, and guest image sets this backend or spec cannot run.
pub fn check_create(
    cfg: &ServiceConfig,
    backend: BackendKind,
    spec: &TenantSpec,
    guest: GuestKind,
) -> Result<(), ImageError> {
    if guest == GuestKind::Agent {
        let dir = image_set_dir(cfg, spec).unwrap_or_default();
        if backend == BackendKind::TenantvmVmm {
            return Err(ImageError(format!(
                "{} is a Linux guest image set: its agent is reached over virtio-serial, which only the QEMU backends offer (the vsock path through tenantvm-vmm is not wired to the agent yet); run tenantvmd with --backend qemu-tcg or --backend qemu-kvm for this tenant",
                dir.display()
            )));
        }
        if spec.disk_gib == 0 {
            return Err(ImageError(format!(
                "{} is a guest image set: its agent unlocks and mounts the tenant's encrypted disk before it starts the payload; set disk_gib = 1 or more",
                dir.display()
            )));
        }
    }
    boot_files(cfg, spec, guest).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, disk_gib: u32) -> TenantSpec {
        TenantSpec::from_toml(&format!(
            "name = \"{name}\"\nvcpus = 1\nmemory_mib = 512\ndisk_gib = {disk_gib}\n[image]\nname = \"linux\"\n"
        ))
        .unwrap()
    }

    fn image_dir(with_manifest: bool) -> (tempfile::TempDir, ServiceConfig) {
        let tmp = tempfile::tempdir().unwrap();
        let set = tmp.path().join("images/linux");
        std::fs::create_dir_all(&set).unwrap();
        if with_manifest {
            std::fs::write(set.join(MANIFEST), "{}").unwrap();
        }
        let mut cfg = ServiceConfig::new(tmp.path().join("state"));
        cfg.image_dir = Some(tmp.path().join("images"));
        (tmp, cfg)
    }

    const QEMU: BackendKind = BackendKind::Qemu {
        accel: crate::backend::QemuAccel::Tcg,
    };

    #[test]
    fn only_named_images_with_a_manifest_run_the_agent() {
        let (_tmp, cfg) = image_dir(true);
        assert_eq!(guest_kind(&cfg, &spec("a", 1)), GuestKind::Agent);
        let (_tmp2, plain) = image_dir(false);
        assert_eq!(guest_kind(&plain, &spec("a", 1)), GuestKind::Plain);
    }

    #[test]
    fn tenantvm_vmm_refuses_a_linux_guest_image_and_names_the_qemu_backends() {
        let (_tmp, cfg) = image_dir(true);
        let err = check_create(
            &cfg,
            BackendKind::TenantvmVmm,
            &spec("a", 1),
            GuestKind::Agent,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("--backend qemu-tcg"), "{err}");
        assert!(err.contains("qemu-kvm"), "{err}");
    }

    #[test]
    fn a_guest_image_tenant_without_a_disk_is_refused() {
        let (_tmp, cfg) = image_dir(true);
        let err = check_create(&cfg, QEMU, &spec("a", 0), GuestKind::Agent)
            .unwrap_err()
            .to_string();
        assert!(err.contains("disk_gib = 1"), "{err}");
    }

    #[test]
    fn a_tampered_image_set_is_refused_before_anything_runs() {
        // A manifest that lists nothing: the boot files are not vouched for.
        let (_tmp, cfg) = image_dir(true);
        let err = check_create(&cfg, QEMU, &spec("a", 1), GuestKind::Agent)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rebuild it with guest-image/build.sh"),
            "{err}"
        );
    }
}
