//! The GPU share reaches the VM and comes back, through the daemon's steps, on a FAKE sysfs
//! tree (the HGX H100 fixture and its fake kernel) linked to a SIMULATED GPU host whose
//! driver enforces the vGPU ordering rules. Both routes, an uninterrupted run, and a crash
//! (the in-process fault hook) at every boundary of the steps from reserve-gpu to launch-vm
//! and from stop-vm to release-gpu (the GPU's own and those around them), after which
//! a restarted service resumes: it must converge to the uninterrupted run's host state, with
//! nothing left bound to the wrong driver, no VF left typed, no instance leaked.

use std::sync::Arc;

use tenantvm_gpu::backend::sim::{SimHost, SimVgpu};
use tenantvm_gpu::host::fake::FakeHost;
use tenantvm_gpu::host::{sriov, PciAddress};
use tenantvm_gpu::route::vgpu::vgpu_state;

use crate::auth::Caller;
use crate::backend::PassthroughDevice;
use crate::domain::lifecycle::LifecycleState;
use crate::domain::spec::TenantSpec;
use crate::gpu::BackendPlanner;
use crate::reconcile::{reconcile, ReconcileOptions};
use crate::tenant::fault::{Boundary, FaultHook};
use crate::tenant::service::TenantCommand;
use crate::tenant::steps::{Op, Step};
use crate::tenant::test_utils::Harness;

/// A FAKE HGX H100 tree with its SIMULATED GPUs, every one with SR-IOV vGPU.
struct GpuHost {
    fake: FakeHost,
    planner: Arc<BackendPlanner>,
}

fn gpu_host() -> GpuHost {
    gpu_host_with(|_| {})
}

fn gpu_host_with(change: impl FnOnce(&mut tenantvm_gpu::host::fake::FakeHostSpec)) -> GpuHost {
    let mut spec = FakeHost::h100x8_spec();
    change(&mut spec);
    let fake = FakeHost::build(&spec).unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hosts/sim-h100x8.json");
    let mut host: SimHost = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for g in &mut host.gpus {
        g.vgpu = SimVgpu::Sriov;
    }
    let sim = fake.attach_sim(&host).unwrap();
    let planner = Arc::new(BackendPlanner::new(Box::new(sim)).with_sysfs(fake.sysfs()));
    GpuHost { fake, planner }
}

/// Everything the routes change, per GPU: MIG mode, instances, enabled VFs, typed VFs
/// (with their instance), and the drivers of the GPU's functions.
/// Per GPU: address, MIG mode, instances (profile, start), enabled VFs, typed VFs (with
/// their instance), the PF's driver.
type GpuState = (
    String,
    bool,
    Vec<(u32, u32)>,
    u32,
    Vec<(String, Option<u32>)>,
    Option<String>,
);
/// Every GPU's state, and how many mdevs exist (their UUIDs are random).
type Snapshot = (Vec<GpuState>, usize);

fn snapshot(h: &GpuHost) -> Snapshot {
    let sysfs = h.fake.sysfs();
    let mut out = Vec::new();
    for g in h.planner.backend().gpus().unwrap() {
        let pf = PciAddress::parse(&g.pci_address).unwrap();
        let mut instances: Vec<(u32, u32)> = g
            .instances
            .iter()
            .map(|i| (i.profile_id, i.start))
            .collect();
        instances.sort_unstable();
        let typed: Vec<(String, Option<u32>)> = vgpu_state(&sysfs, &pf)
            .unwrap()
            .into_iter()
            .filter(|v| v.vgpu_type.is_some())
            .map(|v| (v.vf, v.gpu_instance_id))
            .collect();
        out.push((
            g.pci_address.clone(),
            g.mig_enabled,
            instances,
            sriov::enabled_vfs(&sysfs, &pf).unwrap_or(0),
            typed,
            sysfs.device(&pf).unwrap().driver,
        ));
    }
    (out, sysfs.list(&sysfs.path("sys/bus/mdev/devices")).len())
}

/// The workstation tree (gpu-audio.sysfs.json) with its A100 as a SIMULATED GPU whose vGPU
/// is an mdev (vGPU 16 and older).
fn mdev_host() -> GpuHost {
    let fake = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
    let host: SimHost = serde_json::from_str(
        r#"{"gpus": [{"index": 0, "model": "a100-40gb", "pci_address": "0000:05:00.0",
            "mig_enabled": true, "vgpu": "mdev", "iommu_group": 14}]}"#,
    )
    .unwrap();
    let sim = fake.attach_sim(&host).unwrap();
    let planner = Arc::new(BackendPlanner::new(Box::new(sim)).with_sysfs(fake.sysfs()));
    GpuHost { fake, planner }
}

