//! The tenant directory made ready for a launch (the spec checked, `run/` and the logs
//! created, the cgroup made with the limits) and the jail plan every VMM needs.

use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tenantvm_vmm_api::{
    BlockConfig, RateLimitConfig, MAX_GUEST_CID, MAX_PASSTHROUGH_DEVICES, MIN_GUEST_CID,
};

use super::{RuntimeConfig, JAIL_SERIAL_LOG, JAIL_VM_DIR, RUN_DIR, STOPPED_BY_FILE};
use crate::backend::control::MAX_SOCKET_PATH;
use crate::backend::vfio_nodes::{self, VfioInterface};
use crate::backend::{BackendError, JailConfig, VmSpec};
use crate::jail::{CgroupHandle, JailPlan, JailRlimits};
use crate::logs::{LogKind, LogPolicy, TenantLogs};

/// Open files a VMM may hold (vCPU fds, eventfds, disks, sockets).
const VMM_NOFILE: u64 = 4096;
/// What RLIMIT_MEMLOCK allows beyond guest RAM for a VM with passthrough devices: VFIO pins
/// all guest RAM for DMA, plus the VMM's own small pinned buffers.
pub const MEMLOCK_MARGIN_BYTES: u64 = 64 << 20;

/// The tenant directory, made ready for a launch.
pub struct Prepared {
    /// `<tenant dir>/run`, owned by the tenant uid, empty.
    pub run_dir: PathBuf,
    /// serial.log, writable by the tenant uid.
    pub serial_log: PathBuf,
    /// vmm.log, open for appending (the launcher's stdout and stderr).
    pub vmm_log: fs::File,
    /// The tenant's cgroup, created with the limits.
    pub cgroup: CgroupHandle,
}

fn invalid(message: String) -> BackendError {
    BackendError::InvalidSpec(message)
}

/// Checks the spec, creates `run/` (owned by the tenant uid) and the log files (serial.log
/// writable by the tenant uid), and creates the cgroup with the limits.
pub(super) fn prepare(
    spec: &VmSpec,
    jail: &JailConfig,
    cfg: &RuntimeConfig,
) -> Result<Prepared, BackendError> {
    crate::jail::validate_tenant_name(&spec.tenant)?;
    if spec.vcpus == 0 || spec.vcpus > 256 {
        return Err(invalid(format!("{} vCPUs: give 1 to 256", spec.vcpus)));
    }
    if spec.memory_mib == 0 {
        return Err(invalid("0 MiB of guest memory: give at least 1".into()));
    }
    if spec.cmdline.contains('\0') || spec.cmdline.len() > 4096 {
        return Err(invalid(
            "the kernel command line must be under 4096 bytes without NUL bytes".into(),
        ));
    }
    if jail.uid == 0 || jail.gid == 0 {
        return Err(invalid("uid/gid 0: a jailed VMM never runs as root".into()));
    }
    check_devices(spec)?;
    if let Some(cid) = spec.vsock_cid {
        if !(MIN_GUEST_CID..=MAX_GUEST_CID).contains(&cid) {
            return Err(invalid(format!(
                "vsock CID {cid}: give {MIN_GUEST_CID} to {MAX_GUEST_CID} (0-2 are reserved)"
            )));
        }
    }
    let mut files = vec![("kernel", &spec.kernel)];
    if let Some(initramfs) = &spec.initramfs {
        files.push(("initramfs", initramfs));
    }
    for disk in &spec.disks {
        files.push(("disk", &disk.path));
    }
    for (what, path) in files {
        if !path.is_absolute() || !path.exists() {
            return Err(invalid(format!(
                "{what} {} does not exist (give an absolute host path)",
                path.display()
            )));
        }
    }
    let dir = &spec.tenant_dir;
    let meta = fs::symlink_metadata(dir).map_err(|source| BackendError::Io {
        path: dir.clone(),
        source,
    })?;
    if !meta.is_dir()
        || !dir.is_absolute()
        || dir.file_name().and_then(|n| n.to_str()) != Some(spec.tenant.as_str())
    {
        return Err(invalid(format!(
            "tenant dir {} must be an absolute directory (not a symlink) named after the tenant {:?}",
            dir.display(),
            spec.tenant
        )));
    }
    // One VM per tenant: kill and stop act on the whole cgroup, so a second VM in it would
    // share the first one's fate. Checked before anything (sockets, limits) is touched.
    let members = cfg.cgroups.handle(&spec.tenant)?.members()?;
    if !members.is_empty() {
        return Err(BackendError::AlreadyRunning {
            tenant: spec.tenant.clone(),
            pids: members,
        });
    }
    let parent = dir.parent().unwrap_or(Path::new("/"));
    let logs = TenantLogs::open(parent, &spec.tenant, LogPolicy::default())
        .map_err(|e| invalid(e.to_string()))?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BackendError::Io { path, source }
    };
    // A new run: no earlier stop explains its exit.
    match fs::remove_file(dir.join(STOPPED_BY_FILE)) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(source) => {
            return Err(BackendError::Io {
                path: dir.join(STOPPED_BY_FILE),
                source,
            })
        }
    }
    let run_dir = dir.join(RUN_DIR);
    match fs::DirBuilder::new().mode(0o700).create(&run_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(BackendError::Io {
                path: run_dir,
                source,
            })
        }
    }
    // Stale sockets from a previous run would make the VMM refuse to start.
    for entry in fs::read_dir(&run_dir).map_err(io(&run_dir))? {
        let entry = entry.map_err(io(&run_dir))?;
        fs::remove_file(entry.path()).map_err(io(&entry.path()))?;
    }
    std::os::unix::fs::lchown(&run_dir, Some(jail.uid), Some(jail.gid)).map_err(io(&run_dir))?;
    fs::set_permissions(&run_dir, fs::Permissions::from_mode(0o700)).map_err(io(&run_dir))?;
    let serial_log = logs.path(LogKind::Serial);
    std::os::unix::fs::lchown(&serial_log, Some(jail.uid), Some(jail.gid))
        .map_err(io(&serial_log))?;
    let vmm_log = logs
        .open_append(LogKind::Vmm)
        .map_err(|e| invalid(e.to_string()))?;
    let cgroup = cfg.cgroups.create(&spec.tenant, &jail.limits)?;
    Ok(Prepared {
        run_dir,
        serial_log,
        vmm_log,
        cgroup,
    })
}

