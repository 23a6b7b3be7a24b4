//! How a GPU can be handed to tenants: shared by MIG instances (each reaching its VM as a
//! vGPU) or only given whole. [`decide`] is the one rule: `tenantvm host check` prints its
//! verdict for each GPU and the planner ([`crate::plan`]) places by it, so the two never
//! disagree about a GPU.
//!
//! A GPU can be shared only when all of these hold:
//! - the SKU has MIG (a hardware partition: separate memory slices, caches and engines per
//!   instance); an L40S, an RTX 6000 Ada or a consumer card has none, and tenants "sharing" it
//!   would share one memory space;
//! - the loaded driver is new enough for MIG on that SKU;
//! - a MIG instance can reach a VM: NVIDIA's vGPU manager with SR-IOV virtual functions
//!   (vGPU 17+, Hopper and newer) or mdev types (older vGPU releases, A100).
//!
//! Otherwise it is whole-only, and the reason says which condition failed.

use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::{model_by_pci_device, GpuModel};

/// How MIG instances of a GPU can reach a VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VgpuSupport {
    /// SR-IOV virtual functions with NVIDIA's vGPU manager (vendor-specific VFIO, vGPU 17+).
    Sriov {
        /// `sriov_totalvfs` of the GPU.
        total_vfs: u32,
    },
    /// mdev types under the GPU (vGPU 16 and older).
    Mdev,
    /// Neither.
    Missing {
        /// What is missing, in words.
        reason: String,
    },
    /// A simulated host: assumed present (nothing reaches a VM for real).
    Simulated,
}

/// What is known about one GPU: enough to decide how it can be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuFacts {
    /// PCI device id (vendor 0x10DE).
    pub device_id: u16,
    /// Total memory in MiB, when known (NVML); the database's figure otherwise.
    pub memory_mib: Option<u64>,
    /// Major version of the loaded NVIDIA driver, when known.
    pub driver_major: Option<u32>,
    /// How MIG instances could reach a VM.
    pub vgpu: VgpuSupport,
}

/// Why a GPU can only be given whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum WholeOnly {
    /// The SKU has no MIG.
    NoMig,
    /// The SKU has MIG, the loaded driver is too old for it.
    DriverTooOld {
        /// Loaded driver branch.
        loaded: u32,
        /// Branch MIG needs on this SKU.
        needed: u32,
    },
    /// The SKU has MIG, but no vGPU route exists to hand an instance to a VM.
    NoVgpuRoute {
        /// What is missing.
        missing: String,
    },
}

impl WholeOnly {
    /// Why, in words, for refusals and `host check`.
    pub fn explain(&self) -> String {
        match self {
            WholeOnly::NoMig => "it has no hardware partition (the SKU has no MIG): tenants sharing it would share one memory space and one set of engines".into(),
            WholeOnly::DriverTooOld { loaded, needed } => format!(
                "MIG needs driver R{needed} or newer on this SKU and R{loaded} is loaded"
            ),
            WholeOnly::NoVgpuRoute { missing } => format!(
                "a MIG instance reaches a VM only as a vGPU, and {missing}"
            ),
        }
    }

    /// What to do about it.
    pub fn fix(&self) -> &'static str {
        match self {
            WholeOnly::NoMig => "give it whole (`whole_gpu = true`); to share GPUs between tenants use MIG-capable ones (A100, H100, H200, RTX PRO 6000)",
            WholeOnly::DriverTooOld { .. } => "install a newer NVIDIA data-center driver; until then it can only be given whole",
            WholeOnly::NoVgpuRoute { .. } => "install NVIDIA's vGPU manager (SR-IOV VFs on Hopper and newer, mdev on older releases); until then it can only be given whole",
        }
    }
}

/// How a GPU may be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Sharing {
    /// Shared by MIG instances (each a tenant's vGPU), or given whole.
    Mig,
    /// Given whole only.
    WholeOnly(WholeOnly),
}

impl Sharing {
    /// Whether MIG instances of it can be handed out.
    pub fn can_share(&self) -> bool {
        matches!(self, Sharing::Mig)
    }
}

/// The verdict for one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuClass {
    /// Its model: from the database, or a whole-only model made for an unknown SKU.
    pub model: &'static GpuModel,
    /// How it may be used.
    pub sharing: Sharing,
}

