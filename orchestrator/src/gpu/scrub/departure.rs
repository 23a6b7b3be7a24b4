//! [`Cleaning`] over a tenantvm-gpu backend: the departure's device reset and memory scrub of
//! a released placement.
//!
//! With the simulated backend both steps run their simulated counterparts and say so
//! (assurance `simulated`, never `verified`). With NVML the scrub is the real CUDA scrub
//! ([`super`]) run in a child `tenantvm gpu scrub-device` with the GPU's or the MIG
//! instance's UUID in `CUDA_VISIBLE_DEVICES`, and a whole GPU is reset through its PCI
//! function's sysfs `reset` (the kernel picks FLR, falling back to a secondary bus reset).

use std::collections::BTreeMap;
use std::path::Path;

use tenantvm_gpu::backend::{GpuBackend, GpuInfo};

use super::{scrub_in_child, simulate_scrub, ScrubOutcome, VerifyMode};
use crate::gpu::backend::{find_gpu, BackendPlanner};
use crate::gpu::error::{plan_err, GpuError};
use crate::gpu::seam::Cleaning;
use crate::gpu::types::DeviceResetOutcome;
use crate::receipt::{Assurance, StepResult};
use crate::store::GpuPlacement;

/// TEST ONLY: makes the simulated backend's scrub fail. `all` fails every scrub; otherwise a
/// comma-separated list of slices (`<gpu>/<label>`, e.g. `1/1g.18gb@0`) whose scrub fails.
/// Ignored by the NVML backend.
pub const SIM_SCRUB_FAIL_ENV: &str = "TENANTVM_TEST_SIM_SCRUB_FAIL";

/// The slice as quarantine and the test hook name it.
pub fn slice_id(p: &GpuPlacement) -> String {
    format!("{}/{}", p.gpu, p.label)
}

fn gpu_of(backend: &dyn GpuBackend, p: &GpuPlacement) -> Result<GpuInfo, GpuError> {
    let gpus = backend.gpus().map_err(plan_err)?;
    find_gpu(&gpus, &p.gpu)
        .cloned()
        .ok_or_else(|| plan_err(format!("GPU {} is gone", p.gpu)))
}

/// The MIG profile name and GPU-instance id of a MIG placement (None for a whole GPU).
fn mig_instance(g: &GpuInfo, p: &GpuPlacement) -> Result<Option<(String, u32)>, GpuError> {
    let Some((name, start)) = p.label.split_once('@') else {
        return Ok(None);
    };
    let start: u32 = start
        .parse()
        .map_err(|_| plan_err(format!("unreadable placement {:?}", p.label)))?;
    let model = g
        .gpu_model()
        .ok_or_else(|| plan_err(format!("GPU {} has no known model", g.index)))?;
    let profile = model.profile(name).map_err(plan_err)?;
    let gi = g
        .instances
        .iter()
        .find(|i| i.profile_id == profile.id && i.start == start)
        .ok_or_else(|| {
            plan_err(format!(
                "the MIG instance of {} is gone; it must exist to be scrubbed",
                slice_id(p)
            ))
        })?;
    Ok(Some((name.to_string(), gi.gi_id)))
}

/// Memory of the placement in bytes.
fn placement_bytes(g: &GpuInfo, p: &GpuPlacement) -> u64 {
    let model = g.gpu_model();
    match p.label.split_once('@') {
        Some((name, _)) => model
            .and_then(|m| m.profile(name).ok())
            .map_or(0, |pr| pr.memory_bytes()),
        None => g.memory_mib << 20,
    }
}

fn sim_scrub_fails(p: &GpuPlacement) -> bool {
    let Ok(v) = std::env::var(SIM_SCRUB_FAIL_ENV) else {
        return false;
    };
    let id = slice_id(p);
    v.split(',').any(|s| s.trim() == "all" || s.trim() == id)
}

/// Resets the placement's device.
fn reset(backend: &dyn GpuBackend, p: &GpuPlacement) -> Result<DeviceResetOutcome, GpuError> {
    let g = gpu_of(backend, p)?;
    let mut evidence = BTreeMap::new();
    evidence.insert("slice".to_string(), slice_id(p));
    evidence.insert("pci_address".to_string(), g.pci_address.clone());
    if backend.kind() == "sim" {
        return Ok(DeviceResetOutcome {
            method: "simulated: no device was reset".into(),
            result: StepResult::Ok,
            assurance: Assurance::Simulated,
            evidence,
        });
    }
    if p.label.contains('@') {
        return Ok(DeviceResetOutcome {
            method: "none: a MIG instance has no function reset of its own; it is scrubbed, then destroyed".into(),
            result: StepResult::Skipped,
            assurance: Assurance::NotApplicable,
            evidence,
        });
    }
    let reset = Path::new("/sys/bus/pci/devices")
        .join(&g.pci_address)
        .join("reset");
    std::fs::write(&reset, b"1").map_err(|e| {
        plan_err(format!(
            "cannot reset {} through {}: {e}; stop whatever holds the GPU and run destroy again",
            g.pci_address,
            reset.display()
        ))
    })?;
    Ok(DeviceResetOutcome {
        method: "PCI function reset through sysfs (FLR, or secondary bus reset as the kernel's fallback)".into(),
        result: StepResult::Ok,
        assurance: Assurance::Unverified,
        evidence,
    })
}

