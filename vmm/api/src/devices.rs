//! Passed-through devices: the `devices` list of the `--config` file (`--device` on the
//! command line), the VM's `uuid`, and the exit report in which the VMM says what became of
//! each device (its resets) when it ended. The orchestrator writes the first two and reads
//! the third into the tenant's departure receipt.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Most passed-through devices one VM may have.
pub const MAX_PASSTHROUGH_DEVICES: usize = 8;
/// Where every passed-through device lives.
pub const PCI_DEVICES_DIR: &str = "/sys/bus/pci/devices";

/// One PCI device handed to the guest over VFIO: a whole device bound to `vfio-pci`, an
/// SR-IOV virtual function, or a vendor VFIO driver's virtual function (which stays bound
/// to its own driver).
///
/// On the command line: `--device vfio,path=/sys/bus/pci/devices/0000:41:00.0`, with
/// `,gpudirect_clique=N` for NVIDIA's GPUDirect clique capability and
/// `,iommu=auto|legacy|iommufd` for the kernel interface ([`VfioIommuMode`]). Build one with
/// [`PassthroughConfig::new`] so that options added later keep their defaults.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassthroughConfig {
    /// The device's sysfs directory, `/sys/bus/pci/devices/DOMAIN:BUS:DEV.FN`.
    pub path: PathBuf,
    /// NVIDIA's GPUDirect clique id (0-15, QEMU's `x-nv-gpudirect-clique`): the guest sees
    /// a vendor capability at config offset 0xD4 telling NVIDIA's driver which GPUs may do
    /// peer-to-peer DMA with each other (those with the same id). Off (`None`) by default;
    /// refused at start for a device that is not an NVIDIA GPU.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "clique_in_range"
    )]
    pub gpudirect_clique: Option<u8>,
    /// Which kernel VFIO interface opens the device (`auto` by default; written only
    /// when not `auto`, so older readers still take the file).
    #[serde(default, skip_serializing_if = "VfioIommuMode::is_auto")]
    pub iommu: VfioIommuMode,
}

/// Which kernel VFIO interface opens a passed-through device and maps guest RAM for its
/// DMA.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VfioIommuMode {
    /// iommufd when the kernel offers it for the device (a `vfio-dev/vfioN` cdev in sysfs
    /// and an openable `/dev/iommu`), the legacy container/group interface otherwise.
    #[default]
    Auto,
    /// The legacy interface: `/dev/vfio/vfio` (container) and `/dev/vfio/<group>`.
    Legacy,
    /// iommufd: `/dev/iommu` and the device's `/dev/vfio/devices/vfioN`; refused at start
    /// with the reason when the kernel does not offer it.
    Iommufd,
}

impl VfioIommuMode {
    /// Whether this is the default, [`VfioIommuMode::Auto`].
    pub fn is_auto(&self) -> bool {
        *self == VfioIommuMode::Auto
    }

    /// The option's value as `--device` spells it.
    pub fn as_str(&self) -> &'static str {
        match self {
            VfioIommuMode::Auto => "auto",
            VfioIommuMode::Legacy => "legacy",
            VfioIommuMode::Iommufd => "iommufd",
        }
    }
}

impl fmt::Display for VfioIommuMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for VfioIommuMode {
    type Err = DeviceParseError;

    fn from_str(s: &str) -> Result<Self, DeviceParseError> {
        match s {
            "auto" => Ok(VfioIommuMode::Auto),
            "legacy" => Ok(VfioIommuMode::Legacy),
            "iommufd" => Ok(VfioIommuMode::Iommufd),
            _ => Err(DeviceParseError(format!(
                "iommu={s:?} is not an interface; use auto, legacy or iommufd"
            ))),
        }
    }
}

/// The largest GPUDirect clique id (it is 4 bits in the capability).
pub const MAX_GPUDIRECT_CLIQUE: u8 = 15;