/// The same workstation, its A100 with MIG off: the daemon turns it on for the tenant's
/// instance and must turn it off again as the card's last MIG tenant leaves.
fn mdev_host_mig_off() -> GpuHost {
    let fake = FakeHost::build(&FakeHost::audio_host_spec()).unwrap();
    let host: SimHost = serde_json::from_str(
        r#"{"gpus": [{"index": 0, "model": "a100-40gb", "pci_address": "0000:05:00.0",
            "mig_enabled": false, "vgpu": "mdev", "iommu_group": 14}]}"#,
    )
    .unwrap();
    let sim = fake.attach_sim(&host).unwrap();
    let planner = Arc::new(BackendPlanner::new(Box::new(sim)).with_sysfs(fake.sysfs()));
    GpuHost { fake, planner }
}

/// The HGX tree with only its third H100 (MIG on, no instance, VFs off), with SR-IOV vGPU.
fn one_vgpu_card() -> GpuHost {
    let fake = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hosts/sim-h100x8.json");
    let mut host: SimHost = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    host.gpus.retain(|g| g.index == 2);
    for g in &mut host.gpus {
        g.vgpu = SimVgpu::Sriov;
    }
    let sim = fake.attach_sim(&host).unwrap();
    let planner = Arc::new(BackendPlanner::new(Box::new(sim)).with_sysfs(fake.sysfs()));
    GpuHost { fake, planner }
}

fn sysfs_has_mdev(host: &GpuHost, uuid: &str) -> bool {
    let sysfs = host.fake.sysfs();
    sysfs
        .list(&sysfs.path("sys/bus/mdev/devices"))
        .iter()
        .any(|u| u == uuid)
}

const MDEV: &str = "{ profile = \"1g.5gb\" }";

fn spec(gpu: &str) -> TenantSpec {
    spec_named("g", gpu)
}

fn spec_named(name: &str, gpu: &str) -> TenantSpec {
    TenantSpec::from_toml(&format!(
        "name = \"{name}\"\ngpu = {gpu}\n[image]\nname = \"hello\"\n"
    ))
    .unwrap()
}

const VGPU: &str = "{ profile = \"3g.40gb\" }";
const WHOLE: &str = "{ whole_gpu = true }";

fn state(h: &Harness) -> Option<LifecycleState> {
    h.svc.store().tenant("g").unwrap().map(|t| t.state)
}

fn create(h: &Harness, gpu: &str) {
    h.svc
        .execute(&Caller::Admin, TenantCommand::Create(spec(gpu)))
        .unwrap();
    h.svc.wait_idle();
}

fn destroy(h: &Harness) {
    h.svc
        .execute(&Caller::Admin, TenantCommand::Destroy("g".into()))
        .unwrap();
    h.svc.wait_idle();
}

/// A service over `host`; its fake VM backend says it is QEMU (the backend an mdev needs).
fn harness(host: &GpuHost) -> Harness {
    let h = Harness::new(FaultHook::default()).with_planner(host.planner.clone());
    h.host.state().qemu = true;
    h
}

/// The last launch's devices and UUID.
fn launched(h: &Harness) -> (Vec<PassthroughDevice>, Option<tenantvm_vmm_api::VmUuid>) {
    let s = h.host.state();
    let (_, devices, uuid) = s.launched_devices.last().cloned().unwrap();
    (devices, uuid)
}

