//! The encrypted data disk inside the guest: open it with cryptsetup (the key on stdin,
//! `--key-file=-`, so it never touches a file or a command line), create ext4 on first
//! use, mount, unmount and close.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::mount::{mount, umount, MsFlags};
use thiserror::Error;

use tenantvm_agent_protocol::DiskKey;

use crate::config::DiskConfig;
use crate::reaper::Reaper;

/// How long cryptsetup may take (the key derivation is slow under software emulation).
const CRYPTSETUP_TIMEOUT: Duration = Duration::from_secs(300);
/// How long mke2fs may take.
const MKFS_TIMEOUT: Duration = Duration::from_secs(600);
/// How long to wait for the block device node to appear.
const DEVICE_WAIT: Duration = Duration::from_secs(15);
/// cryptsetup's exit status for a wrong passphrase.
const CRYPTSETUP_EPERM: i32 = 2;

/// Why a disk operation failed.
#[derive(Debug, Error)]
pub enum DiskError {
    /// The block device never appeared.
    #[error(
        "Block device {0} did not appear; attach the encrypted disk as the first virtio-blk device"
    )]
    NoDevice(PathBuf),
    /// The key did not open any keyslot.
    #[error("The key does not open {0}; deliver the tenant's key for this disk")]
    BadKey(PathBuf),
    /// A helper program failed.
    #[error("Helper {program} failed with exit code {code}: {stderr}")]
    Tool {
        /// Program.
        program: String,
        /// Exit code (128 + signal when killed).
        code: i32,
        /// The end of its standard error.
        stderr: String,
    },
    /// A helper program did not finish in time.
    #[error("Helper {0} did not finish in time and was killed")]
    ToolTimeout(String),
    /// The unlocked device holds no file system and formatting was not allowed.
    #[error("The unlocked disk holds no ext4 file system; pass format_if_missing on first use")]
    NoFileSystem,
    /// Mount or unmount failed.
    #[error("Cannot {op} {path}: {source}")]
    Mount {
        /// mount or umount.
        op: &'static str,
        /// Path.
        path: PathBuf,
        /// Cause.
        source: nix::errno::Errno,
    },
    /// Other I/O.
    #[error("Disk I/O on {path} failed: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
}

/// The dm-crypt mapping's device node.
pub fn mapped_device(cfg: &DiskConfig) -> PathBuf {
    Path::new("/dev/mapper").join(&cfg.mapper_name)
}

fn wait_for(path: &Path, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    path.exists()
}

/// Runs a helper with optional secret stdin; returns its exit code and stderr tail.
fn run_tool(
    reaper: &Reaper,
    program: &Path,
    args: &[&str],
    stdin_secret: Option<&[u8]>,
    timeout: Duration,
) -> Result<(i32, String), DiskError> {
    let name = program.display().to_string();
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .env("PATH", "/sbin:/bin:/usr/sbin:/usr/bin")
        .stdin(if stdin_secret.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = reaper.spawn(&mut cmd).map_err(|source| DiskError::Io {
        path: program.to_path_buf(),
        source,
    })?;
    if let (Some(secret), Some(mut stdin)) = (stdin_secret, child.stdin.take()) {
        // A tool that exits early closes the pipe; its exit code tells the story.
        let _ = stdin.write_all(secret);
    }
    let mut stderr = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(s) = stderr.as_mut() {
            let _ = s.take(64 * 1024).read_to_end(&mut buf);
        }
        buf
    });
    let Some(code) = reaper.wait(child.pid, timeout) else {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        reaper.wait(child.pid, Duration::from_secs(5));
        return Err(DiskError::ToolTimeout(name));
    };
    let err = reader.join().unwrap_or_default();
    let text = String::from_utf8_lossy(&err);
    let tail: String = text
        .trim()
        .chars()
        .rev()
        .take(400)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    Ok((code, tail))
}