fn clique_in_range<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u8>, D::Error> {
    let value = Option::<u8>::deserialize(d)?;
    match value {
        Some(n) if n > MAX_GPUDIRECT_CLIQUE => Err(serde::de::Error::custom(format!(
            "gpudirect_clique {n} is out of range; use 0 to {MAX_GPUDIRECT_CLIQUE}"
        ))),
        _ => Ok(value),
    }
}

impl PassthroughConfig {
    /// The device at sysfs directory `path`, every option at its default (no GPUDirect
    /// clique).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            gpudirect_clique: None,
            iommu: VfioIommuMode::Auto,
        }
    }

    /// The device's PCI address (the last component of its sysfs path), when the path has
    /// the `/sys/bus/pci/devices/DDDD:BB:DD.F` shape.
    pub fn address(&self) -> Option<&str> {
        let parent = self.path.parent()?;
        if parent != Path::new(PCI_DEVICES_DIR) {
            return None;
        }
        let name = self.path.file_name()?.to_str()?;
        is_pci_address(name).then_some(name)
    }
}

/// The device's VFIO cdev name (`vfioN`) from its sysfs directory's `vfio-dev/` folder,
/// when the kernel made one.
pub fn cdev_name(sysfs_device: &Path) -> Option<String> {
    let mut names: Vec<String> = std::fs::read_dir(sysfs_device.join("vfio-dev"))
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| {
            n.strip_prefix("vfio")
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    names.sort();
    names.into_iter().next()
}

/// Whether `name` is a full PCI address, `DDDD:BB:DD.F` in lower- or upper-case hex.
pub fn is_pci_address(name: &str) -> bool {
    let b = name.as_bytes();
    if b.len() != 12 || b[4] != b':' || b[7] != b':' || b[10] != b'.' {
        return false;
    }
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
    hex(0..4) && hex(5..7) && hex(8..10) && (b'0'..=b'7').contains(&b[11])
}

/// A `--device` value the VMM does not accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceParseError(pub String);

impl fmt::Display for DeviceParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::error::Error for DeviceParseError {}

impl FromStr for PassthroughConfig {
    type Err = DeviceParseError;

    /// Parses
    /// `vfio,path=/sys/bus/pci/devices/DDDD:BB:DD.F[,gpudirect_clique=N][,iommu=MODE]`.
    fn from_str(s: &str) -> Result<Self, DeviceParseError> {
        let usage = "use --device vfio,path=/sys/bus/pci/devices/DDDD:BB:DD.F\
                     [,gpudirect_clique=0-15][,iommu=auto|legacy|iommufd]";
        let mut parts = s.split(',');
        match parts.next() {
            Some("vfio") => {}
            other => {
                return Err(DeviceParseError(format!(
                    "Unknown device kind {:?}; {usage}",
                    other.unwrap_or("")
                )))
            }
        }
        let mut path = None;
        let mut clique = None;
        let mut iommu = None;
        for part in parts {
            match part.split_once('=') {
                Some(("path", value)) if path.is_none() => path = Some(PathBuf::from(value)),
                Some(("path", _)) => {
                    return Err(DeviceParseError(format!("path given twice; {usage}")))
                }
                Some(("gpudirect_clique", _)) if clique.is_some() => {
                    return Err(DeviceParseError(format!(
                        "gpudirect_clique given twice; {usage}"
                    )))
                }
                Some(("gpudirect_clique", value)) => match value.parse::<u8>() {
                    Ok(n) if n <= MAX_GPUDIRECT_CLIQUE => clique = Some(n),
                    _ => {
                        return Err(DeviceParseError(format!(
                            "gpudirect_clique={value:?} is not a clique id; {usage}"
                        )))
                    }
                },
                Some(("iommu", _)) if iommu.is_some() => {
                    return Err(DeviceParseError(format!("iommu given twice; {usage}")))
                }
                Some(("iommu", value)) => {
                    iommu = Some(
                        value
                            .parse::<VfioIommuMode>()
                            .map_err(|e| DeviceParseError(format!("{e}; {usage}")))?,
                    );
                }
                _ => {
                    return Err(DeviceParseError(format!(
                        "Unknown device option {part:?}; {usage}"
                    )))
                }
            }
        }
        let config = PassthroughConfig {
            path: path.ok_or_else(|| DeviceParseError(format!("No path; {usage}")))?,
            gpudirect_clique: clique,
            iommu: iommu.unwrap_or_default(),
        };
        if config.address().is_none() {
            return Err(DeviceParseError(format!(
                "{} is not a PCI device's sysfs directory; {usage}",
                config.path.display()
            )));
        }
        Ok(config)
    }
}

/// The VM's UUID (`--uuid`, QEMU's `-uuid`): shown to the guest in SMBIOS and read by
/// NVIDIA's vGPU manager to tie a vGPU to its VM. Stored in its canonical lower-case,
/// hyphenated form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct VmUuid([u8; 16]);

impl VmUuid {
    /// The 16 bytes, in the order they are written.
    pub fn bytes(&self) -> [u8; 16] {
        self.0
    }

    /// A UUID from its bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }
}

impl fmt::Display for VmUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, byte) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for VmUuid {
    type Err = DeviceParseError;

