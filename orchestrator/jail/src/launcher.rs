//! The `tenantvm-jail` launcher: carries out a [`JailPlan`]. Runs as root in a fresh,
//! single-threaded process started by the daemon, with stdout/stderr going to vmm.log.
//!
//! ```text
//! launcher (host pid P, in the tenant cgroup)  waits, forwards SIGTERM, exits with the status
//!  └─ init (pid 1 of a new pid + mount namespace)  builds the chroot, reaps, records the status
//!      └─ program (pid 2: the VMM)  chrooted, tenant uid/gid, no capabilities, no_new_privs
//! ```
//! Every process is placed in the cgroup before the program is executed. The jail's mounts
//! live only in its private mount namespace and disappear with its last process.

use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::resource::{setrlimit, Resource};
use nix::unistd::{chdir, chroot, fork, setgroups, setresgid, setresuid, ForkResult, Gid, Uid};

use super::error_chain::error_chain;
use super::process::{ExitRecord, JAIL_SETUP_FAILED};
use super::{JailError, JailPlan};

/// The child the current process forwards SIGTERM/SIGINT/SIGHUP to.
static FORWARD_TO: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward_signal(signal: libc::c_int) {
    let pid = FORWARD_TO.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill(2) is async-signal-safe; pid is our own child.
        unsafe { libc::kill(pid, signal) };
    }
}

fn install_forwarding(child: i32) {
    FORWARD_TO.store(child, Ordering::SeqCst);
    for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction is valid; we set a plain handler that only calls the
        // async-signal-safe kill(2), and pass valid pointers.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = forward_signal as *const () as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

fn setup<T, E: Into<std::io::Error>>(step: &'static str, r: Result<T, E>) -> Result<T, JailError> {
    r.map_err(|e| JailError::Setup {
        step,
        source: e.into(),
    })
}

fn nix_io(e: nix::Error) -> std::io::Error {
    std::io::Error::from_raw_os_error(e as i32)
}

/// Entry point of the `tenantvm-jail` binary: `tenantvm-jail --plan JSON`. Returns the
/// process exit status: the program's status, 128+signal when a signal ended it, or
/// [`JAIL_SETUP_FAILED`].
pub fn main_with_args(args: &[String]) -> i32 {
    let plan = match args {
        [flag, json] if flag == "--plan" => match serde_json::from_str::<JailPlan>(json) {
            Ok(plan) => plan,
            Err(e) => {
                return fail(
                    None,
                    &format!("tenantvm-jail: the --plan JSON is invalid: {e}"),
                )
            }
        },
        _ => {
            return fail(
                None,
                "usage: tenantvm-jail --plan JSON (started by tenantvmd, not by hand)",
            )
        }
    };
    match launch(&plan) {
        Ok(status) => status,
        Err(e) => fail(
            Some(&plan.exit_file),
            &format!("tenantvm-jail: {}", error_chain(&e)),
        ),
    }
}

fn fail(exit_file: Option<&Path>, message: &str) -> i32 {
    let _ = writeln!(std::io::stderr(), "{message}");
    if let Some(path) = exit_file {
        let _ = ExitRecord::Code(JAIL_SETUP_FAILED).write_if_absent(path);
    }
    JAIL_SETUP_FAILED
}

fn close_inherited_fds() {
    // SAFETY: close_range(2) on fds >= 3 only; this process owns no fds of its own yet.
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
}

fn launch(plan: &JailPlan) -> Result<i32, JailError> {
    plan.validate()?;
    close_inherited_fds();
    let me = std::process::id();
    plan.cgroup.add_process(me)?;
    let cap_last = setup(
        "read cap_last_cap",
        fs::read_to_string("/proc/sys/kernel/cap_last_cap"),
    )?;
    let cap_last: u32 = cap_last
        .trim()
        .parse()
        .map_err(|_| JailError::InvalidPlan("bad /proc/sys/kernel/cap_last_cap".into()))?;
    setup(
        "unshare the namespaces",
        // Mount and pid namespaces for the chroot and the process view; network, IPC and
        // UTS namespaces so a compromised VMM reaches no network (not even the host's
        // loopback or abstract Unix sockets), no host SysV IPC, and cannot rename the host.
        unshare(
            CloneFlags::CLONE_NEWNS
                | CloneFlags::CLONE_NEWPID
                | CloneFlags::CLONE_NEWNET
                | CloneFlags::CLONE_NEWIPC
                | CloneFlags::CLONE_NEWUTS,
        )
        .map_err(nix_io),
    )?;
    // SAFETY: this process is single-threaded (a fresh tenantvm-jail), so the child may
    // run arbitrary code after fork.
    match setup("fork the jail init", unsafe { fork() }.map_err(nix_io))? {
        ForkResult::Child => {
            let status = match init(plan, cap_last) {
                Ok(status) => status,
                Err(e) => fail(
                    Some(&plan.exit_file),
                    &format!("tenantvm-jail init: {}", error_chain(&e)),
                ),
            };
            std::process::exit(status);
        }
        ForkResult::Parent { child } => {
            install_forwarding(child.as_raw());
            let status = wait_for(child.as_raw());
            let record = ExitRecord::from_wait_status(status);
            // The init records the program's own status; this covers an init that was killed.
            record.write_if_absent(&plan.exit_file)?;
            Ok(exit_code(
                ExitRecord::read(&plan.exit_file)?.unwrap_or(record),
            ))
        }
    }
}

fn exit_code(record: ExitRecord) -> i32 {
    match record {
        ExitRecord::Code(c) => c,
        ExitRecord::Signal(s) => 128 + s,
    }
}

/// Waits for one child, retrying on EINTR; returns its wait status.
fn wait_for(pid: i32) -> i32 {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid out-pointer to a local.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            return status;
        }
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return 0;
        }
    }
}

