//! What the host will hold, through a real tenantvmd: a tenant larger than the host is
//! refused before anything is recorded; a tenant's VMM runs under a block I/O cgroup limit
//! on the device that holds its disk (v1 blkio throttle here, v2 io.max elsewhere) and
//! under RLIMIT_FSIZE. The idle test guest under tenantvm-vmm on KVM. Skips without root
//! or /dev/kvm.

mod support;

use std::path::{Path, PathBuf};

use support::daemon::{self, TestDaemon};
use support::departure::{cli, create, create_spec, ok, text};

#[test]
fn a_tenant_larger_than_the_host_is_refused_before_anything_is_recorded() {
    if daemon::should_skip("a_tenant_larger_than_the_host_is_refused_before_anything_is_recorded") {
        return;
    }
    let mut d = TestDaemon::new();
    d.start(None);
    let name = daemon::unique("tib");
    let o = create_spec(
        &d,
        &name,
        "memory_mib = 1048576\n[image]\nname = \"idle\"\n",
    );
    assert_eq!(o.status.code(), Some(6), "{}", text(&o));
    assert!(text(&o).contains("--memory-overcommit"), "{}", text(&o));
    assert!(d.store().tenant(&name).unwrap().is_none());
    d.stop();
}

/// The tenant's cgroup directory in the blkio (v1) or unified (v2) hierarchy.
fn io_cgroup(d: &TestDaemon, tenant: &str) -> PathBuf {
    let sub = tenantvm::jail::cgroup::daemon_subtree(&d.state_dir()).unwrap();
    let root = Path::new(tenantvm::jail::cgroup::DEFAULT_CGROUP_ROOT);
    if root.join("cgroup.controllers").exists() {
        root.join(sub).join(tenant)
    } else {
        root.join("blkio").join(sub).join(tenant)
    }
}

/// "Max file size" soft limit of a process, from /proc/PID/limits.
fn max_file_size(pid: i32) -> Option<String> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max file size"))?;
    line.split_whitespace().nth(3).map(str::to_string)
}

#[test]
fn a_tenants_vmm_runs_under_block_io_and_file_size_limits() {
    if daemon::should_skip("a_tenants_vmm_runs_under_block_io_and_file_size_limits") {
        return;
    }
    let mut d = TestDaemon::new();
    d.start(None);
    let name = daemon::unique("io");
    ok(
        create(
            &d,
            &name,
            "disk_gib = 1\n[quotas]\ndisk_mib_per_s = 7\ndisk_iops = 300",
        ),
        "create with a disk",
        &d,
    );
    let dir = io_cgroup(&d, &name);
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    if v2 {
        let io_max = std::fs::read_to_string(dir.join("io.max")).unwrap();
        assert!(
            io_max.contains("rbps=7340032 wbps=7340032 riops=300 wiops=300"),
            "{io_max}"
        );
    } else {
        for (file, value) in [
            ("blkio.throttle.read_bps_device", "7340032"),
            ("blkio.throttle.write_bps_device", "7340032"),
            ("blkio.throttle.read_iops_device", "300"),
            ("blkio.throttle.write_iops_device", "300"),
        ] {
            let text = std::fs::read_to_string(dir.join(file))
                .unwrap_or_else(|e| panic!("{}: {e}", dir.join(file).display()));
            assert!(
                text.lines().any(|l| l.ends_with(&format!(" {value}"))),
                "{file}: {text:?}"
            );
        }
    }
    // Every process of the VM (launcher, init, VMM) is in that cgroup, and the VMM (the
    // one running as the tenant's uid) may not grow a file past its 1 GiB disk.
    let members = daemon::processes_in_cgroup_of(&name);
    assert!(!members.is_empty());
    let limits: Vec<Option<String>> = members.iter().map(|p| max_file_size(*p)).collect();
    assert!(
        limits.iter().any(|l| l.as_deref() == Some("1073741824")),
        "no VM process has RLIMIT_FSIZE = 1 GiB: {limits:?}"
    );
    ok(cli(&d, None, &["destroy", &name]), "destroy", &d);
    assert!(!dir.exists(), "{} left behind", dir.display());
    d.stop();
}
