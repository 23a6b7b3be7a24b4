//! The MIG-backed vGPU route on the FAKE sysfs tree linked to the SIMULATED GPU host: the
//! right order works end to end, and every wrong order the driver punishes fails here too.

mod common;

use common::vgpu_host;
use tenantvm_gpu::backend::{BackendError, GpuBackend};
use tenantvm_gpu::host::vgpu::{self as vf, VgpuError};
use tenantvm_gpu::host::{sriov, vfio, HostDeviceError, PciAddress};
use tenantvm_gpu::mig::{model_by_key, MigProfile};
use tenantvm_gpu::plan::Share;
use tenantvm_gpu::route::vgpu::{self, VgpuRouteError};
use tenantvm_gpu::route::{route_for, whole, Route};

const GPU2: u32 = 2;
const PF2: &str = "0000:3a:00.0";
const GPU6: u32 = 6;
const PF6: &str = "0000:ba:00.0";

fn p(name: &str) -> &'static MigProfile {
    model_by_key("h100-80gb").unwrap().profile(name).unwrap()
}

fn addr(a: &str) -> PciAddress {
    PciAddress::parse(a).unwrap()
}

fn typed(h: &common::VgpuHost, pf: &str) -> usize {
    vgpu::vgpu_state(&h.sysfs, &addr(pf)).unwrap().len()
}

#[test]
fn the_right_order_attaches_verifies_and_gives_everything_back() {
    let h = vgpu_host();
    let info = h.gpu(GPU6);
    assert!(!info.mig_enabled);
    assert_eq!(
        route_for(
            &info,
            &Share::Mig {
                profile_id: 9,
                profile: "3g.40gb".into(),
                start: 4,
                size: 4,
                memory_mib: 40_448
            }
        )
        .unwrap(),
        Route::SriovVgpu
    );
    let prep = vgpu::plan_host(&h.sysfs, &info).unwrap();
    assert!(prep.enables_mig && prep.enables_vfs);
    vgpu::prepare_host(&h.sysfs, &h.sim, &prep).unwrap();
    vgpu::prepare_host(&h.sysfs, &h.sim, &prep).unwrap();
    assert!(h.gpu(GPU6).mig_enabled);
    assert_eq!(sriov::enabled_vfs(&h.sysfs, &addr(PF6)).unwrap(), 16);

    let gi_a = vgpu::ensure_instance(&h.sim, GPU6, p("3g.40gb"), 4).unwrap();
    assert!(gi_a.has_compute_instance);
    let a = vgpu::attach(&h.sysfs, &addr(PF6), &gi_a, p("3g.40gb")).unwrap();
    assert_eq!(a.gpu_instance_id, gi_a.gi_id);
    assert_eq!(a.vgpu_type.name, "NVIDIA H100XM-3-40C");
    assert_eq!(a.placement_id, Some(4), "the FAKE driver reports the start");
    let vf_dev = h.sysfs.device(&addr(&a.vf)).unwrap();
    assert_eq!(
        vf_dev.driver.as_deref(),
        Some("nvidia"),
        "the VF stays on nvidia"
    );
    assert!(a.vf_path(&h.sysfs).ends_with(&a.vf));
    // Running the steps again changes nothing.
    assert_eq!(
        vgpu::ensure_instance(&h.sim, GPU6, p("3g.40gb"), 4).unwrap(),
        gi_a
    );
    assert_eq!(
        vgpu::attach(&h.sysfs, &addr(PF6), &gi_a, p("3g.40gb"))
            .unwrap()
            .vf,
        a.vf
    );

    let gi_b = vgpu::ensure_instance(&h.sim, GPU6, p("1g.10gb"), 0).unwrap();
    let b = vgpu::attach(&h.sysfs, &addr(PF6), &gi_b, p("1g.10gb")).unwrap();
    assert_ne!(a.vf, b.vf);
    assert_eq!(typed(&h, PF6), 2);

    // A departs: type 0, destroy; the card stays in vGPU mode for B.
    vgpu::detach(&h.sysfs, &a).unwrap();
    vgpu::detach(&h.sysfs, &a).unwrap();
    vgpu::destroy_instance(&h.sim, GPU6, p("3g.40gb"), 4).unwrap();
    vgpu::destroy_instance(&h.sim, GPU6, p("3g.40gb"), 4).unwrap();
    let e = vgpu::leave_vgpu_mode(&h.sysfs, &h.sim, &prep).unwrap_err();
    assert!(matches!(e, VgpuRouteError::StillInUse { .. }), "{e}");
    assert_eq!(e.step(), vgpu::STEP_LEAVE);
    // B departs; the card leaves vGPU mode: VFs off, then MIG off as it was.
    vgpu::detach_instance(&h.sysfs, &h.sim, GPU6, p("1g.10gb"), 0).unwrap();
    vgpu::destroy_instance(&h.sim, GPU6, p("1g.10gb"), 0).unwrap();
    vgpu::leave_vgpu_mode(&h.sysfs, &h.sim, &prep).unwrap();
    vgpu::leave_vgpu_mode(&h.sysfs, &h.sim, &prep).unwrap();
    assert_eq!(sriov::enabled_vfs(&h.sysfs, &addr(PF6)).unwrap(), 0);
    let g = h.gpu(GPU6);
    assert!(!g.mig_enabled && g.instances.is_empty());
    // A detach after the VFs are gone has nothing to do.
    vgpu::detach(&h.sysfs, &b).unwrap();
}

