//! A cgroup per tenant, on cgroup v2 or v1 (detected at run time), in a subtree of its
//! own per daemon: `tenantvm/<daemon id>/<tenant>`, where the daemon id is the first 12 hex
//! digits of the SHA-256 of the daemon's canonical state directory ([`daemon_subtree`]).
//! Two daemons on one host (or a test run beside a daemon) never share a tenant's cgroup,
//! and each lists and removes only its own.
//!
//! v2: `<root>/tenantvm/<id>/<tenant>/{memory.max, memory.swap.max, cpu.max, pids.max}`.
//! v1: `<root>/{memory,cpu,pids}/tenantvm/<id>/<tenant>/` with `memory.limit_in_bytes` (and
//! `memory.memsw.limit_in_bytes` where swap is accounted), `cpu.cfs_period_us` +
//! `cpu.cfs_quota_us`, and `pids.max`.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{validate_tenant_name, JailError};

/// Quotas applied to the tenant's cgroup (every process of the VM together).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceLimits {
    /// Memory limit in bytes (guest memory + VMM overhead); swap is capped to the same
    /// total where the host accounts it.
    pub memory_bytes: u64,
    /// CPU time allowed per period, in microseconds (e.g. vCPUs x period).
    pub cpu_quota_us: u64,
    /// CPU accounting period in microseconds (1,000..=1,000,000).
    pub cpu_period_us: u64,
    /// Maximum number of processes and threads.
    pub pids_max: u64,
}

/// The default cgroup filesystem root.
pub const DEFAULT_CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The parent cgroup every daemon's subtree lives under.
pub const PARENT: &str = "tenantvm";
/// Hex digits of the state directory's hash that name a daemon's subtree.
const DAEMON_ID_HEX: usize = 12;
/// How long cleanup waits for a cgroup to empty after SIGKILL before giving up.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the cgroup controllers are mounted on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "version")]
pub enum CgroupLayout {
    /// cgroup v1: one hierarchy per controller.
    V1 {
        /// The memory controller's mount.
        memory: PathBuf,
        /// The cpu controller's mount.
        cpu: PathBuf,
        /// The pids controller's mount.
        pids: PathBuf,
        /// The blkio controller's mount, where there is one (block I/O limits,
        /// [`crate::blkio`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        blkio: Option<PathBuf>,
        /// The devices controller's mount, where there is one (the device allowance,
        /// [`crate::devices`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        devices: Option<PathBuf>,
        /// The cpuacct controller's mount where it is a hierarchy apart from cpu's (some
        /// hosts mount `cpu` and `cpuacct` separately); none where cpu's carries it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cpuacct: Option<PathBuf>,
    },
    /// cgroup v2: the unified hierarchy.
    V2 {
        /// Its mount.
        root: PathBuf,
    },
}

/// One tenant's cgroup(s): stored with the running VM so cleanup finds them after a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "version", deny_unknown_fields)]
pub enum CgroupHandle {
    /// cgroup v1: one directory per controller.
    V1 {
        /// Directory in the memory hierarchy.
        memory: PathBuf,
        /// Directory in the cpu hierarchy.
        cpu: PathBuf,
        /// Directory in the pids hierarchy.
        pids: PathBuf,
        /// Directory in the blkio hierarchy, where the host mounts one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        blkio: Option<PathBuf>,
        /// Directory in the devices hierarchy, where the host mounts one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        devices: Option<PathBuf>,
        /// Directory in the cpuacct hierarchy, where it is apart from cpu's (the VM's CPU
        /// time is read there, `cpuacct.usage`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cpuacct: Option<PathBuf>,
    },
    /// cgroup v2: one directory.
    V2 {
        /// The directory.
        path: PathBuf,
    },
}

/// The host's cgroup hierarchy, as used for one daemon's tenants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroups {
    layout: CgroupLayout,
    /// Where tenant cgroups go, relative to each hierarchy's root: `tenantvm/<daemon id>`
    /// for a daemon ([`Cgroups::for_state_dir`]), `tenantvm` for tools without one.
    subtree: PathBuf,
}

/// The subtree of the daemon whose state directory is `state_dir` (which must exist):
/// `tenantvm/<first 12 hex digits of SHA-256 of its canonical path>`.
pub fn daemon_subtree(state_dir: &Path) -> Result<PathBuf, JailError> {
    use sha2::{Digest, Sha256};
    let canonical = state_dir.canonicalize().map_err(|source| JailError::Io {
        path: state_dir.to_path_buf(),
        source,
    })?;
    let digest = hex::encode(Sha256::digest(canonical.as_os_str().as_encoded_bytes()));
    Ok(Path::new(PARENT).join(&digest[..DAEMON_ID_HEX]))
}

