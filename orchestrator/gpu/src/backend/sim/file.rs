//! The simulated host file: what it holds and the checks it must pass when read.

use serde::{Deserialize, Serialize};

use crate::mig::{self, GpuClass, GpuFacts, GpuModel, Layout, VgpuSupport};

/// The file's contents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimHost {
    /// What the host stands for.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub comment: String,
    /// The GPUs.
    pub gpus: Vec<SimGpu>,
}

/// How MIG instances of a simulated GPU reach a VM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SimVgpu {
    /// Assumed present, nothing behind it (the default).
    #[default]
    Simulated,
    /// SR-IOV VFs with the vGPU manager (a linked fake sysfs tree holds the VFs).
    Sriov,
    /// mdev types.
    Mdev,
    /// No vGPU manager: the GPU can only be given whole.
    None,
}

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimGpu {
    /// Index on the host.
    pub index: u32,
    /// Database model key (`h100-80gb`, `l40s`); or leave it out and give `device_id` and
    /// `memory_mib` for a SKU the database does not know.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// PCI device id (`0x2204`) of a SKU the database does not know.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id: Option<String>,
    /// Memory in MiB of a SKU the database does not know.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// PCI address.
    pub pci_address: String,
    /// Loaded driver version (`570.124.06`), if the host says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// How MIG instances reach a VM.
    #[serde(default)]
    pub vgpu: SimVgpu,
    /// Whether MIG is enabled.
    #[serde(default)]
    pub mig_enabled: bool,
    /// Whether the GPU is passed through whole.
    #[serde(default)]
    pub assigned_whole: bool,
    /// IOMMU group.
    #[serde(default)]
    pub iommu_group: Option<u32>,
    /// SR-IOV virtual functions enabled (kept by the fake kernel of a linked sysfs tree).
    #[serde(default)]
    pub sriov_vfs: u32,
    /// Existing GPU instances.
    #[serde(default)]
    pub instances: Vec<SimInstance>,
    /// What the GPU, given whole, is said to use (none: nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<SimUsage>,
    /// A program (and its first arguments) the SIMULATED driver runs on a real host when it
    /// sets a vGPU type on one of this GPU's real VFs (`... online PF VF`) and when it
    /// clears it (`... offline PF VF`): the setup a stand-in PF's VFs need before a VM can
    /// use them, which NVIDIA's driver does for its own VFs (the nested host's QEMU NVMe
    /// controller brings a secondary controller online this way). See [`super::vendor`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vf_hook: Option<Vec<String>>,
}

/// What a simulated GPU or instance is said to use: set by hand or by a test in the file,
/// reported as [`crate::backend::UsageSource::Simulated`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimUsage {
    /// Memory in use, MiB (at most the slice's memory).
    #[serde(default)]
    pub memory_used_mib: u64,
    /// Engines busy, percent (0-100).
    #[serde(default)]
    pub utilization_percent: u32,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// One simulated GPU instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimInstance {
    /// GPU-instance id.
    pub gi_id: u32,
    /// Profile name (`3g.40gb`).
    pub profile: String,
    /// Start slot.
    pub start: u32,
    /// Whether a client uses it (destroy is refused).
    #[serde(default)]
    pub in_use: bool,
    /// Whether its compute instance exists (a crash between the two creates leaves it false).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub compute_instance: bool,
    /// The VF whose vGPU runs on it (set by the fake kernel when a type is written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu_vf: Option<String>,
    /// What the instance is said to use (none: nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<SimUsage>,
}

fn parse_driver_major(v: &str) -> Option<u32> {
    v.split('.').next()?.trim().parse().ok()
}

