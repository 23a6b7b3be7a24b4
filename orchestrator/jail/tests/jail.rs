//! The jail against the real kernel: namespaces, chroot, uid, capabilities, cgroup limits.
//! Needs root; skips with a printed reason otherwise. The jailed program is the host's
//! /bin/sh (dash), mounted with its shared libraries, so probes use shell builtins only.

mod common;

use std::fs::{self, File, OpenOptions};
use std::path::Path;
use std::time::Duration;

use tenantvm_jail::process::{self, spawn_launcher};
use tenantvm_jail::{
    cleanup_tenant, list_tenant_cgroups, Cgroups, ExitRecord, JailPlan, JailRlimits,
    ResourceLimits, Seal,
};

const RLIMITS: JailRlimits = JailRlimits {
    nofile: 256,
    nproc: 64,
    memlock_bytes: 1 << 20,
    core_bytes: 0,
};

struct Run {
    exit: ExitRecord,
    output: String,
}

/// Runs `script` with /bin/sh in a jail for `tenant` with `limits`; returns its exit record
/// and everything it printed.
fn run_jailed(tag: &str, limits: ResourceLimits, script: &str) -> Run {
    run_jailed_with(tag, limits, script, |_, _| {})
}

/// The plan that runs `script` with /bin/sh as the first test uid, with /dev/null.
fn shell_plan(
    tenant: &str,
    handle: tenantvm_jail::CgroupHandle,
    dir: &Path,
    script: &str,
) -> JailPlan {
    let uid = common::test_uid(0);
    let mut plan = JailPlan::new(
        tenant,
        uid,
        uid,
        handle,
        dir,
        Path::new("/bin/sh"),
        vec!["-c".into(), script.into()],
        RLIMITS,
    )
    .unwrap();
    plan.device(Path::new("/dev/null")).unwrap();
    plan
}

/// As [`run_jailed`], letting `customize` adjust the plan (given the tenant dir) first.
fn run_jailed_with(
    tag: &str,
    limits: ResourceLimits,
    script: &str,
    customize: impl FnOnce(&mut JailPlan, &Path),
) -> Run {
    let tmp = tempfile::tempdir().unwrap();
    let tenant = common::tenant(tag);
    let dir = common::tenant_dir(&tmp, &tenant);
    let _cleanup = common::CleanupOnDrop::new(&tenant, &dir);
    let cgroups = Cgroups::detect().unwrap();
    let handle = cgroups.create(&tenant, &limits).unwrap();
    let mut plan = shell_plan(&tenant, handle, &dir, script);
    customize(&mut plan, &dir);
    let log_path = dir.join("vmm.log");
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .unwrap();
    let launched =
        spawn_launcher(Path::new(env!("CARGO_BIN_EXE_tenantvm-jail")), &plan, &log).unwrap();
    let status = common::wait_until(Duration::from_secs(120), "the jailed shell to exit", || {
        process::wait_nohang(launched.pid)
    });
    let exit = ExitRecord::read(&plan.exit_file)
        .unwrap()
        .expect("the launcher records the exit status");
    // The launcher's own status carries the program's status too.
    match exit {
        ExitRecord::Code(c) => {
            assert_eq!(ExitRecord::from_wait_status(status), ExitRecord::Code(c));
        }
        ExitRecord::Signal(s) => assert_eq!(
            ExitRecord::from_wait_status(status),
            ExitRecord::Code(128 + s)
        ),
    }
    cleanup_tenant(&cgroups, &tenant, &dir).unwrap();
    let output = fs::read_to_string(&log_path).unwrap();
    eprintln!("--- {tag}: {exit:?}\n{output}");
    Run { exit, output }
}

