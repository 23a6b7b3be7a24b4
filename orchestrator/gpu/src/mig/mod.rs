//! MIG profile database: per GPU model, the GPU-instance profiles (ids, slices, memory, SMs)
//! and the placement rules (allowed start slots, size in memory slices, maximum count).
//!
//! Keyed by PCI device id (vendor 0x10DE). Figures come from NVIDIA's MIG user guide and
//! published `nvidia-smi mig -lgip` captures; where NVML is present the live figures win
//! (see [`crate::backend::nvml`] and [`GpuModel::check_against`]). Entries whose source is not
//! an NVIDIA document carry `confirmed: false`.

use serde::Serialize;
use thiserror::Error;

pub mod layout;
pub mod sharing;

pub use layout::{Layout, Placed, PlacementError};
pub use sharing::{decide, GpuClass, GpuFacts, Sharing, VgpuSupport, WholeOnly};

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR_ID: u16 = 0x10de;

/// Errors of the profile database.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum MigDatabaseError {
    /// A GPU model name that the database does not know.
    #[error("Unknown GPU model `{0}`: use one of {1}")]
    UnknownModel(String, String),
    /// A profile name that this GPU model does not have.
    #[error("GPU model {model} has no MIG profile `{profile}`: use one of {known}")]
    UnknownProfile {
        /// The GPU model.
        model: String,
        /// The profile asked for.
        profile: String,
        /// The profiles that exist.
        known: String,
    },
}

/// One GPU-instance profile of one GPU model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MigProfile {
    /// NVML/nvidia-smi GPU-instance profile id (e.g. 19 for 1g, 0 for 7g).
    pub id: u32,
    /// Name as nvidia-smi prints it, e.g. `3g.40gb`.
    pub name: &'static str,
    /// Compute slices (the `Ng` in the name).
    pub compute_slices: u32,
    /// Placement size in memory slices (units of the placement axis).
    pub size: u32,
    /// Allowed start slots on the placement axis.
    pub starts: &'static [u32],
    /// Most instances of this profile on one GPU.
    pub max_count: u32,
    /// Usable memory of the instance in MiB (NVML `memorySizeMB`).
    pub memory_mib: u64,
    /// Streaming multiprocessors of the instance.
    pub sms: u32,
}

impl MigProfile {
    /// Usable memory in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * 1024 * 1024
    }

    /// Bit mask of the placement-axis units an instance started at `start` covers.
    pub fn mask_at(&self, start: u32) -> u32 {
        ((1u32 << self.size) - 1) << start
    }
}

/// One GPU model and its MIG geometry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuModel {
    /// Short key used on the command line, e.g. `h100-80gb`.
    pub key: &'static str,
    /// Marketing name.
    pub name: &'static str,
    /// PCI device ids (vendor 0x10DE) of the SKUs that share this geometry.
    pub pci_device_ids: &'static [u16],
    /// Memory of the whole GPU without MIG, in MiB.
    pub memory_mib: u64,
    /// Units of the placement axis (8 memory slices on A100/H100/H200, 12 on RTX PRO 6000).
    pub placement_units: u32,
    /// Minimum driver branch for MIG on this model.
    pub min_driver: u32,
    /// Whether the figures come from an NVIDIA document (false: third-party capture).
    pub confirmed: bool,
    /// The GPU-instance profiles.
    pub profiles: &'static [MigProfile],
}

impl GpuModel {
    /// Whether the model has MIG (a hardware partition into GPU instances).
    pub fn has_mig(&self) -> bool {
        !self.profiles.is_empty()
    }

