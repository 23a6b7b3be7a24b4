//! The mig-parted v1 configuration format (NVIDIA/mig-parted), read and written.
//!
//! ```yaml
//! version: v1
//! mig-configs:
//!   tenantvm:
//!     - device-filter: ["0x233010DE"]
//!       devices: [0]
//!       mig-enabled: true
//!       mig-devices: {"3g.40gb": 2}
//! ```
//! The format holds counts, not placements. Reading a config as the host's current state
//! ([`MigPartedConfig::apply_to`]) therefore places the counts with the exact search, which
//! also proves the counts are realisable on the GPU.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::mig::{Layout, NVIDIA_VENDOR_ID};
use crate::plan::search::{self, Demand, HostGpu, Request, Share};

/// Errors reading, writing or applying a mig-parted config.
#[derive(Debug, Error)]
pub enum MigPartedError {
    /// YAML syntax or schema error.
    #[error("Not a mig-parted config: {0}")]
    Yaml(#[from] serde_yaml_ng::Error),
    /// A version other than v1.
    #[error("mig-parted config version `{0}` is not supported: use `version: v1`")]
    Version(String),
    /// The label is missing.
    #[error("mig-parted config has no label `{label}`: use one of {known}")]
    NoLabel {
        /// The label asked for.
        label: String,
        /// The labels present.
        known: String,
    },
    /// An entry that contradicts itself.
    #[error("mig-parted config label `{label}`, entry {entry}: {reason}")]
    Entry {
        /// The label.
        label: String,
        /// Entry index.
        entry: usize,
        /// What is wrong.
        reason: String,
    },
    /// The counts cannot be placed on the GPU.
    #[error(
        "mig-parted config asks GPU {gpu} for {wanted}, which no placement allows on a {model}"
    )]
    Unplaceable {
        /// GPU index.
        gpu: u32,
        /// The counts.
        wanted: String,
        /// The GPU model.
        model: String,
    },
    /// The search gave up.
    #[error(transparent)]
    Search(#[from] search::SearchError),
}

/// `devices: all` or a list of indexes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Devices {
    /// The literal `all`.
    All(AllDevices),
    /// GPU indexes.
    List(Vec<u32>),
}

/// The literal string `all`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllDevices {
    /// `all`.
    All,
}

/// `device-filter`: one PCI id or a list (`0x233010DE`: device id then vendor id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceFilter {
    /// One id.
    One(String),
    /// Several ids.
    Many(Vec<String>),
}

/// One entry under a label.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigConfigEntry {
    /// Which GPU models the entry applies to.
    #[serde(
        rename = "device-filter",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub device_filter: Option<DeviceFilter>,
    /// Which GPUs.
    pub devices: Devices,
    /// MIG mode.
    #[serde(rename = "mig-enabled")]
    pub mig_enabled: bool,
    /// Profile name → count.
    #[serde(
        rename = "mig-devices",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub mig_devices: Option<BTreeMap<String, u32>>,
}

/// A whole mig-parted config file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigPartedConfig {
    /// Must be `v1`.
    pub version: String,
    /// Label → entries.
    #[serde(rename = "mig-configs")]
    pub mig_configs: BTreeMap<String, Vec<MigConfigEntry>>,
}

/// Parses a filter id like `0x233010DE` into (device id, vendor id).
fn parse_filter_id(s: &str) -> Option<(u16, u16)> {
    let hex = s
        .trim()
        .strip_prefix("0x")
        .or_else(|| s.trim().strip_prefix("0X"))?;
    let v = u32::from_str_radix(hex, 16).ok()?;
    Some(((v >> 16) as u16, (v & 0xffff) as u16))
}

/// Formats a filter id for a PCI device id of NVIDIA's.
pub fn filter_id(device_id: u16) -> String {
    format!("0x{device_id:04X}{NVIDIA_VENDOR_ID:04X}")
}

impl MigConfigEntry {
    fn matches(&self, gpu: &HostGpu) -> bool {
        let dev_ok = match &self.devices {
            Devices::All(_) => true,
            Devices::List(l) => l.contains(&gpu.index),
        };
        let filter_ok = match &self.device_filter {
            None => true,
            Some(f) => {
                let ids: Vec<&String> = match f {
                    DeviceFilter::One(s) => vec![s],
                    DeviceFilter::Many(v) => v.iter().collect(),
                };
                ids.iter()
                    .filter_map(|s| parse_filter_id(s))
                    .any(|(dev, vendor)| {
                        vendor == NVIDIA_VENDOR_ID && gpu.model.pci_device_ids.contains(&dev)
                    })
            }
        };
        dev_ok && filter_ok
    }
}

