//! The tenantvm-vmm backend with real guests on KVM: a few bytes of 64-bit code in a
//! minimal ELF (the same fixture as the VMM's own tests), jailed. Needs root, /dev/kvm and
//! a built tenantvm-vmm (`cargo build -p tenantvm-vmm`, done by scripts/test.sh); skips
//! with a printed reason otherwise.

mod support;

use std::fs;
use std::path::PathBuf;
use std::time::Duration;
use support::runtime;

use tenantvm::backend::runner::sibling_binary;
use tenantvm::backend::{
    BackendError, ExitReason, JailConfig, RuntimeConfig, VmBackend, VmSpec, VmState, VmmBackend,
};
use tenantvm::jail::cleanup_tenant;

/// 64-bit code: print "hello\n" on COM1, then spin.
const HELLO_SPIN: &[u8] = &[
    0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
    0xb0, b'h', 0xee, 0xb0, b'e', 0xee, 0xb0, b'l', 0xee, 0xb0, b'l', 0xee, 0xb0, b'o', 0xee, 0xb0,
    b'\n', 0xee, 0xeb, 0xfe, // jmp $
];

/// 64-bit code: print "bye\n", then power off through port 0x600.
const BYE_POWEROFF: &[u8] = &[
    0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
    0xb0, b'b', 0xee, 0xb0, b'y', 0xee, 0xb0, b'e', 0xee, 0xb0, b'\n', 0xee, //
    0x66, 0xba, 0x00, 0x06, // mov dx, 0x600
    0xb0, 0x34, 0xee, // mov al, (5 << 2) | (1 << 5); out dx, al
    0xf4, // hlt
];

/// A minimal x86_64 ELF executable: one PT_LOAD segment holding `code` at 1 MiB (entry).
fn tiny_elf(code: &[u8]) -> Vec<u8> {
    const LOAD: u64 = 0x10_0000;
    const CODE_OFFSET: u64 = 0x1000;
    let mut img = Vec::new();
    img.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
    img.extend_from_slice(&2u16.to_le_bytes());
    img.extend_from_slice(&62u16.to_le_bytes());
    img.extend_from_slice(&1u32.to_le_bytes());
    img.extend_from_slice(&LOAD.to_le_bytes());
    img.extend_from_slice(&64u64.to_le_bytes());
    img.extend_from_slice(&0u64.to_le_bytes());
    img.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 1, 64, 0, 0] {
        img.extend_from_slice(&v.to_le_bytes());
    }
    img.extend_from_slice(&1u32.to_le_bytes());
    img.extend_from_slice(&7u32.to_le_bytes());
    for v in [
        CODE_OFFSET,
        LOAD,
        LOAD,
        code.len() as u64,
        code.len() as u64,
        0x1000,
    ] {
        img.extend_from_slice(&v.to_le_bytes());
    }
    img.resize(CODE_OFFSET as usize, 0);
    img.extend_from_slice(code);
    img
}

fn vmm_binary() -> PathBuf {
    sibling_binary("tenantvm-vmm").unwrap()
}

fn skip() -> Option<String> {
    if let Some(reason) = runtime::skip_reason() {
        return Some(reason);
    }
    if let Some(reason) = runtime::kvm_unusable() {
        return Some(reason);
    }
    if !vmm_binary().exists() {
        return Some(format!(
            "{} is not built: run cargo build -p tenantvm-vmm",
            vmm_binary().display()
        ));
    }
    None
}

macro_rules! require {
    () => {
        if let Some(reason) = skip() {
            tenantvm_skip::skip!("{reason}");
        }
    };
}

fn backend() -> VmmBackend {
    let mut config = RuntimeConfig::detect().unwrap();
    config.jail_binary = runtime::jail_binary();
    config.ready_timeout = Duration::from_secs(30);
    VmmBackend::new(vmm_binary(), config)
}

fn spec(tmp: &tempfile::TempDir, tag: &str, code: &[u8]) -> VmSpec {
    let tenant = runtime::tenant(tag);
    let kernel = tmp.path().join(format!("{tag}.elf"));
    fs::write(&kernel, tiny_elf(code)).unwrap();
    VmSpec {
        vsock_cid: None,
        tenant_dir: runtime::tenant_dir(tmp, &tenant),
        devices: vec![],
        uuid: None,
        hugepages: None,
        tenant,
        kernel,
        initramfs: None,
        cmdline: "console=ttyS0".into(),
        vcpus: 1,
        memory_mib: 32,
        disks: vec![],
    }
}

