//! The real GPU host: [`BackendPlanner`], a tenantvm-gpu backend (NVML or a simulated host)
//! and the sysfs devices are handed over through, built from `--gpu-backend` and
//! `--gpu-sysfs-root`, and the helpers its seams share. Each seam's implementation over it
//! is a file of its own ([`super::placement`], [`super::route`],
//! [`super::scrub::departure`], [`super::describe`]).
//!
//! A placement names its GPU by PCI address (NVML's indexes shift when a GPU is bound to
//! vfio-pci); ledger rows written before name it by index, and both are found again. Its
//! label is `whole` or `<profile>@<start>`; the MIG instance of a placement is found again
//! from (GPU, profile, start), so creating and destroying it are idempotent without storing
//! the instance id.

use std::sync::Arc;

use tenantvm_gpu::backend::sim::vendor::SimulatedVgpuDriver;
use tenantvm_gpu::backend::sim::SimBackend;
use tenantvm_gpu::backend::{self as gpu_backend, BackendSpec, GpuBackend, GpuInfo};
use tenantvm_gpu::host::{PciAddress, Sysfs};
use tenantvm_gpu::mig::MigProfile;

use super::error::{device_err, plan_err, GpuError};
use super::seam::GpuHost;
use crate::store::GpuPlacement;

/// Builds the planner `--gpu-backend` names (`nvml` or `sim:FILE`), handing devices over
/// through the sysfs under `sysfs_root` (`--gpu-sysfs-root`). Without one, NVML hands them
/// over through the host's sysfs (`/`) and a simulated host hands over none. A simulated
/// host with a root hands over the real devices at its GPUs' PCI addresses (the nested
/// test host gives QEMU's edu device whole this way): the binding, the VM's devices, the
/// reset and the rebind are real, the inventory, placement and scrub simulated.
pub fn planner_from_arg(
    arg: &str,
    sysfs_root: Option<&std::path::Path>,
) -> anyhow::Result<Arc<dyn GpuHost>> {
    let spec: BackendSpec = arg.parse()?;
    if let Some(root) = sysfs_root {
        if !root.join("sys/bus/pci").is_dir() {
            anyhow::bail!(
                "--gpu-sysfs-root {}: there is no sys/bus/pci under it; name the root the host's sysfs is mounted under (`/`)",
                root.display()
            );
        }
    }
    let backend = gpu_backend::open(&spec)?;
    Ok(Arc::new(planner_with_sysfs(
        BackendPlanner::new(backend),
        &spec,
        sysfs_root,
    )?))
}

/// `planner` with the sysfs it hands devices over through: `sysfs_root` when given, else
/// `/` for NVML and none for a simulated host. A simulated host with a root gets the
/// SIMULATED NVIDIA driver laid over that root's real functions
/// ([`SimulatedVgpuDriver`]): the MIG-backed vGPU route then enables real SR-IOV VFs and
/// hands a real VF over, with the vGPU type on it simulated.
fn planner_with_sysfs(
    planner: BackendPlanner,
    spec: &BackendSpec,
    sysfs_root: Option<&std::path::Path>,
) -> Result<BackendPlanner, gpu_backend::BackendError> {
    Ok(match (sysfs_root, spec) {
        (Some(root), BackendSpec::Sim(file)) => planner.with_sysfs(SimulatedVgpuDriver::over(
            Sysfs::new(root),
            SimBackend::open(file)?,
        )),
        (Some(root), _) => planner.with_sysfs(Sysfs::new(root)),
        (None, BackendSpec::Sim(_)) => planner,
        (None, _) => planner.with_sysfs(Sysfs::new("/")),
    })
}

/// A planner over a tenantvm-gpu backend.
pub struct BackendPlanner {
    backend: Box<dyn GpuBackend>,
    sysfs: Option<Sysfs>,
}

impl BackendPlanner {
    /// A planner over `backend` that hands no device to a VM.
    pub fn new(backend: Box<dyn GpuBackend>) -> BackendPlanner {
        BackendPlanner {
            backend,
            sysfs: None,
        }
    }

    /// The same planner, handing devices over through `sysfs` (`/` on a real host, a FAKE
    /// tree in tests).
    pub fn with_sysfs(self, sysfs: Sysfs) -> BackendPlanner {
        BackendPlanner {
            sysfs: Some(sysfs),
            ..self
        }
    }