impl MigPartedConfig {
    /// Parses and validates YAML.
    pub fn parse(text: &str) -> Result<Self, MigPartedError> {
        let c: MigPartedConfig = serde_yaml_ng::from_str(text)?;
        c.validate()?;
        Ok(c)
    }

    /// Serialises to YAML.
    pub fn to_yaml(&self) -> Result<String, MigPartedError> {
        Ok(serde_yaml_ng::to_string(self)?)
    }

    /// Checks version, filters and the enabled/devices rule.
    pub fn validate(&self) -> Result<(), MigPartedError> {
        if self.version != "v1" {
            return Err(MigPartedError::Version(self.version.clone()));
        }
        for (label, entries) in &self.mig_configs {
            for (i, e) in entries.iter().enumerate() {
                let bad = |reason: &str| MigPartedError::Entry {
                    label: label.clone(),
                    entry: i,
                    reason: reason.into(),
                };
                match (&e.mig_devices, e.mig_enabled) {
                    (None, true) => {
                        return Err(bad("`mig-devices` is required when `mig-enabled: true`"))
                    }
                    (Some(d), false) if !d.is_empty() => {
                        return Err(bad("`mig-devices` must be empty when `mig-enabled: false`"))
                    }
                    _ => {}
                }
                if let Some(f) = &e.device_filter {
                    let ids: Vec<&String> = match f {
                        DeviceFilter::One(s) => vec![s],
                        DeviceFilter::Many(v) => v.iter().collect(),
                    };
                    if let Some(s) = ids.iter().find(|s| parse_filter_id(s).is_none()) {
                        return Err(bad(&format!(
                            "device-filter `{s}` is not a hex PCI id like 0x233010DE"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes the final state of a plan as one label: per GPU, its existing instances plus
    /// the assignments made on it; GPUs given whole or left empty get MIG disabled.
    pub fn from_state(label: &str, gpus: &[HostGpu], assignments: &[search::Assignment]) -> Self {
        let mut entries = Vec::new();
        for g in gpus {
            let mut counts: BTreeMap<String, u32> = BTreeMap::new();
            for i in &g.layout.instances {
                if let Some(p) = g.model.profile_by_id(i.profile_id) {
                    *counts.entry(p.name.to_string()).or_default() += 1;
                }
            }
            let mut whole = g.layout.whole;
            for a in assignments.iter().filter(|a| a.gpu == g.index) {
                match &a.share {
                    Share::Mig { profile, .. } => *counts.entry(profile.clone()).or_default() += 1,
                    Share::WholeGpu { .. } => whole = true,
                }
            }
            let enabled = !whole && !counts.is_empty();
            entries.push(MigConfigEntry {
                device_filter: Some(DeviceFilter::Many(vec![filter_id(
                    g.model.pci_device_ids[0],
                )])),
                devices: Devices::List(vec![g.index]),
                mig_enabled: enabled,
                mig_devices: Some(if enabled { counts } else { BTreeMap::new() }),
            });
        }
        MigPartedConfig {
            version: "v1".into(),
            mig_configs: BTreeMap::from([(label.to_string(), entries)]),
        }
    }

    /// Treats `label` as the state of the host: replaces each matched GPU's layout with a
    /// placement of the configured counts (the first matching entry wins, as in mig-parted).
    pub fn apply_to(&self, label: &str, gpus: &mut [HostGpu]) -> Result<(), MigPartedError> {
        let entries = self
            .mig_configs
            .get(label)
            .ok_or_else(|| MigPartedError::NoLabel {
                label: label.into(),
                known: self
                    .mig_configs
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        for g in gpus.iter_mut() {
            let Some(entry) = entries.iter().find(|e| e.matches(g)) else {
                continue;
            };
            let mut layout = Layout::empty();
            let counts = entry.mig_devices.clone().unwrap_or_default();
            if entry.mig_enabled && !counts.is_empty() {
                let mut requests = Vec::new();
                for (name, n) in &counts {
                    let p = g.model.profile(name).map_err(|e| MigPartedError::Entry {
                        label: label.into(),
                        entry: 0,
                        reason: e.to_string(),
                    })?;
                    for k in 0..*n {
                        requests.push(Request {
                            name: format!("{}#{k}", p.name),
                            demand: Demand::Profile(p.name.to_string()),
                        });
                    }
                }
                let one = [HostGpu {
                    layout: Layout::empty(),
                    ..g.clone()
                }];
                let sol = search::place(&one, &requests, search::DEFAULT_NODE_BUDGET)?.ok_or_else(
                    || MigPartedError::Unplaceable {
                        gpu: g.index,
                        wanted: counts
                            .iter()
                            .map(|(k, v)| format!("{v}×{k}"))
                            .collect::<Vec<_>>()
                            .join(" + "),
                        model: g.model.key.into(),
                    },
                )?;
                for a in sol.assignments {
                    if let Share::Mig {
                        profile_id, start, ..
                    } = a.share
                    {
                        let p = g
                            .model
                            .profile_by_id(profile_id)
                            .expect("placed profile exists");
                        layout
                            .place(p, start)
                            .expect("the search only returns valid placements");
                    }
                }
            }
            g.layout = layout;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mig::model_by_key;

    const SAMPLE: &str = r#"
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  custom:
    - device-filter: ["0x233010DE"]
      devices: [0, 1]
      mig-enabled: true
      mig-devices:
        "3g.40gb": 1
        "2g.20gb": 1
        "1g.10gb": 2
    - devices: all
      mig-enabled: true
      mig-devices: {}
"#;

    fn h100s(n: u32) -> Vec<HostGpu> {
        let m = model_by_key("h100-80gb").unwrap();
        (0..n).map(|index| HostGpu::new(index, m)).collect()
    }

    #[test]
    fn reads_a_config_and_places_its_counts() {
        let c = MigPartedConfig::parse(SAMPLE).unwrap();
        let mut gpus = h100s(3);
        c.apply_to("custom", &mut gpus).unwrap();
        assert_eq!(gpus[0].layout.instances.len(), 4);
        assert_eq!(gpus[0].layout.used.count_ones(), 8);
        assert!(gpus[2].layout.instances.is_empty());
        let e = c.apply_to("nope", &mut gpus).unwrap_err();
        assert!(e.to_string().contains("all-disabled"), "{e}");
    }

    #[test]
    fn writes_what_it_reads() {
        let c = MigPartedConfig::parse(SAMPLE).unwrap();
        let back = MigPartedConfig::parse(&c.to_yaml().unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn from_state_counts_existing_and_new_instances() {
        let mut gpus = h100s(2);
        let m = gpus[0].model;
        gpus[0]
            .layout
            .place(m.profile("3g.40gb").unwrap(), 0)
            .unwrap();
        let a = [search::Assignment {
            tenant: "t".into(),
            gpu: 0,
            share: Share::Mig {
                profile_id: 9,
                profile: "3g.40gb".into(),
                start: 4,
                size: 4,
                memory_mib: 40_448,
            },
        }];
        let c = MigPartedConfig::from_state("tenantvm", &gpus, &a);
        let yaml = c.to_yaml().unwrap();
        assert!(yaml.contains("0x233010DE"), "{yaml}");
        let e = &c.mig_configs["tenantvm"];
        assert_eq!(e[0].mig_devices.as_ref().unwrap()["3g.40gb"], 2);
        assert!(!e[1].mig_enabled);
        // Round trip: the written config places again.
        let mut fresh = h100s(2);
        MigPartedConfig::parse(&yaml)
            .unwrap()
            .apply_to("tenantvm", &mut fresh)
            .unwrap();
        assert_eq!(fresh[0].layout.used, 0xff);
    }

    #[test]
    fn impossible_counts_and_bad_entries_are_refused() {
        let too_many = "version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"4g.40gb\": 1, \"2g.20gb\": 2, \"1g.10gb\": 1}\n";
        let e = MigPartedConfig::parse(too_many)
            .unwrap()
            .apply_to("x", &mut h100s(1))
            .unwrap_err();
        assert!(e.to_string().contains("no placement allows"), "{e}");
        for (text, want) in [
            ("version: v2\nmig-configs: {}\n", "v1"),
            ("version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: true\n", "required"),
            ("version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: false\n      mig-devices: {\"1g.10gb\": 1}\n", "empty"),
            ("version: v1\nmig-configs:\n  x:\n    - devices: all\n      device-filter: zz\n      mig-enabled: false\n", "hex"),
            ("version: v1\nmig-configs:\n  x:\n    - devices: some\n      mig-enabled: false\n", "mig-parted"),
            (": :", "mig-parted"),
        ] {
            let e = MigPartedConfig::parse(text).unwrap_err();
            assert!(e.to_string().contains(want), "{text}: {e}");
        }
        let bad_profile = "version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"5g.50gb\": 1}\n";
        let e = MigPartedConfig::parse(bad_profile)
            .unwrap()
            .apply_to("x", &mut h100s(1))
            .unwrap_err();
        assert!(e.to_string().contains("3g.40gb"), "{e}");
    }
}
