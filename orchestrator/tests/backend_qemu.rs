//! The QEMU backend with a real guest: the stock Debian kernel under `-accel tcg` (it prints
//! its banner, then panics for want of a root filesystem and stays up). Needs root, QEMU and
//! .cache/kernel (scripts/setup.sh); skips with a printed reason otherwise.

mod support;

use std::fs;
use std::path::PathBuf;
use std::time::Duration;
use support::runtime;

use tenantvm::backend::{
    BackendError, ExitReason, JailConfig, QemuAccel, QemuBackend, RuntimeConfig, VmBackend, VmSpec,
    VmState,
};
use tenantvm::jail::cleanup_tenant;

const QEMU: &str = "/usr/bin/qemu-system-x86_64";

fn kernel() -> PathBuf {
    runtime::repo_root().join(".cache/kernel/vmlinuz")
}

fn skip() -> Option<String> {
    if let Some(reason) = runtime::skip_reason() {
        return Some(reason);
    }
    if !PathBuf::from(QEMU).exists() {
        return Some(format!(
            "{QEMU} is not installed (apt-get install qemu-system-x86)"
        ));
    }
    if !kernel().exists() {
        return Some(format!(
            "{} is missing: run scripts/setup.sh",
            kernel().display()
        ));
    }
    None
}

fn backend() -> QemuBackend {
    let mut config = RuntimeConfig::detect().unwrap();
    config.jail_binary = runtime::jail_binary();
    config.ready_timeout = Duration::from_secs(60);
    QemuBackend::new(
        PathBuf::from(QEMU),
        QemuAccel::Tcg,
        tenantvm::backend::qemu::AgentTransport::VirtioSerial,
        config,
    )
}

fn spec(tmp: &tempfile::TempDir, tag: &str) -> VmSpec {
    let tenant = runtime::tenant(tag);
    VmSpec {
        vsock_cid: None,
        tenant_dir: runtime::tenant_dir(tmp, &tenant),
        devices: vec![],
        uuid: None,
        hugepages: None,
        tenant,
        kernel: kernel(),
        initramfs: None,
        cmdline: "console=ttyS0 panic=0".into(),
        vcpus: 1,
        memory_mib: 128,
        disks: vec![],
    }
}

fn jail(slot: u32) -> JailConfig {
    let uid = runtime::test_uid(slot);
    JailConfig {
        uid,
        gid: uid,
        limits: runtime::roomy_limits(),
    }
}

