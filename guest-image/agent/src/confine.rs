//! Runs the payload in its own root: a mount namespace of its own in which the payload's
//! root directory (an engine's distribution root, e.g. `/payload` holding Debian's
//! llama.cpp) becomes `/`, the tenant's data disk is bound at the same path inside it,
//! with a fresh `/proc`, a small `/tmp`, a `/dev` holding only the device nodes an engine
//! needs (and the GPU's, where the guest has them) and a read-only `/sys`; then it drops to
//! an unprivileged uid and gid with no supplementary groups and `no_new_privs`. The engine
//! uses its own loader and libraries, never the initramfs's, and sees nothing of the
//! initramfs (the agent, cryptsetup, the agent config) nor the raw disk.
//!
//! The namespace lives as long as the payload's processes: nothing to undo when it exits.
//! The payload also gets a session (and so a process group) of its own, so that stopping
//! it reaches every process it started.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The device nodes every confined payload gets (bound from the guest's `/dev`).
pub const BASE_DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom"];
/// Prefixes of `/dev` entries passed on when the guest has them (the NVIDIA driver's
/// `nvidia0`, `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`, `nvidia-modeset`).
pub const GPU_DEVICE_PREFIXES: &[&str] = &["nvidia"];
/// Size of the payload's `/tmp` (guest memory).
pub const TMP_SIZE: &str = "size=64m,mode=1777";

/// How the payload is confined (`payload.confine` in the agent config).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfineConfig {
    /// The payload's root directory in the initramfs (e.g. `/payload`).
    pub root: PathBuf,
    /// The uid (and gid) the payload runs as; never 0.
    pub uid: u32,
}

/// Why the payload cannot be confined as configured.
#[derive(Debug, Error)]
pub enum ConfineError {
    /// The config asks for something unsafe or impossible.
    #[error("payload.confine is invalid: {0}")]
    Invalid(&'static str),
    /// A path holds a NUL byte.
    #[error("payload.confine: {0} holds a NUL byte")]
    Nul(PathBuf),
    /// A mount point could not be made inside the root.
    #[error("Cannot prepare {path} inside the payload's root: {source}")]
    Prepare {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

impl ConfineConfig {
    /// Checks what serde cannot.
    pub fn validate(&self) -> Result<(), ConfineError> {
        if self.uid == 0 {
            return Err(ConfineError::Invalid(
                "uid 0 is not confinement: give an unprivileged uid",
            ));
        }
        if !self.root.is_absolute() || self.root == Path::new("/") {
            return Err(ConfineError::Invalid(
                "root must be an absolute directory other than /",
            ));
        }
        Ok(())
    }
}

/// Everything the child needs, prepared before `fork` so that the child only makes
/// system calls (no allocation between `fork` and `exec`).
struct Plan {
    root: CString,
    data_src: CString,
    data_dst: CString,
    tmp: CString,
    proc_: CString,
    dev: CString,
    sys_src: CString,
    sys_dst: CString,
    devices: Vec<(CString, CString)>,
    workdir: CString,
    uid: libc::uid_t,
    tmpfs: CString,
    procfs: CString,
    tmp_opts: CString,
    dev_opts: CString,
}

fn cstring(p: &Path) -> Result<CString, ConfineError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| ConfineError::Nul(p.to_path_buf()))
}

/// `inner` (an absolute path seen from inside the root) under `root`.
fn inside(root: &Path, inner: &Path) -> PathBuf {
    root.join(inner.strip_prefix("/").unwrap_or(inner))
}

/// The guest's device nodes to pass on: [`BASE_DEVICES`] and the GPU's, sorted.
fn devices(dev: &Path) -> Vec<String> {
    let mut out: Vec<String> = BASE_DEVICES.iter().map(|s| s.to_string()).collect();
    if let Ok(entries) = std::fs::read_dir(dev) {
        let mut gpu: Vec<String> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| !t.is_dir() && !t.is_symlink()))
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| GPU_DEVICE_PREFIXES.iter().any(|p| n.starts_with(p)))
            .collect();
        gpu.sort();
        out.extend(gpu);
    }
    out
}

/// Where the tenant's data disk is, outside and inside the payload's root (the agent
/// binds it at the same path: `/data`).
#[derive(Debug, Clone, Copy)]
pub struct DataMount<'a> {
    /// The disk's mount point in the agent's view.
    pub source: &'a Path,
    /// Where the payload sees it (an absolute path inside its root).
    pub inside: &'a Path,
}