/// Checks the passthrough devices: at most [`MAX_PASSTHROUGH_DEVICES`], each well formed,
/// none twice.
pub fn check_devices(spec: &VmSpec) -> Result<(), BackendError> {
    if spec.devices.len() > MAX_PASSTHROUGH_DEVICES {
        return Err(invalid(format!(
            "{} passthrough devices: a VM takes at most {MAX_PASSTHROUGH_DEVICES}",
            spec.devices.len()
        )));
    }
    for (i, device) in spec.devices.iter().enumerate() {
        device.validate()?;
        if spec.devices[..i].contains(device) {
            return Err(invalid(format!(
                "passthrough device {} is given twice",
                device.sysfs_path().display()
            )));
        }
    }
    Ok(())
}

/// The host path of a socket in `run/`, checked against the sockaddr_un limit.
pub(super) fn socket_path(spec: &VmSpec, name: &str) -> Result<PathBuf, BackendError> {
    let path = spec.tenant_dir.join(RUN_DIR).join(name);
    if path.as_os_str().len() > MAX_SOCKET_PATH {
        return Err(invalid(format!(
            "socket path {} is longer than {MAX_SOCKET_PATH} bytes; use a shorter tenants directory",
            path.display()
        )));
    }
    Ok(path)
}

/// The disks of `spec` as the VMM sees them in the jail: `/vm/disk0`, `/vm/disk1`, ... (where
/// [`base_plan`] mounts them), in order, each with its index as id and its quota as a rate
/// limit.
pub fn jail_disks(spec: &VmSpec) -> Vec<BlockConfig> {
    spec.disks
        .iter()
        .enumerate()
        .map(|(i, disk)| BlockConfig {
            path: Path::new(JAIL_VM_DIR).join(format!("disk{i}")),
            read_only: disk.read_only,
            id: Some(format!("disk{i}")),
            rate_limit: disk.limit.map(|limit| RateLimitConfig {
                bytes_per_sec: Some(limit.bytes_per_s),
                ops_per_sec: Some(limit.ops_per_s),
                ..Default::default()
            }),
        })
        .collect()
}

