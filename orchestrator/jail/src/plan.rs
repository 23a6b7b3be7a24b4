//! The jail plan: everything the `tenantvm-jail` launcher needs to build one tenant's jail
//! and start its VMM in it. The daemon builds it ([`JailPlan::new`] + [`JailPlan::bind`]),
//! serialises it onto the launcher's command line, and the launcher carries it out
//! ([`super::launcher`]).

use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use super::{validate_tenant_name, CgroupHandle, JailError};

/// Name of the file in the tenant directory that records how the VMM ended.
pub const EXIT_FILE: &str = "vmm.exit";
/// The smallest RLIMIT_FSIZE a VMM gets: far above the log caps (docs/logs.md), so a
/// serial console or vmm.log that housekeeping rotates never meets it, while one it cannot
/// rotate stops growing here.
pub const MIN_FILE_SIZE_LIMIT: u64 = 64 << 20;

/// A host file or directory made visible inside the jail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BindMount {
    /// Host path (absolute).
    pub source: PathBuf,
    /// Path inside the jail (absolute, no `..`).
    pub target: PathBuf,
    /// Whether the VMM may write through it (disks, the socket directory, serial.log).
    pub writable: bool,
}

/// Seal `mount` (a jail path of a writable bind mount) read-only once `when_exists` (a
/// jail path) exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Seal {
    /// The jail path whose appearance triggers the seal.
    pub when_exists: PathBuf,
    /// The jail path of the mount to make read-only.
    pub mount: PathBuf,
}

/// Per-process rlimits applied to the VMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JailRlimits {
    /// RLIMIT_NOFILE.
    pub nofile: u64,
    /// RLIMIT_NPROC (counted per uid, and each tenant has its own uid).
    pub nproc: u64,
    /// RLIMIT_MEMLOCK in bytes (VFIO pins guest memory).
    pub memlock_bytes: u64,
    /// RLIMIT_CORE in bytes (0: no core dumps of guest memory).
    pub core_bytes: u64,
}

/// Everything the launcher needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JailPlan {
    /// Tenant name (validated).
    pub tenant: String,
    /// The uid the program runs as (not 0).
    pub uid: u32,
    /// The gid the program runs as (not 0); no supplementary groups.
    pub gid: u32,
    /// The cgroup the launcher joins before anything else (so every process of the jail is
    /// accounted and limited).
    pub cgroup: CgroupHandle,
    /// The jail root on the host (`<tenant_dir>/root`): an empty directory on which the
    /// launcher mounts a small tmpfs inside the jail's private mount namespace.
    pub root: PathBuf,
    /// Where the launcher records the exit status (`<tenant_dir>/vmm.exit`).
    pub exit_file: PathBuf,
    /// What is visible inside the jail besides an empty tmpfs.
    pub mounts: Vec<BindMount>,
    /// Character devices (host paths) recreated at the same path inside the jail as nodes
    /// owned by the tenant uid/gid with mode 0600 (so /dev/kvm opens without the host's
    /// `kvm` group, and the host's nodes keep their permissions).
    pub devices: Vec<PathBuf>,
    /// A writable mount to make read-only once a file appears in it (the VMM's socket):
    /// afterwards the VMM cannot create files there, so a compromised VMM cannot fill the
    /// host's disk through it. The host keeps its own, writable view.
    pub seal: Option<Seal>,
    /// Whether to mount a fresh /proc of the jail's pid namespace (hidepid=2).
    pub mount_proc: bool,
    /// The program to run, as a path inside the jail.
    pub program: PathBuf,
    /// Its arguments (without `argv[0]`).
    pub args: Vec<String>,
    /// Its whole environment.
    pub env: Vec<(String, String)>,
    /// Its rlimits.
    pub rlimits: JailRlimits,
    /// RLIMIT_FSIZE of the program: [`MIN_FILE_SIZE_LIMIT`], raised by [`JailPlan::bind`] to
    /// the size of each writable file mounted (its disks) and by
    /// [`JailPlan::allow_file_size`] for a file the program makes itself (guest RAM on a
    /// hugetlb memfd: ftruncate past the limit fails with EFBIG). The launcher also ignores
    /// SIGXFSZ, so a write past it fails (EFBIG) instead of killing the VMM.
    pub file_size_limit: u64,
}