    /// The sysfs devices are handed over through, if any.
    pub fn sysfs(&self) -> Option<&Sysfs> {
        self.sysfs.as_ref()
    }

    /// The backend.
    pub fn backend(&self) -> &dyn GpuBackend {
        self.backend.as_ref()
    }
}

/// The GPU a ledger id names: its PCI address (any case), or its index as text.
pub fn find_gpu<'a>(gpus: &'a [GpuInfo], id: &str) -> Option<&'a GpuInfo> {
    gpus.iter()
        .find(|g| g.pci_address.eq_ignore_ascii_case(id))
        .or_else(|| gpus.iter().find(|g| g.index.to_string() == id))
}

/// The PCI address a ledger or a record names.
pub(super) fn pci(address: &str) -> Result<PciAddress, GpuError> {
    PciAddress::parse(address).map_err(device_err)
}

/// The (profile, start) of a MIG placement label.
pub(super) fn mig_label<'m>(
    info: &'m GpuInfo,
    placement: &GpuPlacement,
) -> Result<(&'m MigProfile, u32), GpuError> {
    let (name, start) = placement
        .label
        .split_once('@')
        .ok_or_else(|| device_err(format!("{} is not a MIG placement", placement.label)))?;
    let start = start
        .parse()
        .map_err(|_| device_err(format!("unreadable placement {:?}", placement.label)))?;
    let model = info
        .gpu_model()
        .ok_or_else(|| device_err(format!("GPU {} has no known model", info.pci_address)))?;
    Ok((model.profile(name).map_err(device_err)?, start))
}

impl BackendPlanner {
    /// The GPU ledger id `id` names, as the backend lists it now.
    pub(super) fn gpu_info(&self, id: &str) -> Result<GpuInfo, GpuError> {
        let gpus = self.backend().gpus().map_err(device_err)?;
        find_gpu(&gpus, id)
            .cloned()
            .ok_or_else(|| device_err(format!("GPU {id} is gone")))
    }

    /// The sysfs devices are handed over through, or why there is none.
    pub(super) fn sysfs_or(&self) -> Result<&Sysfs, GpuError> {
        self.sysfs()
            .ok_or_else(|| device_err("this planner has no sysfs to act on"))
    }
}