/// Opens the LUKS2 disk with `key` as `/dev/mapper/<mapper_name>`.
pub fn unlock(cfg: &DiskConfig, reaper: &Reaper, key: &DiskKey) -> Result<(), DiskError> {
    if !wait_for(&cfg.device, DEVICE_WAIT) {
        return Err(DiskError::NoDevice(cfg.device.clone()));
    }
    let dev = cfg.device.to_string_lossy().into_owned();
    let (code, stderr) = run_tool(
        reaper,
        &cfg.cryptsetup,
        &[
            "open",
            "--type",
            "luks2",
            "--key-file=-",
            &dev,
            &cfg.mapper_name,
        ],
        Some(key.expose()),
        CRYPTSETUP_TIMEOUT,
    )?;
    match code {
        0 => Ok(()),
        CRYPTSETUP_EPERM => Err(DiskError::BadKey(cfg.device.clone())),
        _ => Err(DiskError::Tool {
            program: "cryptsetup open".into(),
            code,
            stderr,
        }),
    }
}

/// Whether the device starts with an ext2/3/4 superblock (magic 0xEF53 at byte 1080).
pub fn has_ext_superblock(dev: &Path) -> Result<bool, DiskError> {
    let io = |source| DiskError::Io {
        path: dev.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::open(dev).map_err(io)?;
    f.seek(SeekFrom::Start(1080)).map_err(io)?;
    let mut magic = [0u8; 2];
    match f.read_exact(&mut magic) {
        Ok(()) => Ok(magic == [0x53, 0xef]),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(io(e)),
    }
}

/// Mounts the unlocked disk, creating ext4 first when allowed and needed. Returns
/// whether it formatted.
pub fn mount_data(
    cfg: &DiskConfig,
    reaper: &Reaper,
    format_if_missing: bool,
) -> Result<bool, DiskError> {
    let dev = mapped_device(cfg);
    let mut formatted = false;
    if !has_ext_superblock(&dev)? {
        if !format_if_missing {
            return Err(DiskError::NoFileSystem);
        }
        let dev_s = dev.to_string_lossy().into_owned();
        let (code, stderr) = run_tool(
            reaper,
            &cfg.mkfs,
            &[
                "-t",
                "ext4",
                "-q",
                "-F",
                "-L",
                "tenantdata",
                "-E",
                "nodiscard",
                &dev_s,
            ],
            None,
            MKFS_TIMEOUT,
        )?;
        if code != 0 {
            return Err(DiskError::Tool {
                program: "mke2fs".into(),
                code,
                stderr,
            });
        }
        formatted = true;
    }
    std::fs::create_dir_all(&cfg.mount_point).map_err(|source| DiskError::Io {
        path: cfg.mount_point.clone(),
        source,
    })?;
    mount(
        Some(&dev),
        &cfg.mount_point,
        Some("ext4"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        None::<&str>,
    )
    .map_err(|source| DiskError::Mount {
        op: "mount",
        path: cfg.mount_point.clone(),
        source,
    })?;
    Ok(formatted)
}

/// Unmounts the data directory.
pub fn unmount_data(cfg: &DiskConfig) -> Result<(), DiskError> {
    // SAFETY: sync(2) has no memory effects.
    unsafe { libc::sync() };
    umount(&cfg.mount_point).map_err(|source| DiskError::Mount {
        op: "umount",
        path: cfg.mount_point.clone(),
        source,
    })
}

/// Closes the dm-crypt mapping (the kernel drops the volume key).
pub fn close(cfg: &DiskConfig, reaper: &Reaper) -> Result<(), DiskError> {
    let (code, stderr) = run_tool(
        reaper,
        &cfg.cryptsetup,
        &["close", &cfg.mapper_name],
        None,
        CRYPTSETUP_TIMEOUT,
    )?;
    if code != 0 {
        return Err(DiskError::Tool {
            program: "cryptsetup close".into(),
            code,
            stderr,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superblock_probe_finds_ext4_magic_and_rejects_others() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("img");
        let mut bytes = vec![0u8; 4096];
        std::fs::write(&p, &bytes).unwrap();
        assert!(!has_ext_superblock(&p).unwrap());
        bytes[1080] = 0x53;
        bytes[1081] = 0xef;
        std::fs::write(&p, &bytes).unwrap();
        assert!(has_ext_superblock(&p).unwrap());
        std::fs::write(&p, [0u8; 10]).unwrap();
        assert!(!has_ext_superblock(&p).unwrap());
        assert!(matches!(
            has_ext_superblock(&dir.path().join("missing")),
            Err(DiskError::Io { .. })
        ));
    }
}