    /// Memory of the whole GPU in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * 1024 * 1024
    }

    /// Looks a profile up by name (`3g.40gb`) or by numeric id (`9`).
    pub fn profile(&self, name_or_id: &str) -> Result<&MigProfile, MigDatabaseError> {
        let wanted = name_or_id.trim();
        let by_id = wanted.parse::<u32>().ok();
        self.profiles
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(wanted) || Some(p.id) == by_id)
            .ok_or_else(|| MigDatabaseError::UnknownProfile {
                model: self.key.to_string(),
                profile: wanted.to_string(),
                known: self
                    .profiles
                    .iter()
                    .map(|p| p.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// Looks a profile up by NVML id.
    pub fn profile_by_id(&self, id: u32) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }

    /// Compares the database with what NVML reported for this GPU (`(id, memory MiB,
    /// placements)` per profile) and returns one line per difference; empty when they agree.
    pub fn check_against(&self, reported: &[ReportedProfile]) -> Vec<String> {
        let mut diffs = Vec::new();
        for r in reported {
            let Some(p) = self.profile_by_id(r.id) else {
                diffs.push(format!(
                    "NVML reports profile id {} ({}) the database lacks",
                    r.id, r.name
                ));
                continue;
            };
            if p.memory_mib != r.memory_mib {
                diffs.push(format!(
                    "{}: memory {} MiB in the database, {} MiB from NVML",
                    p.name, p.memory_mib, r.memory_mib
                ));
            }
            if !r.placements.is_empty() {
                let db: Vec<(u32, u32)> = p.starts.iter().map(|s| (*s, p.size)).collect();
                if db != r.placements {
                    diffs.push(format!(
                        "{}: placements {:?} in the database, {:?} from NVML",
                        p.name, db, r.placements
                    ));
                }
            }
        }
        diffs
    }
}

/// A profile as NVML reports it on a live GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ReportedProfile {
    /// Profile id.
    pub id: u32,
    /// Name, derived from slices and memory.
    pub name: String,
    /// Compute slices.
    pub compute_slices: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Possible placements as `(start, size)`.
    pub placements: Vec<(u32, u32)>,
}

const STARTS_1G: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const STARTS_EVEN: &[u32] = &[0, 2, 4, 6];
const STARTS_2G: &[u32] = &[0, 2, 4];
const STARTS_3G: &[u32] = &[0, 4];
const STARTS_0: &[u32] = &[0];

/// Builds the seven profiles of the 8-slice geometry (A100, H100, H200) from per-size names,
/// memory (MiB) and SMs per compute slice.
macro_rules! eight_slice {
    ($n1:literal, $n1me:literal, $n1d:literal, $n2:literal, $n3:literal, $n4:literal, $n7:literal,
     [$m1:literal, $m1d:literal, $m2:literal, $m3:literal, $m4:literal, $m7:literal],
     [$s1:literal, $s2:literal, $s3:literal, $s4:literal, $s7:literal]) => {
        &[
            MigProfile {
                id: 19,
                name: $n1,
                compute_slices: 1,
                size: 1,
                starts: STARTS_1G,
                max_count: 7,
                memory_mib: $m1,
                sms: $s1,
            },
            MigProfile {
                id: 20,
                name: $n1me,
                compute_slices: 1,
                size: 1,
                starts: STARTS_1G,
                max_count: 1,
                memory_mib: $m1,
                sms: $s1,
            },
            MigProfile {
                id: 15,
                name: $n1d,
                compute_slices: 1,
                size: 2,
                starts: STARTS_EVEN,
                max_count: 4,
                memory_mib: $m1d,
                sms: $s1,
            },
            MigProfile {
                id: 14,
                name: $n2,
                compute_slices: 2,
                size: 2,
                starts: STARTS_2G,
                max_count: 3,
                memory_mib: $m2,
                sms: $s2,
            },
            MigProfile {
                id: 9,
                name: $n3,
                compute_slices: 3,
                size: 4,
                starts: STARTS_3G,
                max_count: 2,
                memory_mib: $m3,
                sms: $s3,
            },
            MigProfile {
                id: 5,
                name: $n4,
                compute_slices: 4,
                size: 4,
                starts: STARTS_0,
                max_count: 1,
                memory_mib: $m4,
                sms: $s4,
            },
            MigProfile {
                id: 0,
                name: $n7,
                compute_slices: 7,
                size: 8,
                starts: STARTS_0,
                max_count: 1,
                memory_mib: $m7,
                sms: $s7,
            },
        ]
    };
}

