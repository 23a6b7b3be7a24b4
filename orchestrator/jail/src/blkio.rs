//! A block I/O limit in each tenant's cgroup, beside the VMM's own throttling (tenantvm-vmm's
//! token bucket, QEMU's block throttling): should a VMM be compromised, the kernel still
//! holds its reads and writes to the device under its disks to the tenant's quota.
//!
//! The device is the one holding each disk: the block device itself when the disk is one,
//! else the device of the file system its image lives on, as a whole disk (the kernel
//! refuses throttles on partitions). v1: `blkio.throttle.{read,write}_{bps,iops}_device`;
//! v2: `io.max` (`MAJ:MIN rbps= wbps= riops= wiops=`). A disk on a file system without a
//! block device (tmpfs, overlayfs, NFS), or a host without the controller, gets no kernel
//! limit, and the outcome says why (the VMM's own throttling still applies). On v1 the
//! kernel throttles direct and read I/O; buffered writes are written back outside the
//! tenant's cgroup, which v2 accounts.

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::cgroup::{mkdir, write_file, CgroupHandle, CgroupLayout, Cgroups};
use super::JailError;

/// The sysfs mount.
pub const SYS_ROOT: &str = "/sys";

/// A tenant's block I/O quota: sustained bytes and operations per second, each for reads
/// and for writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockIoLimit {
    /// Bytes per second.
    pub bytes_per_s: u64,
    /// Operations per second.
    pub ops_per_s: u64,
}

/// What [`Cgroups::limit_block_io`] did for one disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum BlockIoOutcome {
    /// The device holding the disk is throttled in the tenant's cgroup.
    Limited {
        /// The disk.
        disk: PathBuf,
        /// The throttled whole-disk device, `MAJ:MIN`.
        device: String,
    },
    /// No kernel limit could be set; the VMM's own throttling still applies.
    NotLimited {
        /// The disk.
        disk: PathBuf,
        /// Why.
        reason: String,
    },
}

/// The block device (major, minor) holding `path`: the device itself for a block device,
/// else that of its file system; `None` for a file system without one (major 0).
pub fn backing_device(path: &Path) -> Result<Option<(u32, u32)>, JailError> {
    let meta = fs::metadata(path).map_err(|source| JailError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let dev = if meta.file_type().is_block_device() {
        meta.rdev()
    } else {
        meta.dev()
    };
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    Ok((major != 0).then_some((major, minor)))
}

/// The whole disk a (possibly partition) device belongs to, from sysfs
/// (`<sys>/dev/block/MAJ:MIN/partition` marks a partition; its parent directory is the
/// disk). Devices sysfs does not know are returned as they are.
pub fn whole_disk(device: (u32, u32), sys_root: &Path) -> (u32, u32) {
    let node = sys_root
        .join("dev/block")
        .join(format!("{}:{}", device.0, device.1));
    if !node.join("partition").exists() {
        return device;
    }
    // /sys/dev/block/M:m is a symlink into /sys/devices/.../<disk>/<partition>.
    let parent_dev = fs::canonicalize(&node)
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("dev")))
        .and_then(|f| fs::read_to_string(f).ok());
    parent_dev
        .as_deref()
        .and_then(|t| t.trim().split_once(':'))
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        .unwrap_or(device)
}

impl Cgroups {
    /// Creates the tenant's cgroup where needed and limits its block I/O to `limit` on the
    /// device holding each of `disks` (once per device). Call it before the VMM starts:
    /// [`Cgroups::create`] then reuses the cgroup, and the jail launcher joins it with the
    /// others. Returns what was done for each disk.
    pub fn limit_block_io(
        &self,
        tenant: &str,
        disks: &[PathBuf],
        limit: BlockIoLimit,
    ) -> Result<Vec<BlockIoOutcome>, JailError> {
        self.limit_block_io_in(tenant, disks, limit, Path::new(SYS_ROOT))
    }