impl JailPlan {
    /// A plan that runs `program` (a host path, bind-mounted read-only at the same path
    /// inside the jail together with the shared libraries it needs) under `tenant_dir`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        tenant: &str,
        uid: u32,
        gid: u32,
        cgroup: CgroupHandle,
        tenant_dir: &Path,
        program: &Path,
        args: Vec<String>,
        rlimits: JailRlimits,
    ) -> Result<Self, JailError> {
        validate_tenant_name(tenant)?;
        if uid == 0 || gid == 0 {
            return Err(JailError::InvalidIdentity(format!(
                "uid {uid} / gid {gid}: a jailed VMM never runs as root; allocate a tenant uid and gid above 0"
            )));
        }
        let program = canonical(program)?;
        let mut plan = Self {
            tenant: tenant.to_string(),
            uid,
            gid,
            cgroup,
            root: tenant_dir.join(super::JAIL_ROOT_DIR),
            exit_file: tenant_dir.join(EXIT_FILE),
            mounts: Vec::new(),
            devices: Vec::new(),
            seal: None,
            mount_proc: true,
            program: program.clone(),
            args,
            env: Vec::new(),
            rlimits,
            file_size_limit: MIN_FILE_SIZE_LIMIT,
        };
        for lib in shared_libraries(&program)? {
            plan.bind(&lib, &lib, false)?;
        }
        plan.bind(&program, &program, false)?;
        Ok(plan)
    }

    /// Raises the file size limit to at least `bytes`, for a file the program creates and
    /// sizes itself (never lowers it).
    pub fn allow_file_size(&mut self, bytes: u64) -> &mut Self {
        self.file_size_limit = self.file_size_limit.max(bytes);
        self
    }

    /// Adds a bind mount of host `source` at jail path `target`.
    pub fn bind(
        &mut self,
        source: &Path,
        target: &Path,
        writable: bool,
    ) -> Result<&mut Self, JailError> {
        let source = canonical(source)?;
        check_jail_path(target)?;
        if writable {
            // The program may write anywhere inside a writable file (a disk image): never
            // limit it below that file's size.
            if let Ok(meta) = std::fs::metadata(&source) {
                if meta.is_file() {
                    self.file_size_limit = self.file_size_limit.max(meta.len());
                }
            }
        }
        if !self.mounts.iter().any(|m| m.target == target) {
            self.mounts.push(BindMount {
                source,
                target: target.to_path_buf(),
                writable,
            });
        }
        Ok(self)
    }

    /// Adds a character device, recreated at the same path inside the jail for the tenant.
    pub fn device(&mut self, host_path: &Path) -> Result<&mut Self, JailError> {
        use std::os::unix::fs::FileTypeExt;
        let meta = std::fs::metadata(host_path).map_err(|source| JailError::Io {
            path: host_path.to_path_buf(),
            source,
        })?;
        if !meta.file_type().is_char_device() {
            return Err(JailError::InvalidPlan(format!(
                "{} is not a character device",
                host_path.display()
            )));
        }
        check_jail_path(host_path)?;
        if !self.devices.iter().any(|d| d == host_path) {
            self.devices.push(host_path.to_path_buf());
        }
        Ok(self)
    }

    /// Checks the plan before the launcher acts on it (it is also checked there).
    pub fn validate(&self) -> Result<(), JailError> {
        validate_tenant_name(&self.tenant)?;
        if self.file_size_limit < MIN_FILE_SIZE_LIMIT {
            return Err(JailError::InvalidPlan(format!(
                "file size limit {} is below {MIN_FILE_SIZE_LIMIT} bytes",
                self.file_size_limit
            )));
        }
        if self.uid == 0 || self.gid == 0 {
            return Err(JailError::InvalidIdentity(
                "uid and gid must not be 0".into(),
            ));
        }
        check_jail_path(&self.program)?;
        for d in &self.devices {
            check_jail_path(d)?;
        }
        if let Some(seal) = &self.seal {
            check_jail_path(&seal.when_exists)?;
            if !self
                .mounts
                .iter()
                .any(|m| m.target == seal.mount && m.writable)
            {
                return Err(JailError::InvalidPlan(format!(
                    "seal target {} is not a writable bind mount of the plan",
                    seal.mount.display()
                )));
            }
        }
        for m in &self.mounts {
            check_jail_path(&m.target)?;
            if !m.source.is_absolute() {
                return Err(JailError::InvalidPlan(format!(
                    "bind source {} is not absolute",
                    m.source.display()
                )));
            }
        }
        Ok(())
    }
}

