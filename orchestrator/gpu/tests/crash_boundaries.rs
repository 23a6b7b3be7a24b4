//! Crash at every boundary, at the library level: each route's attach and departure
//! sequences, run as the daemon runs them (a record is written before the step that needs
//! it), are interrupted before every mutating operation in turn (every sysfs write on the
//! FAKE tree, every GPU call on the SIMULATED host) and then run again from the start with
//! the records that survived. Every run must converge to the state an uninterrupted run
//! reaches: no device bound to the wrong driver, no VF left typed, no instance leaked.

mod common;

use common::{vgpu_host, Crashing, VgpuHost};
use tenantvm_gpu::backend::GpuBackend;
use tenantvm_gpu::host::fake::{FakeHost, CRASH_MESSAGE};
use tenantvm_gpu::host::vfio::VfioBinding;
use tenantvm_gpu::host::{sriov, PciAddress, Sysfs};
use tenantvm_gpu::mig::{model_by_key, MigProfile};
use tenantvm_gpu::route::vgpu::{self, VgpuAttachment, VgpuHost as Prep};
use tenantvm_gpu::route::whole;

/// What the daemon's store keeps across a crash.
#[derive(Default, Clone)]
struct Records {
    binding: Option<VfioBinding>,
    prep: Option<Prep>,
    attachment: Option<VgpuAttachment>,
}

fn crashed<E: std::fmt::Display>(r: Result<(), E>) -> bool {
    match r {
        Ok(()) => false,
        Err(e) if e.to_string().contains(CRASH_MESSAGE) => true,
        Err(e) => panic!("a step failed for another reason than the crash: {e}"),
    }
}

/// Runs `seq` with a crash before the `n`th mutating operation; true if it crashed.
fn run_with_crash<E: std::fmt::Display>(
    fake: &FakeHost,
    n: u64,
    seq: impl FnOnce() -> Result<(), E>,
) -> bool {
    fake.crash_after(n).unwrap();
    let c = crashed(seq());
    fake.no_crash().unwrap();
    c
}

// ---------------------------------------------------------------- whole card

const GPU: &str = "0000:01:00.0";
const AUDIO: &str = "0000:01:00.1";

fn whole_attach(s: &Sysfs, rec: &mut Records) -> Result<(), String> {
    let gpu = PciAddress::parse(GPU).unwrap();
    if rec.binding.is_none() {
        rec.binding = Some(whole::plan_bind(s, &gpu).map_err(|e| e.to_string())?);
    }
    whole::apply_bind(s, rec.binding.as_ref().unwrap()).map_err(|e| e.to_string())
}

fn whole_depart(s: &Sysfs, rec: &Records) -> Result<(), String> {
    let Some(b) = &rec.binding else {
        return Ok(()); // nothing was ever moved
    };
    whole::reset_gpu(s, b).map_err(|e| e.to_string())?;
    whole::rebind_host_drivers(s, b).map_err(|e| e.to_string())
}

fn drivers(h: &FakeHost) -> Vec<(Option<String>, String)> {
    let s = h.sysfs();
    [GPU, AUDIO]
        .iter()
        .map(|a| {
            let addr = PciAddress::parse(a).unwrap();
            let ov = s
                .read(&s.device_dir(&addr).join("driver_override"))
                .unwrap();
            (s.device(&addr).unwrap().driver, ov)
        })
        .collect()
}

fn host_drivers() -> Vec<(Option<String>, String)> {
    vec![
        (Some("nvidia".into()), "(null)".into()),
        (Some("snd_hda_intel".into()), "(null)".into()),
    ]
}

fn vfio_drivers() -> Vec<(Option<String>, String)> {
    vec![(Some("vfio-pci".into()), "vfio-pci".into()); 2]
}

#[test]
fn whole_card_attach_interrupted_anywhere_resumes_or_rolls_back() {
    let mut n = 0;
    loop {
        for rollback in [false, true] {
            let h = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
            let s = h.sysfs();
            let mut rec = Records::default();
            let c = run_with_crash(&h, n, || whole_attach(&s, &mut rec));
            if !c {
                assert_eq!(drivers(&h), vfio_drivers());
                if rollback {
                    return assert!(n > 4, "the attach has several boundaries: {n}");
                }
                continue;
            }
            if rollback {
                whole_depart(&s, &rec).unwrap();
                assert_eq!(drivers(&h), host_drivers(), "rollback after crash {n}");
            } else {
                whole_attach(&s, &mut rec).unwrap();
                assert_eq!(drivers(&h), vfio_drivers(), "resume after crash {n}");
            }
        }
        n += 1;
    }
}

#[test]
fn whole_card_departure_interrupted_anywhere_converges() {
    let mut n = 0;
    loop {
        let h = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
        let s = h.sysfs();
        let mut rec = Records::default();
        whole_attach(&s, &mut rec).unwrap();
        let c = run_with_crash(&h, n, || whole_depart(&s, &rec));
        if c {
            whole_depart(&s, &rec).unwrap();
        }
        assert_eq!(drivers(&h), host_drivers(), "after crash {n}");
        assert!(h.resets(GPU) >= 1, "the GPU was reset (crash {n})");
        if !c {
            assert!(n > 6, "the departure has several boundaries: {n}");
            break;
        }
        n += 1;
    }
}

// ---------------------------------------------------------------- MIG-backed vGPU

const GPU6: u32 = 6;
const PF6: &str = "0000:ba:00.0";

fn p3g() -> &'static MigProfile {
    model_by_key("h100-80gb")
        .unwrap()
        .profile("3g.40gb")
        .unwrap()
}