/// The one rule: how a GPU with these facts can be used.
pub fn decide(facts: &GpuFacts) -> GpuClass {
    let model = match model_by_pci_device(facts.device_id) {
        Some(m) => m,
        None => unknown_model(facts.device_id, facts.memory_mib.unwrap_or(0)),
    };
    let sharing = if !model.has_mig() {
        Sharing::WholeOnly(WholeOnly::NoMig)
    } else if let Some(loaded) = facts.driver_major.filter(|v| *v < model.min_driver) {
        Sharing::WholeOnly(WholeOnly::DriverTooOld {
            loaded,
            needed: model.min_driver,
        })
    } else if let VgpuSupport::Missing { reason } = &facts.vgpu {
        Sharing::WholeOnly(WholeOnly::NoVgpuRoute {
            missing: reason.clone(),
        })
    } else {
        Sharing::Mig
    };
    GpuClass { model, sharing }
}

/// Models made for SKUs the database does not know, one per (device id, memory).
static UNKNOWN: Mutex<Vec<&'static GpuModel>> = Mutex::new(Vec::new());

/// A whole-only model for an NVIDIA GPU the database does not know (a consumer card, a new
/// SKU). Each distinct (device id, memory) is made once and lives for the process (a handful
/// of SKUs at most), so [`crate::plan::HostGpu`] can hold it like a database model.
pub fn unknown_model(device_id: u16, memory_mib: u64) -> &'static GpuModel {
    let mut known = UNKNOWN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(m) = known
        .iter()
        .find(|m| m.pci_device_ids == [device_id] && m.memory_mib == memory_mib)
    {
        return m;
    }
    let model: &'static GpuModel = Box::leak(Box::new(GpuModel {
        key: Box::leak(format!("10de-{device_id:04x}").into_boxed_str()),
        name: Box::leak(format!("NVIDIA GPU 10de:{device_id:04x}").into_boxed_str()),
        pci_device_ids: Box::leak(Box::new([device_id])),
        memory_mib,
        placement_units: 1,
        min_driver: 0,
        confirmed: false,
        profiles: &[],
    }));
    known.push(model);
    model
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(device_id: u16, driver: Option<u32>, vgpu: VgpuSupport) -> GpuFacts {
        GpuFacts {
            device_id,
            memory_mib: None,
            driver_major: driver,
            vgpu,
        }
    }

    #[test]
    fn mig_sku_with_a_vgpu_route_and_a_new_driver_can_be_shared() {
        let c = decide(&facts(
            0x2330,
            Some(570),
            VgpuSupport::Sriov { total_vfs: 16 },
        ));
        assert_eq!(c.model.key, "h100-80gb");
        assert!(c.sharing.can_share());
        assert!(decide(&facts(0x20f1, None, VgpuSupport::Mdev))
            .sharing
            .can_share());
    }

    #[test]
    fn each_missing_condition_makes_it_whole_only_with_its_reason() {
        let l40s = decide(&facts(0x26b9, Some(570), VgpuSupport::Simulated));
        assert_eq!(l40s.sharing, Sharing::WholeOnly(WholeOnly::NoMig));
        assert!(l40s.sharing != Sharing::Mig);
        let old = decide(&facts(0x2bb1, Some(535), VgpuSupport::Simulated));
        assert_eq!(
            old.sharing,
            Sharing::WholeOnly(WholeOnly::DriverTooOld {
                loaded: 535,
                needed: 575
            })
        );
        let no_route = decide(&facts(
            0x2330,
            Some(570),
            VgpuSupport::Missing {
                reason: "no vGPU manager is loaded".into(),
            },
        ));
        let Sharing::WholeOnly(w) = &no_route.sharing else {
            panic!("{no_route:?}")
        };
        assert!(w.explain().contains("no vGPU manager"), "{}", w.explain());
        assert!(WholeOnly::NoMig.explain().contains("no hardware partition"));
    }

    #[test]
    fn unknown_skus_get_one_whole_only_model_each() {
        let a = decide(&GpuFacts {
            memory_mib: Some(24_576),
            ..facts(0x2204, None, VgpuSupport::Simulated)
        });
        assert!(!a.model.has_mig());
        assert_eq!(a.model.memory_mib, 24_576);
        assert_eq!(a.sharing, Sharing::WholeOnly(WholeOnly::NoMig));
        let b = unknown_model(0x2204, 24_576);
        assert!(std::ptr::eq(a.model, b), "made once");
        assert!(!std::ptr::eq(b, unknown_model(0x2204, 12_288)));
    }
}