fn jail(slot: u32) -> JailConfig {
    let uid = runtime::test_uid(slot);
    // A spinning guest: half a CPU at most.
    let limits = tenantvm::backend::ResourceLimits {
        cpu_quota_us: 50_000,
        ..runtime::roomy_limits()
    };
    JailConfig {
        uid,
        gid: uid,
        limits,
    }
}

fn cleanup(spec: &VmSpec) {
    cleanup_tenant(
        &RuntimeConfig::detect().unwrap().cgroups,
        &spec.tenant,
        &spec.tenant_dir,
    )
    .unwrap();
}

fn serial(spec: &VmSpec) -> String {
    fs::read_to_string(spec.tenant_dir.join("serial.log")).unwrap_or_default()
}

#[test]
fn vmm_guest_launches_reports_state_and_stops_through_the_socket() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "vmm", HELLO_SPIN);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let backend = backend();
    let vm = backend.launch(&spec, &jail(4)).unwrap();
    assert_eq!(vm.api_sock, spec.tenant_dir.join("run/api.sock"));
    assert_eq!(backend.state(&vm).unwrap(), VmState::Running);
    // A second launch for the same tenant is refused and leaves the first VM alone.
    assert!(matches!(
        backend.launch(&spec, &jail(4)),
        Err(BackendError::AlreadyRunning { .. })
    ));
    assert_eq!(backend.state(&vm).unwrap(), VmState::Running);
    runtime::wait_until(Duration::from_secs(30), "hello on serial", || {
        serial(&spec).contains("hello\n").then_some(())
    });
    assert_eq!(
        backend.stop(&vm, Duration::from_secs(10)).unwrap(),
        ExitReason::Stopped
    );
    assert_eq!(
        backend.state(&vm).unwrap(),
        VmState::Exited {
            status: ExitReason::Stopped
        }
    );
    cleanup(&spec);
}

#[test]
fn vmm_exit_report_is_written_in_the_jail_and_read_back_after_the_stop() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "vreport", HELLO_SPIN);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let backend = backend();
    let vm = backend.launch(&spec, &jail(16)).unwrap();
    // Only an ended VMM's report counts.
    assert_eq!(backend.exit_report(&vm).unwrap(), None);
    assert_eq!(
        backend.stop(&vm, Duration::from_secs(10)).unwrap(),
        ExitReason::Stopped
    );
    let report = backend
        .exit_report(&vm)
        .unwrap()
        .expect("the VMM wrote its exit report to /report in its jail");
    assert_eq!(report.status, 6, "stopped on request");
    assert!(report.devices.is_empty(), "{report:?}");
    cleanup(&spec);
}

/// `nr_throttled` from the cgroup's cpu.stat (v1 cpu hierarchy or v2 directory).
fn nr_throttled(cgroup: &tenantvm::jail::CgroupHandle) -> u64 {
    let dir = match cgroup {
        tenantvm::jail::CgroupHandle::V1 { cpu, .. } => cpu,
        tenantvm::jail::CgroupHandle::V2 { path } => path,
    };
    let stat = fs::read_to_string(dir.join("cpu.stat")).unwrap();
    stat.lines()
        .find_map(|l| l.strip_prefix("nr_throttled "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn vmm_spinning_guest_is_throttled_by_the_cpu_quota() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "vcpu", HELLO_SPIN);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let backend = backend();
    // 10 ms of CPU per 100 ms for a guest that spins forever.
    let mut jail = jail(14);
    jail.limits.cpu_quota_us = 10_000;
    let vm = backend.launch(&spec, &jail).unwrap();
    runtime::wait_until(
        Duration::from_secs(60),
        "the cgroup to throttle the guest",
        || (nr_throttled(&vm.cgroup) > 0).then_some(()),
    );
    assert_eq!(backend.state(&vm).unwrap(), VmState::Running);
    backend.kill(&vm).unwrap();
}

#[test]
fn vmm_recycled_pid_is_not_mistaken_for_the_vm() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "vpid", HELLO_SPIN);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let backend = backend();
    let vm = backend.launch(&spec, &jail(9)).unwrap();
    // Same pid, another start time: what a recycled pid looks like after a host reboot
    // or a long daemon outage.
    let impostor = tenantvm::backend::RunningVm {
        start_time_ticks: vm.start_time_ticks + 1,
        ..vm.clone()
    };
    assert_eq!(backend.state(&impostor).unwrap(), VmState::Gone);
    assert_eq!(backend.state(&vm).unwrap(), VmState::Running);
    backend.kill(&vm).unwrap();
    cleanup(&spec);
}