impl Cgroups {
    /// Detects the layout under /sys/fs/cgroup.
    pub fn detect() -> Result<Self, JailError> {
        Self::detect_at(Path::new(DEFAULT_CGROUP_ROOT))
    }

    /// Detects the layout under `root`: v2 when `root/cgroup.controllers` exists and offers
    /// memory, cpu and pids; otherwise v1 when `root/{memory,cpu,pids}` are hierarchies.
    pub fn detect_at(root: &Path) -> Result<Self, JailError> {
        let controllers = root.join("cgroup.controllers");
        if controllers.exists() {
            let text = read_trimmed(&controllers)?;
            let have: Vec<&str> = text.split_whitespace().collect();
            for needed in ["memory", "cpu", "pids"] {
                if !have.contains(&needed) {
                    return Err(JailError::CgroupUnavailable(format!(
                        "the cgroup v2 hierarchy at {} lacks the {needed} controller; enable it in the parent's cgroup.subtree_control",
                        root.display()
                    )));
                }
            }
            return Ok(Self {
                layout: CgroupLayout::V2 {
                    root: root.to_path_buf(),
                },
                subtree: PathBuf::from(PARENT),
            });
        }
        let memory = root.join("memory");
        let cpu = root.join("cpu");
        let pids = root.join("pids");
        // The root of a v1 pids hierarchy has no pids.* files: accept a cgroup mount there.
        for (dir, file) in [
            (&memory, "memory.limit_in_bytes"),
            (&cpu, "cpu.cfs_quota_us"),
            (&pids, "pids.max"),
        ] {
            if !dir.join(file).exists() && !is_cgroup_v1_mount(dir) {
                return Err(JailError::CgroupUnavailable(format!(
                    "neither cgroup v2 ({}) nor a cgroup v1 hierarchy with {file} at {} is mounted; mount the memory, cpu and pids controllers",
                    controllers.display(),
                    dir.display()
                )));
            }
        }
        let blkio = root.join("blkio");
        let blkio = (is_blkio_hierarchy(&blkio) || is_cgroup_v1_mount(&blkio)).then_some(blkio);
        let devices = root.join("devices");
        let devices = (devices.join("devices.allow").exists() || is_cgroup_v1_mount(&devices))
            .then_some(devices);
        // cpuacct mounted apart from cpu: the CPU time is only there.
        let cpuacct = root.join("cpuacct");
        let cpuacct = (!cpu.join("cpuacct.usage").exists()
            && cpuacct.join("cpuacct.usage").exists())
        .then_some(cpuacct);
        Ok(Self {
            layout: CgroupLayout::V1 {
                memory,
                cpu,
                pids,
                blkio,
                devices,
                cpuacct,
            },
            subtree: PathBuf::from(PARENT),
        })
    }

    /// Uses `layout` as given (no detection), with tenant cgroups directly under `tenantvm`.
    pub fn with_layout(layout: CgroupLayout) -> Self {
        Self {
            layout,
            subtree: PathBuf::from(PARENT),
        }
    }

    /// The same hierarchy, scoped to the daemon whose state directory is `state_dir`: its
    /// tenants' cgroups live in [`daemon_subtree`], and [`Cgroups::list_tenants`] sees only
    /// those. Every daemon uses this; the unscoped `tenantvm/<tenant>` is for tools and tests
    /// that run VMs without a daemon.
    pub fn for_state_dir(self, state_dir: &Path) -> Result<Self, JailError> {
        Ok(Self {
            subtree: daemon_subtree(state_dir)?,
            ..self
        })
    }

    /// Where this daemon's tenant cgroups live, relative to each hierarchy's root.
    pub fn subtree(&self) -> &Path {
        &self.subtree
    }

    /// The layout in use.
    pub fn layout(&self) -> &CgroupLayout {
        &self.layout
    }

    /// The handle a tenant's cgroup has (whether or not it exists).
    pub fn handle(&self, tenant: &str) -> Result<CgroupHandle, JailError> {
        validate_tenant_name(tenant)?;
        let sub = &self.subtree;
        Ok(match &self.layout {
            CgroupLayout::V1 {
                memory,
                cpu,
                pids,
                blkio,
                devices,
                cpuacct,
            } => CgroupHandle::V1 {
                memory: memory.join(sub).join(tenant),
                cpu: cpu.join(sub).join(tenant),
                pids: pids.join(sub).join(tenant),
                blkio: blkio.as_ref().map(|b| b.join(sub).join(tenant)),
                devices: devices.as_ref().map(|d| d.join(sub).join(tenant)),
                cpuacct: cpuacct.as_ref().map(|c| c.join(sub).join(tenant)),
            },
            CgroupLayout::V2 { root } => CgroupHandle::V2 {
                path: root.join(sub).join(tenant),
            },
        })
    }

