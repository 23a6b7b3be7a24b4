//! Tests on real hardware. Each runs only when an environment variable names the device and
//! otherwise prints `SKIP <test>: <reason>` to stderr:
//! - `TENANTVM_TEST_GPU=<nvml index>`: places a 1g request on the live host (read-only);
//!   with `TENANTVM_TEST_MIG_CREATE=1` also creates and destroys a 1g GPU instance (needs
//!   root and MIG already enabled on that GPU);
//! - `TENANTVM_TEST_VFIO_GPU=<pci address>`: the whole-card route: binds the GPU's IOMMU
//!   group to vfio-pci, resets the GPU (checked) and rebinds the host drivers (needs root, an
//!   IOMMU, vfio-pci, and an idle GPU);
//! - `TENANTVM_TEST_VGPU=<nvml index>`: the MIG-backed vGPU route (needs root, a Hopper or
//!   newer GPU, NVIDIA's vGPU manager, and no GPU instances on that GPU unless its VFs are
//!   already enabled): prepares the host, makes a 1g instance, types a VF and checks its
//!   `gpu_instance_id`, then undoes every step, leaving MIG mode and VFs as it found them.
//!
//! `scripts/gpu-host-check.sh` runs these with the variables set and prints one summary.

use tenantvm_gpu::backend::nvml::NvmlBackend;
use tenantvm_gpu::backend::{host_gpus, BackendError, GpuBackend};
use tenantvm_gpu::host::{vfio, PciAddress, Sysfs};
use tenantvm_gpu::plan::place::place_on_host;
use tenantvm_gpu::plan::search::DEFAULT_NODE_BUDGET;
use tenantvm_gpu::plan::GpuRequest;
use tenantvm_gpu::route::{vgpu, whole};

fn skip(test: &str, reason: &str) {
    tenantvm_skip::record(&format!("{}::{test}", env!("CARGO_CRATE_NAME")), reason);
}

