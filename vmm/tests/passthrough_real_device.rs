//! Gated on a real host: `TENANTVM_TEST_VFIO_DEVICE=/sys/bus/pci/devices/DDDD:BB:DD.F`, a
//! device already bound to vfio-pci (by hand: driver_override, unbind, drivers_probe, as
//! docs/testing.md shows), with /dev/vfio and KVM usable by the test. The test guest boots with
//! the device passed through and lists bus 0: the device's real vendor:device ids must be
//! there; the exit report records both resets. Prints `SKIP` without the variable.
//!
//! The stock guest image with the NVIDIA driver (`nvidia-smi` in the guest) is the next
//! step on GPU hardware and is not automated here.

use std::path::PathBuf;

use tenantvm_testkit::{exit, guest, require_kvm, GuestImage, Verdict, VmRun};
use tenantvm_vmm_api::ExitReport;

fn sysfs_id(dev: &std::path::Path, file: &str) -> String {
    let raw = std::fs::read_to_string(dev.join(file)).expect("sysfs id");
    raw.trim().trim_start_matches("0x").to_owned()
}

#[test]
fn real_device_reaches_the_guest_with_its_ids() {
    let Some(dev) = std::env::var_os("TENANTVM_TEST_VFIO_DEVICE").map(PathBuf::from) else {
        tenantvm_skip::skip!(
            "set TENANTVM_TEST_VFIO_DEVICE=/sys/bus/pci/devices/BDF (bound to vfio-pci) to pass a real device through"
        );
    };
    require_kvm!("real_device_reaches_the_guest_with_its_ids");
    let ids = format!("{}:{}", sysfs_id(&dev, "vendor"), sysfs_id(&dev, "device"));
    let dir = tempfile::tempdir().unwrap();
    let report_path = dir.path().join("exit.json");
    let out = VmRun::new(
        env!("CARGO_BIN_EXE_tenantvm-vmm"),
        guest(GuestImage::Elf).unwrap(),
    )
    .test("pci-list")
    .args([
        "--device".to_string(),
        format!("vfio,path={}", dev.display()),
        "--exit-report".into(),
        report_path.display().to_string(),
    ])
    .run()
    .unwrap();
    assert_eq!(out.status, Some(exit::POWER_OFF), "{}", out.describe());
    let report = out.report("pci-list").unwrap();
    assert_eq!(report.verdict, Verdict::Pass, "{}", out.describe());
    let listed = report.field("ids").unwrap_or_default();
    assert!(listed.split(',').any(|i| i == ids), "{ids} not in {listed}");
    let exit: ExitReport =
        serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    assert_eq!(exit.devices.len(), 1);
    eprintln!(
        "{}: reset at attach {:?}, at detach {:?}",
        dev.display(),
        exit.devices[0].reset_at_attach,
        exit.devices[0].reset_at_detach
    );
}