    /// [`Cgroups::limit_block_io`] with sysfs at `sys_root` (tests use a fake tree).
    pub fn limit_block_io_in(
        &self,
        tenant: &str,
        disks: &[PathBuf],
        limit: BlockIoLimit,
        sys_root: &Path,
    ) -> Result<Vec<BlockIoOutcome>, JailError> {
        let handle = self.handle(tenant)?;
        let target = match (&handle, self.layout()) {
            (
                CgroupHandle::V1 {
                    blkio: Some(dir), ..
                },
                _,
            ) => Some(dir.clone()),
            (CgroupHandle::V2 { path }, CgroupLayout::V2 { root }) if self.v2_has_io(root) => {
                Some(path.clone())
            }
            _ => None,
        };
        let Some(dir) = target else {
            let reason = match self.layout() {
                CgroupLayout::V1 { .. } => "no blkio controller is mounted on this host",
                CgroupLayout::V2 { .. } => "the io controller is not available in cgroup v2",
            };
            return Ok(disks
                .iter()
                .map(|d| BlockIoOutcome::NotLimited {
                    disk: d.clone(),
                    reason: reason.into(),
                })
                .collect());
        };
        let mut out = Vec::new();
        let mut done: Vec<(u32, u32)> = Vec::new();
        for disk in disks {
            let Some(device) = backing_device(disk)? else {
                out.push(BlockIoOutcome::NotLimited {
                    disk: disk.clone(),
                    reason: "its file system has no block device (tmpfs, overlayfs, NFS...)".into(),
                });
                continue;
            };
            let (major, minor) = whole_disk(device, sys_root);
            if !done.contains(&(major, minor)) {
                self.make_dirs_for(&dir)?;
                write_limit(&handle, &dir, (major, minor), limit)?;
                done.push((major, minor));
            }
            out.push(BlockIoOutcome::Limited {
                disk: disk.clone(),
                device: format!("{major}:{minor}"),
            });
        }
        Ok(out)
    }

    /// Whether the v2 hierarchy offers the io controller.
    fn v2_has_io(&self, root: &Path) -> bool {
        fs::read_to_string(root.join("cgroup.controllers"))
            .is_ok_and(|t| t.split_whitespace().any(|c| c == "io"))
    }

    /// Creates `dir` (a tenant cgroup in one hierarchy) and its parents, enabling the v2
    /// controllers down the path as [`Cgroups::create`] does.
    fn make_dirs_for(&self, dir: &Path) -> Result<(), JailError> {
        match self.layout() {
            CgroupLayout::V2 { root } => {
                let mut at = root.clone();
                super::cgroup::enable_v2_controllers(&at)?;
                for part in self.subtree().components() {
                    at.push(part);
                    mkdir(&at)?;
                    super::cgroup::enable_v2_controllers(&at)?;
                }
                mkdir(dir)
            }
            CgroupLayout::V1 { .. } => {
                let mut missing = Vec::new();
                let mut at = dir.to_path_buf();
                while !at.exists() {
                    missing.push(at.clone());
                    if !at.pop() {
                        break;
                    }
                }
                for d in missing.iter().rev() {
                    mkdir(d)?;
                }
                Ok(())
            }
        }
    }
}