/// Pid 1 of the jail: builds the root, starts the program, reaps until it exits.
fn init(plan: &JailPlan, cap_last: u32) -> Result<i32, JailError> {
    build_root(plan)?;
    // SAFETY: single-threaded process (forked from the single-threaded launcher).
    match setup("fork the jailed program", unsafe { fork() }.map_err(nix_io))? {
        ForkResult::Child => {
            let e = enter_and_exec(plan, cap_last);
            let _ = writeln!(std::io::stderr(), "tenantvm-jail: {}", error_chain(&e));
            // SAFETY: _exit skips atexit handlers and buffers shared with the parent.
            unsafe { libc::_exit(JAIL_SETUP_FAILED) };
        }
        ForkResult::Parent { child } => {
            install_forwarding(child.as_raw());
            let mut seal = plan.seal.clone();
            let seal_deadline = Instant::now() + SEAL_WAIT;
            // As pid 1, reap every orphan; stop when the program itself exits. Leaving then
            // makes the kernel SIGKILL whatever else is left in the namespace.
            loop {
                // Poll while a seal is pending, block once it is done (or given up).
                if let Some(s) = &seal {
                    let present = jail_path(&plan.root, &s.when_exists).exists();
                    if present && seal_mount(plan, &s.mount)? {
                        seal = None;
                    } else if Instant::now() > seal_deadline {
                        if present {
                            return Err(JailError::Setup {
                                step: "seal a writable mount read-only (kept busy by the program)",
                                source: std::io::Error::from_raw_os_error(libc::EBUSY),
                            });
                        }
                        let _ = writeln!(
                            std::io::stderr(),
                            "tenantvm-jail: {} did not appear; {} stays writable",
                            s.when_exists.display(),
                            s.mount.display()
                        );
                        seal = None;
                    }
                }
                let flags = if seal.is_some() { libc::WNOHANG } else { 0 };
                let mut status = 0;
                // SAFETY: waitpid with a valid out-pointer to a local.
                let r = unsafe { libc::waitpid(-1, &mut status, flags) };
                if r == 0 {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                if r == child.as_raw() {
                    let record = ExitRecord::from_wait_status(status);
                    record.write(&plan.exit_file)?;
                    return Ok(exit_code(record));
                }
                if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) {
                    return Ok(JAIL_SETUP_FAILED);
                }
            }
        }
    }
}

