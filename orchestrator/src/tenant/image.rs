//! What a tenant boots: a named image (`<image-dir>/<name>/kernel`, `initramfs`, `cmdline`),
//! host files, or a guest image set (`guest-image/build.sh` output, recognised by its
//! `manifest.json`, whose guest runs the tenantvm agent). Checked at create, before anything
//! is recorded; resolved again at each launch (a set's files are checked against their
//! manifest every time, so a modified set never boots). Every boot file must lie under the
//! daemon's image directory once symlinks are resolved ([`check_under_image_dir`]), so a
//! spec (or a symlink planted in the image directory) can never hand a host file such as
//! `/etc/shadow` to a guest.

use std::fs;
use std::path::{Path, PathBuf};

use tenantvm_agent_protocol::{ImageSet, SetKernel};
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

/// Which of a guest image set's kernels `backend` boots: tenantvm-vmm the ELF `vmlinux`
/// (entered through its PVH note, no decompression in the guest: under the nested test
/// host's TCG the bzImage's decompressor alone took most of a minute), QEMU the bzImage.
pub fn set_kernel(backend: BackendKind) -> SetKernel {
    match backend {
        BackendKind::TenantvmVmm => SetKernel::Elf,
        BackendKind::Qemu { .. } => SetKernel::BzImage,
    }
}

/// The kernel (the one `backend` boots), initramfs and command line of a guest image set,
/// after checking them against its manifest (a modified or incomplete set is refused).
fn set_files(dir: &Path, backend: BackendKind) -> Result<BootFiles, ImageError> {
    let set = ImageSet::open_with_kernel(dir, set_kernel(backend)).map_err(|e| {
        ImageError(format!(
            "guest image set {}: {e}; rebuild it with guest-image/build.sh",
            dir.display()
        ))
    })?;
    Ok(BootFiles {
        kernel: set.kernel,
        initramfs: Some(dir.join("initramfs.cpio.gz")),
        cmdline: set.cmdline,
    })
}