    /// Creates (or reuses) the tenant's cgroup and writes `limits` into it.
    pub fn create(&self, tenant: &str, limits: &ResourceLimits) -> Result<CgroupHandle, JailError> {
        validate_limits(limits)?;
        let handle = self.handle(tenant)?;
        match &self.layout {
            CgroupLayout::V2 { root } => {
                // Controllers are enabled down the path: v2 hands a controller to a child
                // only when its parent's subtree_control lists it.
                let mut dir = root.clone();
                enable_v2_controllers(&dir)?;
                for part in self.subtree.components() {
                    dir.push(part);
                    mkdir(&dir)?;
                    enable_v2_controllers(&dir)?;
                }
            }
            CgroupLayout::V1 {
                memory,
                cpu,
                pids,
                blkio,
                devices,
                cpuacct,
            } => {
                for dir in [
                    Some(memory),
                    Some(cpu),
                    Some(pids),
                    blkio.as_ref(),
                    devices.as_ref(),
                    cpuacct.as_ref(),
                ]
                .into_iter()
                .flatten()
                {
                    let mut dir = dir.clone();
                    for part in self.subtree.components() {
                        dir.push(part);
                        mkdir(&dir)?;
                    }
                }
            }
        }
        for dir in handle.dirs() {
            mkdir(dir)?;
        }
        handle.apply(limits)?;
        Ok(handle)
    }

    /// This daemon's subtree in each hierarchy.
    fn subtree_dirs(&self) -> Vec<PathBuf> {
        let sub = &self.subtree;
        match &self.layout {
            CgroupLayout::V1 {
                memory,
                cpu,
                pids,
                blkio,
                devices,
                cpuacct,
            } => [
                Some(memory),
                Some(cpu),
                Some(pids),
                blkio.as_ref(),
                devices.as_ref(),
                cpuacct.as_ref(),
            ]
            .into_iter()
            .flatten()
            .map(|d| d.join(sub))
            .collect(),
            CgroupLayout::V2 { root } => vec![root.join(sub)],
        }
    }

    /// Removes this daemon's subtree from each hierarchy where it holds no tenant's cgroup
    /// (rmdir of a cgroup fails while it has children, so one in use stays), for a daemon
    /// that stops: nothing of it is left on the host. The shared `tenantvm` parent stays
    /// (another daemon may be making its subtree in it). Returns the directories removed.
    pub fn remove_subtree_if_empty(&self) -> Vec<PathBuf> {
        if self.subtree == Path::new(PARENT) {
            // The unscoped tree of tools and tests: shared, never removed here.
            return Vec::new();
        }
        self.subtree_dirs()
            .into_iter()
            .filter(|dir| fs::remove_dir(dir).is_ok())
            .collect()
    }

    /// Names of the tenants that have a cgroup in this daemon's subtree (in any hierarchy),
    /// sorted: for reconcile. Other daemons' subtrees are never listed.
    pub fn list_tenants(&self) -> Result<Vec<String>, JailError> {
        let mut names = Vec::new();
        for parent in self.subtree_dirs() {
            let entries = match fs::read_dir(&parent) {
                Ok(entries) => entries,
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(JailError::Io {
                        path: parent,
                        source,
                    })
                }
            };
            for entry in entries {
                let entry = entry.map_err(|source| JailError::Io {
                    path: parent.clone(),
                    source,
                })?;
                let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
                if let Some(name) = entry.file_name().to_str() {
                    if is_dir
                        && validate_tenant_name(name).is_ok()
                        && !names.iter().any(|n| n == name)
                    {
                        names.push(name.to_string());
                    }
                }
            }
        }
        names.sort();
        Ok(names)
    }
}

impl CgroupHandle {
    /// The directories of this cgroup (one for v2; three or, with blkio, four for v1).
    pub fn dirs(&self) -> Vec<&PathBuf> {
        match self {
            CgroupHandle::V1 {
                memory,
                cpu,
                pids,
                blkio,
                devices,
                cpuacct,
            } => [
                Some(memory),
                Some(cpu),
                Some(pids),
                blkio.as_ref(),
                devices.as_ref(),
                cpuacct.as_ref(),
            ]
            .into_iter()
            .flatten()
            .collect(),
            CgroupHandle::V2 { path } => vec![path],
        }
    }