fn write_limit(
    handle: &CgroupHandle,
    dir: &Path,
    (major, minor): (u32, u32),
    limit: BlockIoLimit,
) -> Result<(), JailError> {
    let dev = format!("{major}:{minor}");
    match handle {
        CgroupHandle::V1 { .. } => {
            for (file, value) in [
                ("blkio.throttle.read_bps_device", limit.bytes_per_s),
                ("blkio.throttle.write_bps_device", limit.bytes_per_s),
                ("blkio.throttle.read_iops_device", limit.ops_per_s),
                ("blkio.throttle.write_iops_device", limit.ops_per_s),
            ] {
                write_file(&dir.join(file), &format!("{dev} {value}"))?;
            }
            Ok(())
        }
        CgroupHandle::V2 { .. } => write_file(
            &dir.join("io.max"),
            &format!(
                "{dev} rbps={b} wbps={b} riops={o} wiops={o}",
                b = limit.bytes_per_s,
                o = limit.ops_per_s
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: BlockIoLimit = BlockIoLimit {
        bytes_per_s: 7 << 20,
        ops_per_s: 300,
    };

    /// A fake sysfs tree: `dev/block/8:1` a partition of the disk `8:0`.
    fn fake_sys() -> tempfile::TempDir {
        let sys = tempfile::tempdir().unwrap();
        let disk = sys.path().join("devices/pci0/block/sda");
        let part = disk.join("sda1");
        fs::create_dir_all(&part).unwrap();
        fs::write(disk.join("dev"), "8:0\n").unwrap();
        fs::write(part.join("dev"), "8:1\n").unwrap();
        fs::write(part.join("partition"), "1\n").unwrap();
        fs::create_dir_all(sys.path().join("dev/block")).unwrap();
        std::os::unix::fs::symlink(&part, sys.path().join("dev/block/8:1")).unwrap();
        std::os::unix::fs::symlink(&disk, sys.path().join("dev/block/8:0")).unwrap();
        sys
    }

    #[test]
    fn a_partition_maps_to_its_whole_disk() {
        let sys = fake_sys();
        assert_eq!(whole_disk((8, 1), sys.path()), (8, 0));
        assert_eq!(whole_disk((8, 0), sys.path()), (8, 0));
        assert_eq!(whole_disk((254, 0), sys.path()), (254, 0));
    }

    #[test]
    fn a_file_on_a_memory_file_system_has_no_block_device() {
        // /dev/shm is a tmpfs on Linux: major 0.
        if let Ok(f) = tempfile::NamedTempFile::new_in("/dev/shm") {
            assert_eq!(backing_device(f.path()).unwrap(), None);
        }
    }

    fn fake_v1_with_blkio() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (ctl, file) in [
            ("memory", "memory.limit_in_bytes"),
            ("cpu", "cpu.cfs_quota_us"),
            ("pids", "pids.max"),
            ("blkio", "blkio.throttle.read_bps_device"),
        ] {
            fs::create_dir(dir.path().join(ctl)).unwrap();
            fs::write(dir.path().join(ctl).join(file), "").unwrap();
        }
        dir
    }

    #[test]
    fn v1_throttles_the_whole_disk_under_each_disk_once() {
        let tree = fake_v1_with_blkio();
        let state = tempfile::tempdir().unwrap();
        let cgroups = Cgroups::detect_at(tree.path())
            .unwrap()
            .for_state_dir(state.path())
            .unwrap();
        // Two disk images on the same (real) file system: one throttle.
        let disks = [state.path().join("a.img"), state.path().join("b.img")];
        for d in &disks {
            fs::write(d, b"").unwrap();
        }
        let Some(dev) = backing_device(&disks[0]).unwrap() else {
            tenantvm_skip::skip!("the temp dir has no block device");
        };
        let sys = fake_sys();
        let out = cgroups
            .limit_block_io_in("alpha", &disks, LIMIT, sys.path())
            .unwrap();
        let want = whole_disk(dev, sys.path());
        let device = format!("{}:{}", want.0, want.1);
        assert!(out
            .iter()
            .all(|o| matches!(o, BlockIoOutcome::Limited { device: d, .. } if *d == device)));
        let CgroupHandle::V1 {
            blkio: Some(dir), ..
        } = cgroups.handle("alpha").unwrap()
        else {
            panic!("no blkio cgroup")
        };
        assert!(dir.ends_with(cgroups.subtree().join("alpha")));
        for (file, value) in [
            ("blkio.throttle.read_bps_device", "7340032"),
            ("blkio.throttle.write_bps_device", "7340032"),
            ("blkio.throttle.read_iops_device", "300"),
            ("blkio.throttle.write_iops_device", "300"),
        ] {
            assert_eq!(
                fs::read_to_string(dir.join(file)).unwrap(),
                format!("{device} {value}")
            );
        }
    }

    #[test]
    fn v2_writes_io_max_and_hosts_without_the_controller_say_so() {
        let tree = tempfile::tempdir().unwrap();
        fs::write(
            tree.path().join("cgroup.controllers"),
            "cpu io memory pids\n",
        )
        .unwrap();
        fs::write(tree.path().join("cgroup.subtree_control"), "").unwrap();
        let state = tempfile::tempdir().unwrap();
        let cgroups = Cgroups::detect_at(tree.path())
            .unwrap()
            .for_state_dir(state.path())
            .unwrap();
        // What the kernel gives each new directory on the way down.
        let mut at = tree.path().to_path_buf();
        for part in cgroups.subtree().components() {
            at.push(part);
            fs::create_dir_all(&at).unwrap();
            fs::write(at.join("cgroup.subtree_control"), "").unwrap();
        }
        let disk = state.path().join("d.img");
        fs::write(&disk, b"").unwrap();
        if backing_device(&disk).unwrap().is_none() {
            tenantvm_skip::skip!("no block device under the temp dir");
        }
        let out = cgroups
            .limit_block_io_in(
                "beta",
                std::slice::from_ref(&disk),
                LIMIT,
                Path::new("/nonexistent"),
            )
            .unwrap();
        let BlockIoOutcome::Limited { device, .. } = &out[0] else {
            panic!("{out:?}")
        };
        let CgroupHandle::V2 { path } = cgroups.handle("beta").unwrap() else {
            panic!()
        };
        assert_eq!(
            fs::read_to_string(path.join("io.max")).unwrap(),
            format!("{device} rbps=7340032 wbps=7340032 riops=300 wiops=300")
        );
        assert!(
            fs::read_to_string(tree.path().join("cgroup.subtree_control"))
                .unwrap()
                .contains("+io")
        );
        // Without the io controller: nothing written, and the outcome says why.
        fs::write(tree.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        let out = cgroups
            .limit_block_io_in("gamma", &[disk], LIMIT, Path::new("/nonexistent"))
            .unwrap();
        assert!(
            matches!(&out[0], BlockIoOutcome::NotLimited { reason, .. } if reason.contains("io controller")),
            "{out:?}"
        );
    }
}