/// The files a spec boots, checked to exist (and, for a guest image set, against its
/// manifest). `guest` is the stored guest kind: a tenant created from an image set keeps
/// booting it as one, with the kernel `backend` boots ([`set_kernel`]).
pub fn boot_files(
    cfg: &ServiceConfig,
    spec: &TenantSpec,
    guest: GuestKind,
    backend: BackendKind,
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
        let boot = set_files(&dir, backend)?;
        let mut files = vec![boot.kernel.as_path()];
        files.extend(boot.initramfs.as_deref());
        check_under_image_dir(cfg.image_dir.as_deref(), &files)?;
        return Ok(boot);
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
                    .map_or(default_cmdline, |s| s.trim().to_string()),
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
    let mut files = vec![kernel.as_path()];
    files.extend(initramfs.as_deref());
    check_under_image_dir(cfg.image_dir.as_deref(), &files)?;
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

/// Checks that every boot file lies under `image_dir` once symlinks are resolved. Missing
/// files are left to the caller's existence check.
pub fn check_under_image_dir(image_dir: Option<&Path>, files: &[&Path]) -> Result<(), ImageError> {
    let no_image_dir = || {
        ImageError(
            "tenantvmd runs without --image-dir, so no guest files can be used; restart it with --image-dir and put the guest's files there".into(),
        )
    };
    let root = image_dir
        .ok_or_else(no_image_dir)?
        .canonicalize()
        .map_err(|_| no_image_dir())?;
    for file in files {
        let Ok(resolved) = file.canonicalize() else {
            continue;
        };
        if !resolved.starts_with(&root) {
            return Err(ImageError(format!(
                "boot file {} is not under the image directory {} (symlinks resolved): put the guest's files there, or use a named image",
                resolved.display(),
                root.display()
            )));
        }
    }
    Ok(())
}

/// Refuses, before anything is recorded, a tenant this daemon cannot boot: missing,
/// modified or misplaced image files, and guest image sets the spec cannot run.
pub fn check_create(
    cfg: &ServiceConfig,
    spec: &TenantSpec,
    guest: GuestKind,
    backend: BackendKind,
) -> Result<(), ImageError> {
    if guest == GuestKind::Agent && spec.disk_gib == 0 {
        let dir = image_set_dir(cfg, spec).unwrap_or_default();
        return Err(ImageError(format!(
            "{} is a guest image set: its agent unlocks and mounts the tenant's encrypted disk before it starts the payload; set disk_gib = 1 or more",
            dir.display()
        )));
    }
    boot_files(cfg, spec, guest, backend).map(|_| ())
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

    #[test]
    fn only_named_images_with_a_manifest_run_the_agent() {
        let (_tmp, cfg) = image_dir(true);
        assert_eq!(guest_kind(&cfg, &spec("a", 1)), GuestKind::Agent);
        let (_tmp2, plain) = image_dir(false);
        assert_eq!(guest_kind(&plain, &spec("a", 1)), GuestKind::Plain);
    }

    #[test]
    fn a_guest_image_tenant_without_a_disk_is_refused() {
        let (_tmp, cfg) = image_dir(true);
        let err = check_create(
            &cfg,
            &spec("a", 0),
            GuestKind::Agent,
            BackendKind::TenantvmVmm,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("disk_gib = 1"), "{err}");
    }

    #[test]
    fn a_tampered_image_set_is_refused_before_anything_runs() {
        // A manifest that lists nothing: the boot files are not vouched for.
        let (_tmp, cfg) = image_dir(true);
        let err = check_create(
            &cfg,
            &spec("a", 1),
            GuestKind::Agent,
            BackendKind::TenantvmVmm,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("rebuild it with guest-image/build.sh"),
            "{err}"
        );
    }

    /// A guest image set with both kernels and a manifest that vouches for them.
    fn write_set(cfg: &ServiceConfig) -> PathBuf {
        use sha2::Digest;
        let set = cfg.image_dir.as_ref().unwrap().join("linux");
        let mut files = serde_json::Map::new();
        for (name, content) in [
            ("vmlinuz", "bzimage"),
            ("vmlinux", "elf"),
            ("initramfs.cpio.gz", "initramfs"),
            ("cmdline", "console=ttyS0\n"),
        ] {
            std::fs::write(set.join(name), content).unwrap();
            files.insert(
                name.into(),
                serde_json::json!({"sha256": hex::encode(sha2::Sha256::digest(content))}),
            );
        }
        std::fs::write(
            set.join(MANIFEST),
            serde_json::json!({"format": 1, "files": files}).to_string(),
        )
        .unwrap();
        set
    }

    #[test]
    fn tenantvm_vmm_boots_the_sets_elf_kernel_and_qemu_its_bzimage() {
        use crate::backend::QemuAccel;
        let (_tmp, cfg) = image_dir(true);
        let set = write_set(&cfg);
        let s = spec("a", 1);
        let vmm = boot_files(&cfg, &s, GuestKind::Agent, BackendKind::TenantvmVmm).unwrap();
        assert_eq!(vmm.kernel, set.join("vmlinux"));
        assert_eq!(vmm.initramfs, Some(set.join("initramfs.cpio.gz")));
        assert_eq!(vmm.cmdline, "console=ttyS0");
        for accel in [QemuAccel::Kvm, QemuAccel::Tcg] {
            let qemu = boot_files(&cfg, &s, GuestKind::Agent, BackendKind::Qemu { accel }).unwrap();
            assert_eq!(qemu.kernel, set.join("vmlinuz"));
        }
        // The ELF kernel is checked against the manifest like the rest.
        std::fs::write(set.join("vmlinux"), "modified").unwrap();
        let err = check_create(&cfg, &s, GuestKind::Agent, BackendKind::TenantvmVmm)
            .unwrap_err()
            .to_string();
        assert!(err.contains("vmlinux does not match the manifest"), "{err}");
        check_create(
            &cfg,
            &s,
            GuestKind::Agent,
            BackendKind::Qemu {
                accel: QemuAccel::Kvm,
            },
        )
        .unwrap();
    }

    #[test]
    fn boot_files_outside_the_image_directory_are_refused() {
        use crate::auth::Caller;
        use crate::tenant::fault::FaultHook;
        use crate::tenant::service::TenantCommand;
        use crate::tenant::test_utils::Harness;
        let h = Harness::new(FaultHook::default());
        let images = h.dir.path().join("images");
        // A host file named directly, and a named image whose kernel is a symlink out.
        let outside = h.dir.path().join("outside-kernel");
        std::fs::write(&outside, b"host secret").unwrap();
        std::fs::create_dir_all(images.join("evil")).unwrap();
        std::os::unix::fs::symlink(&outside, images.join("evil/kernel")).unwrap();
        for (name, image) in [
            ("direct", format!("kernel = \"{}\"", outside.display())),
            ("symlinked", "name = \"evil\"".to_string()),
        ] {
            let spec =
                TenantSpec::from_toml(&format!("name = \"{name}\"\n[image]\n{image}\n")).unwrap();
            let err = h
                .svc
                .execute(&Caller::Admin, TenantCommand::Create(spec))
                .expect_err(name);
            assert!(err.to_string().contains("image directory"), "{name}: {err}");
            assert!(h.svc.store().tenant(name).unwrap().is_none());
        }
        // A kernel inside the image directory, named by path, is fine.
        let inside = images.join("hello/kernel");
        let spec = TenantSpec::from_toml(&format!(
            "name = \"inside\"\n[image]\nkernel = \"{}\"\n",
            inside.display()
        ))
        .unwrap();
        h.svc
            .execute(&Caller::Admin, TenantCommand::Create(spec))
            .unwrap();
        h.svc.wait_idle();
    }
}