#[test]
fn the_old_order_instance_then_vfs_loses_the_instance_and_fails() {
    let h = vgpu_host();
    // What the host-binding code did before: the GPU instance first, VFs enabled lazily.
    let gi = vgpu::ensure_instance(&h.sim, GPU2, p("3g.40gb"), 0).unwrap();
    sriov::enable_vfs(&h.sysfs, &addr(PF2)).unwrap();
    assert!(
        h.gpu(GPU2).instances.is_empty(),
        "enabling VFs wiped the instance"
    );
    assert!(h.gpu(GPU2).mig_enabled, "MIG mode survives");
    let e = vgpu::attach(&h.sysfs, &addr(PF2), &gi, p("3g.40gb")).unwrap_err();
    assert!(
        matches!(
            &e,
            VgpuRouteError::Vgpu {
                source: VgpuError::NoCreatableType { .. },
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("wipes it"), "{e}");
    assert_eq!(typed(&h, PF2), 0);
}

#[test]
fn preparation_refuses_to_wipe_instances_a_card_holds() {
    let h = vgpu_host();
    vgpu::ensure_instance(&h.sim, GPU2, p("1g.10gb"), 6).unwrap();
    let e = vgpu::plan_host(&h.sysfs, &h.gpu(GPU2)).unwrap_err();
    assert!(matches!(e, VgpuRouteError::WouldWipe { .. }), "{e}");
    // A record made before the instance appeared is checked again when applied.
    let h = vgpu_host();
    let prep = vgpu::plan_host(&h.sysfs, &h.gpu(GPU2)).unwrap();
    vgpu::ensure_instance(&h.sim, GPU2, p("1g.10gb"), 6).unwrap();
    let e = vgpu::prepare_host(&h.sysfs, &h.sim, &prep).unwrap_err();
    assert!(matches!(e, VgpuRouteError::WouldWipe { .. }), "{e}");
    assert_eq!(h.gpu(GPU2).instances.len(), 1, "nothing was wiped");
}

#[test]
fn types_are_empty_until_an_instance_exists_and_ids_read_enxio_until_a_type_is_set() {
    let h = vgpu_host();
    let prep = vgpu::plan_host(&h.sysfs, &h.gpu(GPU2)).unwrap();
    vgpu::prepare_host(&h.sysfs, &h.sim, &prep).unwrap();
    let vf0 = sriov::vfs(&h.sysfs, &addr(PF2))[0].clone();
    assert!(vf::creatable_types(&h.sysfs, &vf0).unwrap().is_empty());
    let raw = h
        .sysfs
        .read(&h.sysfs.device_dir(&vf0).join("nvidia/gpu_instance_id"))
        .unwrap_err();
    assert!(
        matches!(&raw, HostDeviceError::Io { source, .. } if source.raw_os_error() == Some(libc::ENXIO)),
        "{raw}"
    );
    let s = vf::vf_state(&h.sysfs, &vf0).unwrap();
    assert_eq!(
        (s.vgpu_type, s.gpu_instance_id, s.placement_id),
        (None, None, None)
    );

    let gi = vgpu::ensure_instance(&h.sim, GPU2, p("2g.20gb"), 2).unwrap();
    let types = vf::creatable_types(&h.sysfs, &vf0).unwrap();
    assert_eq!(
        types.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
        ["NVIDIA H100XM-2-20C"],
        "only the profile with a free instance"
    );
    let a = vgpu::attach(&h.sysfs, &addr(PF2), &gi, p("2g.20gb")).unwrap();
    let s = vf::vf_state(&h.sysfs, &addr(&a.vf)).unwrap();
    assert_eq!(s.gpu_instance_id, Some(gi.gi_id));
    // The instance is taken: no VF offers its type any more.
    let vf1 = sriov::vfs(&h.sysfs, &addr(PF2))[1].clone();
    assert!(vf::creatable_types(&h.sysfs, &vf1).unwrap().is_empty());
    // A type that is not creatable is refused by the driver.
    let t = vf::VgpuType {
        id: "1056".into(),
        name: "NVIDIA H100XM-3-40C".into(),
    };
    vf::set_vgpu_type(&h.sysfs, &vf1, &t).unwrap_err();
}

#[test]
fn mig_mode_cannot_change_while_vfs_are_enabled() {
    let h = vgpu_host();
    // VFs first, MIG second: the wrong order.
    sriov::enable_vfs(&h.sysfs, &addr(PF6)).unwrap();
    let e = h.sim.set_mig_mode(GPU6, true).unwrap_err();
    assert!(matches!(e, BackendError::InUse { .. }), "{e}");
    // And MIG off while VFs are enabled is refused too: VFs go first at teardown.
    let h = vgpu_host();
    let prep = vgpu::plan_host(&h.sysfs, &h.gpu(GPU6)).unwrap();
    vgpu::prepare_host(&h.sysfs, &h.sim, &prep).unwrap();
    let e = h.sim.set_mig_mode(GPU6, false).unwrap_err();
    assert!(e.to_string().contains("virtual functions"), "{e}");
}

#[test]
fn teardown_out_of_order_is_refused() {
    let h = vgpu_host();
    let prep = vgpu::plan_host(&h.sysfs, &h.gpu(GPU2)).unwrap();
    vgpu::prepare_host(&h.sysfs, &h.sim, &prep).unwrap();
    let gi = vgpu::ensure_instance(&h.sim, GPU2, p("3g.40gb"), 4).unwrap();
    let a = vgpu::attach(&h.sysfs, &addr(PF2), &gi, p("3g.40gb")).unwrap();
    // The instance before the type: refused while the vGPU runs on it.
    let e = vgpu::destroy_instance(&h.sim, GPU2, p("3g.40gb"), 4).unwrap_err();
    assert_eq!(e.step(), vgpu::STEP_DESTROY);
    assert!(e.to_string().contains("current_vgpu_type"), "{e}");
    // The VFs before the type: the kernel says EBUSY.
    let e = sriov::disable_vfs(&h.sysfs, &addr(PF2)).unwrap_err();
    assert!(e.to_string().contains("busy"), "{e}");
    let e = vgpu::leave_vgpu_mode(&h.sysfs, &h.sim, &prep).unwrap_err();
    assert!(e.to_string().contains(&a.vf), "{e}");
    vgpu::detach(&h.sysfs, &a).unwrap();
    let e = vgpu::leave_vgpu_mode(&h.sysfs, &h.sim, &prep).unwrap_err();
    assert!(e.to_string().contains("GPU instances"), "{e}");
    vgpu::destroy_instance(&h.sim, GPU2, p("3g.40gb"), 4).unwrap();
    vgpu::leave_vgpu_mode(&h.sysfs, &h.sim, &prep).unwrap();
    assert!(h.gpu(GPU2).mig_enabled, "MIG was on before: it stays on");
}

#[test]
fn a_vgpu_on_another_instance_than_planned_is_released_and_fails() {
    let h = vgpu_host();
    let prep = vgpu::plan_host(&h.sysfs, &h.gpu(GPU2)).unwrap();
    vgpu::prepare_host(&h.sysfs, &h.sim, &prep).unwrap();
    // A leftover 3g at slot 0 (lower id) and the planner's 3g at slot 4.
    let leftover = vgpu::ensure_instance(&h.sim, GPU2, p("3g.40gb"), 0).unwrap();
    let planned = vgpu::ensure_instance(&h.sim, GPU2, p("3g.40gb"), 4).unwrap();
    assert!(leftover.gi_id < planned.gi_id);
    let e = vgpu::attach(&h.sysfs, &addr(PF2), &planned, p("3g.40gb")).unwrap_err();
    assert!(
        matches!(e, VgpuRouteError::WrongInstance { wanted, got, .. } if wanted == planned.gi_id && got == leftover.gi_id),
        "{e}"
    );
    assert_eq!(e.step(), vgpu::STEP_SET_TYPE);
    assert_eq!(typed(&h, PF2), 0, "the type was cleared again");
    // Once the leftover is gone the same step succeeds.
    vgpu::destroy_instance(&h.sim, GPU2, p("3g.40gb"), 0).unwrap();
    let a = vgpu::attach(&h.sysfs, &addr(PF2), &planned, p("3g.40gb")).unwrap();
    assert_eq!(a.gpu_instance_id, planned.gi_id);
}

#[test]
fn a_stale_detach_leaves_a_vf_that_now_serves_someone_else() {
    let h = vgpu_host();
    let prep = vgpu::plan_host(&h.sysfs, &h.gpu(GPU2)).unwrap();
    vgpu::prepare_host(&h.sysfs, &h.sim, &prep).unwrap();
    let gi = vgpu::ensure_instance(&h.sim, GPU2, p("1g.10gb"), 0).unwrap();
    let a = vgpu::attach(&h.sysfs, &addr(PF2), &gi, p("1g.10gb")).unwrap();
    vgpu::detach(&h.sysfs, &a).unwrap();
    vgpu::destroy_instance(&h.sim, GPU2, p("1g.10gb"), 0).unwrap();
    // The same VF is reused for a new tenant's instance.
    let gi2 = vgpu::ensure_instance(&h.sim, GPU2, p("2g.20gb"), 4).unwrap();
    let b = vgpu::attach(&h.sysfs, &addr(PF2), &gi2, p("2g.20gb")).unwrap();
    assert_eq!(a.vf, b.vf);
    vgpu::detach(&h.sysfs, &a).unwrap();
    assert_eq!(typed(&h, PF2), 1, "B's vGPU is untouched");
}

#[test]
fn vgpu_vfs_and_cards_in_vgpu_mode_are_never_bound_to_vfio() {
    let h = vgpu_host();
    let prep = vgpu::plan_host(&h.sysfs, &h.gpu(GPU2)).unwrap();
    vgpu::prepare_host(&h.sysfs, &h.sim, &prep).unwrap();
    let vf0 = sriov::vfs(&h.sysfs, &addr(PF2))[0].clone();
    let e = vfio::bind_group(&h.sysfs, &vf0).unwrap_err();
    assert!(matches!(e, HostDeviceError::VgpuVf(_)), "{e}");
    let e = vfio::bind_group(&h.sysfs, &addr(PF2)).unwrap_err();
    assert!(
        matches!(e, HostDeviceError::VfsEnabled { vfs: 16, .. }),
        "{e}"
    );
    let e = whole::check_free(&h.sysfs, &h.gpu(GPU2)).unwrap_err();
    assert!(e.to_string().contains("vGPU mode"), "{e}");
    assert_eq!(
        h.sysfs.device(&vf0).unwrap().driver.as_deref(),
        Some("nvidia")
    );
}