#[test]
fn a_vgpu_reaches_the_vm_on_its_planned_instance_and_everything_comes_back() {
    let host = gpu_host();
    let before = snapshot(&host);
    let h = harness(&host);
    create(&h, VGPU);
    assert_eq!(
        state(&h),
        Some(LifecycleState::Running),
        "{:?}",
        h.svc.store().tenant("g").unwrap().unwrap().error
    );
    let (devices, uuid) = launched(&h);
    assert!(
        uuid.is_some(),
        "a vGPU VM needs its UUID on the VMM's command line"
    );
    let [PassthroughDevice::Pci { address, .. }] = &devices[..] else {
        panic!("one VF expected: {devices:?}")
    };
    // The VF the VM got is typed and serves an instance of the tenant's card.
    let during = snapshot(&host);
    let card = during
        .0
        .iter()
        .find(|g| g.4.iter().any(|(vf, _)| vf == address))
        .unwrap_or_else(|| panic!("VF {address} is not typed: {during:?}"));
    assert_eq!(card.4.len(), 1);
    assert!(card.3 > 0 && card.1, "VFs and MIG on: {card:?}");
    destroy(&h);
    assert_eq!(state(&h), None);
    assert_eq!(snapshot(&host), before, "the card left vGPU mode as it was");
    assert!(h.svc.store().gpu_devices().unwrap().is_empty());
    assert!(h.svc.store().gpu_reservations().unwrap().is_empty());
}

#[test]
fn a_whole_gpu_is_bound_to_vfio_handed_over_and_given_back_to_its_driver() {
    let host = gpu_host();
    let before = snapshot(&host);
    let h = harness(&host);
    create(&h, WHOLE);
    assert_eq!(
        state(&h),
        Some(LifecycleState::Running),
        "{:?}",
        h.svc.store().tenant("g").unwrap().unwrap().error
    );
    let (devices, _) = launched(&h);
    let Some(PassthroughDevice::Pci {
        address,
        iommu_group,
    }) = devices.first()
    else {
        panic!("no device: {devices:?}")
    };
    let sysfs = host.fake.sysfs();
    let dev = sysfs.device(&PciAddress::parse(address).unwrap()).unwrap();
    assert_eq!(dev.driver.as_deref(), Some("vfio-pci"));
    assert_eq!(dev.iommu_group, Some(*iommu_group));
    destroy(&h);
    assert_eq!(state(&h), None);
    assert_eq!(snapshot(&host), before);
    assert!(
        host.fake.resets(address) >= 1,
        "the departure reset the GPU"
    );
}

/// The HGX tree with only its third H100, given whole: MIG on and no instance on it.
fn one_whole_card_in_mig_mode() -> GpuHost {
    let host = one_vgpu_card();
    let info = &host.planner.backend().gpus().unwrap()[0];
    assert!(info.mig_enabled && info.instances.is_empty(), "{info:?}");
    host
}

/// A card in MIG mode handed whole gives its guest's CUDA no device: MIG goes off before
/// the card is bound (recorded first), and back on as the tenant leaves.
#[test]
fn a_whole_card_in_mig_mode_is_handed_over_with_mig_off_and_gets_it_back() {
    let host = one_whole_card_in_mig_mode();
    let before = snapshot(&host);
    let h = harness(&host);
    create(&h, WHOLE);
    assert_eq!(
        state(&h),
        Some(LifecycleState::Running),
        "{:?}",
        h.svc.store().tenant("g").unwrap().unwrap().error
    );
    let during = snapshot(&host);
    assert!(
        !during.0[0].1,
        "MIG is off while the card is the tenant's: {during:?}"
    );
    assert_eq!(during.0[0].5.as_deref(), Some("vfio-pci"));
    // The record says so, for the departure (and a restarted daemon).
    let row = h.svc.store().gpu_devices().unwrap().pop().unwrap().1;
    assert!(
        row.record.contains("\"mig_turned_off\":true"),
        "{}",
        row.record
    );
    destroy(&h);
    assert_eq!(state(&h), None);
    assert_eq!(
        snapshot(&host),
        before,
        "MIG back on, the card back on nvidia"
    );
}

/// A backend that counts its rescans and otherwise is the SIMULATED one it wraps.
struct CountsRescans {
    inner: Box<dyn tenantvm_gpu::backend::GpuBackend>,
    rescans: Arc<std::sync::atomic::AtomicUsize>,
}

