//! Both backends with the in-tree no_std test guest (`target/test-guests/tvm-testguest`,
//! built by scripts/build-test-guests.sh, see docs/test-guests.md), jailed: the same PVH
//! ELF under tenantvm-vmm and under QEMU (kvm and tcg). Needs root, /dev/kvm, the built
//! guest and binaries; skips with a printed reason otherwise.

mod support;

use std::fs;
use std::path::PathBuf;
use std::time::Duration;
use support::runtime;

use tenantvm::backend::runner::sibling_binary;
use tenantvm::backend::{
    BackendError, ExitReason, JailConfig, QemuAccel, QemuBackend, RuntimeConfig, VmBackend, VmSpec,
    VmState, VmmBackend,
};

const QEMU: &str = "/usr/bin/qemu-system-x86_64";

fn guest() -> PathBuf {
    runtime::repo_root().join("target/test-guests/tvm-testguest")
}

fn skip() -> Option<String> {
    if let Some(reason) = runtime::skip_reason() {
        return Some(reason);
    }
    if let Some(reason) = runtime::kvm_unusable() {
        return Some(reason);
    }
    if !guest().exists() {
        return Some(format!(
            "{} is not built: run scripts/build-test-guests.sh",
            guest().display()
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

fn config() -> RuntimeConfig {
    let mut config = RuntimeConfig::detect().unwrap();
    config.jail_binary = runtime::jail_binary();
    config.ready_timeout = Duration::from_secs(60);
    config
}

fn vmm_backend() -> Option<VmmBackend> {
    let bin = sibling_binary("tenantvm-vmm").unwrap();
    if !bin.exists() {
        tenantvm_skip::record_skip!(
            "{} is not built: run cargo build -p tenantvm-vmm",
            bin.display()
        );
        return None;
    }
    Some(VmmBackend::new(bin, config()))
}

fn qemu_backend(accel: QemuAccel) -> Option<QemuBackend> {
    if !PathBuf::from(QEMU).exists() {
        tenantvm_skip::record_skip!("{QEMU} is not installed (apt-get install qemu-system-x86)");
        return None;
    }
    Some(QemuBackend::new(
        PathBuf::from(QEMU),
        accel,
        tenantvm::backend::qemu::AgentTransport::VirtioSerial,
        config(),
    ))
}

fn spec(tmp: &tempfile::TempDir, tag: &str, test: &str, vcpus: u32) -> VmSpec {
    let tenant = runtime::tenant(tag);
    VmSpec {
        vsock_cid: None,
        tenant_dir: runtime::tenant_dir(tmp, &tenant),
        devices: vec![],
        uuid: None,
        hugepages: None,
        tenant,
        kernel: guest(),
        initramfs: None,
        cmdline: format!("tvm.test={test}"),
        vcpus,
        memory_mib: 64,
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

fn serial(spec: &VmSpec) -> String {
    fs::read_to_string(spec.tenant_dir.join("serial.log")).unwrap_or_default()
}

/// Launches the idle test, waits for its ticks on serial.log, checks the state, stops it.
fn idle_guest_runs_and_stops(
    backend: &dyn VmBackend,
    tag: &str,
    slot: u32,
    expected_stop: &[ExitReason],
) {
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, tag, "idle", 1);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let vm = backend.launch(&spec, &jail(slot)).unwrap();
    runtime::wait_until(
        Duration::from_secs(120),
        "the idle guest's ticks on serial",
        || {
            let s = serial(&spec);
            (s.contains("TVMTEST idle READY") && s.contains("tick 2")).then_some(())
        },
    );
    assert_eq!(backend.state(&vm).unwrap(), VmState::Running);
    let reason = backend.stop(&vm, Duration::from_secs(6)).unwrap();
    assert!(expected_stop.contains(&reason), "{reason:?}");
    assert!(matches!(
        backend.state(&vm).unwrap(),
        VmState::Exited { .. }
    ));
}

#[test]
fn vmm_backend_runs_the_test_guest() {
    let _one = runtime::one_guest_at_a_time();
    require!();
    let Some(backend) = vmm_backend() else { return };
    idle_guest_runs_and_stops(&backend, "gvmm", 20, &[ExitReason::Stopped]);
}

#[test]
fn qemu_kvm_backend_runs_the_test_guest() {
    let _one = runtime::one_guest_at_a_time();
    require!();
    let Some(backend) = qemu_backend(QemuAccel::Kvm) else {
        return;
    };
    // The guest has no ACPI power button handling: powerdown is ignored, then QEMU quits.
    idle_guest_runs_and_stops(&backend, "gqkvm", 21, &[ExitReason::Stopped]);
}

#[test]
fn qemu_tcg_backend_runs_the_test_guest() {
    let _one = runtime::one_guest_at_a_time();
    require!();
    let Some(backend) = qemu_backend(QemuAccel::Tcg) else {
        return;
    };
    idle_guest_runs_and_stops(&backend, "gqtcg", 22, &[ExitReason::Stopped]);
}

/// Runs a test guest that ends on its own; returns how, and its serial output.
fn run_to_end(
    backend: &dyn VmBackend,
    tag: &str,
    test: &str,
    vcpus: u32,
    slot: u32,
) -> (ExitReason, String) {
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(&tmp, tag, test, vcpus);
    let _cleanup = runtime::CleanupOnDrop::new(&spec.tenant, &spec.tenant_dir);
    let reason = match backend.launch(&spec, &jail(slot)) {
        Ok(vm) => runtime::wait_until(
            Duration::from_secs(120),
            "the guest to end",
            || match backend.state(&vm).unwrap() {
                VmState::Exited { status } => Some(status),
                _ => None,
            },
        ),
        // Quick guests can end before the socket is first asked.
        Err(BackendError::LaunchFailed { reason, .. }) => reason,
        Err(e) => panic!("{e}"),
    };
    (reason, serial(&spec))
}

#[test]
fn vmm_backend_smp_guest_passes_inside_the_jail() {
    let _one = runtime::one_guest_at_a_time();
    require!();
    let Some(backend) = vmm_backend() else { return };
    let (reason, serial) = run_to_end(&backend, "gsmp", "smp", 2, 23);
    assert!(serial.contains("TVMTEST smp PASS cpus=2"), "{serial}");
    assert_eq!(reason, ExitReason::PowerOff);
}

#[test]
fn vmm_backend_reports_guest_panic() {
    let _one = runtime::one_guest_at_a_time();
    require!();
    let Some(backend) = vmm_backend() else { return };
    let (reason, serial) = run_to_end(&backend, "gpanic", "panic", 1, 24);
    assert!(serial.contains("TVMTEST panic PANIC"), "{serial}");
    assert_eq!(reason, ExitReason::GuestPanic);
}