#[test]
fn jailed_program_sees_own_pid_namespace_and_chroot_only() {
    require_root!();
    let run = run_jailed(
        "ns",
        common::roomy_limits(),
        "echo pid=$$; for f in /* /proc/[0-9]*; do echo entry $f; done; \
         if echo x > /newfile; then echo root-writable; else echo root-readonly; fi 2>/dev/null",
    );
    assert_eq!(run.exit, ExitRecord::Code(0), "{}", run.output);
    assert!(
        run.output.contains("pid=2\n"),
        "the program is pid 1's child in its own pid namespace:\n{}",
        run.output
    );
    let entries: Vec<&str> = run
        .output
        .lines()
        .filter_map(|l| l.strip_prefix("entry "))
        .collect();
    // Only what the plan mounted: /bin (sh), /lib* (its libraries), /usr maybe, /dev, /proc.
    for e in &entries {
        assert!(
            ["/bin", "/lib", "/lib64", "/usr", "/dev", "/proc"]
                .iter()
                .any(|p| e.starts_with(p)),
            "unexpected entry {e} in the jail root:\n{}",
            run.output
        );
    }
    assert!(!entries
        .iter()
        .any(|e| *e == "/etc" || *e == "/root" || *e == "/home" || *e == "/tmp"));
    // hidepid=2 and the new pid namespace: only our own process (pid 2) is visible.
    let pids: Vec<&&str> = entries.iter().filter(|e| e.starts_with("/proc/")).collect();
    assert_eq!(pids, vec![&"/proc/2"], "{}", run.output);
    assert!(run.output.contains("root-readonly"), "{}", run.output);
}

#[test]
fn jailed_program_runs_as_tenant_without_capabilities() {
    require_root!();
    let run = run_jailed(
        "caps",
        common::roomy_limits(),
        "while read k v rest; do case $k in Uid:|Gid:|Groups:|CapInh:|CapPrm:|CapEff:|CapBnd:|CapAmb:|NoNewPrivs:) echo \"$k $v\";; esac; done < /proc/self/status",
    );
    assert_eq!(run.exit, ExitRecord::Code(0), "{}", run.output);
    let uid = common::test_uid(0);
    assert!(
        run.output.contains(&format!("Uid: {uid}\n")),
        "{}",
        run.output
    );
    assert!(
        run.output.contains(&format!("Gid: {uid}\n")),
        "{}",
        run.output
    );
    assert!(
        run.output.contains("Groups: \n"),
        "no supplementary groups:\n{}",
        run.output
    );
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert!(
            run.output.contains(&format!("{set}: 0000000000000000\n")),
            "{set} must be empty:\n{}",
            run.output
        );
    }
    assert!(run.output.contains("NoNewPrivs: 1\n"), "{}", run.output);
}

#[test]
fn writable_mount_is_sealed_once_the_trigger_file_appears() {
    require_root!();
    let uid = common::test_uid(0);
    let run = run_jailed_with(
        "seal",
        common::roomy_limits(),
        "echo x > /run/ready || exit 3; i=0; \
         while [ $i -lt 100000 ]; do \
           if ! (echo y > /run/probe$i) 2>/dev/null; then echo sealed; exit 0; fi; i=$((i+1)); \
         done; echo never-sealed",
        |plan, dir| {
            let run = dir.join("run");
            fs::create_dir(&run).unwrap();
            std::os::unix::fs::chown(&run, Some(uid), Some(uid)).unwrap();
            plan.bind(&run, Path::new("/run"), true).unwrap();
            plan.seal = Some(Seal {
                when_exists: "/run/ready".into(),
                mount: "/run".into(),
            });
        },
    );
    assert_eq!(run.exit, ExitRecord::Code(0), "{}", run.output);
    assert!(
        run.output.contains("sealed\n") && !run.output.contains("never-sealed"),
        "{}",
        run.output
    );
}

#[test]
fn jailed_program_has_no_network_but_its_own_loopback() {
    require_root!();
    let run = run_jailed(
        "net",
        common::roomy_limits(),
        "while read name rest; do echo \"if $name\"; done < /proc/self/net/dev",
    );
    assert_eq!(run.exit, ExitRecord::Code(0), "{}", run.output);
    let interfaces: Vec<&str> = run
        .output
        .lines()
        .filter_map(|l| l.strip_prefix("if "))
        .filter(|n| n.ends_with(':'))
        .collect();
    assert_eq!(interfaces, vec!["lo:"], "{}", run.output);
}