impl tenantvm_gpu::backend::GpuBackend for CountsRescans {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn gpus(
        &self,
    ) -> Result<Vec<tenantvm_gpu::backend::GpuInfo>, tenantvm_gpu::backend::BackendError> {
        self.inner.gpus()
    }
    fn set_mig_mode(&self, gpu: u32, on: bool) -> Result<(), tenantvm_gpu::backend::BackendError> {
        self.inner.set_mig_mode(gpu, on)
    }
    fn possible_placements(
        &self,
        gpu: u32,
        profile: u32,
    ) -> Result<Vec<(u32, u32)>, tenantvm_gpu::backend::BackendError> {
        self.inner.possible_placements(gpu, profile)
    }
    fn remaining_capacity(
        &self,
        gpu: u32,
        profile: u32,
    ) -> Result<u32, tenantvm_gpu::backend::BackendError> {
        self.inner.remaining_capacity(gpu, profile)
    }
    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile: u32,
        start: u32,
    ) -> Result<tenantvm_gpu::backend::GpuInstance, tenantvm_gpu::backend::BackendError> {
        self.inner.create_gpu_instance(gpu, profile, start)
    }
    fn ensure_compute_instance(
        &self,
        gpu: u32,
        gi: u32,
    ) -> Result<(), tenantvm_gpu::backend::BackendError> {
        self.inner.ensure_compute_instance(gpu, gi)
    }
    fn destroy_instance(
        &self,
        gpu: u32,
        gi: u32,
    ) -> Result<(), tenantvm_gpu::backend::BackendError> {
        self.inner.destroy_instance(gpu, gi)
    }
    fn rescan(&self) -> Result<(), tenantvm_gpu::backend::BackendError> {
        self.rescans
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.rescan()
    }
}

/// NVML enumerates GPUs when its session opens: after the card leaves its driver for
/// vfio-pci, and after it comes back, the daemon has the backend enumerate them again.
#[test]
fn the_gpu_backend_rescans_after_a_whole_card_is_bound_and_after_it_is_rebound() {
    let fake = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hosts/sim-h100x8.json");
    let host: SimHost = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let rescans = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let backend = CountsRescans {
        inner: Box::new(fake.attach_sim(&host).unwrap()),
        rescans: rescans.clone(),
    };
    let planner = Arc::new(BackendPlanner::new(Box::new(backend)).with_sysfs(fake.sysfs()));
    let host = GpuHost { fake, planner };
    let h = harness(&host);
    let count = || rescans.load(std::sync::atomic::Ordering::SeqCst);
    create(&h, WHOLE);
    assert_eq!(state(&h), Some(LifecycleState::Running));
    assert_eq!(count(), 1, "after the bind");
    destroy(&h);
    assert_eq!(state(&h), None);
    assert_eq!(count(), 2, "after the rebind");
}

#[test]
fn a_whole_card_that_had_mig_on_converges_after_a_crash_at_every_step_boundary() {
    converges(WHOLE, one_whole_card_in_mig_mode);
}

#[test]
fn a_failed_reset_quarantines_the_card_and_the_receipt_names_the_step() {
    // Every GPU's function reset fails (the fake kernel answers the write with an error).
    let host = gpu_host_with(|spec| {
        for d in &mut spec.devices {
            if d.vendor == "0x10de" && d.class.starts_with("0x0302") {
                d.reset_fails = true;
            }
        }
    });
    let h = harness(&host);
    create(&h, WHOLE);
    assert_eq!(state(&h), Some(LifecycleState::Running));
    let (devices, _) = launched(&h);
    let Some(PassthroughDevice::Pci { address, .. }) = devices.first().cloned() else {
        panic!("no device")
    };
    destroy(&h);
    // The departure finished; the card is quarantined with the failed step as the reason.
    assert_eq!(state(&h), None);
    let q = h.svc.store().quarantined().unwrap();
    assert_eq!(q.len(), 1, "{q:?}");
    assert!(q[0].reason.starts_with("device-reset: "), "{}", q[0].reason);
    assert_eq!(q[0].gpu, address);
    let entry = h.receipts_of("g").remove(0);
    let line = |step| {
        entry
            .receipt
            .steps
            .iter()
            .find(|s| s.step == step)
            .cloned()
            .unwrap()
    };
    let reset = line(crate::receipt::DepartureStep::DeviceReset);
    assert_eq!(reset.result, crate::receipt::StepResult::Failed);
    assert!(reset.error.unwrap().contains("device-reset"));
    let release = line(crate::receipt::DepartureStep::GpuRelease);
    assert!(release.evidence["quarantined"].starts_with("device-reset"));
    // The driver came back all the same, and the next whole GPU is another card.
    let sysfs = host.fake.sysfs();
    let dev = sysfs.device(&PciAddress::parse(&address).unwrap()).unwrap();
    assert_eq!(dev.driver.as_deref(), Some("nvidia"));
    create(&h, WHOLE);
    let (devices, _) = launched(&h);
    assert!(
        !devices
            .iter()
            .any(|d| matches!(d, PassthroughDevice::Pci { address: a, .. } if *a == address)),
        "{devices:?}"
    );
}