impl BackendPlanner {
    /// The (GPU index, profile, start) of a MIG placement; None for a whole GPU.
    pub(super) fn mig_of(
        &self,
        placement: &GpuPlacement,
    ) -> Result<Option<(u32, &'static MigProfile, u32)>, GpuError> {
        let Some((name, start)) = placement.label.split_once('@') else {
            return Ok(None);
        };
        let bad = || plan_err(format!("unreadable placement {:?}", placement.label));
        let start: u32 = start.parse().map_err(|_| bad())?;
        let gpus = self.backend.gpus().map_err(plan_err)?;
        let info = find_gpu(&gpus, &placement.gpu)
            .ok_or_else(|| plan_err(format!("GPU {} is gone", placement.gpu)))?;
        let model = info
            .gpu_model()
            .ok_or_else(|| plan_err(format!("GPU {} has no known model", placement.gpu)))?;
        let profile = model.profile(name).map_err(plan_err)?;
        Ok(Some((info.index, profile, start)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::spec::GpuRequest;
    use crate::gpu::seam::{Describe, DeviceRoute, Placement};
    use crate::gpu::types::DeviceRecord;
    use crate::store::GpuPlacement;

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/hosts")
            .join(name)
    }

    fn sim_file(dir: &tempfile::TempDir, text: &str) -> BackendPlanner {
        let path = dir.path().join("host.json");
        std::fs::write(&path, text).unwrap();
        BackendPlanner::new(gpu_backend::open(&BackendSpec::Sim(path)).unwrap())
    }

    fn sim(dir: &tempfile::TempDir, name: &str) -> BackendPlanner {
        sim_file(dir, &std::fs::read_to_string(fixture(name)).unwrap())
    }

    /// One H100 with MIG on and nothing on it (SIMULATED).
    const ONE_H100: &str = r#"{"gpus": [{"index": 0, "model": "h100-80gb",
        "pci_address": "0000:41:00.0", "mig_enabled": true, "instances": [],
        "iommu_group": 17}]}"#;

    fn profile(p: &str) -> GpuRequest {
        GpuRequest {
            profile: Some(p.into()),
            ..Default::default()
        }
    }

    fn overlaps(a: &GpuPlacement, b: &GpuPlacement) -> bool {
        a.gpu == b.gpu && a.slots.iter().any(|s| b.slots.contains(s))
    }

    #[test]
    fn placements_go_around_instances_and_held_shares_by_pci_address() {
        let dir = tempfile::tempdir().unwrap();
        let p = sim(&dir, "sim-mixed.json");
        let mut held: Vec<GpuPlacement> = Vec::new();
        for i in 0..12 {
            let Ok(got) = p.place(&format!("t{i}"), &profile("1g.5gb"), &held) else {
                break;
            };
            // GPU 0 (A100-40GB, 0000:07:00.0) has a 2g.10gb at start 2.
            assert_eq!(got.gpu, "0000:07:00.0", "{got:?}");
            assert!(
                !got.slots.contains(&2) && !got.slots.contains(&3),
                "{got:?}"
            );
            assert!(!held.iter().any(|h| overlaps(h, &got)), "{got:?} {held:?}");
            held.push(got);
        }
        // 1g.5gb fits on the six free slots of the A100 (slot 7 holds no 1g): at most 6.
        assert!(!held.is_empty() && held.len() <= 6, "{held:?}");
        let err = p.place("late", &profile("1g.5gb"), &held).unwrap_err();
        assert!(err.to_string().contains("1g.5gb"), "{err}");
        // A ledger row of the first format names the GPU by index: still understood.
        let by_index = GpuPlacement {
            gpu: "0".into(),
            ..held[0].clone()
        };
        p.place("again", &profile("1g.5gb"), &held[1..]).unwrap();
        let mut old = held[1..].to_vec();
        old.push(by_index);
        p.place("again", &profile("1g.5gb"), &old).unwrap_err();
    }

    #[test]
    fn a_simulated_host_hands_real_devices_over_only_with_a_sysfs_root() {
        use crate::tenant::test_utils::{EDU_TREE, SIM_AT_EDU};
        use tenantvm_gpu::host::fake::FakeHost;
        let tree = FakeHost::build(&serde_json::from_str(EDU_TREE).unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("host.json");
        std::fs::write(&path, SIM_AT_EDU).unwrap();
        let spec = BackendSpec::Sim(path.clone());
        let whole = GpuRequest {
            whole_gpu: true,
            ..Default::default()
        };
        let open = || BackendPlanner::new(gpu_backend::open(&spec).unwrap());

        // Without a root the simulated host hands nothing over.
        let p = planner_with_sysfs(open(), &spec, None).unwrap();
        assert!(p.sysfs().is_none());
        let placement = p.place("t", &whole, &[]).unwrap();
        let record = p.plan_device(&placement).unwrap();
        assert!(!record.attaches(), "{record:?}");

        // With one, the device at the simulated GPU's address is bound as a whole card:
        // its group, and the driver and override it has now (none) recorded.
        let p = planner_with_sysfs(open(), &spec, Some(tree.root())).unwrap();
        let record = p.plan_device(&placement).unwrap();
        let DeviceRecord::Whole { binding, .. } = &record else {
            panic!("{record:?}")
        };
        assert_eq!((binding.group, binding.gpu.as_str()), (5, "0000:00:03.0"));
        assert_eq!(binding.devices.len(), 1);
        assert_eq!(binding.devices[0].previous_driver, None);
        assert_eq!(binding.devices[0].previous_override, None);

        // A root without sysfs under it is refused, naming the flag.
        let err = planner_from_arg(&format!("sim:{}", path.display()), Some(dir.path()))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("--gpu-sysfs-root") && err.contains("sys/bus/pci"),
            "{err}"
        );
        planner_from_arg(&format!("sim:{}", path.display()), Some(tree.root())).unwrap();
    }

    #[test]
    fn a_fragmenting_first_fit_order_is_not_a_refusal() {
        // First-fit would put two 1g instances at slots 0 and 1 and then refuse the 4g,
        // whose only start is 0. The planner puts them where the 4g still fits.
        let dir = tempfile::tempdir().unwrap();
        let p = sim_file(&dir, ONE_H100);
        let mut held = Vec::new();
        for i in 0..2 {
            let got = p
                .place(&format!("small{i}"), &profile("1g.10gb"), &held)
                .unwrap();
            held.push(got);
        }
        let big = p.place("big", &profile("4g.40gb"), &held).unwrap();
        assert_eq!(
            (big.label.as_str(), &big.slots[..]),
            ("4g.40gb@0", &[0, 1, 2, 3][..])
        );
        assert!(!held.iter().any(|h| overlaps(h, &big)));
    }

    #[test]
    fn gpus_without_a_partition_are_given_whole_and_never_shared() {
        let dir = tempfile::tempdir().unwrap();
        let p = sim(&dir, "sim-whole-only.json");
        let err = p
            .place("a", &profile("1g.10gb"), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("can only be given whole"), "{err}");
        let whole = GpuRequest {
            whole_gpu: true,
            ..Default::default()
        };
        let got = p.place("a", &whole, &[]).unwrap();
        assert_eq!(got.label, "whole");
        let next = p.place("b", &whole, std::slice::from_ref(&got)).unwrap();
        assert_ne!(next.gpu, got.gpu);
    }

    #[test]
    fn materialize_and_release_are_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let p = sim(&dir, "sim-mixed.json");
        let cand = p.place("t", &profile("1g.18gb"), &[]).unwrap();
        let count = |p: &BackendPlanner| -> usize {
            p.backend
                .gpus()
                .unwrap()
                .iter()
                .map(|g| g.instances.len())
                .sum()
        };
        let before = count(&p);
        p.materialize(&cand).unwrap();
        p.materialize(&cand).unwrap();
        assert_eq!(count(&p), before + 1);
        // Once made, the instance and the ledger's row for it count once.
        let next = p
            .place("u", &profile("1g.18gb"), std::slice::from_ref(&cand))
            .unwrap();
        assert!(!overlaps(&next, &cand));
        p.release(&cand).unwrap();
        p.release(&cand).unwrap();
        assert_eq!(count(&p), before);
    }

    #[test]
    fn a_placement_on_a_gpu_with_mig_off_turns_mig_on_to_make_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = sim_file(
            &dir,
            &ONE_H100.replace("\"mig_enabled\": true", "\"mig_enabled\": false"),
        );
        assert!(!p.backend.gpus().unwrap()[0].mig_enabled);
        let got = p.place("t", &profile("1g.10gb"), &[]).unwrap();
        p.materialize(&got).unwrap();
        let g = &p.backend.gpus().unwrap()[0];
        assert!(g.mig_enabled && g.instances.len() == 1, "{g:?}");
    }

    #[test]
    fn model_requests_are_sized_like_the_tenants_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = sim(&dir, "sim-mixed.json");
        let r = GpuRequest {
            model: Some("llama-3-8b".into()),
            ..Default::default()
        };
        let got = p.place("m", &r, &[]).unwrap();
        assert!(got.label.contains('@') || got.label == "whole", "{got:?}");
        let bad = GpuRequest {
            model: Some("no-such-model".into()),
            ..Default::default()
        };
        p.place("m", &bad, &[]).unwrap_err();
    }

    #[test]
    fn usage_is_read_for_the_placements_own_instance_and_labelled_simulated() {
        use tenantvm_gpu::backend::UsageSource;
        let dir = tempfile::tempdir().unwrap();
        let p = sim_file(&dir, ONE_H100);
        let a = p.place("a", &profile("1g.10gb"), &[]).unwrap();
        let b = p
            .place("b", &profile("1g.10gb"), std::slice::from_ref(&a))
            .unwrap();
        // Not made yet: an error, not somebody else's figures.
        p.usage(&a).unwrap_err();
        p.materialize(&a).unwrap();
        p.materialize(&b).unwrap();
        // The simulated host says what b's instance uses; a's says nothing.
        let path = dir.path().join("host.json");
        let mut host: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let start_b: u64 = b.label.split_once('@').unwrap().1.parse().unwrap();
        for i in host["gpus"][0]["instances"].as_array_mut().unwrap() {
            if i["start"].as_u64() == Some(start_b) {
                i["usage"] = serde_json::json!({"memory_used_mib": 512, "utilization_percent": 40});
            }
        }
        std::fs::write(&path, host.to_string()).unwrap();
        let ub = p.usage(&b).unwrap().unwrap();
        assert_eq!(
            (ub.memory_used_bytes, ub.utilization_percent, ub.source),
            (512 << 20, Some(40), UsageSource::Simulated)
        );
        let ua = p.usage(&a).unwrap().unwrap();
        assert_eq!((ua.memory_used_bytes, ua.utilization_percent), (0, Some(0)));
        assert_eq!(ua.memory_total_bytes, ub.memory_total_bytes);
    }
}