/// Scrubs the placement's memory (its MIG instance must still exist).
fn scrub(backend: &dyn GpuBackend, p: &GpuPlacement) -> Result<ScrubOutcome, GpuError> {
    let g = gpu_of(backend, p)?;
    if backend.kind() == "sim" {
        return Ok(simulate_scrub(
            &format!("sim-gpu{}/{}", g.index, p.label),
            placement_bytes(&g, p),
            sim_scrub_fails(p),
        ));
    }
    let mig = mig_instance(&g, p)?;
    let uuid = nvml_uuid(g.index, mig.as_ref().map(|m| m.1))?;
    let program = crate::backend::runner::sibling_binary("tenantvm").map_err(plan_err)?;
    let mut outcome = scrub_in_child(&program, &["gpu", "scrub-device"], &uuid, VerifyMode::Full)
        .map_err(plan_err)?;
    // The daemon's own judgement: the coverage rule on the child's counts, against the
    // slice it placed (a child scrubbing another device, or an older child, cannot pass).
    outcome.judge(Some(placement_bytes(&g, p)));
    Ok(outcome)
}

/// The UUID of GPU `index`, or of its MIG device in GPU instance `gi_id`.
fn nvml_uuid(index: u32, gi_id: Option<u32>) -> Result<String, GpuError> {
    use nvml_wrapper::Nvml;
    let nvml = Nvml::init().map_err(plan_err)?;
    let dev = nvml.device_by_index(index).map_err(plan_err)?;
    let Some(gi_id) = gi_id else {
        return dev.uuid().map_err(plan_err);
    };
    let count = dev.mig_device_count().map_err(plan_err)?;
    for i in 0..count {
        let Ok(mig) = dev.mig_device_by_index(i) else {
            continue;
        };
        let mut id: u32 = 0;
        // SAFETY: the handle belongs to `nvml`, which outlives this call; `id` is a valid out
        // pointer for the duration of the call.
        let code = unsafe { nvml.lib().nvmlDeviceGetGpuInstanceId(mig.handle(), &mut id) };
        if code == nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_SUCCESS && id == gi_id {
            return mig.uuid().map_err(plan_err);
        }
    }
    Err(plan_err(format!(
        "GPU {index} has no MIG device in GPU instance {gi_id}"
    )))
}

impl Cleaning for BackendPlanner {
    fn reset(&self, placement: &GpuPlacement) -> Result<DeviceResetOutcome, GpuError> {
        reset(self.backend(), placement)
    }

    fn scrub(&self, placement: &GpuPlacement) -> Result<ScrubOutcome, GpuError> {
        scrub(self.backend(), placement)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenantvm_gpu::backend::{self as gpu_backend, BackendSpec};

    fn sim(dir: &tempfile::TempDir) -> Box<dyn GpuBackend> {
        let src =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hosts/sim-mixed.json");
        let path = dir.path().join("host.json");
        std::fs::copy(src, &path).unwrap();
        gpu_backend::open(&BackendSpec::Sim(path)).unwrap()
    }

    #[test]
    fn sim_reset_and_scrub_say_simulated() {
        let dir = tempfile::tempdir().unwrap();
        let b = sim(&dir);
        // GPU 0 holds a 2g.10gb instance at start 2 in the fixture.
        let p = GpuPlacement {
            gpu: "0".into(),
            slots: vec![2, 3],
            label: "2g.10gb@2".into(),
        };
        let r = reset(b.as_ref(), &p).unwrap();
        assert_eq!(r.assurance, Assurance::Simulated);
        let s = scrub(b.as_ref(), &p).unwrap();
        assert_eq!(s.assurance, Assurance::Simulated);
        assert!(s.passed);
        assert!(s.total_bytes > 8 << 30, "{}", s.total_bytes);
    }

    #[test]
    fn scrub_of_an_unknown_gpu_is_an_error_not_a_pass() {
        let dir = tempfile::tempdir().unwrap();
        let b = sim(&dir);
        let p = GpuPlacement {
            gpu: "9".into(),
            slots: vec![0],
            label: "1g.5gb@0".into(),
        };
        scrub(b.as_ref(), &p).unwrap_err();
    }
}
