//! Shared by the route tests: a FAKE sysfs tree linked to a SIMULATED GPU host, and a backend
//! wrapper that puts a crash point before every mutating GPU call.

#![allow(dead_code)]

use std::path::PathBuf;

use tenantvm_gpu::backend::sim::{SimBackend, SimHost, SimVgpu};
use tenantvm_gpu::backend::{BackendError, GpuBackend, GpuInfo, GpuInstance};
use tenantvm_gpu::host::fake::FakeHost;
use tenantvm_gpu::host::Sysfs;

/// The HGX H100 tree of h100x8.sysfs.json with sim-h100x8.json as its GPUs, every GPU with
/// SR-IOV vGPU. GPU 2 (0000:3a:00.0) is empty with MIG on; GPU 6 (0000:ba:00.0) has MIG off.
pub struct VgpuHost {
    pub fake: FakeHost,
    pub sim: SimBackend,
    pub sysfs: Sysfs,
}

pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

pub fn vgpu_host() -> VgpuHost {
    let fake = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
    let text = std::fs::read_to_string(fixture("hosts/sim-h100x8.json")).unwrap();
    let mut host: SimHost = serde_json::from_str(&text).unwrap();
    for g in &mut host.gpus {
        g.vgpu = SimVgpu::Sriov;
    }
    let sim = fake.attach_sim(&host).unwrap();
    let sysfs = fake.sysfs();
    VgpuHost { fake, sim, sysfs }
}

impl VgpuHost {
    pub fn gpu(&self, index: u32) -> GpuInfo {
        self.sim
            .gpus()
            .unwrap()
            .into_iter()
            .find(|g| g.index == index)
            .unwrap()
    }
}

/// A backend whose mutating calls pass a crash point of the fake tree first.
pub struct Crashing<'a> {
    pub inner: &'a SimBackend,
    pub fake: &'a FakeHost,
}

impl Crashing<'_> {
    fn point(&self) -> Result<(), BackendError> {
        self.fake.crash_point().map_err(|e| BackendError::Nvml {
            call: "crash point",
            detail: e.to_string(),
        })
    }
}

impl GpuBackend for Crashing<'_> {
    fn kind(&self) -> &'static str {
        "sim"
    }
    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError> {
        self.inner.gpus()
    }
    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<(), BackendError> {
        self.point()?;
        self.inner.set_mig_mode(gpu, enabled)
    }
    fn possible_placements(&self, gpu: u32, p: u32) -> Result<Vec<(u32, u32)>, BackendError> {
        self.inner.possible_placements(gpu, p)
    }
    fn remaining_capacity(&self, gpu: u32, p: u32) -> Result<u32, BackendError> {
        self.inner.remaining_capacity(gpu, p)
    }
    fn create_gpu_instance(&self, gpu: u32, p: u32, s: u32) -> Result<GpuInstance, BackendError> {
        self.point()?;
        self.inner.create_gpu_instance(gpu, p, s)
    }
    fn ensure_compute_instance(&self, gpu: u32, gi: u32) -> Result<(), BackendError> {
        self.point()?;
        self.inner.ensure_compute_instance(gpu, gi)
    }
    fn destroy_instance(&self, gpu: u32, gi: u32) -> Result<(), BackendError> {
        self.point()?;
        self.inner.destroy_instance(gpu, gi)
    }
}