#[test]
fn the_launcher_leads_a_session_of_its_own_so_the_daemons_exit_sends_it_nothing() {
    require_root!();
    let tmp = tempfile::tempdir().unwrap();
    let tenant = common::tenant("session");
    let dir = common::tenant_dir(&tmp, &tenant);
    let _cleanup = common::CleanupOnDrop::new(&tenant, &dir);
    let cgroups = Cgroups::detect().unwrap();
    let handle = cgroups.create(&tenant, &common::roomy_limits()).unwrap();
    let plan = shell_plan(&tenant, handle, &dir, "while :; do :; done");
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("vmm.log"))
        .unwrap();
    let launched =
        spawn_launcher(Path::new(env!("CARGO_BIN_EXE_tenantvm-jail")), &plan, &log).unwrap();
    // /proc/PID/stat after the command's name: state, ppid, pgrp, session.
    let stat = fs::read_to_string(format!("/proc/{}/stat", launched.pid)).unwrap();
    let fields: Vec<i32> = stat[stat.rfind(')').unwrap() + 2..]
        .split(' ')
        .skip(1)
        .take(3)
        .map(|f| f.parse().unwrap())
        .collect();
    cleanup_tenant(&cgroups, &tenant, &dir).unwrap();
    let _ = process::wait_nohang(launched.pid);
    // SAFETY: getsid(0) has no preconditions.
    let ours = unsafe { libc::getsid(0) };
    assert_ne!(
        ours, launched.pid,
        "the control: the test's own session is another"
    );
    assert_eq!(
        (fields[1], fields[2]),
        (launched.pid, launched.pid),
        "the launcher's process group and session (its parent is {})",
        fields[0]
    );
}

#[test]
fn exit_status_of_the_program_reaches_the_daemon() {
    require_root!();
    let run = run_jailed("status", common::roomy_limits(), "exit 7");
    assert_eq!(run.exit, ExitRecord::Code(7));
}

#[test]
fn pids_limit_stops_a_fork_bomb() {
    require_root!();
    let limits = ResourceLimits {
        pids_max: 8,
        cpu_quota_us: 10_000,
        ..common::roomy_limits()
    };
    let run = run_jailed(
        "pids",
        limits,
        "i=0; while [ $i -lt 40 ]; do ( while :; do :; done ) & i=$((i+1)); echo started $i; done; echo all-started",
    );
    assert!(!run.output.contains("all-started"), "{}", run.output);
    assert!(run.output.contains("Cannot fork"), "{}", run.output);
    let started = run
        .output
        .lines()
        .filter(|l| l.starts_with("started "))
        .count();
    // launcher + init + sh take 3 of the 8.
    assert!(
        started <= 5,
        "started {started} with pids.max 8:\n{}",
        run.output
    );
}

#[test]
fn memory_limit_stops_a_memory_hog() {
    require_root!();
    let limits = ResourceLimits {
        memory_bytes: 32 << 20,
        ..common::roomy_limits()
    };
    let run = run_jailed(
        "mem",
        limits,
        "x=0123456789abcdef; while :; do x=$x$x; echo len ${#x}; done",
    );
    assert_eq!(
        run.exit,
        ExitRecord::Signal(libc::SIGKILL),
        "the OOM killer ends it:\n{}",
        run.output
    );
    let longest: u64 = run
        .output
        .lines()
        .filter_map(|l| l.strip_prefix("len "))
        .filter_map(|n| n.parse().ok())
        .max()
        .unwrap_or(0);
    assert!(
        longest <= 32 << 20,
        "grew to {longest} bytes under a 32 MiB limit"
    );
}

