//! The guest's own view of its devices ([`crate::Request::GpuInfo`]): the PCI functions the
//! guest kernel enumerated and, where the image has `nvidia-smi`, the GPUs the NVIDIA driver
//! sees with their memory. The host compares it with the share it handed over
//! (`tenantvm gpu-info`).
//!
//! The reply comes from the tenant's guest, so the host treats it as hostile: serde keeps the
//! numbers in their ranges, and [`GpuInfoReply::check`] bounds every list and string before
//! anything reads it (the frame cap alone would let 4 MiB of strings through).

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Most PCI functions one reply lists (a guest has a handful; the rest is cut).
pub const MAX_PCI_DEVICES: usize = 256;
/// Most `nvidia-smi` rows one reply carries (one per GPU the guest sees).
pub const MAX_GPU_ROWS: usize = 16;
/// Longest string field (a driver name, a GPU name, a UUID, a message), bytes.
pub const MAX_FIELD_LEN: usize = 256;
/// Longest `nvidia-smi` may run before the agent kills it, seconds.
pub const NVIDIA_SMI_DEADLINE_SECS: u64 = 20;
/// Most bytes of `nvidia-smi` output the agent reads (the rest is dropped and said so).
pub const MAX_NVIDIA_SMI_OUTPUT: usize = 64 * 1024;
/// The `--query-gpu` fields the agent asks `nvidia-smi` for, in this order.
pub const NVIDIA_SMI_QUERY: &str = "index,name,uuid,memory.total,memory.used,mig.mode.current";

/// One PCI function as the guest kernel shows it in `/sys/bus/pci/devices`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciFunction {
    /// Its address in the guest, `DDDD:BB:DD.F` (the guest's own numbering, not the host's).
    pub address: String,
    /// Vendor id.
    pub vendor: u16,
    /// Device id.
    pub device: u16,
    /// Subsystem vendor id (absent when the guest kernel shows none).
    pub subsystem_vendor: Option<u16>,
    /// Subsystem device id.
    pub subsystem_device: Option<u16>,
    /// Class code, 24 bits (`0x030200`: a 3D controller).
    pub class: u32,
    /// The guest driver bound to it, if any.
    pub driver: Option<String>,
}

/// One GPU as `nvidia-smi --query-gpu=...` printed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SmiGpu {
    /// nvidia-smi's index.
    pub index: u32,
    /// Product name.
    pub name: String,
    /// GPU UUID.
    pub uuid: String,
    /// Total framebuffer memory the driver reports, MiB (absent: `[N/A]`).
    pub memory_total_mib: Option<u64>,
    /// Used memory, MiB.
    pub memory_used_mib: Option<u64>,
    /// `mig.mode.current` (`Enabled`, `Disabled`; absent: `[N/A]`, no MIG on this GPU).
    pub mig_mode: Option<String>,
}

/// What became of `nvidia-smi` in the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "kebab-case", deny_unknown_fields)]
pub enum NvidiaSmi {
    /// The image has no `nvidia-smi` in any of the places looked at (not an error: an
    /// image without the NVIDIA driver's tools).
    Absent {
        /// The paths looked at.
        searched: Vec<String>,
    },
    /// It ran and exited 0.
    Ran {
        /// The binary run.
        path: String,
        /// The rows parsed.
        gpus: Vec<SmiGpu>,
        /// Lines of its output that were not a row of the query (or beyond
        /// [`MAX_GPU_ROWS`]).
        unparsed_lines: u32,
        /// Its output was longer than [`MAX_NVIDIA_SMI_OUTPUT`] and was cut.
        truncated: bool,
    },
    /// It could not be started or exited non-zero (no GPU, driver not loaded, ...).
    Failed {
        /// The binary.
        path: String,
        /// Exit code, or 128 + signal (absent: it never started).
        exit_code: Option<i32>,
        /// Its first output line, or why it could not start.
        message: String,
    },
    /// It ran past [`NVIDIA_SMI_DEADLINE_SECS`] and the agent killed it.
    TimedOut {
        /// The binary.
        path: String,
        /// How long it was given, ms.
        after_ms: u64,
    },
}