#[test]
fn vmm_socket_swapped_for_another_tenants_is_refused() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let a = spec(&tmp, "vswapa", HELLO_SPIN);
    let _cleanup_a = runtime::CleanupOnDrop::new(&a.tenant, &a.tenant_dir);
    let b = spec(&tmp, "vswapb", HELLO_SPIN);
    let _cleanup_b = runtime::CleanupOnDrop::new(&b.tenant, &b.tenant_dir);
    let backend = backend();
    let vm_a = backend.launch(&a, &jail(12)).unwrap();
    let vm_b = backend.launch(&b, &jail(13)).unwrap();
    // A compromised VMM of tenant A replaces its socket (in its writable /run) with a
    // symlink to B's, hoping the daemon stops B when it stops A.
    fs::remove_file(&vm_a.api_sock).unwrap();
    std::os::unix::fs::symlink(&vm_b.api_sock, &vm_a.api_sock).unwrap();
    let err = backend.state(&vm_a).unwrap_err();
    assert!(err.to_string().contains("refusing"), "{err}");
    assert_eq!(
        backend.stop(&vm_a, Duration::from_secs(1)).unwrap(),
        ExitReason::Signaled {
            signal: libc::SIGKILL
        }
    );
    assert_eq!(
        backend.state(&vm_b).unwrap(),
        VmState::Running,
        "B is untouched"
    );
    assert_eq!(
        backend.stop(&vm_b, Duration::from_secs(10)).unwrap(),
        ExitReason::Stopped
    );
}

#[test]
fn vmm_paused_guest_reads_as_paused() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "vpause", HELLO_SPIN);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let backend = backend();
    let vm = backend.launch(&spec, &jail(10)).unwrap();
    let mut conn = std::os::unix::net::UnixStream::connect(&vm.api_sock).unwrap();
    std::io::Write::write_all(&mut conn, b"{\"command\":\"pause\"}\n").unwrap();
    let mut answer = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(&conn), &mut answer).unwrap();
    assert!(answer.contains("\"ok\":true"), "{answer}");
    assert_eq!(backend.state(&vm).unwrap(), VmState::Paused);
    assert_eq!(
        backend.stop(&vm, Duration::from_secs(10)).unwrap(),
        ExitReason::Stopped
    );
    cleanup(&spec);
}

/// Environment variable naming the tenant dir root for the adoption helper below.
const ADOPT_ENV: &str = "TENANTVM_TEST_ADOPT_DIR";

/// Helper run in a separate process by `vmm_adopted_after_daemon_restart_is_managed`: it
/// plays a daemon that launches a VM, prints the RunningVm and dies without waiting.
#[test]
#[ignore = "run by vmm_adopted_after_daemon_restart_is_managed in a child process"]
fn adopt_helper_launch_and_exit() {
    let Ok(root) = std::env::var(ADOPT_ENV) else {
        tenantvm_skip::skip!("only meaningful when {ADOPT_ENV} is set by the adoption test");
    };
    let root = PathBuf::from(root);
    let tenant = runtime::tenant("vadopt");
    let kernel = root.join("adopt.elf");
    fs::write(&kernel, tiny_elf(HELLO_SPIN)).unwrap();
    let dir = root.join(&tenant);
    fs::create_dir_all(&dir).unwrap();
    let spec = VmSpec {
        vsock_cid: None,
        tenant_dir: dir,
        devices: vec![],
        uuid: None,
        hugepages: None,
        tenant,
        kernel,
        initramfs: None,
        cmdline: String::new(),
        vcpus: 1,
        memory_mib: 32,
        disks: vec![],
    };
    let vm = backend().launch(&spec, &jail(11)).unwrap();
    println!("RUNNING_VM={}", serde_json::to_string(&vm).unwrap());
}