/// The nested host's edu as a whole card (FAKE tree, SIMULATED host at its address): no
/// host driver before, no reset method.
fn edu_host() -> GpuHost {
    use crate::tenant::test_utils::{EDU_TREE, SIM_AT_EDU};
    let fake = FakeHost::build(&serde_json::from_str(EDU_TREE).unwrap()).unwrap();
    let sim = fake
        .attach_sim(&serde_json::from_str(SIM_AT_EDU).unwrap())
        .unwrap();
    let planner = Arc::new(BackendPlanner::new(Box::new(sim)).with_sysfs(fake.sysfs()));
    GpuHost { fake, planner }
}

#[test]
fn a_card_without_reset_or_host_driver_goes_back_unbound_and_the_receipt_says_no_reset() {
    let host = edu_host();
    let h = harness(&host);
    create(&h, WHOLE);
    assert_eq!(
        state(&h),
        Some(LifecycleState::Running),
        "{:?}",
        h.svc.store().tenant("g").unwrap().unwrap().error
    );
    let edu = PciAddress::parse("0000:00:03.0").unwrap();
    let sysfs = host.fake.sysfs();
    assert_eq!(
        sysfs.device(&edu).unwrap().driver.as_deref(),
        Some("vfio-pci")
    );
    destroy(&h);
    assert_eq!(state(&h), None);
    // Back to no driver, its override cleared: a later probe binds nothing to it.
    assert_eq!(sysfs.device(&edu).unwrap().driver, None);
    let over = sysfs
        .read(&sysfs.path("sys/bus/pci/devices/0000:00:03.0/driver_override"))
        .unwrap();
    assert!(over.is_empty() || over == "(null)", "{over:?}");
    assert_eq!(host.fake.resets("0000:00:03.0"), 0);
    let entry = h.receipts_of("g").remove(0);
    let line = |step| {
        entry
            .receipt
            .steps
            .iter()
            .find(|s| s.step == step)
            .cloned()
            .unwrap()
    };
    // No reset is claimed: the step failed, saying why, and the card is quarantined.
    let reset = line(crate::receipt::DepartureStep::DeviceReset);
    assert_eq!(reset.result, crate::receipt::StepResult::Failed);
    let error = reset.error.as_deref().unwrap();
    assert!(error.contains("no reset method"), "{reset:?}");
    // Host device work, not a placement: the message does not say "cannot be planned".
    assert!(!error.contains("planned"), "{error}");
    assert_eq!(reset.evidence["quarantined"], "true");
    let scrub = line(crate::receipt::DepartureStep::GpuScrub);
    assert_eq!(scrub.assurance, crate::receipt::Assurance::Simulated);
    let release = line(crate::receipt::DepartureStep::GpuRelease);
    assert_eq!(
        release.evidence["driver 0000:00:03.0"], "none (before the bind: none)",
        "{release:?}"
    );
    assert!(release.evidence["quarantined"].starts_with("device-reset"));
    assert!(h.svc.store().gpu_devices().unwrap().is_empty());
}

/// The steps of `op` from `first` to `last`: those around the GPU's. (The crash tests of
/// `tenant::tests` cover every boundary of every step with the fake planner; each run here
/// costs a FAKE tree and a SIMULATED host file, so only the boundaries where the device is
/// in flight are repeated with the real routes.)
fn window(op: Op, first: Step, last: Step) -> Vec<Step> {
    let steps = op.steps();
    let a = steps.iter().position(|s| *s == first).unwrap();
    let b = steps.iter().position(|s| *s == last).unwrap();
    steps[a..=b].to_vec()
}