fn vgpu_attach(h: &VgpuHost, be: &dyn GpuBackend, rec: &mut Records) -> Result<(), String> {
    let e = |e: vgpu::VgpuRouteError| format!("{}: {e}", e.step());
    if rec.prep.is_none() {
        let info = be
            .gpus()
            .unwrap()
            .into_iter()
            .find(|g| g.index == GPU6)
            .unwrap();
        rec.prep = Some(vgpu::plan_host(&h.sysfs, &info).map_err(e)?);
    }
    vgpu::prepare_host(&h.sysfs, be, rec.prep.as_ref().unwrap()).map_err(e)?;
    let gi = vgpu::ensure_instance(be, GPU6, p3g(), 4).map_err(e)?;
    let pf = PciAddress::parse(PF6).unwrap();
    rec.attachment = Some(vgpu::attach(&h.sysfs, &pf, &gi, p3g()).map_err(e)?);
    Ok(())
}

fn vgpu_depart(h: &VgpuHost, be: &dyn GpuBackend, rec: &Records) -> Result<(), String> {
    let e = |e: vgpu::VgpuRouteError| format!("{}: {e}", e.step());
    // By the instance, not the record: a crash may have typed a VF before it was recorded.
    vgpu::detach_instance(&h.sysfs, be, GPU6, p3g(), 4).map_err(e)?;
    vgpu::destroy_instance(be, GPU6, p3g(), 4).map_err(e)?;
    if let Some(prep) = &rec.prep {
        vgpu::leave_vgpu_mode(&h.sysfs, be, prep).map_err(e)?;
    }
    Ok(())
}

/// (MIG on, VFs enabled, typed VFs with their instance, instances with a compute instance).
type VgpuState = (bool, u32, Vec<(String, Option<u32>)>, Vec<(u32, u32, bool)>);

fn vgpu_state(h: &VgpuHost) -> VgpuState {
    let g = h.gpu(GPU6);
    let pf = PciAddress::parse(PF6).unwrap();
    let typed = vgpu::vgpu_state(&h.sysfs, &pf)
        .unwrap()
        .into_iter()
        .map(|s| (s.vf, s.gpu_instance_id))
        .collect();
    let instances = g
        .instances
        .iter()
        .map(|i| (i.profile_id, i.start, i.has_compute_instance))
        .collect();
    (
        g.mig_enabled,
        sriov::enabled_vfs(&h.sysfs, &pf).unwrap(),
        typed,
        instances,
    )
}

fn assert_pf_on_nvidia(h: &VgpuHost) {
    let pf = PciAddress::parse(PF6).unwrap();
    assert_eq!(
        h.sysfs.device(&pf).unwrap().driver.as_deref(),
        Some("nvidia")
    );
    for vf in sriov::vfs(&h.sysfs, &pf) {
        assert_eq!(
            h.sysfs.device(&vf).unwrap().driver.as_deref(),
            Some("nvidia"),
            "{vf} on nvidia, never vfio-pci"
        );
    }
}

fn attached_state(h: &VgpuHost) -> VgpuState {
    let (mig, vfs, typed, instances) = vgpu_state(h);
    assert_eq!(typed.len(), 1, "exactly one typed VF");
    (mig, vfs, typed, instances)
}

fn clean_state() -> VgpuState {
    (false, 0, Vec::new(), Vec::new())
}

#[test]
fn vgpu_attach_interrupted_anywhere_resumes_or_rolls_back() {
    // The uninterrupted run, for comparison.
    let reference = {
        let h = vgpu_host();
        let mut rec = Records::default();
        vgpu_attach(&h, &h.sim, &mut rec).unwrap();
        attached_state(&h)
    };
    assert_eq!(
        (reference.0, reference.1, reference.3.clone()),
        (true, 16, vec![(9, 4, true)])
    );
    let mut n = 0;
    loop {
        let mut finished = false;
        for rollback in [false, true] {
            let h = vgpu_host();
            let be = Crashing {
                inner: &h.sim,
                fake: &h.fake,
            };
            let mut rec = Records::default();
            let c = run_with_crash(&h.fake, n, || vgpu_attach(&h, &be, &mut rec));
            if !c {
                finished = true;
                break;
            }
            if rollback {
                vgpu_depart(&h, &h.sim, &rec).unwrap();
                assert_eq!(vgpu_state(&h), clean_state(), "rollback after crash {n}");
            } else {
                vgpu_attach(&h, &h.sim, &mut rec).unwrap();
                let got = attached_state(&h);
                assert_eq!(got, reference, "resume after crash {n}");
                let a = rec.attachment.unwrap();
                assert_eq!(got.2[0], (a.vf, Some(a.gpu_instance_id)));
            }
            assert_pf_on_nvidia(&h);
        }
        if finished {
            assert_eq!(n, 5, "MIG on, VFs, GPU instance, compute instance, type");
            break;
        }
        n += 1;
    }
}

#[test]
fn vgpu_departure_interrupted_anywhere_converges() {
    let mut n = 0;
    loop {
        let h = vgpu_host();
        let mut rec = Records::default();
        vgpu_attach(&h, &h.sim, &mut rec).unwrap();
        let be = Crashing {
            inner: &h.sim,
            fake: &h.fake,
        };
        let c = run_with_crash(&h.fake, n, || vgpu_depart(&h, &be, &rec));
        if c {
            vgpu_depart(&h, &h.sim, &rec).unwrap();
        }
        assert_eq!(vgpu_state(&h), clean_state(), "after crash {n}");
        assert_pf_on_nvidia(&h);
        if !c {
            assert_eq!(n, 4, "type 0, destroy, VFs off, MIG off");
            break;
        }
        n += 1;
    }
}