#[test]
fn vmm_adopted_after_daemon_restart_is_managed() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "adopt_helper_launch_and_exit",
            "--nocapture",
        ])
        .env(ADOPT_ENV, tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RUNNING_VM="))
        .unwrap_or_else(|| {
            panic!(
                "helper printed no RunningVm: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let vm: tenantvm::backend::RunningVm = serde_json::from_str(json).unwrap();
    let _cleanup = runtime::CleanupOnDrop::new(&vm.tenant, &vm.tenant_dir);
    // The "old daemon" is gone; this process is not the launcher's parent.
    assert!(tenantvm::jail::process::wait_nohang(vm.pid).is_none());
    let backend = backend();
    assert_eq!(backend.state(&vm).unwrap(), VmState::Running);
    assert_eq!(
        backend.stop(&vm, Duration::from_secs(10)).unwrap(),
        ExitReason::Stopped
    );
    // The status comes from vmm.exit, not from waitpid.
    assert_eq!(
        backend.state(&vm).unwrap(),
        VmState::Exited {
            status: ExitReason::Stopped
        }
    );
    cleanup_tenant(
        &RuntimeConfig::detect().unwrap().cgroups,
        &vm.tenant,
        &vm.tenant_dir,
    )
    .unwrap();
}

#[test]
fn vmm_kill_is_final_and_idempotent() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "vkill", HELLO_SPIN);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let backend = backend();
    let vm = backend.launch(&spec, &jail(5)).unwrap();
    backend.kill(&vm).unwrap();
    assert_eq!(
        backend.state(&vm).unwrap(),
        VmState::Exited {
            status: ExitReason::Signaled {
                signal: libc::SIGKILL
            }
        }
    );
    backend.kill(&vm).unwrap();
    assert_eq!(
        backend.stop(&vm, Duration::from_secs(1)).unwrap(),
        ExitReason::Signaled {
            signal: libc::SIGKILL
        }
    );
    cleanup(&spec);
}

#[test]
fn vmm_guest_power_off_is_reported() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "voff", BYE_POWEROFF);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let backend = backend();
    // The guest may power off before the socket answers: both paths carry the reason.
    match backend.launch(&spec, &jail(6)) {
        Ok(vm) => {
            let state =
                runtime::wait_until(Duration::from_secs(30), "the guest to power off", || {
                    match backend.state(&vm).unwrap() {
                        VmState::Running => None,
                        other => Some(other),
                    }
                });
            assert_eq!(
                state,
                VmState::Exited {
                    status: ExitReason::PowerOff
                }
            );
        }
        Err(BackendError::LaunchFailed { reason, .. }) => assert_eq!(reason, ExitReason::PowerOff),
        Err(e) => panic!("{e}"),
    }
    assert_eq!(serial(&spec), "bye\n");
    cleanup(&spec);
}

#[test]
fn vmm_bad_kernel_fails_launch_with_reason_and_log() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "vbad", HELLO_SPIN);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    fs::write(&spec.kernel, b"this is not a kernel").unwrap();
    let err = backend().launch(&spec, &jail(7)).unwrap_err();
    match err {
        BackendError::LaunchFailed { reason, log_tail } => {
            assert_eq!(reason, ExitReason::StartFailure { code: 11 });
            assert!(log_tail.contains("tenantvm-vmm"), "{log_tail}");
        }
        other => panic!("{other}"),
    }
    // Nothing of the failed launch is left: no process, no cgroup.
    let cgroup = RuntimeConfig::detect()
        .unwrap()
        .cgroups
        .handle(&spec.tenant)
        .unwrap();
    assert!(cgroup.dirs().iter().all(|d| !d.exists()));
    cleanup(&spec);
}

#[test]
fn vmm_attaches_a_rate_limited_disk_as_virtio_blk() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = spec(&tmp, "vdisk", HELLO_SPIN);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let image = tmp.path().join("disk.img");
    fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    spec.disks.push(tenantvm::backend::DiskAttachment {
        path: image,
        read_only: true,
        limit: Some(tenantvm::backend::DiskRateLimit {
            bytes_per_s: 1 << 20,
            ops_per_s: 100,
        }),
    });
    let backend = backend();
    let vm = backend.launch(&spec, &jail(8)).unwrap();
    assert_eq!(backend.state(&vm).unwrap(), VmState::Running);
    // The VMM reports the disk's device counters under the id the backend gave it.
    let mut sock = std::os::unix::net::UnixStream::connect(&vm.api_sock).unwrap();
    std::io::Write::write_all(&mut sock, b"{\"command\":\"metrics\"}\n").unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(&sock), &mut line).unwrap();
    let answer: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(answer["ok"], serde_json::json!(true), "{line}");
    let devices = answer["devices"].as_object().unwrap();
    assert!(devices.keys().any(|k| k.starts_with("disk0")), "{line}");
    backend.kill(&vm).unwrap();
    cleanup(&spec);
}

