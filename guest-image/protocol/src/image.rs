//! The host's view of an image set built by guest-image/build.sh: open it and verify every
//! file against `manifest.json` before booting. (The QEMU command line that boots it is
//! tenantvm-vmm-api's `QemuCommand`, shared with the orchestrator's QEMU backend.)

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};
use thiserror::Error;

/// The files of an image set that are booted besides the kernel, all listed in the manifest.
const BOOT_FILES: [&str; 2] = ["initramfs.cpio.gz", "cmdline"];

/// Which of the set's two kernels is booted (both are the same Linux; the manifest lists both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetKernel {
    /// `vmlinuz`, the bzImage: what QEMU's `-kernel` boots.
    BzImage,
    /// `vmlinux`, the ELF image with a PVH note: what tenantvm-vmm boots without
    /// decompressing anything in the guest (docs/vmm.md).
    Elf,
}

impl SetKernel {
    /// The file name in the set.
    pub const fn file(self) -> &'static str {
        match self {
            SetKernel::BzImage => "vmlinuz",
            SetKernel::Elf => "vmlinux",
        }
    }
}

/// Why an image set cannot be used.
#[derive(Debug, Error)]
pub enum ImageSetError {
    /// A file is missing or unreadable.
    #[error("Cannot read {path}: {source}; rebuild with guest-image/build.sh")]
    Read {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// manifest.json is not valid.
    #[error("Image manifest {path} is not valid: {source}; rebuild with guest-image/build.sh")]
    Manifest {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: serde_json::Error,
    },
    /// A boot file is not listed in the manifest.
    #[error("The image manifest does not list {0}; rebuild with guest-image/build.sh")]
    Unlisted(&'static str),
    /// A file's hash differs from the manifest.
    #[error("Image file {file} does not match the manifest (sha256 {actual}, expected {expected}); the image set was modified or is incomplete")]
    HashMismatch {
        /// File name.
        file: &'static str,
        /// Hash in the manifest.
        expected: String,
        /// Hash of the file.
        actual: String,
    },
}

#[derive(Deserialize)]
struct FileEntry {
    sha256: String,
}

#[derive(Deserialize)]
struct Manifest {
    files: std::collections::BTreeMap<String, FileEntry>,
}

/// A verified image set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSet {
    /// The directory.
    pub dir: PathBuf,
    /// The kernel that was checked (`vmlinuz` or `vmlinux` in [`Self::dir`]).
    pub kernel: PathBuf,
    /// The kernel command line.
    pub cmdline: String,
}

fn sha256_file(path: &Path) -> Result<String, ImageSetError> {
    let read = |source| ImageSetError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(read)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(read)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

impl ImageSet {
    /// Opens `dir` and checks vmlinuz, initramfs.cpio.gz and cmdline against the manifest.
    pub fn open(dir: &Path) -> Result<Self, ImageSetError> {
        Self::open_with_kernel(dir, SetKernel::BzImage)
    }

    /// Opens `dir` and checks `kernel`'s file, initramfs.cpio.gz and cmdline against the
    /// manifest.
    pub fn open_with_kernel(dir: &Path, kernel: SetKernel) -> Result<Self, ImageSetError> {
        let manifest_path = dir.join("manifest.json");
        let text = std::fs::read(&manifest_path).map_err(|source| ImageSetError::Read {
            path: manifest_path.clone(),
            source,
        })?;
        let manifest: Manifest =
            serde_json::from_slice(&text).map_err(|source| ImageSetError::Manifest {
                path: manifest_path,
                source,
            })?;
        for file in std::iter::once(kernel.file()).chain(BOOT_FILES) {
            let entry = manifest
                .files
                .get(file)
                .ok_or(ImageSetError::Unlisted(file))?;
            let actual = sha256_file(&dir.join(file))?;
            if !actual.eq_ignore_ascii_case(&entry.sha256) {
                return Err(ImageSetError::HashMismatch {
                    file,
                    expected: entry.sha256.clone(),
                    actual,
                });
            }
        }
        let cmdline_path = dir.join("cmdline");
        let cmdline = std::fs::read_to_string(&cmdline_path)
            .map_err(|source| ImageSetError::Read {
                path: cmdline_path,
                source,
            })?
            .trim()
            .to_string();
        Ok(Self {
            dir: dir.to_path_buf(),
            kernel: dir.join(kernel.file()),
            cmdline,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_set(dir: &Path) {
        let mut files = serde_json::Map::new();
        for (name, content) in [
            ("vmlinuz", "kernel"),
            ("vmlinux", "elf kernel"),
            ("initramfs.cpio.gz", "initramfs"),
            ("cmdline", "console=ttyS0\n"),
        ] {
            std::fs::write(dir.join(name), content).unwrap();
            files.insert(
                name.into(),
                serde_json::json!({"sha256": hex::encode(Sha256::digest(content)), "size": content.len()}),
            );
        }
        std::fs::write(
            dir.join("manifest.json"),
            serde_json::json!({"format": 1, "files": files}).to_string(),
        )
        .unwrap();
    }

    #[test]
    fn verified_set_opens() {
        let dir = tempfile::tempdir().unwrap();
        fake_set(dir.path());
        let set = ImageSet::open(dir.path()).unwrap();
        assert_eq!(set.cmdline, "console=ttyS0");
        assert_eq!(set.dir, dir.path());
        assert_eq!(set.kernel, dir.path().join("vmlinuz"));
    }

    #[test]
    fn the_elf_kernel_is_checked_when_it_is_the_one_booted() {
        let dir = tempfile::tempdir().unwrap();
        fake_set(dir.path());
        let set = ImageSet::open_with_kernel(dir.path(), SetKernel::Elf).unwrap();
        assert_eq!(set.kernel, dir.path().join("vmlinux"));
        std::fs::write(dir.path().join("vmlinux"), "evil").unwrap();
        assert!(matches!(
            ImageSet::open_with_kernel(dir.path(), SetKernel::Elf),
            Err(ImageSetError::HashMismatch {
                file: "vmlinux",
                ..
            })
        ));
        // The bzImage's check does not read the ELF image.
        ImageSet::open(dir.path()).unwrap();
        // A set built before it listed vmlinux is refused for the ELF boot, by name.
        std::fs::remove_file(dir.path().join("vmlinux")).unwrap();
        let manifest = std::fs::read_to_string(dir.path().join("manifest.json")).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&manifest).unwrap();
        v["files"].as_object_mut().unwrap().remove("vmlinux");
        std::fs::write(dir.path().join("manifest.json"), v.to_string()).unwrap();
        assert!(matches!(
            ImageSet::open_with_kernel(dir.path(), SetKernel::Elf),
            Err(ImageSetError::Unlisted("vmlinux"))
        ));
    }

    #[test]
    fn tampered_missing_or_unlisted_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        fake_set(dir.path());
        std::fs::write(dir.path().join("initramfs.cpio.gz"), "evil").unwrap();
        assert!(matches!(
            ImageSet::open(dir.path()),
            Err(ImageSetError::HashMismatch {
                file: "initramfs.cpio.gz",
                ..
            })
        ));
        fake_set(dir.path());
        std::fs::remove_file(dir.path().join("vmlinuz")).unwrap();
        assert!(matches!(
            ImageSet::open(dir.path()),
            Err(ImageSetError::Read { .. })
        ));
        std::fs::write(dir.path().join("manifest.json"), r#"{"files":{}}"#).unwrap();
        assert!(matches!(
            ImageSet::open(dir.path()),
            Err(ImageSetError::Unlisted("vmlinuz"))
        ));
        std::fs::write(dir.path().join("manifest.json"), "not json").unwrap();
        assert!(matches!(
            ImageSet::open(dir.path()),
            Err(ImageSetError::Manifest { .. })
        ));
    }
}