    fn from_str(s: &str) -> Result<Self, DeviceParseError> {
        let bad = || {
            DeviceParseError(format!(
                "Invalid UUID {s:?}; use the form 8-4-4-4-12 hex digits, e.g. \
                 5c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b"
            ))
        };
        let b = s.as_bytes();
        if b.len() != 36 || [8, 13, 18, 23].iter().any(|&i| b[i] != b'-') {
            return Err(bad());
        }
        let digits: Vec<u8> = b.iter().copied().filter(|&c| c != b'-').collect();
        if digits.len() != 32 || !digits.iter().all(u8::is_ascii_hexdigit) {
            return Err(bad());
        }
        let mut out = [0u8; 16];
        for (i, pair) in digits.chunks(2).enumerate() {
            let text = std::str::from_utf8(pair).map_err(|_| bad())?;
            out[i] = u8::from_str_radix(text, 16).map_err(|_| bad())?;
        }
        Ok(Self(out))
    }
}

impl TryFrom<String> for VmUuid {
    type Error = DeviceParseError;

    fn try_from(s: String) -> Result<Self, DeviceParseError> {
        s.parse()
    }
}

impl From<VmUuid> for String {
    fn from(u: VmUuid) -> String {
        u.to_string()
    }
}

/// How a device reset went (at attach, before the guest sees the device; at detach, before
/// the device goes back to the host).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome", deny_unknown_fields)]
pub enum ResetOutcome {
    /// `VFIO_DEVICE_RESET` succeeded (`method` is the kernel's `reset_method` in use, when
    /// known: `flr`, `pm`, `bus`, ...).
    Reset {
        /// The kernel's reset method, as `/sys/.../reset_method` names it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        method: Option<String>,
    },
    /// The function reset failed or was not offered; `VFIO_DEVICE_PCI_HOT_RESET` (a
    /// secondary bus reset of the device's slot or bus) succeeded instead.
    HotReset,
    /// The device offers no reset mechanism (the kernel reports no `VFIO_DEVICE_FLAGS_RESET`
    /// and no hot reset is possible): its state was not cleared by a reset.
    Unsupported,
    /// Every reset tried failed; `error` says how (errno text).
    Failed {
        /// What the kernel answered.
        error: String,
    },
    /// The VMM did not get as far as this reset (it failed earlier, or was killed).
    NotAttempted,
}

impl ResetOutcome {
    /// Whether the device's state was cleared by a reset.
    pub fn cleared(&self) -> bool {
        matches!(self, ResetOutcome::Reset { .. } | ResetOutcome::HotReset)
    }
}