/// Every GPU model the planner knows.
pub static MODELS: &[GpuModel] = &[
    GpuModel {
        key: "a100-40gb",
        name: "NVIDIA A100 40GB",
        pci_device_ids: &[0x20b0, 0x20f1],
        memory_mib: 40_960,
        placement_units: 8,
        min_driver: 450,
        confirmed: true,
        profiles: eight_slice!(
            "1g.5gb",
            "1g.5gb+me",
            "1g.10gb",
            "2g.10gb",
            "3g.20gb",
            "4g.20gb",
            "7g.40gb",
            [4_864, 9_856, 9_856, 19_968, 19_968, 40_192],
            [14, 28, 42, 56, 98]
        ),
    },
    GpuModel {
        key: "a100-80gb",
        name: "NVIDIA A100 80GB",
        pci_device_ids: &[0x20b2, 0x20b5],
        memory_mib: 81_920,
        placement_units: 8,
        min_driver: 450,
        confirmed: true,
        profiles: eight_slice!(
            "1g.10gb",
            "1g.10gb+me",
            "1g.20gb",
            "2g.20gb",
            "3g.40gb",
            "4g.40gb",
            "7g.80gb",
            [9_728, 19_968, 19_968, 40_192, 40_192, 81_152],
            [14, 28, 42, 56, 98]
        ),
    },
    GpuModel {
        key: "h100-80gb",
        name: "NVIDIA H100 80GB",
        pci_device_ids: &[0x2330, 0x2331],
        memory_mib: 81_559,
        placement_units: 8,
        min_driver: 525,
        confirmed: true,
        profiles: eight_slice!(
            "1g.10gb",
            "1g.10gb+me",
            "1g.20gb",
            "2g.20gb",
            "3g.40gb",
            "4g.40gb",
            "7g.80gb",
            [9_984, 20_096, 20_096, 40_448, 40_448, 81_152],
            [16, 32, 60, 64, 132]
        ),
    },
    GpuModel {
        key: "h100-nvl",
        name: "NVIDIA H100 NVL 94GB",
        pci_device_ids: &[0x2321],
        memory_mib: 95_830,
        placement_units: 8,
        min_driver: 525,
        confirmed: false,
        profiles: eight_slice!(
            "1g.12gb",
            "1g.12gb+me",
            "1g.24gb",
            "2g.24gb",
            "3g.47gb",
            "4g.47gb",
            "7g.94gb",
            [11_008, 22_272, 22_272, 45_568, 45_568, 93_184],
            [16, 32, 60, 64, 132]
        ),
    },
    GpuModel {
        key: "h200",
        name: "NVIDIA H200 141GB",
        pci_device_ids: &[0x2335, 0x233b],
        memory_mib: 143_771,
        placement_units: 8,
        min_driver: 550,
        confirmed: false,
        profiles: eight_slice!(
            "1g.18gb",
            "1g.18gb+me",
            "1g.35gb",
            "2g.35gb",
            "3g.71gb",
            "4g.71gb",
            "7g.141gb",
            [16_384, 33_280, 33_280, 69_632, 69_632, 140_288],
            [16, 32, 60, 64, 132]
        ),
    },
    GpuModel {
        key: "rtx-pro-6000",
        name: "NVIDIA RTX PRO 6000 Blackwell 96GB",
        pci_device_ids: &[0x2bb1, 0x2bb5],
        memory_mib: 97_887,
        placement_units: 12,
        min_driver: 575,
        confirmed: false,
        profiles: &[
            MigProfile {
                id: 19,
                name: "1g.24gb",
                compute_slices: 1,
                size: 3,
                starts: &[0, 3, 6, 9],
                max_count: 4,
                memory_mib: 23_808,
                sms: 46,
            },
            MigProfile {
                id: 14,
                name: "2g.48gb",
                compute_slices: 2,
                size: 6,
                starts: &[0, 6],
                max_count: 2,
                memory_mib: 47_872,
                sms: 94,
            },
            MigProfile {
                id: 5,
                name: "4g.96gb",
                compute_slices: 4,
                size: 12,
                starts: &[0],
                max_count: 1,
                memory_mib: 96_256,
                sms: 188,
            },
        ],
    },
    // GPUs without MIG: no hardware partition, so they are only ever given whole. Memory is
    // what NVML reports as total (nvidia-smi captures, not an NVIDIA document: unconfirmed);
    // on a live host NVML's own figure is used.
    GpuModel {
        key: "l40s",
        name: "NVIDIA L40S",
        pci_device_ids: &[0x26b9],
        memory_mib: 46_068,
        placement_units: 1,
        min_driver: 0,
        confirmed: false,
        profiles: &[],
    },
    GpuModel {
        key: "l40",
        name: "NVIDIA L40",
        pci_device_ids: &[0x26b5],
        memory_mib: 46_068,
        placement_units: 1,
        min_driver: 0,
        confirmed: false,
        profiles: &[],
    },
    GpuModel {
        key: "rtx-6000-ada",
        name: "NVIDIA RTX 6000 Ada Generation",
        pci_device_ids: &[0x26b1],
        memory_mib: 49_140,
        placement_units: 1,
        min_driver: 0,
        confirmed: false,
        profiles: &[],
    },
    GpuModel {
        key: "l4",
        name: "NVIDIA L4",
        pci_device_ids: &[0x27b8],
        memory_mib: 23_034,
        placement_units: 1,
        min_driver: 0,
        confirmed: false,
        profiles: &[],
    },
    GpuModel {
        key: "a10",
        name: "NVIDIA A10",
        pci_device_ids: &[0x2236],
        memory_mib: 23_028,
        placement_units: 1,
        min_driver: 0,
        confirmed: false,
        profiles: &[],
    },
    GpuModel {
        key: "rtx-4090",
        name: "NVIDIA GeForce RTX 4090",
        pci_device_ids: &[0x2684],
        memory_mib: 24_564,
        placement_units: 1,
        min_driver: 0,
        confirmed: false,
        profiles: &[],
    },
];