/// The config file the backend writes passes the VMM's own parser and validation
/// (`tenantvm-vmm --check`, which opens nothing: the paths are the jail's). Needs only a
/// built tenantvm-vmm.
#[test]
fn vmm_the_config_the_backend_writes_passes_the_vmms_own_check() {
    if !vmm_binary().exists() {
        tenantvm_skip::skip!(
            "{} is not built: run cargo build -p tenantvm-vmm",
            vmm_binary().display()
        );
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = spec(&tmp, "vcheck", HELLO_SPIN);
    spec.initramfs = Some(spec.kernel.clone());
    spec.vcpus = 2;
    spec.memory_mib = 96;
    spec.disks.push(tenantvm::backend::DiskAttachment {
        path: tmp.path().join("disk.img"),
        read_only: false,
        limit: Some(tenantvm::backend::DiskRateLimit {
            bytes_per_s: 1 << 20,
            ops_per_s: 100,
        }),
    });
    let written = tenantvm::backend::vmm::Vmm::config_file(
        &spec,
        tenantvm::backend::vfio_nodes::VfioInterface::Legacy,
    )
    .unwrap();
    let file = tmp.path().join("vm.json");
    fs::write(&file, written.to_json().unwrap()).unwrap();
    let out = std::process::Command::new(vmm_binary())
        .args(["--check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // What the VMM resolved is what the backend meant.
    let resolved: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(resolved["kernel"], "/vm/kernel");
    assert_eq!(resolved["initramfs"], "/vm/initramfs");
    assert_eq!(resolved["vcpus"], 2);
    assert_eq!(resolved["memory_mib"], 96);
    assert_eq!(resolved["serial"], "file:/log/serial.log");
    assert_eq!(resolved["api_sock"], "/run/api.sock");
    assert_eq!(resolved["disks"][0]["path"], "/vm/disk0");
    assert_eq!(resolved["disks"][0]["rate_limit"]["bytes_per_sec"], 1 << 20);
    assert_eq!(resolved["vsock"]["uds_path"], "/run/vsock.sock");
    assert_eq!(resolved["seccomp"], "on");
}

/// A SIGSTOPped tenantvm-vmm (a wedged or hostile VMM) accepts a connection but never
/// answers: state gives up at the control timeout, and stop kills the cgroup then instead
/// of waiting out the grace period and more.
#[test]
fn vmm_a_stopped_vmm_is_stopped_in_bounded_time() {
    require!();
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, "vstop", HELLO_SPIN);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let mut backend = backend();
    let control = Duration::from_secs(2);
    {
        let mut config = backend.config().clone();
        config.control_timeout = control;
        backend = VmmBackend::new(vmm_binary(), config);
    }
    let vm = backend.launch(&spec, &jail(15)).unwrap();
    assert_eq!(backend.state(&vm).unwrap(), VmState::Running);
    // The VM got its agent channel: the vsock socket exists beside the control socket.
    let endpoint = backend.agent_endpoint(&vm);
    assert_eq!(
        endpoint,
        tenantvm_agent_protocol::AgentEndpoint::vsock(spec.tenant_dir.join("run/vsock.sock"))
    );
    assert!(endpoint.path().is_some_and(|p| p.exists()));
    runtime::freeze(&vm.cgroup);
    let (b, v) = (backend.clone(), vm.clone());
    let (state, took) = runtime::within(Duration::from_secs(60), "state", move || b.state(&v));
    let err = state.unwrap_err();
    assert!(err.is_unresponsive(), "{err}");
    assert!(
        took < control + Duration::from_secs(3),
        "state took {took:?}"
    );
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
    // One control timeout to find it does not answer, then the kill: not the 10 s grace.
    assert!(
        took < control + Duration::from_secs(3),
        "stop took {took:?}"
    );
    assert!(vm.cgroup.members().unwrap().is_empty());
    cleanup(&spec);
}
