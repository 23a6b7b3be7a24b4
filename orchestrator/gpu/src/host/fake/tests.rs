//! Tests of the fake host tree and its kernel.

use super::*;
use crate::host::PciAddress;

#[test]
fn the_h100x8_tree_has_eight_gpus_each_alone_in_its_group() {
    let host = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
    let s = host.sysfs();
    let devs = s.devices().unwrap();
    let gpus: Vec<_> = devs.iter().filter(|d| d.is_gpu()).collect();
    assert_eq!(gpus.len(), 8);
    for g in gpus {
        let members = s.group_members(g.iommu_group.unwrap()).unwrap();
        assert_eq!(members.len(), 1, "{}", g.address);
    }
    assert_eq!(
        devs.iter().filter(|d| d.device == 0x22a3).count(),
        4,
        "four NVSwitches"
    );
    assert!(devs.iter().filter(|d| d.is_bridge()).count() >= 24);
    let root = host.root().to_path_buf();
    drop(host);
    assert!(!root.exists(), "the tree is removed on drop");
}

#[test]
fn fake_kernel_unbinds_and_probes_with_the_override() {
    let host = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
    let s = host.sysfs();
    let a = PciAddress::parse("0000:01:00.1").unwrap();
    let dir = s.path("sys/bus/pci/devices/0000:01:00.1");
    s.write(&dir.join("driver_override"), "vfio-pci").unwrap();
    s.write(&dir.join("driver/unbind"), a.as_str()).unwrap();
    assert_eq!(s.device(&a).unwrap().driver, None);
    s.write(&s.path("sys/bus/pci/drivers_probe"), a.as_str())
        .unwrap();
    assert_eq!(s.device(&a).unwrap().driver.as_deref(), Some("vfio-pci"));
}

fn errno_of(e: crate::host::HostDeviceError) -> Option<i32> {
    match e {
        crate::host::HostDeviceError::Io { source, .. } => source.raw_os_error(),
        _ => None,
    }
}

#[test]
fn the_fake_kernel_refuses_writes_as_the_kernel_does_and_leaves_the_file() {
    let host = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
    let s = host.sysfs();
    let num = s.path("sys/bus/pci/devices/0000:18:00.0/sriov_numvfs");
    assert_eq!(
        errno_of(s.write(&num, "17").unwrap_err()),
        Some(libc::ERANGE)
    );
    assert_eq!(
        s.read(&num).unwrap(),
        "0",
        "a refused write changes nothing"
    );
    s.write(&num, "4").unwrap();
    assert_eq!(errno_of(s.write(&num, "8").unwrap_err()), Some(libc::EBUSY));
    assert_eq!(s.read(&num).unwrap(), "4");
    let missing = s.path("sys/bus/pci/devices/0000:18:00.0/no_such_attribute");
    assert_eq!(
        errno_of(s.write(&missing, "1").unwrap_err()),
        Some(libc::ENOENT)
    );
    let reset = s.path("sys/bus/pci/devices/0000:18:00.0/reset");
    assert_eq!(
        errno_of(s.write(&reset, "0").unwrap_err()),
        Some(libc::EINVAL)
    );
    s.write(&reset, "1").unwrap();
    assert_eq!(host.resets("0000:18:00.0"), 1);
    // Without a linked driver a VF's type cannot be set, and its ids read ENXIO.
    let vf = s.path("sys/bus/pci/devices/0000:18:00.4/nvidia");
    assert_eq!(
        errno_of(s.write(&vf.join("current_vgpu_type"), "1056").unwrap_err()),
        Some(libc::EINVAL),
        "not creatable"
    );
    assert_eq!(
        s.read_unless_enxio(&vf.join("gpu_instance_id")).unwrap(),
        None
    );
}

#[test]
fn crash_points_stop_the_nth_operation_without_doing_it() {
    let host = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
    let s = host.sysfs();
    let ov = s.path("sys/bus/pci/devices/0000:01:00.1/driver_override");
    host.crash_after(1).unwrap();
    s.write(&ov, "vfio-pci").unwrap();
    let e = s.write(&ov, "pci-stub").unwrap_err();
    assert!(e.to_string().contains(CRASH_MESSAGE), "{e}");
    assert_eq!(
        s.read(&ov).unwrap(),
        "vfio-pci",
        "the crashed write did not happen"
    );
    assert!(host.crash_point().is_err(), "the process stays dead");
    host.no_crash().unwrap();
    s.write(&ov, "").unwrap();
    assert_eq!(s.read(&ov).unwrap(), "(null)");
    assert_eq!(host.ops(), 2);
}
