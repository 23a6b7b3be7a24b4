//! Tests of the runner's preparation, plans and launch deadlines.

use super::launch::ready_timeout_for;
use super::prepare::{prepare, socket_path};
use super::*;
use crate::backend::vfio_nodes::VfioInterface;
use crate::backend::ResourceLimits;
use crate::jail::{CgroupHandle, CgroupLayout};

/// A config whose cgroups point into a fake tree (nothing here reaches them).
fn fake_config(dir: &Path) -> RuntimeConfig {
    RuntimeConfig {
        jail_binary: dir.join("tenantvm-jail"),
        cgroups: Cgroups::with_layout(CgroupLayout::V2 {
            root: dir.join("fake-cgroupfs"),
        }),
        ready_timeout: Duration::from_secs(1),
        control_timeout: Duration::from_secs(1),
    }
}

fn spec(dir: &Path, tenant: &str) -> VmSpec {
    let kernel = dir.join("kernel");
    fs::write(&kernel, b"k").unwrap();
    VmSpec {
        vsock_cid: None,
        tenant: tenant.into(),
        kernel,
        initramfs: None,
        cmdline: String::new(),
        vcpus: 1,
        memory_mib: 32,
        disks: vec![],
        tenant_dir: dir.join(tenant),
        devices: vec![],
        uuid: None,
        hugepages: None,
    }
}

const JAIL: JailConfig = JailConfig {
    uid: 4242,
    gid: 4242,
    limits: ResourceLimits {
        memory_bytes: 64 << 20,
        cpu_quota_us: 100_000,
        cpu_period_us: 100_000,
        pids_max: 32,
    },
};

#[test]
fn prepare_requires_tenant_dir_named_after_the_tenant() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = spec(tmp.path(), "alpha");
    fs::create_dir(tmp.path().join("other")).unwrap();
    spec.tenant_dir = tmp.path().join("other");
    let err = prepare(&spec, &JAIL, &fake_config(tmp.path()))
        .err()
        .unwrap();
    assert!(matches!(err, BackendError::InvalidSpec(_)), "{err}");
}

#[test]
fn prepare_refuses_a_symlinked_tenant_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec(tmp.path(), "alpha");
    fs::create_dir(tmp.path().join("real")).unwrap();
    std::os::unix::fs::symlink(tmp.path().join("real"), &spec.tenant_dir).unwrap();
    let err = prepare(&spec, &JAIL, &fake_config(tmp.path()))
        .err()
        .unwrap();
    assert!(matches!(err, BackendError::InvalidSpec(_)), "{err}");
    assert!(!tmp.path().join("real/run").exists());
}

#[test]
fn prepare_rejects_relative_or_missing_guest_files() {
    let tmp = tempfile::tempdir().unwrap();
    let base = spec(tmp.path(), "alpha");
    fs::create_dir(&base.tenant_dir).unwrap();
    for bad in [
        VmSpec {
            kernel: "relative/kernel".into(),
            ..base.clone()
        },
        VmSpec {
            initramfs: Some(tmp.path().join("missing")),
            ..base.clone()
        },
    ] {
        assert!(matches!(
            prepare(&bad, &JAIL, &fake_config(tmp.path())),
            Err(BackendError::InvalidSpec(_))
        ));
    }
    assert!(!base.tenant_dir.join("run").exists());
}

#[test]
fn socket_path_rejects_tenant_dirs_too_long_for_sockaddr_un() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = spec(tmp.path(), "alpha");
    socket_path(&spec, "api.sock").unwrap();
    spec.tenant_dir = PathBuf::from(format!("/{}/alpha", "d".repeat(100)));
    assert!(matches!(
        socket_path(&spec, "api.sock"),
        Err(BackendError::InvalidSpec(_))
    ));
}

#[test]
fn a_vm_given_devices_has_time_to_pin_its_ram_and_one_without_does_not() {
    let tmp = tempfile::tempdir().unwrap();
    let base = Duration::from_secs(10);
    let plain = VmSpec {
        memory_mib: 8192,
        ..spec(tmp.path(), "alpha")
    };
    assert_eq!(
        ready_timeout_for(base, &plain),
        base,
        "the control: no devices"
    );
    let with_gpu = VmSpec {
        devices: vec![gpu("0000:41:00.0", 7)],
        ..plain.clone()
    };
    assert_eq!(
        ready_timeout_for(base, &with_gpu),
        Duration::from_secs(10 + 8 * 10)
    );
    let small = VmSpec {
        memory_mib: 512,
        ..with_gpu
    };
    assert_eq!(ready_timeout_for(base, &small), Duration::from_secs(20));
}

#[test]
fn missing_binaries_are_named() {
    let err = check_binary("tenantvm-vmm", Path::new("/no/such/tenantvm-vmm")).unwrap_err();
    assert!(err.to_string().contains("/no/such/tenantvm-vmm"), "{err}");
}

