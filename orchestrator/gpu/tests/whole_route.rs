//! The whole-card route on the FAKE sysfs tree: bind the group, hand out the device paths,
//! then the departure's reset (checked) and rebind, each failing with its own step's error.

mod common;

use tenantvm_gpu::backend::sim::SimBackend;
use tenantvm_gpu::backend::GpuBackend;
use tenantvm_gpu::host::fake::FakeHost;
use tenantvm_gpu::host::reset::DeviceReset;
use tenantvm_gpu::host::PciAddress;
use tenantvm_gpu::route::whole::{self, RebindError, ResetError};

const GPU: &str = "0000:01:00.0";
const AUDIO: &str = "0000:01:00.1";

fn driver(h: &FakeHost, a: &str) -> Option<String> {
    h.sysfs()
        .device(&PciAddress::parse(a).unwrap())
        .unwrap()
        .driver
}

#[test]
fn attach_and_departure_in_order() {
    let h = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
    let s = h.sysfs();
    let gpu = PciAddress::parse(GPU).unwrap();
    let binding = whole::plan_bind(&s, &gpu).unwrap();
    assert_eq!(
        driver(&h, GPU).as_deref(),
        Some("nvidia"),
        "planning moves nothing"
    );
    whole::apply_bind(&s, &binding).unwrap();
    whole::apply_bind(&s, &binding).unwrap();
    assert_eq!(driver(&h, GPU).as_deref(), Some("vfio-pci"));
    assert_eq!(driver(&h, AUDIO).as_deref(), Some("vfio-pci"));
    let paths = whole::device_paths(&s, &binding);
    assert!(paths[0].ends_with(GPU), "the GPU first: {paths:?}");
    assert_eq!(paths.len(), 2);

    let r = whole::reset_gpu(&s, &binding).unwrap();
    assert!(matches!(r.devices[0].1, DeviceReset::Reset { .. }));
    whole::rebind_host_drivers(&s, &binding).unwrap();
    whole::rebind_host_drivers(&s, &binding).unwrap();
    assert_eq!(driver(&h, GPU).as_deref(), Some("nvidia"));
    assert_eq!(driver(&h, AUDIO).as_deref(), Some("snd_hda_intel"));
    assert_eq!(
        whole::DEPARTURE_STEPS,
        [
            "stop-vm",
            "device-reset",
            "rebind-host-driver",
            "scrub-verify",
            "release"
        ]
    );
}

#[test]
fn each_departure_step_fails_with_its_own_error() {
    let mut spec = FakeHost::audio_host_spec();
    spec.devices
        .iter_mut()
        .find(|d| d.bdf == GPU)
        .unwrap()
        .reset_fails = true;
    let h = FakeHost::build(&spec).unwrap();
    let s = h.sysfs();
    let binding = whole::plan_bind(&s, &PciAddress::parse(GPU).unwrap()).unwrap();
    whole::apply_bind(&s, &binding).unwrap();
    let e = whole::reset_gpu(&s, &binding).unwrap_err();
    assert!(matches!(e, ResetError::Failed { .. }), "{e}");
    assert_eq!(ResetError::STEP, "device-reset");

    // The recorded host driver is gone (module unloaded): the rebind says so.
    let mut wrong = binding.clone();
    wrong.devices[0].previous_driver = Some("nouveau".into());
    let e = whole::rebind_host_drivers(&s, &wrong).unwrap_err();
    assert!(
        matches!(&e, RebindError::Mismatch { wanted, .. } if wanted == "nouveau"),
        "{e}"
    );
    assert!(e.to_string().contains("module is loaded"), "{e}");
    assert_eq!(RebindError::STEP, "rebind-host-driver");
    // The audio function (tried too) is back on its driver.
    assert_eq!(driver(&h, AUDIO).as_deref(), Some("snd_hda_intel"));
}

#[test]
fn a_gpu_holding_mig_instances_is_not_given_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.json");
    std::fs::copy(common::fixture("hosts/sim-h100x8.json"), &path).unwrap();
    let sim = SimBackend::open(&path).unwrap();
    let h = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
    let gpus = sim.gpus().unwrap();
    let e = whole::check_free(&h.sysfs(), &gpus[0]).unwrap_err();
    assert!(e.to_string().contains("MIG instances"), "{e}");
    whole::check_free(&h.sysfs(), &gpus[2]).unwrap();
}
