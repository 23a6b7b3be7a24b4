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