impl SimGpu {
    /// What [`mig::decide`] needs to know.
    pub fn facts(&self) -> Result<GpuFacts, String> {
        let (device_id, memory_mib) = match (&self.model, &self.device_id) {
            (Some(key), None) => {
                let m = mig::model_by_key(key).map_err(|e| e.to_string())?;
                (m.pci_device_ids[0], m.memory_mib)
            }
            (None, Some(id)) => {
                let id = u16::from_str_radix(id.trim_start_matches("0x"), 16)
                    .map_err(|_| format!("GPU {}: device_id `{id}` is not hex", self.index))?;
                let mem = self
                    .memory_mib
                    .ok_or_else(|| format!("GPU {}: give memory_mib with device_id", self.index))?;
                (id, mem)
            }
            _ => {
                return Err(format!(
                    "GPU {}: give either `model` or `device_id` (with `memory_mib`)",
                    self.index
                ))
            }
        };
        Ok(GpuFacts {
            device_id,
            memory_mib: Some(memory_mib),
            driver_major: self.driver.as_deref().and_then(parse_driver_major),
            vgpu: match self.vgpu {
                SimVgpu::Simulated => VgpuSupport::Simulated,
                SimVgpu::Sriov => VgpuSupport::Sriov { total_vfs: 16 },
                SimVgpu::Mdev => VgpuSupport::Mdev,
                SimVgpu::None => VgpuSupport::Missing {
                    reason: "the simulated host has no vGPU manager".into(),
                },
            },
        })
    }

    /// Its model and how it may be used.
    pub fn class(&self) -> Result<GpuClass, String> {
        Ok(mig::decide(&self.facts()?))
    }

    pub(crate) fn model(&self) -> Result<&'static GpuModel, String> {
        Ok(self.class()?.model)
    }

    /// Its occupancy, through the planner's [`Layout`].
    pub fn layout(&self) -> Result<Layout, String> {
        let model = self.model()?;
        let mut l = Layout::empty();
        l.whole = self.assigned_whole;
        for i in &self.instances {
            let p = model.profile(&i.profile).map_err(|e| e.to_string())?;
            l.place(p, i.start)
                .map_err(|e| format!("GPU {} instance {}: {e}", self.index, i.gi_id))?;
        }
        Ok(l)
    }
}

impl SimHost {
    /// Checks models, profiles, placements, unique indexes and instance ids.
    pub fn validate(&self) -> Result<(), String> {
        let mut indexes = std::collections::HashSet::new();
        for g in &self.gpus {
            if !indexes.insert(g.index) {
                return Err(format!("GPU index {} appears twice", g.index));
            }
            g.layout()?;
            if !g.instances.is_empty() && (!g.mig_enabled || g.assigned_whole) {
                return Err(format!(
                    "GPU {} has instances but MIG is off or it is assigned whole",
                    g.index
                ));
            }
            let usages = g.usage.iter().map(|u| (u, "the GPU".to_string())).chain(
                g.instances.iter().filter_map(|i| {
                    i.usage
                        .as_ref()
                        .map(|u| (u, format!("instance {}", i.gi_id)))
                }),
            );
            for (u, what) in usages {
                if u.utilization_percent > 100 {
                    return Err(format!(
                        "GPU {} {what}: utilization_percent {} is over 100",
                        g.index, u.utilization_percent
                    ));
                }
            }
            if g.vf_hook
                .as_ref()
                .is_some_and(|h| h.is_empty() || h[0].is_empty())
            {
                return Err(format!("GPU {}: vf_hook names no program", g.index));
            }
            let mut ids = std::collections::HashSet::new();
            if let Some(i) = g.instances.iter().find(|i| !ids.insert(i.gi_id)) {
                return Err(format!(
                    "GPU {} has two instances with id {}",
                    g.index, i.gi_id
                ));
            }
        }
        Ok(())
    }

    /// The GPU at a PCI address.
    pub fn gpu_at(&self, pci_address: &str) -> Option<&SimGpu> {
        self.gpus
            .iter()
            .find(|g| g.pci_address.eq_ignore_ascii_case(pci_address))
    }

    /// The GPU at a PCI address, to change.
    pub fn gpu_at_mut(&mut self, pci_address: &str) -> Option<&mut SimGpu> {
        self.gpus
            .iter_mut()
            .find(|g| g.pci_address.eq_ignore_ascii_case(pci_address))
    }
}