    /// Writes `limits` into the cgroup's control files.
    pub fn apply(&self, limits: &ResourceLimits) -> Result<(), JailError> {
        validate_limits(limits)?;
        match self {
            CgroupHandle::V2 { path } => {
                write_file(&path.join("memory.max"), &limits.memory_bytes.to_string())?;
                let swap = path.join("memory.swap.max");
                if swap.exists() {
                    write_file(&swap, "0")?;
                }
                write_file(
                    &path.join("cpu.max"),
                    &format!("{} {}", limits.cpu_quota_us, limits.cpu_period_us),
                )?;
                write_file(&path.join("pids.max"), &limits.pids_max.to_string())?;
            }
            CgroupHandle::V1 {
                memory, cpu, pids, ..
            } => {
                let bytes = limits.memory_bytes.to_string();
                let limit = memory.join("memory.limit_in_bytes");
                let memsw = memory.join("memory.memsw.limit_in_bytes");
                if memsw.exists() {
                    // memsw must stay >= limit_in_bytes: raise memsw first when growing,
                    // lower limit_in_bytes first when shrinking.
                    if write_file(&memsw, &bytes).is_err() {
                        write_file(&limit, &bytes)?;
                        write_file(&memsw, &bytes)?;
                    } else {
                        write_file(&limit, &bytes)?;
                    }
                } else {
                    write_file(&limit, &bytes)?;
                }
                write_file(
                    &cpu.join("cpu.cfs_period_us"),
                    &limits.cpu_period_us.to_string(),
                )?;
                write_file(
                    &cpu.join("cpu.cfs_quota_us"),
                    &limits.cpu_quota_us.to_string(),
                )?;
                write_file(&pids.join("pids.max"), &limits.pids_max.to_string())?;
            }
        }
        Ok(())
    }

    /// Reads the limits back from the control files.
    pub fn read_limits(&self) -> Result<ResourceLimits, JailError> {
        match self {
            CgroupHandle::V2 { path } => {
                let cpu = read_trimmed(&path.join("cpu.max"))?;
                let mut parts = cpu.split_whitespace();
                let quota = parts.next().unwrap_or("max");
                let period = parts.next().unwrap_or("100000");
                Ok(ResourceLimits {
                    memory_bytes: parse_limit(
                        &path.join("memory.max"),
                        &read_trimmed(&path.join("memory.max"))?,
                    )?,
                    cpu_quota_us: parse_limit(&path.join("cpu.max"), quota)?,
                    cpu_period_us: parse_limit(&path.join("cpu.max"), period)?,
                    pids_max: parse_limit(
                        &path.join("pids.max"),
                        &read_trimmed(&path.join("pids.max"))?,
                    )?,
                })
            }
            CgroupHandle::V1 {
                memory, cpu, pids, ..
            } => {
                let read = |p: PathBuf| -> Result<u64, JailError> {
                    let text = read_trimmed(&p)?;
                    parse_limit(&p, &text)
                };
                Ok(ResourceLimits {
                    memory_bytes: read(memory.join("memory.limit_in_bytes"))?,
                    cpu_quota_us: read(cpu.join("cpu.cfs_quota_us"))?,
                    cpu_period_us: read(cpu.join("cpu.cfs_period_us"))?,
                    pids_max: read(pids.join("pids.max"))?,
                })
            }
        }
    }