/// How long the init watches for the seal's file before leaving the mount writable.
const SEAL_WAIT: Duration = Duration::from_secs(60);

/// Remounts the jail's bind mount at `mount_point` read-only (the host's view is
/// unaffected). Returns false while a file is open for writing through it (EBUSY): the
/// caller retries until its deadline, after which a VMM that keeps it busy ends the jail.
fn seal_mount(plan: &JailPlan, mount_point: &Path) -> Result<bool, JailError> {
    let none: Option<&str> = None;
    let target = jail_path(&plan.root, mount_point);
    let flags = MsFlags::MS_REMOUNT
        | MsFlags::MS_BIND
        | MsFlags::MS_RDONLY
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NODEV;
    match mount(none, &target, none, flags, none) {
        Ok(()) => Ok(true),
        Err(nix::Error::EBUSY) => Ok(false),
        Err(e) => Err(JailError::Setup {
            step: "seal a writable mount read-only",
            source: nix_io(e),
        }),
    }
}

fn jail_path(root: &Path, inside: &Path) -> PathBuf {
    root.join(inside.strip_prefix("/").unwrap_or(inside))
}

/// Mounts a small tmpfs on the jail root, bind-mounts the plan's files into it (read-only
/// unless writable), mounts the namespace's /proc, and makes the tmpfs read-only.
fn build_root(plan: &JailPlan) -> Result<(), JailError> {
    let none: Option<&str> = None;
    setup(
        "make mounts private",
        mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none).map_err(nix_io),
    )?;
    let root = &plan.root;
    setup("create the jail root", fs::create_dir_all(root))?;
    setup(
        "mount the jail tmpfs",
        mount(
            Some("tenantvm-jail"),
            root,
            Some("tmpfs"),
            // Not nodev: the tenant's device nodes live here. The tenant cannot add any
            // (no CAP_MKNOD, and the tmpfs ends up read-only).
            MsFlags::MS_NOSUID,
            Some("size=1m,nr_inodes=1024,mode=0755"),
        )
        .map_err(nix_io),
    )?;
    for m in &plan.mounts {
        let target = jail_path(root, &m.target);
        let meta = fs::metadata(&m.source).map_err(|source| JailError::Io {
            path: m.source.clone(),
            source,
        })?;
        if let Some(parent) = target.parent() {
            setup("create mount parents", fs::create_dir_all(parent))?;
        }
        if meta.is_dir() {
            setup("create a mount point", fs::create_dir_all(&target))?;
        } else if !target.exists() {
            setup("create a mount point", fs::File::create(&target).map(drop))?;
        }
        setup(
            "bind-mount",
            mount(Some(&m.source), &target, none, MsFlags::MS_BIND, none).map_err(nix_io),
        )?;
        let device = meta.file_type().is_char_device() || meta.file_type().is_block_device();
        let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_NOSUID;
        if !device {
            flags |= MsFlags::MS_NODEV;
        }
        if !m.writable {
            flags |= MsFlags::MS_RDONLY;
        }
        setup(
            "remount a bind mount with restricted flags",
            mount(none, &target, none, flags, none).map_err(nix_io),
        )?;
    }
    for host in &plan.devices {
        make_device(plan, host)?;
    }
    if plan.mount_proc {
        let proc_dir = root.join("proc");
        setup("create /proc", fs::create_dir_all(&proc_dir))?;
        setup(
            "mount the namespace's /proc",
            mount(
                Some("proc"),
                &proc_dir,
                Some("proc"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some("hidepid=2"),
            )
            .map_err(nix_io),
        )?;
    }
    setup(
        "chmod the jail root",
        fs::set_permissions(root, fs::Permissions::from_mode(0o755)),
    )?;
    setup(
        "make the jail root read-only",
        mount(
            none,
            root,
            none,
            MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID,
            none,
        )
        .map_err(nix_io),
    )?;
    Ok(())
}