/// The answer to [`crate::Request::GpuInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuInfoReply {
    /// The guest's PCI functions, by address (at most [`MAX_PCI_DEVICES`]).
    pub pci: Vec<PciFunction>,
    /// More functions existed than were listed.
    pub pci_truncated: bool,
    /// Entries of `/sys/bus/pci/devices` that could not be read or parsed (skipped).
    pub pci_unreadable: u32,
    /// `nvidia-smi`'s view.
    pub nvidia_smi: NvidiaSmi,
}

/// Why a [`GpuInfoReply`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GpuInfoError {
    /// A list is longer than its cap.
    #[error("the gpu-info reply lists {count} {what}, more than the {max} allowed")]
    TooMany {
        /// Which list.
        what: &'static str,
        /// How many it has.
        count: usize,
        /// The cap.
        max: usize,
    },
    /// A string is too long or holds control characters.
    #[error("the gpu-info reply's {0} is too long or not printable")]
    BadField(&'static str),
    /// A PCI address is not `DDDD:BB:DD.F`.
    #[error("the gpu-info reply names a PCI function {0:?} that is not an address")]
    BadAddress(String),
    /// A class code wider than 24 bits.
    #[error("the gpu-info reply gives a class code {0:#x} wider than 24 bits")]
    BadClass(u32),
}

/// Whether `s` is a PCI address as sysfs names it: `DDDD:BB:DD.F`, lowercase or uppercase
/// hex, device below 0x20 and function below 8.
pub fn is_pci_address(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() != 12 || b[4] != b':' || b[7] != b':' || b[10] != b'.' {
        return false;
    }
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
    if !(hex(0..4) && hex(5..7) && hex(8..10)) {
        return false;
    }
    let dev = u8::from_str_radix(&s[8..10], 16).unwrap_or(u8::MAX);
    matches!(b[11], b'0'..=b'7') && dev < 0x20
}

/// Whether `s` is short and printable (no control characters at all).
pub fn is_plain_field(s: &str) -> bool {
    s.len() <= MAX_FIELD_LEN && !s.chars().any(char::is_control)
}

fn field(s: &str, what: &'static str) -> Result<(), GpuInfoError> {
    if is_plain_field(s) {
        Ok(())
    } else {
        Err(GpuInfoError::BadField(what))
    }
}