    /// Moves process `pid` (and its future children) into the cgroup.
    pub fn add_process(&self, pid: u32) -> Result<(), JailError> {
        for dir in self.dirs() {
            write_file(&dir.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// The pids of the processes in the cgroup (union over the hierarchies); empty when
    /// the cgroup does not exist.
    pub fn members(&self) -> Result<Vec<i32>, JailError> {
        let mut pids = Vec::new();
        for dir in self.dirs() {
            let file = dir.join("cgroup.procs");
            let text = match fs::read_to_string(&file) {
                Ok(text) => text,
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(source) => return Err(JailError::Io { path: file, source }),
            };
            for line in text.lines() {
                if let Ok(pid) = line.trim().parse::<i32>() {
                    if pid > 0 && !pids.contains(&pid) {
                        pids.push(pid);
                    }
                }
            }
        }
        Ok(pids)
    }

    /// SIGKILLs every process in the cgroup until none is left. `reap` is called after each
    /// round with the pids just signalled, and once more at the end with every pid seen, so
    /// a caller that is the parent of some of them can wait for them. Idempotent.
    pub fn kill_all(&self, mut reap: impl FnMut(&[i32])) -> Result<(), JailError> {
        if let CgroupHandle::V2 { path } = self {
            let kill = path.join("cgroup.kill");
            if kill.exists() {
                // Best effort: the loop below confirms and covers kernels without it.
                let _ = fs::write(&kill, "1");
            }
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        let mut seen: Vec<i32> = Vec::new();
        loop {
            let members = self.members()?;
            if members.is_empty() {
                // Those that left the cgroup by dying may only now be reapable zombies.
                reap(&seen);
                return Ok(());
            }
            seen.extend(
                members
                    .iter()
                    .filter(|p| !seen.contains(p))
                    .copied()
                    .collect::<Vec<_>>(),
            );
            for pid in &members {
                // SAFETY: kill(2) with a positive pid read from cgroup.procs and a valid signal
                // number; it touches no memory of ours.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
            }
            reap(&members);
            if Instant::now() > deadline {
                return Err(JailError::CgroupBusy {
                    path: self.dirs()[0].clone(),
                    pids: members,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kills every member and removes the cgroup directories. Idempotent.
    ///
    /// A process that was being started into the cgroup when the kill began (a launcher
    /// that joins its cgroup itself, after the daemon forked it) can join after the first
    /// sweep: while a directory is busy, its members are killed again.
    pub fn destroy(&self, mut reap: impl FnMut(&[i32])) -> Result<(), JailError> {
        self.kill_all(&mut reap)?;
        for dir in self.dirs() {
            let deadline = Instant::now() + DRAIN_TIMEOUT;
            loop {
                match fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == ErrorKind::NotFound => break,
                    // Exiting tasks can keep a cgroup busy for a moment after SIGKILL, and
                    // a late joiner keeps it busy until it is killed too.
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
                    {
                        self.kill_all(&mut reap)?;
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(source) => {
                        return Err(JailError::Io {
                            path: dir.clone(),
                            source,
                        })
                    }
                }
            }
        }
        Ok(())
    }
}

fn validate_limits(limits: &ResourceLimits) -> Result<(), JailError> {
    if limits.memory_bytes < 4 << 20 {
        return Err(JailError::InvalidLimits(format!(
            "memory limit {} bytes is below the 4 MiB minimum; give guest memory + VMM overhead",
            limits.memory_bytes
        )));
    }
    if !(1_000..=1_000_000).contains(&limits.cpu_period_us) {
        return Err(JailError::InvalidLimits(format!(
            "CPU period {} us is outside 1000..=1000000 us",
            limits.cpu_period_us
        )));
    }
    if limits.cpu_quota_us < 1_000 {
        return Err(JailError::InvalidLimits(format!(
            "CPU quota {} us is below the 1000 us minimum",
            limits.cpu_quota_us
        )));
    }
    if limits.pids_max == 0 {
        return Err(JailError::InvalidLimits(
            "pids limit 0 would stop the VMM from starting".into(),
        ));
    }
    Ok(())
}

/// Enables memory, cpu and pids (and io, where `dir` offers it) for `dir`'s children.
pub(crate) fn enable_v2_controllers(dir: &Path) -> Result<(), JailError> {
    let file = dir.join("cgroup.subtree_control");
    let current = read_trimmed(&file)?;
    let offered = fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
    let io = offered.split_whitespace().any(|c| c == "io");
    let missing: Vec<String> = ["memory", "cpu", "pids"]
        .iter()
        .chain(io.then_some(&"io"))
        .filter(|c| !current.split_whitespace().any(|have| have == **c))
        .map(|c| format!("+{c}"))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    write_file(&file, &missing.join(" "))
}

/// Whether `dir` looks like a cgroup v1 blkio hierarchy (its throttle files exist).
fn is_blkio_hierarchy(dir: &Path) -> bool {
    match fs::metadata(dir.join("blkio.throttle.read_bps_device")) {
        Ok(_) => true,
        Err(e) => e.kind() != ErrorKind::NotFound && dir.is_dir(),
    }
}

/// Whether `dir` is the root of a cgroup v1 hierarchy (statfs type CGROUP_SUPER_MAGIC).
fn is_cgroup_v1_mount(dir: &Path) -> bool {
    const CGROUP_SUPER_MAGIC: libc::c_long = 0x0027_e0eb;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: a zeroed statfs is a valid out-buffer.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: path is NUL-terminated and buf a valid statfs; statfs writes only into buf.
    let r = unsafe { libc::statfs(path.as_ptr(), &mut buf) };
    r == 0 && buf.f_type == CGROUP_SUPER_MAGIC && dir.join("cgroup.procs").exists()
}

fn parse_limit(path: &Path, text: &str) -> Result<u64, JailError> {
    if text == "max" || text == "-1" {
        return Ok(u64::MAX);
    }
    text.parse().map_err(|_| {
        JailError::CgroupUnavailable(format!("unexpected value {text:?} in {}", path.display()))
    })
}

pub(crate) fn mkdir(dir: &Path) -> Result<(), JailError> {
    match fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(JailError::Io {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

pub(crate) fn write_file(path: &Path, value: &str) -> Result<(), JailError> {
    fs::write(path, value).map_err(|source| JailError::CgroupWrite {
        path: path.to_path_buf(),
        value: value.to_string(),
        source,
    })
}

fn read_trimmed(path: &Path) -> Result<String, JailError> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|source| JailError::Io {
            path: path.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: ResourceLimits = ResourceLimits {
        memory_bytes: 256 << 20,
        cpu_quota_us: 200_000,
        cpu_period_us: 100_000,
        pids_max: 64,
    };

    /// A fake cgroup v2 filesystem in a tempdir: plain files where the kernel has control files.
    fn fake_v2_tree() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join("cgroup.controllers"),
            "cpuset cpu io memory hugetlb pids rdma misc\n",
        )
        .unwrap();
        fs::write(dir.path().join("cgroup.subtree_control"), "\n").unwrap();
        // The kernel gives every new cgroup directory its control files; the fake
        // pre-creates the one the code reads from the parent.
        fs::create_dir(dir.path().join(PARENT)).unwrap();
        fs::write(dir.path().join(PARENT).join("cgroup.subtree_control"), "\n").unwrap();
        dir
    }

    /// In a fake v2 tree, what the kernel gives a daemon's new subtree: its control file.
    fn fake_daemon_subtree(root: &Path, cgroups: &Cgroups) {
        if matches!(cgroups.layout(), CgroupLayout::V2 { .. }) {
            let dir = root.join(cgroups.subtree());
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join("cgroup.subtree_control"), "\n").unwrap();
        }
    }

    /// A fake cgroup v1 layout in a tempdir: one directory per controller.
    fn fake_v1_tree() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (ctl, file) in [
            ("memory", "memory.limit_in_bytes"),
            ("cpu", "cpu.cfs_quota_us"),
            ("pids", "pids.max"),
        ] {
            fs::create_dir(dir.path().join(ctl)).unwrap();
            fs::write(dir.path().join(ctl).join(file), "max\n").unwrap();
        }
        dir
    }

    #[test]
    fn detect_prefers_v2_when_unified_hierarchy_has_controllers() {
        let tree = fake_v2_tree();
        let cgroups = Cgroups::detect_at(tree.path()).unwrap();
        assert_eq!(
            cgroups.layout(),
            &CgroupLayout::V2 {
                root: tree.path().to_path_buf()
            }
        );
    }

    #[test]
    fn detect_rejects_v2_without_pids_controller() {
        let tree = fake_v2_tree();
        fs::write(tree.path().join("cgroup.controllers"), "cpu memory\n").unwrap();
        let err = Cgroups::detect_at(tree.path()).unwrap_err();
        assert!(err.to_string().contains("pids"), "{err}");
    }

    #[test]
    fn detect_falls_back_to_v1_controllers() {
        let tree = fake_v1_tree();
        let cgroups = Cgroups::detect_at(tree.path()).unwrap();
        assert!(matches!(cgroups.layout(), CgroupLayout::V1 { .. }));
    }

    #[test]
    fn a_cpuacct_hierarchy_apart_from_cpu_gets_the_tenants_cgroup_too() {
        let tree = fake_v1_tree();
        // Where cpu carries cpuacct (`cpu,cpuacct`), nothing apart.
        fs::write(tree.path().join("cpu/cpuacct.usage"), "0\n").unwrap();
        fs::create_dir(tree.path().join("cpuacct")).unwrap();
        fs::write(tree.path().join("cpuacct/cpuacct.usage"), "0\n").unwrap();
        let together = Cgroups::detect_at(tree.path()).unwrap();
        assert!(
            matches!(together.layout(), CgroupLayout::V1 { cpuacct: None, .. }),
            "{:?}",
            together.layout()
        );
        // Apart (this host's layout): the tenant's cgroup is made there too, and its pid
        // goes there with the others.
        fs::remove_file(tree.path().join("cpu/cpuacct.usage")).unwrap();
        let apart = Cgroups::detect_at(tree.path()).unwrap();
        let handle = apart.create("alpha", &LIMITS).unwrap();
        let CgroupHandle::V1 {
            cpuacct: Some(dir), ..
        } = &handle
        else {
            panic!("{handle:?}")
        };
        assert_eq!(dir, &tree.path().join("cpuacct/tenantvm/alpha"));
        assert!(dir.is_dir());
        assert!(handle.dirs().contains(&dir));
    }

    #[test]
    fn a_stopping_daemons_subtree_goes_when_empty_and_stays_while_used() {
        let tree = fake_v1_tree();
        let state = tempfile::tempdir().unwrap();
        let cgroups = Cgroups::detect_at(tree.path())
            .unwrap()
            .for_state_dir(state.path())
            .unwrap();
        let handle = cgroups.create("alpha", &LIMITS).unwrap();
        let subtree = tree.path().join("memory").join(cgroups.subtree());
        // A tenant's cgroup in it: nothing removed (a fake tree's rmdir fails as the
        // kernel's does on a cgroup with children).
        assert!(cgroups.remove_subtree_if_empty().is_empty());
        assert!(subtree.is_dir());
        // Emptied (the fake tree holds the limits as files; the kernel's has none left).
        for dir in handle.dirs() {
            fs::remove_dir_all(dir).unwrap();
        }
        assert_eq!(cgroups.remove_subtree_if_empty().len(), 3);
        assert!(!subtree.exists());
        assert!(
            tree.path().join("memory").join(PARENT).is_dir(),
            "the shared parent went"
        );
        // The unscoped tree of tools and tests is never removed.
        let unscoped = Cgroups::detect_at(tree.path()).unwrap();
        assert!(unscoped.remove_subtree_if_empty().is_empty());
    }

    #[test]
    fn detect_explains_when_nothing_is_mounted() {
        let empty = tempfile::tempdir().unwrap();
        let err = Cgroups::detect_at(empty.path()).unwrap_err();
        assert!(matches!(err, JailError::CgroupUnavailable(_)));
    }

    #[test]
    fn v2_create_enables_controllers_and_writes_limits() {
        let tree = fake_v2_tree();
        let cgroups = Cgroups::detect_at(tree.path()).unwrap();
        let handle = cgroups.create("alpha", &LIMITS).unwrap();
        let dir = tree.path().join("tenantvm/alpha");
        assert_eq!(handle, CgroupHandle::V2 { path: dir.clone() });
        assert_eq!(
            fs::read_to_string(tree.path().join("cgroup.subtree_control")).unwrap(),
            // The fake host offers io too: enabled for block I/O limits.
            "+memory +cpu +pids +io"
        );
        assert_eq!(
            fs::read_to_string(dir.join("memory.max")).unwrap(),
            "268435456"
        );
        assert_eq!(
            fs::read_to_string(dir.join("cpu.max")).unwrap(),
            "200000 100000"
        );
        assert_eq!(fs::read_to_string(dir.join("pids.max")).unwrap(), "64");
        assert_eq!(handle.read_limits().unwrap(), LIMITS);
    }

    #[test]
    fn v2_disables_swap_when_the_host_accounts_it() {
        let tree = fake_v2_tree();
        let cgroups = Cgroups::detect_at(tree.path()).unwrap();
        let dir = tree.path().join("tenantvm/alpha");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("memory.swap.max"), "max").unwrap();
        cgroups.create("alpha", &LIMITS).unwrap();
        assert_eq!(
            fs::read_to_string(dir.join("memory.swap.max")).unwrap(),
            "0"
        );
    }

    #[test]
    fn v2_read_limits_understands_max() {
        let tree = fake_v2_tree();
        let handle = Cgroups::detect_at(tree.path())
            .unwrap()
            .create("alpha", &LIMITS)
            .unwrap();
        let CgroupHandle::V2 { path } = &handle else {
            unreachable!()
        };
        fs::write(path.join("cpu.max"), "max 100000\n").unwrap();
        assert_eq!(handle.read_limits().unwrap().cpu_quota_us, u64::MAX);
    }

    #[test]
    fn v1_create_writes_each_controller() {
        let tree = fake_v1_tree();
        let handle = Cgroups::detect_at(tree.path())
            .unwrap()
            .create("beta", &LIMITS)
            .unwrap();
        let base = tree.path();
        assert_eq!(
            fs::read_to_string(base.join("memory/tenantvm/beta/memory.limit_in_bytes")).unwrap(),
            "268435456"
        );
        assert_eq!(
            fs::read_to_string(base.join("cpu/tenantvm/beta/cpu.cfs_quota_us")).unwrap(),
            "200000"
        );
        assert_eq!(
            fs::read_to_string(base.join("cpu/tenantvm/beta/cpu.cfs_period_us")).unwrap(),
            "100000"
        );
        assert_eq!(
            fs::read_to_string(base.join("pids/tenantvm/beta/pids.max")).unwrap(),
            "64"
        );
        assert_eq!(handle.read_limits().unwrap(), LIMITS);
    }

    #[test]
    fn create_rejects_bad_names_and_limits() {
        let tree = fake_v2_tree();
        let cgroups = Cgroups::detect_at(tree.path()).unwrap();
        assert!(matches!(
            cgroups.create("../x", &LIMITS),
            Err(JailError::InvalidTenantName(_))
        ));
        for bad in [
            ResourceLimits {
                memory_bytes: 1024,
                ..LIMITS
            },
            ResourceLimits {
                cpu_period_us: 10,
                ..LIMITS
            },
            ResourceLimits {
                cpu_quota_us: 0,
                ..LIMITS
            },
            ResourceLimits {
                pids_max: 0,
                ..LIMITS
            },
        ] {
            assert!(
                matches!(cgroups.create("ok", &bad), Err(JailError::InvalidLimits(_))),
                "{bad:?}"
            );
        }
        assert!(!tree.path().join("tenantvm/ok").exists());
    }

    #[test]
    fn list_tenants_ignores_foreign_entries() {
        let tree = fake_v1_tree();
        let cgroups = Cgroups::detect_at(tree.path()).unwrap();
        cgroups.create("b", &LIMITS).unwrap();
        cgroups.create("a", &LIMITS).unwrap();
        fs::create_dir(tree.path().join("pids/tenantvm/c")).unwrap();
        fs::create_dir(tree.path().join("pids/tenantvm/Not_A_Tenant")).unwrap();
        fs::write(tree.path().join("memory/tenantvm/file"), "").unwrap();
        assert_eq!(cgroups.list_tenants().unwrap(), vec!["a", "b", "c"]);
    }

    #[test]
    fn two_daemons_never_share_or_touch_each_others_tenant_cgroups() {
        for tree in [fake_v1_tree(), fake_v2_tree()] {
            let states = tempfile::tempdir().unwrap();
            let (sa, sb) = (states.path().join("a"), states.path().join("b"));
            fs::create_dir_all(&sa).unwrap();
            fs::create_dir_all(&sb).unwrap();
            let host = Cgroups::detect_at(tree.path()).unwrap();
            let a = host.clone().for_state_dir(&sa).unwrap();
            let b = host.for_state_dir(&sb).unwrap();
            fake_daemon_subtree(tree.path(), &a);
            fake_daemon_subtree(tree.path(), &b);
            let ha = a.create("alice", &LIMITS).unwrap();
            let hb = b.create("alice", &LIMITS).unwrap();
            assert_ne!(ha, hb, "both daemons' alice share a cgroup");
            for (dir, own) in ha
                .dirs()
                .into_iter()
                .map(|d| (d, &a))
                .chain(hb.dirs().into_iter().map(|d| (d, &b)))
            {
                assert!(dir.ends_with(own.subtree().join("alice")), "{dir:?}");
            }
            // The kernel's control files vanish with their directory; the fake's are files.
            for dir in ha.dirs() {
                for f in fs::read_dir(dir).unwrap() {
                    fs::remove_file(f.unwrap().path()).unwrap();
                }
            }
            a.handle("alice").unwrap().destroy(|_| {}).unwrap();
            for dir in ha.dirs() {
                assert!(!dir.exists(), "{dir:?}");
            }
            for dir in hb.dirs() {
                assert!(dir.is_dir(), "b's alice lost {dir:?}");
            }
            assert_eq!(a.list_tenants().unwrap(), Vec::<String>::new());
            assert_eq!(b.list_tenants().unwrap(), vec!["alice"]);
            // The same state directory, however it is spelled, is the same daemon.
            let again = Cgroups::detect_at(tree.path())
                .unwrap()
                .for_state_dir(&sb.join("../b"))
                .unwrap();
            assert_eq!(again.handle("alice").unwrap(), hb);
        }
    }

    #[test]
    fn members_of_missing_cgroup_is_empty_and_kill_is_idempotent() {
        let tree = fake_v2_tree();
        let handle = Cgroups::detect_at(tree.path())
            .unwrap()
            .handle("gone")
            .unwrap();
        assert!(handle.members().unwrap().is_empty());
        handle.destroy(|_| {}).unwrap();
        handle.destroy(|_| {}).unwrap();
    }
}