/// Creates a node for host character device `host` at the same path in the jail, owned by
/// the tenant uid/gid, mode 0600.
fn make_device(plan: &JailPlan, host: &Path) -> Result<(), JailError> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(host).map_err(|source| JailError::Io {
        path: host.to_path_buf(),
        source,
    })?;
    if !meta.file_type().is_char_device() {
        return Err(JailError::InvalidPlan(format!(
            "{} is not a character device",
            host.display()
        )));
    }
    let target = jail_path(&plan.root, host);
    if let Some(parent) = target.parent() {
        setup("create device parents", fs::create_dir_all(parent))?;
    }
    let _ = fs::remove_file(&target);
    let path = cstring(target.as_os_str().as_bytes())?;
    // SAFETY: mknod(2) with a NUL-terminated path and plain integers.
    let r = unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o600, meta.rdev()) };
    setup("create a device node", check(r))?;
    setup(
        "chown a device node",
        std::os::unix::fs::chown(&target, Some(plan.uid), Some(plan.gid)),
    )?;
    setup(
        "chmod a device node",
        fs::set_permissions(&target, fs::Permissions::from_mode(0o600)),
    )?;
    Ok(())
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// In the program's process: chroot, rlimits, drop to the tenant's uid/gid with no groups
/// and no capabilities (bounding, ambient, inheritable, permitted, effective), set
/// no_new_privs, and exec. Returns only on failure.
fn enter_and_exec(plan: &JailPlan, cap_last: u32) -> JailError {
    let run = || -> Result<std::convert::Infallible, JailError> {
        setup("chroot", chroot(&plan.root).map_err(nix_io))?;
        setup("chdir /", chdir("/").map_err(nix_io))?;
        let rl = plan.rlimits;
        for (name, resource, value) in [
            ("RLIMIT_NOFILE", Resource::RLIMIT_NOFILE, rl.nofile),
            ("RLIMIT_NPROC", Resource::RLIMIT_NPROC, rl.nproc),
            ("RLIMIT_MEMLOCK", Resource::RLIMIT_MEMLOCK, rl.memlock_bytes),
            ("RLIMIT_CORE", Resource::RLIMIT_CORE, rl.core_bytes),
            ("RLIMIT_FSIZE", Resource::RLIMIT_FSIZE, plan.file_size_limit),
        ] {
            setup(name, set_rlimit(name, resource, value))?;
        }
        // A write past RLIMIT_FSIZE then fails with EFBIG (the VMM drops that output)
        // instead of SIGXFSZ killing the VM; SIG_IGN survives execve.
        // SAFETY: signal(2) with a valid signal number and SIG_IGN touches no memory.
        if unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) } == libc::SIG_ERR {
            return Err(JailError::Setup {
                step: "ignore SIGXFSZ",
                source: std::io::Error::last_os_error(),
            });
        }
        setup("drop supplementary groups", setgroups(&[]).map_err(nix_io))?;
        let gid = Gid::from_raw(plan.gid);
        setup("setresgid", setresgid(gid, gid, gid).map_err(nix_io))?;
        for cap in 0..=cap_last {
            setup(
                "drop the capability bounding set",
                prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap)),
            )?;
        }
        setup(
            "clear ambient capabilities",
            prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            ),
        )?;
        let uid = Uid::from_raw(plan.uid);
        // Leaving uid 0 without SECBIT_KEEP_CAPS clears the permitted and effective sets.
        setup("setresuid", setresuid(uid, uid, uid).map_err(nix_io))?;
        // After the uid change, which clears the parent-death signal (an earlier one was
        // lost); execve of the program keeps it.
        setup(
            "set the parent-death signal",
            prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong),
        )?;
        setup("clear inheritable capabilities", clear_capabilities())?;
        setup("set no_new_privs", prctl(libc::PR_SET_NO_NEW_PRIVS, 1))?;
        let program = cstring(plan.program.as_os_str().as_bytes())?;
        let mut argv = vec![program.clone()];
        for a in &plan.args {
            argv.push(cstring(a.as_bytes())?);
        }
        let env: Vec<CString> = plan
            .env
            .iter()
            .map(|(k, v)| cstring(format!("{k}={v}").as_bytes()))
            .collect::<Result<_, _>>()?;
        setup(
            "exec the program",
            nix::unistd::execve(&program, &argv, &env).map_err(nix_io),
        )
    };
    match run() {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

/// Sets soft and hard limit to `value`. Raising a hard limit needs CAP_SYS_RESOURCE, which
/// some hosts (containers) do not grant even to root: then the limit stays at the current
/// hard limit, and vmm.log says so.
fn set_rlimit(name: &str, resource: Resource, value: u64) -> std::io::Result<()> {
    match setrlimit(resource, value, value) {
        Ok(()) => Ok(()),
        Err(nix::Error::EPERM) => {
            let (_, hard) = nix::sys::resource::getrlimit(resource).map_err(nix_io)?;
            let _ = writeln!(
                std::io::stderr(),
                "tenantvm-jail: cannot raise {name} to {value} without CAP_SYS_RESOURCE; keeping {hard}"
            );
            setrlimit(resource, value.min(hard), value.min(hard)).map_err(nix_io)
        }
        Err(e) => Err(nix_io(e)),
    }
}

/// prctl(2) for the options used here, which take one integer argument and no pointers.
fn prctl(option: libc::c_int, arg: libc::c_ulong) -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments only (PDEATHSIG, CAPBSET_DROP, CAP_AMBIENT
    // CLEAR_ALL, NO_NEW_PRIVS: none reads or writes our memory).
    check(unsafe { libc::prctl(option, arg, 0, 0, 0) })
}

/// Empties every capability set of this process (capset(2), version 3).
fn clear_capabilities() -> std::io::Result<()> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData::default(); 2];
    // SAFETY: capset(2) with a valid header and the two data words version 3 expects; the
    // kernel only reads them.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    check(if r < 0 { -1 } else { 0 })
}