fn is_root() -> bool {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn live_host_places_a_1g_tenant() {
    const T: &str = "live_host_places_a_1g_tenant";
    let Ok(idx) = std::env::var("TENANTVM_TEST_GPU") else {
        return skip(T, "set TENANTVM_TEST_GPU=<nvml index> on a GPU host");
    };
    let gpu: u32 = idx.parse().expect("TENANTVM_TEST_GPU is a GPU index");
    let b = NvmlBackend::new().expect("NVML loads where TENANTVM_TEST_GPU is set");
    let infos = b.gpus().unwrap();
    let info = infos
        .iter()
        .find(|g| g.index == gpu)
        .expect("the GPU exists");
    eprintln!(
        "GPU {gpu}: {} ({:04x}), driver {:?}, vGPU {:?}",
        info.name, info.pci_device_id, info.driver_major, info.vgpu
    );
    let host = host_gpus(&infos).unwrap();
    eprintln!(
        "sharing: {:?}",
        host.iter().map(|g| &g.sharing).collect::<Vec<_>>()
    );
    let req = GpuRequest {
        profile: Some("1g.10gb".into()),
        ..GpuRequest::default()
    };
    match place_on_host(&infos, &[], "hardware-test", &req, DEFAULT_NODE_BUDGET) {
        Ok(p) => eprintln!("placed: GPU {} {} ({:?})", p.gpu, p.label(), p.pci_address),
        Err(e) => eprintln!("refused (the host decides): {e}"),
    }
    let whole_req = GpuRequest {
        whole_gpu: true,
        ..GpuRequest::default()
    };
    let t = std::time::Instant::now();
    let r = place_on_host(
        &infos,
        &[],
        "hardware-test",
        &whole_req,
        DEFAULT_NODE_BUDGET,
    );
    eprintln!(
        "whole: {:?} in {:?}",
        r.as_ref().map(|p| p.label()),
        t.elapsed()
    );
}

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
    let Some(h) = host.first().filter(|h| h.model.has_mig()) else {
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
    let gi = b.create_gpu_instance(gpu, one.id, start).unwrap();
    assert_eq!(gi.start, start);
    assert!(!gi.has_compute_instance);
    b.ensure_compute_instance(gpu, gi.gi_id).unwrap();
    b.ensure_compute_instance(gpu, gi.gi_id).unwrap();
    let listed = b.gpus().unwrap()[gpu as usize]
        .instances
        .iter()
        .find(|i| i.gi_id == gi.gi_id)
        .cloned();
    let again = b.create_instance(gpu, one.id, start);
    let destroyed = b.destroy_instance(gpu, gi.gi_id);
    assert!(listed.is_some_and(|i| i.has_compute_instance));
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
fn whole_card_bind_reset_and_rebind_on_a_real_gpu() {
    const T: &str = "whole_card_bind_reset_and_rebind_on_a_real_gpu";
    let Ok(addr) = std::env::var("TENANTVM_TEST_VFIO_GPU") else {
        tenantvm_skip::skip!(
            "set TENANTVM_TEST_VFIO_GPU=<pci address> to bind a real GPU to vfio-pci"
        );
    };
    if !is_root() {
        return skip(T, "needs root to write sysfs");
    }
    let s = Sysfs::new("/");
    let gpu = PciAddress::parse(&addr).expect("TENANTVM_TEST_VFIO_GPU is a PCI address");
    let before = s.device(&gpu).unwrap().driver;
    let binding = whole::plan_bind(&s, &gpu).unwrap();
    whole::apply_bind(&s, &binding).unwrap();
    for d in &binding.devices {
        let a = PciAddress::parse(&d.address).unwrap();
        assert_eq!(
            s.device(&a).unwrap().driver.as_deref(),
            Some(vfio::VFIO_DRIVER)
        );
    }
    let t = std::time::Instant::now();
    let reset = whole::reset_gpu(&s, &binding);
    eprintln!("reset: {reset:?} in {:?}", t.elapsed());
    let rebind = whole::rebind_host_drivers(&s, &binding);
    reset.unwrap();
    rebind.unwrap();
    assert_eq!(s.device(&gpu).unwrap().driver, before);
}

#[test]
fn mig_backed_vgpu_on_a_real_gpu() {
    const T: &str = "mig_backed_vgpu_on_a_real_gpu";
    let Ok(idx) = std::env::var("TENANTVM_TEST_VGPU") else {
        return skip(
            T,
            "set TENANTVM_TEST_VGPU=<nvml index> on a host with NVIDIA's vGPU manager",
        );
    };
    if !is_root() {
        return skip(T, "needs root (MIG mode, SR-IOV, vGPU types)");
    }
    let gpu: u32 = idx.parse().expect("TENANTVM_TEST_VGPU is a GPU index");
    let s = Sysfs::new("/");
    let b = NvmlBackend::new().expect("NVML loads");
    let info = b
        .gpus()
        .unwrap()
        .into_iter()
        .find(|g| g.index == gpu)
        .expect("the GPU exists");
    let prep = match vgpu::plan_host(&s, &info) {
        Ok(p) => p,
        Err(e) => return skip(T, &format!("GPU {gpu} cannot enter vGPU mode now: {e}")),
    };
    let host = host_gpus(std::slice::from_ref(&info)).unwrap();
    let model = host[0].model;
    let one = model.profile("19").unwrap();
    vgpu::prepare_host(&s, &b, &prep).unwrap();
    let layout = &host_gpus(&b.gpus().unwrap()).unwrap()[gpu as usize].layout;
    let start = *layout.free_starts(one).first().expect("a free 1g start");
    let pf = PciAddress::parse(&info.pci_address).unwrap();
    let steps = (|| {
        let gi = vgpu::ensure_instance(&b, gpu, one, start)?;
        let a = vgpu::attach(&s, &pf, &gi, one)?;
        eprintln!("attached: {a:?}");
        assert_eq!(a.gpu_instance_id, gi.gi_id);
        vgpu::detach(&s, &a)
    })();
    let destroyed = vgpu::destroy_instance(&b, gpu, one, start);
    // The card leaves vGPU mode only if this test put it there.
    let left = if prep.enables_vfs {
        vgpu::leave_vgpu_mode(&s, &b, &prep)
    } else {
        Ok(())
    };
    steps.unwrap();
    destroyed.unwrap();
    left.unwrap();
}