fn canonical(path: &Path) -> Result<PathBuf, JailError> {
    path.canonicalize().map_err(|source| JailError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// A jail path must be absolute and made of plain components only.
fn check_jail_path(path: &Path) -> Result<(), JailError> {
    let plain = path.is_absolute()
        && path
            .components()
            .skip(1)
            .all(|c| matches!(c, Component::Normal(_)));
    if plain && path != Path::new("/") {
        Ok(())
    } else {
        Err(JailError::InvalidPlan(format!(
            "jail path {} must be absolute, not /, and without '..' or '.'",
            path.display()
        )))
    }
}

/// The ELF interpreter (PT_INTERP) of a binary, or None for a static binary.
pub fn elf_interpreter(binary: &Path) -> Result<Option<PathBuf>, JailError> {
    let io = |source| JailError::Io {
        path: binary.to_path_buf(),
        source,
    };
    let mut data = Vec::new();
    File::open(binary)
        .map_err(io)?
        .take(64 << 20)
        .read_to_end(&mut data)
        .map_err(io)?;
    let bad = || {
        JailError::InvalidPlan(format!(
            "{} is not a 64-bit little-endian ELF executable",
            binary.display()
        ))
    };
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 || data[5] != 1 {
        return Err(bad());
    }
    let u16_at = |o: usize| data.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u64_at = |o: usize| {
        data.get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    };
    let phoff = usize::try_from(u64_at(0x20).ok_or_else(bad)?).map_err(|_| bad())?;
    let phentsize = usize::from(u16_at(0x36).ok_or_else(bad)?);
    let phnum = usize::from(u16_at(0x38).ok_or_else(bad)?);
    for i in 0..phnum {
        let ph = phoff
            .checked_add(i.checked_mul(phentsize).ok_or_else(bad)?)
            .ok_or_else(bad)?;
        let p_type = data
            .get(ph..ph + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or_else(bad)?;
        if p_type == 3 {
            let off = usize::try_from(u64_at(ph + 8).ok_or_else(bad)?).map_err(|_| bad())?;
            let size = usize::try_from(u64_at(ph + 32).ok_or_else(bad)?).map_err(|_| bad())?;
            let raw = data
                .get(off..off.checked_add(size).ok_or_else(bad)?)
                .ok_or_else(bad)?;
            let name = raw.split(|b| *b == 0).next().unwrap_or_default();
            let text = std::str::from_utf8(name).map_err(|_| bad())?;
            return Ok(Some(PathBuf::from(text)));
        }
    }
    Ok(None)
}

/// The shared libraries (and the interpreter) a dynamically linked binary loads, as
/// resolved by its own dynamic loader (`ld.so --list`, what `ldd` does); empty for a static
/// binary. Each is a canonical host path to bind-mount read-only at the same place.
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>, JailError> {
    let Some(interp) = elf_interpreter(binary)? else {
        return Ok(Vec::new());
    };
    let output = Command::new(&interp)
        .arg("--list")
        .arg(binary)
        .env_clear()
        .output()
        .map_err(|source| JailError::Io {
            path: interp.clone(),
            source,
        })?;
    if !output.status.success() {
        return Err(JailError::InvalidPlan(format!(
            "cannot list the libraries of {} with {}: {}; install them or use a static build",
            binary.display(),
            interp.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    let mut libs = Vec::new();
    // The interpreter itself must appear at its PT_INTERP path.
    libs.push(interp.clone());
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let line = line.trim();
        if line.contains("not found") {
            return Err(JailError::InvalidPlan(format!(
                "{} needs a missing library: {line}",
                binary.display()
            )));
        }
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.trim(),
            None => line,
        };
        let path = path.split(" (").next().unwrap_or("").trim();
        if path.starts_with('/') {
            let p = PathBuf::from(path);
            if !libs.contains(&p) {
                libs.push(p);
            }
        }
    }
    // Libraries are often symlinks: mount the real file at the path the loader asks for
    // (bind mounts follow the source link).
    Ok(libs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle() -> CgroupHandle {
        CgroupHandle::V2 {
            path: PathBuf::from("/sys/fs/cgroup/tenantvm/t"),
        }
    }

    const RL: JailRlimits = JailRlimits {
        nofile: 1024,
        nproc: 64,
        memlock_bytes: 1 << 20,
        core_bytes: 0,
    };

    #[test]
    fn dynamic_binary_gets_its_loader_and_libc() {
        let sh = Path::new("/bin/sh").canonicalize().unwrap();
        let interp = elf_interpreter(&sh)
            .unwrap()
            .expect("/bin/sh is dynamically linked on Debian");
        let libs = shared_libraries(&sh).unwrap();
        assert!(libs.contains(&interp));
        assert!(
            libs.iter().any(|l| l.to_string_lossy().contains("libc.so")),
            "{libs:?}"
        );
    }

    #[test]
    fn non_elf_is_rejected_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("script");
        std::fs::write(&f, "#!/bin/sh\n").unwrap();
        assert!(matches!(
            elf_interpreter(&f),
            Err(JailError::InvalidPlan(_))
        ));
        std::fs::write(&f, b"\x7fELF\x02\x01\x01").unwrap();
        assert!(matches!(
            elf_interpreter(&f),
            Err(JailError::InvalidPlan(_))
        ));
    }

    #[test]
    fn plan_refuses_root_identity() {
        let dir = tempfile::tempdir().unwrap();
        let err = JailPlan::new(
            "t",
            0,
            1000,
            handle(),
            dir.path(),
            Path::new("/bin/sh"),
            vec![],
            RL,
        )
        .unwrap_err();
        assert!(matches!(err, JailError::InvalidIdentity(_)));
        let err = JailPlan::new(
            "t",
            1000,
            0,
            handle(),
            dir.path(),
            Path::new("/bin/sh"),
            vec![],
            RL,
        )
        .unwrap_err();
        assert!(matches!(err, JailError::InvalidIdentity(_)));
    }

    #[test]
    fn plan_refuses_escaping_targets() {
        let dir = tempfile::tempdir().unwrap();
        let mut plan = JailPlan::new(
            "t",
            1000,
            1000,
            handle(),
            dir.path(),
            Path::new("/bin/sh"),
            vec![],
            RL,
        )
        .unwrap();
        for bad in ["relative", "/a/../../etc", "/", "/.."] {
            assert!(
                matches!(
                    plan.bind(Path::new("/dev/null"), Path::new(bad), false),
                    Err(JailError::InvalidPlan(_))
                ),
                "{bad}"
            );
        }
        plan.bind(Path::new("/does/not/exist"), Path::new("/x"), false)
            .unwrap_err();
        plan.bind(Path::new("/dev/null"), Path::new("/dev/null"), true)
            .unwrap();
        plan.device(Path::new("/dev/null")).unwrap();
        assert!(matches!(
            plan.device(Path::new("/bin/sh")),
            Err(JailError::InvalidPlan(_))
        ));
        plan.validate().unwrap();
        assert_eq!(plan.exit_file, dir.path().join(EXIT_FILE));
    }

    #[test]
    fn the_file_size_limit_covers_writable_files_only() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("disk.img");
        std::fs::File::create(&disk)
            .unwrap()
            .set_len(10 << 30)
            .unwrap();
        let mut plan = JailPlan::new(
            "t",
            1000,
            1000,
            handle(),
            dir.path(),
            Path::new("/bin/sh"),
            vec![],
            RL,
        )
        .unwrap();
        assert_eq!(plan.file_size_limit, MIN_FILE_SIZE_LIMIT);
        plan.bind(&disk, Path::new("/vm/ro"), false).unwrap();
        assert_eq!(plan.file_size_limit, MIN_FILE_SIZE_LIMIT);
        plan.bind(&disk, Path::new("/vm/disk0"), true).unwrap();
        assert_eq!(plan.file_size_limit, 10 << 30);
        plan.validate().unwrap();
        plan.file_size_limit = 4096;
        assert!(plan.validate().is_err());
    }

    #[test]
    fn plan_round_trips_through_json() {
        let dir = tempfile::tempdir().unwrap();
        let plan = JailPlan::new(
            "t",
            1000,
            1000,
            handle(),
            dir.path(),
            Path::new("/bin/sh"),
            vec!["-c".into(), "true".into()],
            RL,
        )
        .unwrap();
        let json = serde_json::to_string(&plan).unwrap();
        assert_eq!(serde_json::from_str::<JailPlan>(&json).unwrap(), plan);
    }
}