/// Looks a model up by its key (`h100-80gb`), case-insensitively; `_` and `-` are equivalent.
pub fn model_by_key(key: &str) -> Result<&'static GpuModel, MigDatabaseError> {
    let norm = key.trim().to_ascii_lowercase().replace('_', "-");
    MODELS.iter().find(|m| m.key == norm).ok_or_else(|| {
        MigDatabaseError::UnknownModel(
            key.to_string(),
            MODELS.iter().map(|m| m.key).collect::<Vec<_>>().join(", "),
        )
    })
}

/// Looks a model up by PCI device id (vendor 0x10DE implied); `None` for GPUs the database
/// does not know (see [`sharing::decide`] for those). Models without MIG have no profiles.
pub fn model_by_pci_device(device_id: u16) -> Option<&'static GpuModel> {
    MODELS
        .iter()
        .find(|m| m.pci_device_ids.contains(&device_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_placement_fits_inside_the_axis() {
        for m in MODELS {
            for p in m.profiles {
                for s in p.starts {
                    assert!(
                        s + p.size <= m.placement_units,
                        "{} {} at {s}",
                        m.key,
                        p.name
                    );
                }
                assert!(p.memory_mib <= m.memory_mib, "{} {}", m.key, p.name);
            }
        }
    }

    #[test]
    fn profile_names_carry_the_model_memory() {
        let h100 = model_by_key("H100_80GB").unwrap();
        assert_eq!(h100.profile("3g.40gb").unwrap().id, 9);
        assert_eq!(h100.profile("0").unwrap().name, "7g.80gb");
        let h200 = model_by_key("h200").unwrap();
        assert_eq!(h200.profile("19").unwrap().name, "1g.18gb");
        // The 7g.80gb of an H100 is 79.25 GiB (NVIDIA MIG user guide).
        assert_eq!(h100.profile("7g.80gb").unwrap().memory_mib, 81_152);
    }

    #[test]
    fn lookup_by_pci_device_id() {
        assert_eq!(model_by_pci_device(0x2330).unwrap().key, "h100-80gb");
        assert_eq!(model_by_pci_device(0x20b0).unwrap().key, "a100-40gb");
        assert!(
            !model_by_pci_device(0x26b9).unwrap().has_mig(),
            "L40S has no MIG"
        );
        assert!(
            model_by_pci_device(0x2204).is_none(),
            "RTX 3090 is not in the database"
        );
    }

    #[test]
    fn unknown_model_and_profile_say_what_exists() {
        let err = model_by_key("h300").unwrap_err();
        assert!(err.to_string().contains("h100-80gb"), "{err}");
        let err = model_by_key("a100-40gb")
            .unwrap()
            .profile("5g.30gb")
            .unwrap_err();
        assert!(err.to_string().contains("3g.20gb"), "{err}");
    }

    #[test]
    fn check_against_reports_memory_and_placement_differences() {
        let h100 = model_by_key("h100-80gb").unwrap();
        let same = ReportedProfile {
            id: 9,
            name: "3g.40gb".into(),
            compute_slices: 3,
            memory_mib: 40_448,
            placements: vec![(0, 4), (4, 4)],
        };
        assert!(h100.check_against(std::slice::from_ref(&same)).is_empty());
        let other = ReportedProfile {
            memory_mib: 40_000,
            placements: vec![(0, 4)],
            ..same
        };
        let diffs = h100.check_against(&[other]);
        assert_eq!(diffs.len(), 2, "{diffs:?}");
    }
}