/// Create with a crash at `step`/`boundary`, restart, reconcile: it must end running with
/// the host as an uninterrupted create leaves it; then destroy with a crash at every
/// boundary too, converging to the host as it was.
fn converges(gpu: &str, gpu_host: fn() -> GpuHost) {
    let reference = {
        let host = gpu_host();
        let before = snapshot(&host);
        let h = harness(&host);
        create(&h, gpu);
        assert_eq!(state(&h), Some(LifecycleState::Running));
        let created = snapshot(&host);
        destroy(&h);
        // The uninterrupted run gives the card back as it found it (MIG mode included).
        assert_eq!(snapshot(&host), before, "the host as the tenant found it");
        (created, snapshot(&host))
    };
    for step in window(Op::Create, Step::ReserveGpu, Step::LaunchVm) {
        for boundary in [Boundary::Before, Boundary::After] {
            let host = gpu_host();
            let mut h = harness(&host);
            h.restart(FaultHook::fail_at("create", step.name(), boundary));
            create(&h, gpu);
            h.restart(FaultHook::default());
            reconcile(&h.svc, &ReconcileOptions::default()).unwrap();
            assert_eq!(
                state(&h),
                Some(LifecycleState::Running),
                "create {step:?} {boundary:?}: {:?}",
                h.svc.store().tenant("g").unwrap().unwrap().error
            );
            assert_eq!(snapshot(&host), reference.0, "create {step:?} {boundary:?}");
        }
    }
    for step in window(Op::Destroy, Step::StopVm, Step::ReleaseGpu) {
        for boundary in [Boundary::Before, Boundary::After] {
            let host = gpu_host();
            let mut h = harness(&host);
            create(&h, gpu);
            h.restart(FaultHook::fail_at("destroy", step.name(), boundary));
            destroy(&h);
            h.restart(FaultHook::default());
            reconcile(&h.svc, &ReconcileOptions::default()).unwrap();
            assert_eq!(state(&h), None, "destroy {step:?} {boundary:?}");
            assert_eq!(
                snapshot(&host),
                reference.1,
                "destroy {step:?} {boundary:?}"
            );
            assert!(h.svc.store().gpu_devices().unwrap().is_empty());
            assert!(h.svc.store().gpu_reservations().unwrap().is_empty());
        }
    }
}

#[test]
fn a_vgpu_tenant_converges_after_a_crash_at_every_step_boundary() {
    converges(VGPU, gpu_host);
}

#[test]
fn a_whole_gpu_tenant_converges_after_a_crash_at_every_step_boundary() {
    converges(WHOLE, gpu_host);
}

#[test]
fn an_mdev_tenant_converges_after_a_crash_at_every_step_boundary() {
    converges(MDEV, mdev_host);
}