fn uid_of(pid: i32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn qemu_guest_launches_reports_state_and_stops() {
    let _one = runtime::one_guest_at_a_time();
    if let Some(reason) = skip() {
        tenantvm_skip::skip!("{reason}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "qemu");
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let jail = jail(1);
    let backend = backend();
    let vm = backend.launch(&spec, &jail).unwrap();
    assert_eq!(backend.state(&vm).unwrap(), VmState::Running);
    // The guest really runs: its banner reaches serial.log through the jail.
    let serial = spec.tenant_dir.join("serial.log");
    runtime::wait_until(
        Duration::from_secs(120),
        "the kernel banner on serial",
        || {
            fs::read_to_string(&serial)
                .ok()
                .filter(|s| s.contains("Linux version"))
        },
    );
    // QEMU runs as the tenant uid inside the cgroup.
    let members = vm.cgroup.members().unwrap();
    assert!(
        members.iter().any(|p| uid_of(*p) == Some(jail.uid)),
        "no member runs as uid {}",
        jail.uid
    );
    let reason = backend.stop(&vm, Duration::from_secs(4)).unwrap();
    assert!(
        matches!(reason, ExitReason::Stopped | ExitReason::PowerOff),
        "{reason:?}"
    );
    assert!(matches!(
        backend.state(&vm).unwrap(),
        VmState::Exited { .. }
    ));
    // Stopping again reports the same end.
    assert!(matches!(
        backend.stop(&vm, Duration::from_secs(1)).unwrap(),
        ExitReason::Stopped | ExitReason::PowerOff
    ));
    cleanup_tenant(
        &RuntimeConfig::detect().unwrap().cgroups,
        &spec.tenant,
        &spec.tenant_dir,
    )
    .unwrap();
}

#[test]
fn qemu_kvm_accel_opens_the_jails_kvm_node() {
    let _one = runtime::one_guest_at_a_time();
    if let Some(reason) = skip() {
        tenantvm_skip::skip!("{reason}");
    }
    if let Some(reason) = runtime::kvm_unusable() {
        tenantvm_skip::skip!("{reason}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = spec(&tmp, "qkvm");
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    // The ELF vmlinux with its PVH note (QEMU's pvh.bin option ROM, mounted from the host).
    spec.kernel = runtime::repo_root().join(".cache/kernel/vmlinux");
    let mut config = RuntimeConfig::detect().unwrap();
    config.jail_binary = runtime::jail_binary();
    config.ready_timeout = Duration::from_secs(60);
    let backend = QemuBackend::new(
        PathBuf::from(QEMU),
        QemuAccel::Kvm,
        tenantvm::backend::qemu::AgentTransport::VirtioSerial,
        config,
    );
    let vm = backend.launch(&spec, &jail(4)).unwrap();
    assert_eq!(backend.state(&vm).unwrap(), VmState::Running);
    backend.kill(&vm).unwrap();
    assert_eq!(
        backend.state(&vm).unwrap(),
        VmState::Exited {
            status: ExitReason::Signaled {
                signal: libc::SIGKILL
            }
        }
    );
}

#[test]
fn qemu_kill_is_final_and_idempotent() {
    let _one = runtime::one_guest_at_a_time();
    if let Some(reason) = skip() {
        tenantvm_skip::skip!("{reason}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "qkill");
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let backend = backend();
    let vm = backend.launch(&spec, &jail(2)).unwrap();
    backend.kill(&vm).unwrap();
    assert_eq!(
        backend.state(&vm).unwrap(),
        VmState::Exited {
            status: ExitReason::Signaled {
                signal: libc::SIGKILL
            }
        }
    );
    assert!(vm.cgroup.members().unwrap().is_empty());
    backend.kill(&vm).unwrap();
    cleanup_tenant(
        &RuntimeConfig::detect().unwrap().cgroups,
        &spec.tenant,
        &spec.tenant_dir,
    )
    .unwrap();
    assert!(vm.cgroup.dirs().iter().all(|d| !d.exists()));
}

#[test]
fn qemu_launch_rejects_bad_specs_before_starting_anything() {
    if let Some(reason) = skip() {
        tenantvm_skip::skip!("{reason}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let backend = backend();
    let good = spec(&tmp, "qbad");
    let cases = [
        VmSpec {
            kernel: "/no/such/kernel".into(),
            ..good.clone()
        },
        VmSpec {
            vcpus: 0,
            ..good.clone()
        },
        VmSpec {
            memory_mib: 0,
            ..good.clone()
        },
        VmSpec {
            tenant: "../evil".into(),
            ..good.clone()
        },
        VmSpec {
            tenant_dir: tmp.path().to_path_buf(),
            ..good.clone()
        },
        VmSpec {
            cmdline: "a\0b".into(),
            ..good.clone()
        },
        // Reserved vsock CIDs (the host's, VMADDR_CID_ANY).
        VmSpec {
            vsock_cid: Some(2),
            ..good.clone()
        },
        VmSpec {
            vsock_cid: Some(u32::MAX),
            ..good.clone()
        },
    ];
    for bad in cases {
        let err = backend.launch(&bad, &jail(3)).unwrap_err();
        assert!(
            matches!(err, BackendError::InvalidSpec(_) | BackendError::Jail(_)),
            "{bad:?}: {err}"
        );
    }
    let root = JailConfig { uid: 0, ..jail(3) };
    assert!(matches!(
        backend.launch(&good, &root),
        Err(BackendError::InvalidSpec(_))
    ));
    assert!(
        !good.tenant_dir.join("run").exists(),
        "nothing was prepared"
    );
}

/// A SIGSTOPped QEMU never accepts on its QMP socket (backlog 1): the first connection
/// waits in the queue for an answer that never comes, and a second connect(2) would block
/// for good without a deadline. Stop kills the cgroup after one control timeout.
#[test]
fn qemu_a_stopped_qemu_is_stopped_in_bounded_time() {
    let _one = runtime::one_guest_at_a_time();
    if let Some(reason) = skip() {
        tenantvm_skip::skip!("{reason}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "qstop");
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let control = Duration::from_secs(2);
    let mut config = RuntimeConfig::detect().unwrap();
    config.jail_binary = runtime::jail_binary();
    config.ready_timeout = Duration::from_secs(60);
    config.control_timeout = control;
    let backend = QemuBackend::new(
        PathBuf::from(QEMU),
        QemuAccel::Tcg,
        tenantvm::backend::qemu::AgentTransport::VirtioSerial,
        config,
    );
    let vm = backend.launch(&spec, &jail(5)).unwrap();
    assert_eq!(
        backend.agent_endpoint(&vm),
        tenantvm_agent_protocol::AgentEndpoint::Serial(spec.tenant_dir.join("run/agent.sock"))
    );
    runtime::freeze(&vm.cgroup);
    // Twice: the first stop's connection may sit in the one-slot queue; the second
    // connect then meets a full backlog.
    for round in 0..2 {
        let (b, v) = (backend.clone(), vm.clone());
        let (state, took) = runtime::within(Duration::from_secs(60), "state", move || b.state(&v));
        assert!(state.unwrap_err().is_unresponsive(), "round {round}");
        assert!(
            took < control + Duration::from_secs(3),
            "state took {took:?}"
        );
    }
    let (b, v) = (backend.clone(), vm.clone());
    let (stopped, took) = runtime::within(Duration::from_secs(60), "stop", move || {
        b.stop(&v, Duration::from_secs(10))
    });
    assert_eq!(
        stopped.unwrap(),
        ExitReason::Signaled {
            signal: libc::SIGKILL
        }
    );
    assert!(
        took < control + Duration::from_secs(3),
        "stop took {took:?}"
    );
    assert!(vm.cgroup.members().unwrap().is_empty());
    cleanup_tenant(
        &RuntimeConfig::detect().unwrap().cgroups,
        &spec.tenant,
        &spec.tenant_dir,
    )
    .unwrap();
}