fn check(r: i32) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn cstring(bytes: &[u8]) -> Result<CString, JailError> {
    CString::new(bytes)
        .map_err(|_| JailError::InvalidPlan("an argument or variable contains a NUL byte".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CgroupHandle, JailRlimits};

    #[test]
    fn launcher_without_plan_prints_usage_and_fails() {
        assert_eq!(main_with_args(&[]), JAIL_SETUP_FAILED);
        assert_eq!(
            main_with_args(&["--other".into(), "x".into()]),
            JAIL_SETUP_FAILED
        );
    }

    #[test]
    fn launcher_rejects_malformed_plan_json() {
        assert_eq!(
            main_with_args(&["--plan".into(), "{not json".into()]),
            JAIL_SETUP_FAILED
        );
        assert_eq!(
            main_with_args(&["--plan".into(), "{\"tenant\":\"t\",\"bogus\":1}".into()]),
            JAIL_SETUP_FAILED
        );
    }

    #[test]
    fn launcher_refuses_root_identity_and_records_the_failure() {
        let dir = tempfile::tempdir().unwrap();
        let plan = JailPlan {
            tenant: "t".into(),
            uid: 0,
            gid: 0,
            cgroup: CgroupHandle::V2 {
                path: dir.path().join("cg"),
            },
            root: dir.path().join("root"),
            exit_file: dir.path().join("vmm.exit"),
            mounts: vec![],
            devices: vec![],
            seal: None,
            mount_proc: true,
            program: "/bin/true".into(),
            args: vec![],
            env: vec![],
            rlimits: JailRlimits {
                nofile: 64,
                nproc: 8,
                memlock_bytes: 0,
                core_bytes: 0,
            },
            file_size_limit: crate::plan::MIN_FILE_SIZE_LIMIT,
        };
        let json = serde_json::to_string(&plan).unwrap();
        assert_eq!(main_with_args(&["--plan".into(), json]), JAIL_SETUP_FAILED);
        assert_eq!(
            ExitRecord::read(&plan.exit_file).unwrap(),
            Some(ExitRecord::Code(JAIL_SETUP_FAILED))
        );
        // Nothing was joined or mounted.
        assert!(!dir.path().join("cg").exists() && !plan.root.exists());
    }

    #[test]
    fn exit_code_encodes_signals_like_a_shell() {
        assert_eq!(exit_code(ExitRecord::Code(6)), 6);
        assert_eq!(exit_code(ExitRecord::Signal(9)), 137);
    }
}