#[test]
fn an_mdev_share_is_refused_at_create_on_tenantvm_vmm_with_what_to_do() {
    let host = mdev_host();
    let before = snapshot(&host);
    let h = harness(&host);
    h.host.state().qemu = false;
    let err = h
        .svc
        .execute(&Caller::Admin, TenantCommand::Create(spec(MDEV)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("mdev") && err.contains("--backend qemu-kvm"),
        "{err}"
    );
    assert_eq!(state(&h), None);
    assert_eq!(snapshot(&host), before, "nothing touched");
}

#[test]
fn an_mdev_vgpu_is_created_handed_over_by_its_sysfs_path_and_removed() {
    let host = mdev_host();
    let before = snapshot(&host);
    let h = harness(&host);
    create(&h, MDEV);
    assert_eq!(state(&h), Some(LifecycleState::Running));
    let (devices, uuid) = launched(&h);
    let [PassthroughDevice::Mdev {
        uuid: mdev,
        iommu_group,
    }] = &devices[..]
    else {
        panic!("one mdev expected: {devices:?}")
    };
    assert!(uuid.is_some());
    let during = snapshot(&host);
    assert_eq!(during.1, 1);
    assert!(sysfs_has_mdev(&host, mdev));
    assert!(
        !before.0[0].2.contains(&during.0[0].2[0]),
        "an instance was made"
    );
    // Its own IOMMU group, which the jail will give the VMM as /dev/vfio/<group>.
    let sysfs = host.fake.sysfs();
    assert!(sysfs
        .path(&format!(
            "sys/kernel/iommu_groups/{iommu_group}/devices/{mdev}"
        ))
        .exists());
    destroy(&h);
    assert_eq!(snapshot(&host), before);
}

#[test]
fn mig_mode_turned_on_for_an_mdev_tenant_goes_back_off_as_it_leaves() {
    let host = mdev_host_mig_off();
    let before = snapshot(&host);
    assert!(!before.0[0].1, "the card starts with MIG off");
    let h = harness(&host);
    create(&h, MDEV);
    assert_eq!(state(&h), Some(LifecycleState::Running));
    assert!(snapshot(&host).0[0].1, "MIG on for the tenant's instance");
    // The record says so before the mode is changed (the crash test below relies on it).
    let rows = h.svc.store().gpu_devices().unwrap();
    assert!(
        rows[0]
            .1
            .record
            .contains("\"mig_turned_on\":\"0000:05:00.0\""),
        "{rows:?}"
    );
    destroy(&h);
    assert_eq!(snapshot(&host), before, "MIG off again");
}

#[test]
fn an_mdev_tenant_that_turned_mig_on_converges_after_a_crash_at_every_step_boundary() {
    converges(MDEV, mdev_host_mig_off);
}

#[test]
fn a_card_that_had_mig_on_keeps_it_and_the_last_mig_tenant_turns_it_off() {
    // MIG on before: it stays on after the tenant leaves.
    let host = mdev_host();
    let before = snapshot(&host);
    let h = harness(&host);
    create(&h, MDEV);
    destroy(&h);
    assert_eq!(snapshot(&host), before);
    assert!(snapshot(&host).0[0].1);

    // MIG off before, two tenants on the card: the first to leave hands the duty to the
    // other, the last one turns MIG off.
    let host = mdev_host_mig_off();
    let before = snapshot(&host);
    let h = harness(&host);
    for name in ["a", "b"] {
        h.svc
            .execute(
                &Caller::Admin,
                TenantCommand::Create(spec_named(name, MDEV)),
            )
            .unwrap();
        h.svc.wait_idle();
        let t = h.svc.store().tenant(name).unwrap().unwrap();
        assert_eq!(t.state, LifecycleState::Running, "{name}: {:?}", t.error);
    }
    h.svc
        .execute(&Caller::Admin, TenantCommand::Destroy("a".into()))
        .unwrap();
    h.svc.wait_idle();
    assert!(snapshot(&host).0[0].1, "b's instance still needs MIG");
    let rows = h.svc.store().gpu_devices().unwrap();
    assert_eq!(rows.len(), 1);
    assert!(
        rows[0].1.record.contains("mig_turned_on"),
        "b inherited: {rows:?}"
    );
    h.svc
        .execute(&Caller::Admin, TenantCommand::Destroy("b".into()))
        .unwrap();
    h.svc.wait_idle();
    assert_eq!(
        snapshot(&host),
        before,
        "the last MIG tenant turned MIG off"
    );
}

/// A planner that holds the departure of a card's last vGPU tenant inside
/// `leave_device_mode` (VFs off, MIG off) until the test lets it go, and notes whether
/// another tenant's create planned its route meanwhile.
struct GatedPlanner {
    inner: Arc<BackendPlanner>,
    entered: std::sync::Mutex<Option<std::sync::mpsc::Sender<()>>>,
    go: std::sync::Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    inside: std::sync::atomic::AtomicBool,
    planned_inside: std::sync::atomic::AtomicBool,
}

mod gated {
    use super::GatedPlanner;
    use crate::backend::PassthroughDevice;
    use crate::domain::spec::GpuRequest;
    use crate::gpu::{Cleaning, Describe, DeviceResetOutcome, DeviceRoute, GpuError, Placement};
    use crate::gpu::{DeviceRecord, MigRestore};
    use crate::store::GpuPlacement;
    use std::sync::atomic::Ordering::SeqCst;

    impl Placement for GatedPlanner {
        fn place(
            &self,
            tenant: &str,
            request: &GpuRequest,
            held: &[GpuPlacement],
        ) -> Result<GpuPlacement, GpuError> {
            self.inner.place(tenant, request, held)
        }
        fn materialize(&self, p: &GpuPlacement) -> Result<(), GpuError> {
            self.inner.materialize(p)
        }
        fn release(&self, p: &GpuPlacement) -> Result<(), GpuError> {
            Placement::release(self.inner.as_ref(), p)
        }
        fn mig_enabled(&self, gpu: &str) -> Result<Option<bool>, GpuError> {
            self.inner.mig_enabled(gpu)
        }
        fn restore_mig_off(&self, gpu: &str) -> Result<MigRestore, GpuError> {
            Placement::restore_mig_off(self.inner.as_ref(), gpu)
        }
    }

    impl DeviceRoute for GatedPlanner {
        fn plan_device(&self, p: &GpuPlacement) -> Result<DeviceRecord, GpuError> {
            if self.inside.load(SeqCst) {
                self.planned_inside.store(true, SeqCst);
            }
            self.inner.plan_device(p)
        }
        fn prepare_device(&self, p: &GpuPlacement, r: &DeviceRecord) -> Result<(), GpuError> {
            self.inner.prepare_device(p, r)
        }
        fn plan_bind(&self, p: &GpuPlacement, r: &DeviceRecord) -> Result<DeviceRecord, GpuError> {
            self.inner.plan_bind(p, r)
        }
        fn bind_device(
            &self,
            p: &GpuPlacement,
            r: &DeviceRecord,
        ) -> Result<DeviceRecord, GpuError> {
            self.inner.bind_device(p, r)
        }
        fn devices(&self, r: &DeviceRecord) -> Result<Vec<PassthroughDevice>, GpuError> {
            self.inner.devices(r)
        }
        fn reset_device(&self, r: &DeviceRecord) -> Result<Option<DeviceResetOutcome>, GpuError> {
            self.inner.reset_device(r)
        }
        fn rebind_device(&self, r: &DeviceRecord) -> Result<(), GpuError> {
            self.inner.rebind_device(r)
        }
        fn detach_device(&self, p: &GpuPlacement, r: &DeviceRecord) -> Result<(), GpuError> {
            self.inner.detach_device(p, r)
        }
        fn leave_device_mode(&self, card: &str, r: &DeviceRecord) -> Result<(), GpuError> {
            let entered = self.entered.lock().unwrap().take();
            if let Some(tx) = entered {
                self.inside.store(true, SeqCst);
                tx.send(()).unwrap();
                let go = self.go.lock().unwrap().take().unwrap();
                go.recv_timeout(std::time::Duration::from_secs(60)).unwrap();
                let out = DeviceRoute::leave_device_mode(self.inner.as_ref(), card, r);
                self.inside.store(false, SeqCst);
                return out;
            }
            DeviceRoute::leave_device_mode(self.inner.as_ref(), card, r)
        }
    }

    impl Cleaning for GatedPlanner {
        fn reset(&self, p: &GpuPlacement) -> Result<DeviceResetOutcome, GpuError> {
            self.inner.reset(p)
        }
        fn scrub(&self, p: &GpuPlacement) -> Result<crate::gpu::scrub::ScrubOutcome, GpuError> {
            self.inner.scrub(p)
        }
    }

    impl Describe for GatedPlanner {}
}

#[test]
fn a_vgpu_create_waits_while_the_cards_last_vgpu_tenant_takes_it_out_of_vgpu_mode() {
    let host = one_vgpu_card();
    let before = snapshot(&host);
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel();
    let gated = Arc::new(GatedPlanner {
        inner: host.planner.clone(),
        entered: std::sync::Mutex::new(Some(entered_tx)),
        go: std::sync::Mutex::new(Some(go_rx)),
        inside: Default::default(),
        planned_inside: Default::default(),
    });
    let h = Harness::new(FaultHook::default()).with_planner(gated.clone());
    h.host.state().qemu = true;
    let run = |cmd| {
        h.svc.execute(&Caller::Admin, cmd).unwrap();
    };
    run(TenantCommand::Create(spec_named("a", VGPU)));
    h.svc.wait_idle();
    let card = snapshot(&host).0[0].clone();
    assert!(
        card.1 && card.3 > 0,
        "a put the card in vGPU mode: {card:?}"
    );
    // a leaves; its departure stops inside the card's way out of vGPU mode.
    run(TenantCommand::Destroy("a".into()));
    entered_rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .unwrap();
    // b wants a vGPU on the same card meanwhile: its host preparation must wait.
    run(TenantCommand::Create(spec_named("b", VGPU)));
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        !gated
            .planned_inside
            .load(std::sync::atomic::Ordering::SeqCst),
        "b planned its route while a was taking the card out of vGPU mode"
    );
    go_tx.send(()).unwrap();
    h.svc.wait_idle();
    assert!(h.svc.store().tenant("a").unwrap().is_none());
    let b = h.svc.store().tenant("b").unwrap().unwrap();
    assert_eq!(b.state, LifecycleState::Running, "{:?}", b.error);
    // b found the card out of vGPU mode (VFs off), put it back, and says so.
    let rows = h.svc.store().gpu_devices().unwrap();
    assert!(
        rows[0].1.record.contains("\"enables_vfs\":true"),
        "{rows:?}"
    );
    run(TenantCommand::Destroy("b".into()));
    h.svc.wait_idle();
    assert_eq!(snapshot(&host), before, "the card as it was");
}
