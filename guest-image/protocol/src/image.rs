//! The host's view of an image set built by guest-image/build.sh: open it, verify every
//! file against `manifest.json` before booting, and build the QEMU command line that the
//! end-to-end test uses (so the orchestrator's QEMU backend can reuse the tested one).

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::message::VIRTIO_SERIAL_PORT_NAME;

/// The files of an image set that are booted, all listed in the manifest.
const BOOT_FILES: [&str; 3] = ["vmlinuz", "initramfs.cpio.gz", "cmdline"];

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
    /// The kernel command line.
    pub cmdline: String,
}

/// How QEMU runs the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Software emulation (any host).
    Tcg,
    /// Hardware virtualisation (/dev/kvm).
    Kvm,
}

/// What to attach to a QEMU guest.
#[derive(Debug, Clone)]
pub struct QemuGuest<'a> {
    /// The LUKS2 data disk (first virtio-blk device, `/dev/vda`).
    pub disk: &'a Path,
    /// The Unix socket QEMU listens on for the agent's virtio-serial port.
    pub agent_socket: &'a Path,
    /// Where the serial console goes.
    pub console: &'a Path,
    /// TCG or KVM.
    pub accel: Accel,
    /// Guest memory.
    pub memory_mib: u32,
    /// vCPUs.
    pub vcpus: u32,
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
        for file in BOOT_FILES {
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
            cmdline,
        })
    }

    /// QEMU arguments (without the program name) that boot this image with `guest`.
    pub fn qemu_args(&self, guest: &QemuGuest<'_>) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        let mut push = |s: &str| args.push(s.into());
        match guest.accel {
            Accel::Tcg => ["-accel", "tcg", "-cpu", "max"]
                .iter()
                .for_each(|a| push(a)),
            Accel::Kvm => ["-accel", "kvm", "-cpu", "host"]
                .iter()
                .for_each(|a| push(a)),
        }
        push("-m");
        push(&guest.memory_mib.to_string());
        push("-smp");
        push(&guest.vcpus.to_string());
        for a in [
            "-nodefaults",
            "-no-reboot",
            "-display",
            "none",
            "-monitor",
            "none",
        ] {
            push(a);
        }
        push("-kernel");
        args.push(self.dir.join("vmlinuz").into());
        args.push("-initrd".into());
        args.push(self.dir.join("initramfs.cpio.gz").into());
        args.push("-append".into());
        args.push(self.cmdline.clone().into());
        args.push("-serial".into());
        args.push(format!("file:{}", guest.console.display()).into());
        args.push("-device".into());
        args.push("virtio-serial-pci,id=vser0".into());
        args.push("-chardev".into());
        args.push(
            format!(
                "socket,id=agent,path={},server=on,wait=off",
                guest.agent_socket.display()
            )
            .into(),
        );
        args.push("-device".into());
        args.push(
            format!("virtserialport,bus=vser0.0,chardev=agent,name={VIRTIO_SERIAL_PORT_NAME}")
                .into(),
        );
        args.push("-drive".into());
        args.push(
            format!(
                "file={},format=raw,if=none,id=data,cache=writeback",
                guest.disk.display()
            )
            .into(),
        );
        args.push("-device".into());
        args.push("virtio-blk-pci,drive=data".into());
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_set(dir: &Path) {
        let mut files = serde_json::Map::new();
        for (name, content) in [
            ("vmlinuz", "kernel"),
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
    fn verified_set_opens_and_builds_a_qemu_command() {
        let dir = tempfile::tempdir().unwrap();
        fake_set(dir.path());
        let set = ImageSet::open(dir.path()).unwrap();
        assert_eq!(set.cmdline, "console=ttyS0");
        let args = set.qemu_args(&QemuGuest {
            disk: Path::new("/d.img"),
            agent_socket: Path::new("/a.sock"),
            console: Path::new("/c.log"),
            accel: Accel::Kvm,
            memory_mib: 1024,
            vcpus: 2,
        });
        let joined = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(joined.contains("-accel kvm -cpu host -m 1024 -smp 2"));
        assert!(joined.contains("name=org.tenantvm.agent.0"));
        assert!(joined.contains("file=/d.img,format=raw"));
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