/// What became of one passed-through device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceReport {
    /// The device's sysfs directory, as configured.
    pub path: PathBuf,
    /// The reset before the guest saw it.
    pub reset_at_attach: ResetOutcome,
    /// The reset after the guest stopped.
    pub reset_at_detach: ResetOutcome,
    /// The kernel interface the device was opened through (`legacy` or `iommufd`), once
    /// it was opened; absent for the model GPU and for a device never opened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<VfioIommuMode>,
    /// How long mapping all guest RAM for DMA into the device's container or iommufd took,
    /// in milliseconds (the kernel pins every page then): one mapping serves every device
    /// of a container, and each of them reports it. Absent for the model GPU and for a
    /// device that never got that far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dma_map_ms: Option<u64>,
}

/// The file `tenantvm-vmm --exit-report FILE` writes (atomically: a temporary file renamed
/// into place) as the VMM ends, whatever the reason it ends for short of SIGKILL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExitReport {
    /// The process exit status the VMM ends with ([`crate::ExitStatus::code`]).
    pub status: u8,
    /// One entry per configured device, in configuration order.
    #[serde(default)]
    pub devices: Vec<DeviceReport>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_flags_need_the_vfio_kind_and_a_pci_sysfs_path() {
        let ok: PassthroughConfig = "vfio,path=/sys/bus/pci/devices/0000:41:00.0"
            .parse()
            .unwrap();
        assert_eq!(ok.address(), Some("0000:41:00.0"));
        assert_eq!(
            ok,
            PassthroughConfig::new("/sys/bus/pci/devices/0000:41:00.0")
        );
        let nv: PassthroughConfig =
            "vfio,gpudirect_clique=15,path=/sys/bus/pci/devices/0000:41:00.0"
                .parse()
                .unwrap();
        assert_eq!(nv.gpudirect_clique, Some(15));
        for bad in [
            "",
            "virtio,path=/sys/bus/pci/devices/0000:41:00.0",
            "vfio",
            "vfio,path=/dev/vfio/3",
            "vfio,path=/sys/bus/pci/devices/../../../etc",
            "vfio,path=/sys/bus/pci/devices/0000:41:00.8",
            "vfio,path=/sys/bus/pci/devices/0000:41:00.0,path=/sys/bus/pci/devices/0000:42:00.0",
            "vfio,path=/sys/bus/pci/devices/0000:41:00.0,iommu=off",
            "vfio,path=/sys/bus/pci/devices/0000:41:00.0,gpudirect_clique=16",
            "vfio,path=/sys/bus/pci/devices/0000:41:00.0,gpudirect_clique=-1",
            "vfio,path=/sys/bus/pci/devices/0000:41:00.0,gpudirect_clique=",
            "vfio,path=/sys/bus/pci/devices/0000:41:00.0,gpudirect_clique=1,gpudirect_clique=2",
            "vfio,gpudirect_clique=1",
            "vfio,path=/sys/bus/pci/devices/0000:41:00.0,iommu=",
            "vfio,path=/sys/bus/pci/devices/0000:41:00.0,iommu=IOMMUFD",
            "vfio,path=/sys/bus/pci/devices/0000:41:00.0,iommu=legacy,iommu=iommufd",
        ] {
            assert!(
                bad.parse::<PassthroughConfig>().is_err(),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn iommu_mode_defaults_to_auto_and_parses_each_value() {
        let p = "/sys/bus/pci/devices/0000:41:00.0";
        assert_eq!(
            format!("vfio,path={p}")
                .parse::<PassthroughConfig>()
                .unwrap()
                .iommu,
            VfioIommuMode::Auto
        );
        for mode in [
            VfioIommuMode::Auto,
            VfioIommuMode::Legacy,
            VfioIommuMode::Iommufd,
        ] {
            let c: PassthroughConfig = format!("vfio,iommu={mode},path={p}").parse().unwrap();
            assert_eq!(c.iommu, mode);
        }
        let err = format!("vfio,path={p},iommu=off")
            .parse::<PassthroughConfig>()
            .unwrap_err();
        assert!(err.to_string().contains("auto, legacy or iommufd"), "{err}");
        // The config file: absent means auto, auto is not written, others round-trip.
        let json = format!(r#"{{"path":"{p}","iommu":"iommufd"}}"#);
        let c: PassthroughConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(c.iommu, VfioIommuMode::Iommufd);
        assert_eq!(serde_json::to_string(&c).unwrap(), json);
        serde_json::from_str::<PassthroughConfig>(&format!(r#"{{"path":"{p}","iommu":"off"}}"#))
            .unwrap_err();
    }

    #[test]
    fn gpudirect_clique_defaults_off_in_old_configs_and_is_range_checked() {
        let old: PassthroughConfig =
            serde_json::from_str(r#"{"path":"/sys/bus/pci/devices/0000:41:00.0"}"#).unwrap();
        assert_eq!(old.gpudirect_clique, None);
        // Written without the field when off, so older readers still take it.
        assert_eq!(
            serde_json::to_string(&old).unwrap(),
            r#"{"path":"/sys/bus/pci/devices/0000:41:00.0"}"#
        );
        let nv: PassthroughConfig = serde_json::from_str(
            r#"{"path":"/sys/bus/pci/devices/0000:41:00.0","gpudirect_clique":3}"#,
        )
        .unwrap();
        assert_eq!(nv.gpudirect_clique, Some(3));
        let err = serde_json::from_str::<PassthroughConfig>(
            r#"{"path":"/sys/bus/pci/devices/0000:41:00.0","gpudirect_clique":16}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("use 0 to 15"), "{err}");
    }

    #[test]
    fn uuids_round_trip_in_canonical_form_and_refuse_other_shapes() {
        let u: VmUuid = "5C2B8A1E-0D3F-4C6A-9B7E-2F1A0C9D8E7B".parse().unwrap();
        assert_eq!(u.to_string(), "5c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b");
        let json = serde_json::to_string(&u).unwrap();
        assert_eq!(serde_json::from_str::<VmUuid>(&json).unwrap(), u);
        for bad in [
            "",
            "5c2b8a1e0d3f4c6a9b7e2f1a0c9d8e7b",
            "5c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7",
            "5c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7g",
            "+c2b8a1e-0d3f-4c6a-9b7e-2f1a0c9d8e7b",
        ] {
            assert!(bad.parse::<VmUuid>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn exit_reports_read_back_and_refuse_unknown_fields() {
        let report = ExitReport {
            status: 6,
            devices: vec![DeviceReport {
                path: "/sys/bus/pci/devices/0000:00:04.0".into(),
                reset_at_attach: ResetOutcome::Reset {
                    method: Some("flr".into()),
                },
                reset_at_detach: ResetOutcome::Unsupported,
                interface: Some(VfioIommuMode::Iommufd),
                dma_map_ms: Some(12),
            }],
        };
        let json = serde_json::to_string(&report).unwrap();
        assert_eq!(serde_json::from_str::<ExitReport>(&json).unwrap(), report);
        assert!(report.devices[0].reset_at_attach.cleared());
        assert!(!report.devices[0].reset_at_detach.cleared());
        serde_json::from_str::<ExitReport>(r#"{"status":0,"extra":1}"#).unwrap_err();
        assert!(json.contains(r#""interface":"iommufd""#), "{json}");
        // Reports written before the field existed still read.
        let old: DeviceReport = serde_json::from_str(
            r#"{"path":"/x","reset_at_attach":{"outcome":"not_attempted"},
                "reset_at_detach":{"outcome":"not_attempted"}}"#,
        )
        .unwrap();
        assert_eq!(old.interface, None);
    }
}