fn gpu(address: &str, group: u32) -> crate::backend::PassthroughDevice {
    crate::backend::PassthroughDevice::Pci {
        address: address.into(),
        iommu_group: group,
    }
}

#[test]
fn memlock_covers_guest_ram_plus_a_margin_when_devices_are_passed() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = spec(tmp.path(), "alpha");
    spec.memory_mib = 16 << 10;
    let jail = JailConfig {
        limits: ResourceLimits {
            memory_bytes: 1 << 30,
            ..JAIL.limits
        },
        ..JAIL
    };
    assert_eq!(memlock_bytes(&spec, &jail), 1 << 30);
    spec.devices = vec![gpu("0000:41:00.0", 17)];
    assert_eq!(
        memlock_bytes(&spec, &jail),
        (16u64 << 30) + MEMLOCK_MARGIN_BYTES
    );
}

#[test]
fn guest_ram_on_huge_pages_raises_the_file_size_limit_to_the_ram() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = spec(tmp.path(), "alpha");
    fs::create_dir(&spec.tenant_dir).unwrap();
    spec.memory_mib = 16 << 10;
    let prepared = || Prepared {
        run_dir: tmp.path().to_path_buf(),
        serial_log: spec.kernel.clone(),
        vmm_log: fs::File::open(&spec.kernel).unwrap(),
        cgroup: CgroupHandle::V2 {
            path: tmp.path().join("cg"),
        },
    };
    let limit = |spec: &VmSpec| {
        base_plan(
            spec,
            &JAIL,
            &prepared(),
            Path::new("/bin/sh"),
            vec![],
            VfioInterface::Legacy,
        )
        .unwrap()
        .file_size_limit
    };
    assert_eq!(limit(&spec), crate::jail::plan::MIN_FILE_SIZE_LIMIT);
    for pages in [
        tenantvm_vmm_api::HugePages::Size2M,
        tenantvm_vmm_api::HugePages::Size1G,
    ] {
        spec.hugepages = Some(pages);
        assert_eq!(limit(&spec), 16 << 30, "{pages}");
    }
}

#[test]
fn a_device_without_its_vfio_node_is_refused_with_what_to_check() {
    if std::path::Path::new("/dev/vfio/4095").exists() {
        tenantvm_skip::skip!("this host has an IOMMU group 4095");
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = spec(tmp.path(), "alpha");
    fs::create_dir(&spec.tenant_dir).unwrap();
    spec.devices = vec![gpu("0000:41:00.0", 4095)];
    let prepared = Prepared {
        run_dir: tmp.path().to_path_buf(),
        serial_log: spec.kernel.clone(),
        vmm_log: fs::File::open(&spec.kernel).unwrap(),
        cgroup: CgroupHandle::V2 {
            path: tmp.path().join("cg"),
        },
    };
    let err = base_plan(
        &spec,
        &JAIL,
        &prepared,
        Path::new("/bin/sh"),
        vec![],
        VfioInterface::Legacy,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("/dev/vfio/4095") && err.contains("vfio-pci"),
        "{err}"
    );
}

#[test]
fn the_group_is_mounted_where_the_devices_relative_link_leads_in_the_jail() {
    // A sysfs-like tree: the device three levels below /sys/devices (behind a bridge),
    // its group under /sys/kernel/iommu_groups, linked relatively as the kernel does.
    let tmp = tempfile::tempdir().unwrap();
    let sys = tmp.path().join("sys");
    let dev = sys.join("devices/pci0000:00/0000:00:01.0/0000:01:00.0");
    let group = sys.join("kernel/iommu_groups/17");
    fs::create_dir_all(&dev).unwrap();
    fs::create_dir_all(group.join("devices")).unwrap();
    std::os::unix::fs::symlink(
        "../../../../kernel/iommu_groups/17",
        dev.join("iommu_group"),
    )
    .unwrap();
    let jail = Path::new("/sys/bus/pci/devices/0000:01:00.0");
    let (host, target) = group_mount(&dev, jail).unwrap();
    assert_eq!(host, group.canonicalize().unwrap());
    // From /sys/bus/pci/devices/0000:01:00.0, four levels up is /sys.
    assert_eq!(target, Path::new("/sys/kernel/iommu_groups/17"));
    // A device on the root bus links one level less far: it resolves elsewhere in the
    // jail, and that is where its group goes.
    let shallow = sys.join("devices/pci0000:00/0000:00:04.0");
    fs::create_dir_all(&shallow).unwrap();
    std::os::unix::fs::symlink(
        "../../../kernel/iommu_groups/17",
        shallow.join("iommu_group"),
    )
    .unwrap();
    let (_, target) =
        group_mount(&shallow, Path::new("/sys/bus/pci/devices/0000:00:04.0")).unwrap();
    assert_eq!(target, Path::new("/sys/bus/kernel/iommu_groups/17"));
    // No link: nothing to mount.
    assert!(group_mount(&group, jail).is_none());
}