/// Makes the mount points inside `cfg.root` (the initramfs is writable by the agent) and
/// sets `cmd` up to enter the confinement between `fork` and `exec`: `data` says where the
/// data disk is bound, `workdir` is the payload's working directory inside the root, `dev`
/// the guest's `/dev` (tests use another).
pub fn apply(
    cmd: &mut Command,
    cfg: &ConfineConfig,
    data: DataMount<'_>,
    workdir: &Path,
    dev: &Path,
) -> Result<(), ConfineError> {
    cfg.validate()?;
    let root = &cfg.root;
    let data_dst = inside(root, data.inside);
    let device_names = devices(dev);
    for dir in [
        data_dst.clone(),
        root.join("tmp"),
        root.join("proc"),
        root.join("dev"),
        root.join("sys"),
    ] {
        std::fs::create_dir_all(&dir).map_err(|source| ConfineError::Prepare {
            path: dir.clone(),
            source,
        })?;
    }
    let plan = Plan {
        root: cstring(root)?,
        data_src: cstring(data.source)?,
        data_dst: cstring(&data_dst)?,
        tmp: cstring(&root.join("tmp"))?,
        proc_: cstring(&root.join("proc"))?,
        dev: cstring(&root.join("dev"))?,
        sys_src: cstring(Path::new("/sys"))?,
        sys_dst: cstring(&root.join("sys"))?,
        devices: device_names
            .iter()
            .map(|n| Ok((cstring(&dev.join(n))?, cstring(&root.join("dev").join(n))?)))
            .collect::<Result<_, ConfineError>>()?,
        workdir: cstring(workdir)?,
        uid: cfg.uid,
        tmpfs: c"tmpfs".to_owned(),
        procfs: c"proc".to_owned(),
        tmp_opts: CString::new(TMP_SIZE).expect("no NUL"),
        dev_opts: c"size=64k,mode=755".to_owned(),
    };
    // SAFETY: the closure runs in the child between fork and exec; it only makes system
    // calls on memory prepared above (no allocation, no locks) and reports errno.
    unsafe {
        cmd.pre_exec(move || enter(&plan));
    }
    Ok(())
}

/// The last OS error, as `pre_exec` wants it (no allocation).
fn os_err() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// `mount(2)`, errno on failure.
fn mount(
    src: Option<&CString>,
    dst: &CString,
    fstype: Option<&CString>,
    flags: libc::c_ulong,
    data: Option<&CString>,
) -> std::io::Result<()> {
    let ptr = |c: Option<&CString>| c.map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is a NUL-terminated string that outlives the call, or null
    // where mount(2) allows it.
    let rc = unsafe { libc::mount(ptr(src), dst.as_ptr(), ptr(fstype), flags, ptr(data).cast()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(os_err())
    }
}

/// Binds `src` on `dst` and remounts the bind with `flags` (`MS_BIND` alone ignores them).
fn bind(
    src: &CString,
    dst: &CString,
    recursive: bool,
    flags: libc::c_ulong,
) -> std::io::Result<()> {
    let rec = if recursive { libc::MS_REC } else { 0 };
    mount(Some(src), dst, None, libc::MS_BIND | rec, None)?;
    mount(
        None,
        dst,
        None,
        libc::MS_REMOUNT | libc::MS_BIND | flags,
        None,
    )
}

fn check(rc: libc::c_int) -> std::io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(os_err())
    }
}

/// The child's side: runs between fork and exec.
fn enter(p: &Plan) -> std::io::Result<()> {
    // SAFETY: setsid(2) and unshare(2) take no pointers.
    unsafe {
        if libc::setsid() < 0 {
            return Err(os_err());
        }
        check(libc::unshare(libc::CLONE_NEWNS))?;
    }
    let root_dir = c"/".to_owned();
    // Nothing mounted here propagates back to the agent's namespace.
    mount(None, &root_dir, None, libc::MS_REC | libc::MS_PRIVATE, None)?;
    mount(
        Some(&p.tmpfs),
        &p.tmp,
        Some(&p.tmpfs),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(&p.tmp_opts),
    )?;
    mount(
        Some(&p.procfs),
        &p.proc_,
        Some(&p.procfs),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )?;
    mount(
        Some(&p.tmpfs),
        &p.dev,
        Some(&p.tmpfs),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some(&p.dev_opts),
    )?;
    for (src, dst) in &p.devices {
        // SAFETY: open(2)/close(2) on a prepared path; the file is a bind target.
        let fd = unsafe {
            libc::open(
                dst.as_ptr(),
                libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            return Err(os_err());
        }
        // SAFETY: fd was just opened above.
        unsafe { libc::close(fd) };
        bind(src, dst, false, libc::MS_NOSUID | libc::MS_NOEXEC)?;
    }
    bind(
        &p.sys_src,
        &p.sys_dst,
        true,
        libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
    )?;
    bind(
        &p.data_src,
        &p.data_dst,
        true,
        libc::MS_NOSUID | libc::MS_NODEV,
    )?;
    // SAFETY: system calls on prepared strings and integers.
    unsafe {
        check(libc::chroot(p.root.as_ptr()))?;
        check(libc::chdir(p.workdir.as_ptr()))?;
        check(libc::setgroups(0, std::ptr::null()))?;
        check(libc::setresgid(p.uid, p.uid, p.uid))?;
        check(libc::setresuid(p.uid, p.uid, p.uid))?;
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