#[test]
fn cgroup_limits_read_back_and_cleanup_is_idempotent() {
    require_root!();
    let tmp = tempfile::tempdir().unwrap();
    let tenant = common::tenant("cg");
    let dir = common::tenant_dir(&tmp, &tenant);
    let cgroups = Cgroups::detect().unwrap();
    let limits = ResourceLimits {
        memory_bytes: 300 << 20,
        cpu_quota_us: 150_000,
        cpu_period_us: 100_000,
        pids_max: 42,
    };
    let handle = cgroups.create(&tenant, &limits).unwrap();
    assert_eq!(handle.read_limits().unwrap(), limits);
    assert!(list_tenant_cgroups(&cgroups).unwrap().contains(&tenant));
    // A process in the cgroup is killed by cleanup.
    let mut child = std::process::Command::new("/bin/sh")
        .args(["-c", "while :; do sleep 1; done"])
        .spawn()
        .unwrap();
    handle.add_process(child.id()).unwrap();
    assert!(handle
        .members()
        .unwrap()
        .contains(&i32::try_from(child.id()).unwrap()));
    let pid = i32::try_from(child.id()).unwrap();
    cleanup_tenant(&cgroups, &tenant, &dir).unwrap();
    // Killed, and reaped by cleanup since it is our child: no zombie is left behind.
    assert_eq!(process::start_time_ticks(pid).unwrap(), None);
    child.try_wait().unwrap_err();
    for d in handle.dirs() {
        assert!(!d.exists(), "{} removed", d.display());
    }
    assert!(!list_tenant_cgroups(&cgroups).unwrap().contains(&tenant));
    cleanup_tenant(&cgroups, &tenant, &dir).unwrap();
    let _ = File::open(&dir).unwrap();
}

#[test]
fn a_jailed_program_cannot_grow_a_file_past_the_file_size_limit() {
    require_root!();
    let uid = common::test_uid(0);
    let run = run_jailed_with(
        "fsize",
        common::roomy_limits(),
        // 2048 writes of 64 KiB: 128 MiB, twice the limit for a jail without large disks.
        "exec 3>>/out || exit 3; i=0; while [ $i -lt 2048 ]; do \
           printf '%65536s' x >&3 || { echo refused-at $i; exit 0; }; i=$((i+1)); \
         done; echo wrote-all",
        |plan, dir| {
            let out = dir.join("out");
            fs::write(&out, b"").unwrap();
            std::os::unix::fs::chown(&out, Some(uid), Some(uid)).unwrap();
            plan.bind(&out, Path::new("/out"), true).unwrap();
        },
    );
    // Not killed by SIGXFSZ: the write fails (EFBIG) and the program goes on.
    assert_eq!(run.exit, ExitRecord::Code(0), "{}", run.output);
    assert!(
        run.output.contains("refused-at 1024"),
        "the 1025th 64 KiB write must fail at the 64 MiB limit:\n{}",
        run.output
    );
}

#[test]
fn a_process_that_joins_the_cgroup_during_teardown_is_killed_and_the_cgroup_goes() {
    require_root!();
    let cgroups = Cgroups::detect().unwrap();
    let tenant = common::tenant("latejoin");
    let handle = cgroups.create(&tenant, &common::roomy_limits()).unwrap();
    let dirs: Vec<std::path::PathBuf> = handle.dirs().into_iter().cloned().collect();
    let mut late = std::process::Command::new("/bin/sleep")
        .arg("60")
        .spawn()
        .unwrap();
    // A launcher joins its cgroup itself, after the daemon forked it. The window is
    // reproduced exactly: the first sweep has found the cgroup empty, and before any
    // directory is removed, a live process joins every controller's directory.
    let mut joined = false;
    let result = handle.destroy(|_| {
        if !joined {
            joined = true;
            for dir in &dirs {
                fs::write(dir.join("cgroup.procs"), late.id().to_string()).unwrap();
            }
        }
    });
    let status = late.wait().unwrap();
    assert!(joined, "the control: the late joiner was added");
    assert!(result.is_ok(), "teardown: {result:?}");
    assert!(
        dirs.iter().all(|d| !d.exists()),
        "every cgroup directory is gone"
    );
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "the late joiner was killed, not left to run: {status:?}"
    );
}
