//! Tests on real hardware. Each runs only when an environment variable names the device and
//! otherwise prints why it skips:
//! - `TENANTVM_TEST_GPU=<nvml index>` with `TENANTVM_TEST_MIG_CREATE=1`: creates and destroys
//!   a 1g GPU instance (needs root and MIG already enabled on that GPU);
//! - `TENANTVM_TEST_VFIO_GPU=<pci address>`: binds the GPU's IOMMU group to vfio-pci and gives
//!   the drivers back (needs root, an IOMMU, vfio-pci, and an idle GPU).

use tenantvm_gpu::backend::nvml::NvmlBackend;
use tenantvm_gpu::backend::{host_gpus, BackendError, GpuBackend};
use tenantvm_gpu::host::{vfio, PciAddress, Sysfs};

#[test]
fn nvml_create_overlap_and_destroy_follow_the_simulated_rules() {
    let (Ok(idx), Ok(_)) = (
        std::env::var("TENANTVM_TEST_GPU"),
        std::env::var("TENANTVM_TEST_MIG_CREATE"),
    ) else {
        tenantvm_skip::skip!(
            "set TENANTVM_TEST_GPU=<index> and TENANTVM_TEST_MIG_CREATE=1 to create a MIG instance"
        );
    };
    let gpu: u32 = idx.parse().expect("TENANTVM_TEST_GPU is a GPU index");
    let b = NvmlBackend::new().expect("NVML loads");
    let infos = b.gpus().unwrap();
    let info = infos
        .iter()
        .find(|g| g.index == gpu)
        .expect("the GPU exists");
    if !info.mig_enabled {
        tenantvm_skip::skip!(
            "MIG is disabled on GPU {gpu} (enable it with `nvidia-smi -i {gpu} -mig 1`)"
        );
    }
    let host = host_gpus(std::slice::from_ref(info)).unwrap();
    let Some(h) = host.first() else {
        tenantvm_skip::skip!("GPU {gpu} is not in the MIG database");
    };
    let one = h.model.profile("19").unwrap();
    let placements = b.possible_placements(gpu, one.id).unwrap();
    assert_eq!(
        placements,
        one.starts
            .iter()
            .map(|s| (*s, one.size))
            .collect::<Vec<_>>()
    );
    let Some(start) = h.layout.free_starts(one).first().copied() else {
        tenantvm_skip::skip!("no free 1g start on GPU {gpu}");
    };
    let gi = b.create_instance(gpu, one.id, start).unwrap();
    assert_eq!(gi.start, start);
    let again = b.create_instance(gpu, one.id, start);
    let destroyed = b.destroy_instance(gpu, gi.gi_id);
    assert!(
        matches!(again, Err(BackendError::InsufficientResources { .. })),
        "{again:?}"
    );
    destroyed.unwrap();
    assert!(matches!(
        b.destroy_instance(gpu, gi.gi_id),
        Err(BackendError::NoSuchInstance { .. })
    ));
}

#[test]
fn vfio_bind_and_release_restore_the_real_drivers() {
    let Ok(addr) = std::env::var("TENANTVM_TEST_VFIO_GPU") else {
        tenantvm_skip::skip!(
            "set TENANTVM_TEST_VFIO_GPU=<pci address> to bind a real GPU to vfio-pci"
        );
    };
    let s = Sysfs::new("/");
    let gpu = PciAddress::parse(&addr).expect("TENANTVM_TEST_VFIO_GPU is a PCI address");
    let before = s.device(&gpu).unwrap().driver;
    let binding = vfio::bind_group(&s, &gpu).unwrap();
    for d in &binding.devices {
        let a = PciAddress::parse(&d.address).unwrap();
        assert_eq!(
            s.device(&a).unwrap().driver.as_deref(),
            Some(vfio::VFIO_DRIVER)
        );
    }
    vfio::release(&s, &binding).unwrap();
    assert_eq!(s.device(&gpu).unwrap().driver, before);
}