impl GpuInfoReply {
    /// Checks the caps: list lengths, string lengths and characters, address and class
    /// forms. The host calls it on every reply before reading it.
    pub fn check(&self) -> Result<(), GpuInfoError> {
        if self.pci.len() > MAX_PCI_DEVICES {
            return Err(GpuInfoError::TooMany {
                what: "PCI functions",
                count: self.pci.len(),
                max: MAX_PCI_DEVICES,
            });
        }
        for f in &self.pci {
            if !is_pci_address(&f.address) {
                let shown: String = f.address.chars().take(32).collect();
                return Err(GpuInfoError::BadAddress(shown));
            }
            if f.class > 0x00ff_ffff {
                return Err(GpuInfoError::BadClass(f.class));
            }
            if let Some(d) = &f.driver {
                field(d, "driver name")?;
            }
        }
        match &self.nvidia_smi {
            NvidiaSmi::Absent { searched } => {
                if searched.len() > MAX_GPU_ROWS {
                    return Err(GpuInfoError::TooMany {
                        what: "searched paths",
                        count: searched.len(),
                        max: MAX_GPU_ROWS,
                    });
                }
                for p in searched {
                    field(p, "searched path")?;
                }
            }
            NvidiaSmi::Ran { path, gpus, .. } => {
                field(path, "nvidia-smi path")?;
                if gpus.len() > MAX_GPU_ROWS {
                    return Err(GpuInfoError::TooMany {
                        what: "nvidia-smi rows",
                        count: gpus.len(),
                        max: MAX_GPU_ROWS,
                    });
                }
                for g in gpus {
                    field(&g.name, "GPU name")?;
                    field(&g.uuid, "GPU UUID")?;
                    if let Some(m) = &g.mig_mode {
                        field(m, "MIG mode")?;
                    }
                }
            }
            NvidiaSmi::Failed { path, message, .. } => {
                field(path, "nvidia-smi path")?;
                field(message, "nvidia-smi message")?;
            }
            NvidiaSmi::TimedOut { path, .. } => field(path, "nvidia-smi path")?,
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn function(address: &str) -> PciFunction {
        PciFunction {
            address: address.into(),
            vendor: 0x10de,
            device: 0x2330,
            subsystem_vendor: Some(0x10de),
            subsystem_device: Some(0x16c1),
            class: 0x030200,
            driver: Some("nvidia".into()),
        }
    }

    fn reply() -> GpuInfoReply {
        GpuInfoReply {
            pci: vec![function("0000:00:05.0")],
            pci_truncated: false,
            pci_unreadable: 0,
            nvidia_smi: NvidiaSmi::Ran {
                path: "/usr/bin/nvidia-smi".into(),
                gpus: vec![SmiGpu {
                    index: 0,
                    name: "NVIDIA H100 80GB HBM3 MIG 1g.10gb".into(),
                    uuid: "GPU-8e0c6a3c-0000-0000-0000-000000000000".into(),
                    memory_total_mib: Some(9984),
                    memory_used_mib: Some(0),
                    mig_mode: None,
                }],
                unparsed_lines: 0,
                truncated: false,
            },
        }
    }

    #[test]
    fn pci_addresses_are_checked_whole() {
        for ok in ["0000:00:05.0", "0000:3B:1f.7", "ffff:ff:00.0"] {
            assert!(is_pci_address(ok), "{ok}");
        }
        for bad in [
            "",
            "0000:00:05",
            "0000:00:20.0",
            "0000:00:05.8",
            "000g:00:05.0",
            "0000-00:05.0",
            "0000:00:05.0 ",
            "../../etc/x",
        ] {
            assert!(!is_pci_address(bad), "{bad}");
        }
    }

    #[test]
    fn a_sound_reply_passes_and_bounds_are_held() {
        assert_eq!(reply().check(), Ok(()));
        let mut r = reply();
        r.pci = vec![function("0000:00:05.0"); MAX_PCI_DEVICES + 1];
        assert!(matches!(r.check(), Err(GpuInfoError::TooMany { .. })));
        let mut r = reply();
        r.pci[0].address = "0000:00:05.0\x1b[2J".into();
        assert!(matches!(r.check(), Err(GpuInfoError::BadAddress(_))));
        let mut r = reply();
        r.pci[0].class = 0x0100_0000;
        assert_eq!(r.check(), Err(GpuInfoError::BadClass(0x0100_0000)));
        let mut r = reply();
        r.pci[0].driver = Some("x".repeat(MAX_FIELD_LEN + 1));
        assert_eq!(r.check(), Err(GpuInfoError::BadField("driver name")));
        let mut r = reply();
        if let NvidiaSmi::Ran { gpus, .. } = &mut r.nvidia_smi {
            gpus[0].name = "evil\x1b]0;title\x07".into();
        }
        assert_eq!(r.check(), Err(GpuInfoError::BadField("GPU name")));
        let mut r = reply();
        if let NvidiaSmi::Ran { gpus, .. } = &mut r.nvidia_smi {
            *gpus = vec![gpus[0].clone(); MAX_GPU_ROWS + 1];
        }
        assert!(matches!(r.check(), Err(GpuInfoError::TooMany { .. })));
        let r = GpuInfoReply {
            nvidia_smi: NvidiaSmi::Failed {
                path: "/usr/bin/nvidia-smi".into(),
                exit_code: Some(9),
                message: "m".repeat(MAX_FIELD_LEN + 1),
            },
            ..reply()
        };
        assert_eq!(r.check(), Err(GpuInfoError::BadField("nvidia-smi message")));
    }

    #[test]
    fn numbers_out_of_range_and_unknown_fields_do_not_decode() {
        let good = serde_json::to_value(reply()).unwrap();
        for (pointer, bad) in [
            ("/pci/0/vendor", serde_json::json!(65536)),
            ("/pci/0/device", serde_json::json!(-1)),
            ("/pci/0/class", serde_json::json!("0x030200")),
            ("/nvidia_smi/gpus/0/memory_total_mib", serde_json::json!(-5)),
            ("/nvidia_smi/state", serde_json::json!("exploded")),
        ] {
            let mut v = good.clone();
            *v.pointer_mut(pointer).unwrap() = bad;
            assert!(
                serde_json::from_value::<GpuInfoReply>(v).is_err(),
                "{pointer}"
            );
        }
        let mut v = good;
        v["pci"][0]["extra"] = serde_json::json!(1);
        serde_json::from_value::<GpuInfoReply>(v).unwrap_err();
    }
}