/// The jail plan every VMM needs: the program with its libraries, the guest files under
/// /vm, /dev/null and /dev/urandom, the socket directory at /run, serial.log at
/// /log/serial.log, and the passed-through devices' sysfs directories and VFIO nodes for
/// `vfio` ([`vfio_nodes`]).
pub fn base_plan(
    spec: &VmSpec,
    jail: &JailConfig,
    prepared: &Prepared,
    program: &Path,
    args: Vec<String>,
    vfio: VfioInterface,
) -> Result<JailPlan, BackendError> {
    let rlimits = JailRlimits {
        nofile: VMM_NOFILE,
        nproc: jail.limits.pids_max,
        memlock_bytes: memlock_bytes(spec, jail),
        core_bytes: 0,
    };
    let mut plan = JailPlan::new(
        &spec.tenant,
        jail.uid,
        jail.gid,
        prepared.cgroup.clone(),
        &spec.tenant_dir,
        program,
        args,
        rlimits,
    )?;
    if spec.hugepages.is_some() {
        // Guest RAM on huge pages is a hugetlb memfd the VMM (or QEMU) sizes to the whole
        // RAM, and ftruncate obeys RLIMIT_FSIZE: without this a tenant whose RAM is larger
        // than its largest disk fails at launch with EFBIG.
        plan.allow_file_size(u64::from(spec.memory_mib) << 20);
    }
    let vm = Path::new(JAIL_VM_DIR);
    plan.bind(&spec.kernel, &vm.join("kernel"), false)?;
    if let Some(initramfs) = &spec.initramfs {
        plan.bind(initramfs, &vm.join("initramfs"), false)?;
    }
    for (i, disk) in spec.disks.iter().enumerate() {
        plan.bind(&disk.path, &vm.join(format!("disk{i}")), !disk.read_only)?;
    }
    plan.device(Path::new("/dev/null"))?;
    plan.device(Path::new("/dev/urandom"))?;
    plan.bind(&prepared.run_dir, Path::new("/run"), true)?;
    plan.bind(&prepared.serial_log, Path::new(JAIL_SERIAL_LOG), true)?;
    for node in vfio_nodes::nodes(spec, vfio, Path::new("/")) {
        plan.device(&node).map_err(|e| {
            invalid(format!(
                "{}: {e}; is the device bound to vfio-pci (or its vGPU type set) and the vfio modules loaded? `tenantvm host check` says",
                node.display()
            ))
        })?;
    }
    for device in &spec.devices {
        // The VMM finds the device (its IOMMU group, its vfio-dev) through its sysfs
        // directory: read-only, at the path the VMM's config names; and its IOMMU group's
        // directory where the device's relative `iommu_group` link leads from there (the VMM
        // lists the group's members).
        let path = device.sysfs_path();
        plan.bind(&path, &path, false)?;
        if let Some((group, target)) = group_mount(&path, &path) {
            plan.bind(&group, &target, false)?;
        }
    }
    Ok(plan)
}

/// Where the `iommu_group` link of the device directory `host_dir` leads when that
/// directory is mounted at `jail_dir`: (the group's host directory, its path in the jail).
/// sysfs links are relative and a device's canonical directory sits deeper or shallower
/// than `/sys/bus/pci/devices/<address>`, so the group is mounted where the link resolves
/// from the jail path. None when the link is missing or leads nowhere usable.
pub fn group_mount(host_dir: &Path, jail_dir: &Path) -> Option<(PathBuf, PathBuf)> {
    let link = host_dir.join("iommu_group");
    let rel = fs::read_link(&link).ok()?;
    let host_group = link.canonicalize().ok()?;
    let mut target = jail_dir.to_path_buf();
    for part in rel.components() {
        match part {
            std::path::Component::ParentDir => {
                if !target.pop() {
                    return None;
                }
            }
            std::path::Component::Normal(name) => target.push(name),
            std::path::Component::CurDir => {}
            // An absolute link: the group is mounted at that path.
            std::path::Component::RootDir | std::path::Component::Prefix(_) => {
                target = PathBuf::from("/");
            }
        }
    }
    (target != Path::new("/")).then_some((host_group, target))
}

/// RLIMIT_MEMLOCK of the VMM: with passthrough devices, guest RAM plus
/// [`MEMLOCK_MARGIN_BYTES`] (VFIO pins all of guest RAM), never below the cgroup memory
/// limit it had before devices existed; without devices, the cgroup memory limit.
pub fn memlock_bytes(spec: &VmSpec, jail: &JailConfig) -> u64 {
    if spec.devices.is_empty() {
        return jail.limits.memory_bytes;
    }
    (u64::from(spec.memory_mib) << 20)
        .saturating_add(MEMLOCK_MARGIN_BYTES)
        .max(jail.limits.memory_bytes)
}
