//! The `--config` file of `tenantvm-vmm`: one JSON document describing the VM. The VMM
//! reads it (and lets command-line flags override it); the orchestrator writes it. Unknown
//! fields are refused at every level, so a misspelt field is an error, never ignored.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::devices::{PassthroughConfig, VmUuid};

/// Guest RAM when none is given.
pub const DEFAULT_MEMORY_MIB: u64 = 128;
/// Most guest RAM accepted (1 TiB).
pub const MAX_MEMORY_MIB: u64 = 1 << 20;
/// Kernel command line when none is given.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1";
/// Most virtio devices (PCI bus 0 has 32 slots; the host bridge takes one).
pub const MAX_PCI_DEVICES: usize = 31;
/// Longest disk id (the virtio-blk GET_ID serial).
pub const MAX_DISK_ID_BYTES: usize = 20;
/// Lowest guest CID a VM may have (0-2 are reserved).
pub const MIN_GUEST_CID: u64 = 3;
/// Highest guest CID a VM may have (2^32 - 1 is reserved).
pub const MAX_GUEST_CID: u64 = u32::MAX as u64 - 1;

/// The `--config` file: every field optional, unknown fields refused.
///
/// Field names and meanings match the command-line flags (docs/vmm.md). Absent fields take
/// the VMM's defaults; absent fields are also left out when the file is written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfigFile {
    /// Kernel image: an ELF vmlinux (its PVH entry is used when the note exists) or a
    /// bzImage. Required, here or as `--kernel`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    /// Initramfs (cpio, optionally compressed), placed at the top of low guest memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initramfs: Option<PathBuf>,
    /// Kernel command line, under 4096 bytes (default [`DEFAULT_CMDLINE`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    /// Guest RAM in MiB, 1 to [`MAX_MEMORY_MIB`] (default [`DEFAULT_MEMORY_MIB`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// Number of vCPUs, at least 1 and at most what KVM allows on the host (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    /// Where the guest's serial console goes: `"stdout"` (default), `"file:PATH"` or
    /// `"none"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<SerialConfig>,
    /// Path of the control socket (docs/vmm.md, "Control socket"); none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_sock: Option<PathBuf>,
    /// Kernel entry point: `"auto"` (default), `"linux"` or `"pvh"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<BootProtocol>,
    /// virtio-blk disks, in PCI slot order after the host bridge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disks: Option<Vec<BlockConfig>>,
    /// The virtio-vsock device; none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<VsockConfig>,
    /// Whether the guest gets a virtio-rng device fed from the host's getrandom (default
    /// true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rng: Option<bool>,
    /// Seccomp filters on the VMM's threads: `"on"` (default), `"log"` or `"off"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seccomp: Option<SeccompMode>,
    /// PCI devices passed through over VFIO, at most
    /// [`crate::devices::MAX_PASSTHROUGH_DEVICES`] (`--device`; none by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<PassthroughConfig>>,
    /// The VM's UUID (`--uuid`): SMBIOS system UUID, and the id NVIDIA's vGPU manager
    /// ties a vGPU to. Random when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<VmUuid>,
    /// Where the VMM writes its [`crate::devices::ExitReport`] as it ends (`--exit-report`;
    /// none by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_report: Option<PathBuf>,
    /// Huge pages backing the guest's RAM (`--hugepages 2M|1G`): `"2M"` or `"1G"`; the
    /// host must have enough of them reserved. Ordinary pages when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugepages: Option<HugePages>,
}

impl VmConfigFile {
    /// Parses a config document. serde's message names the field and the problem.
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The document as written to a config file (pretty-printed JSON, absent fields left
    /// out). Fails only for a path that is not UTF-8, which JSON cannot carry.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self)
    }

    /// Returns `self` with every field set in `over` replaced (`--disk` flags replace the
    /// whole `disks` list).
    pub fn overridden_by(self, over: VmConfigFile) -> Self {
        Self {
            kernel: over.kernel.or(self.kernel),
            initramfs: over.initramfs.or(self.initramfs),
            cmdline: over.cmdline.or(self.cmdline),
            memory_mib: over.memory_mib.or(self.memory_mib),
            vcpus: over.vcpus.or(self.vcpus),
            serial: over.serial.or(self.serial),
            api_sock: over.api_sock.or(self.api_sock),
            boot: over.boot.or(self.boot),
            disks: over.disks.or(self.disks),
            vsock: over.vsock.or(self.vsock),
            rng: over.rng.or(self.rng),
            seccomp: over.seccomp.or(self.seccomp),
            devices: over.devices.or(self.devices),
            uuid: over.uuid.or(self.uuid),
            exit_report: over.exit_report.or(self.exit_report),
            hugepages: over.hugepages.or(self.hugepages),
        }
    }
}

/// Where the guest's serial output goes. Written in the file as one string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SerialConfig {
    /// The VMM's stdout; stdin feeds the guest's serial input.
    Stdout,
    /// A file, opened for appending (created if missing): `file:PATH`.
    File(PathBuf),
    /// Discarded.
    None,
}

/// A serial setting that is not `stdout`, `none` or `file:PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SerialParseError(pub String);

impl fmt::Display for SerialParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Invalid serial setting {:?}; use stdout, none or file:PATH",
            self.0
        )
    }
}

impl std::error::Error for SerialParseError {}

impl FromStr for SerialConfig {
    type Err = SerialParseError;

    fn from_str(s: &str) -> Result<Self, SerialParseError> {
        match s {
            "stdout" => Ok(SerialConfig::Stdout),
            "none" => Ok(SerialConfig::None),
            _ => match s.strip_prefix("file:") {
                Some(path) if !path.is_empty() => Ok(SerialConfig::File(PathBuf::from(path))),
                _ => Err(SerialParseError(s.to_owned())),
            },
        }
    }
}

impl fmt::Display for SerialConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SerialConfig::Stdout => f.write_str("stdout"),
            SerialConfig::None => f.write_str("none"),
            SerialConfig::File(path) => write!(f, "file:{}", path.display()),
        }
    }
}

impl Serialize for SerialConfig {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SerialConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A word that is not one of an enum's accepted names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownName {
    /// What was given.
    pub given: String,
    /// What is accepted.
    pub accepted: &'static [&'static str],
}

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not one of {}",
            self.given,
            self.accepted.join(", ")
        )
    }
}

impl std::error::Error for UnknownName {}

/// The size of the huge pages that back a guest's RAM: from the host's reserved pool
/// (`/sys/kernel/mm/hugepages/hugepages-<kB>kB`), so the RAM is never swapped or split,
/// and a GPU's DMA mapping pins and maps it in large pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HugePages {
    /// 2 MiB pages.
    #[serde(rename = "2M")]
    Size2M,
    /// 1 GiB pages.
    #[serde(rename = "1G")]
    Size1G,
}

impl HugePages {
    /// The accepted names, as written in the file and on the command line.
    pub const NAMES: &'static [&'static str] = &["2M", "1G"];

    /// The page size in bytes.
    pub fn bytes(self) -> u64 {
        match self {
            HugePages::Size2M => 2 << 20,
            HugePages::Size1G => 1 << 30,
        }
    }

    /// The name (`2M`, `1G`), as QEMU's `hugetlbsize` takes it too.
    pub fn as_str(self) -> &'static str {
        match self {
            HugePages::Size2M => "2M",
            HugePages::Size1G => "1G",
        }
    }

    /// The pool's directory under `/sys/kernel/mm/hugepages/`.
    pub fn sysfs_dir(self) -> &'static str {
        match self {
            HugePages::Size2M => "hugepages-2048kB",
            HugePages::Size1G => "hugepages-1048576kB",
        }
    }

    /// How many pages `memory_mib` of guest RAM takes, or `None` when it is not a whole
    /// number of pages.
    pub fn pages_for(self, memory_mib: u64) -> Option<u64> {
        let bytes = memory_mib.checked_mul(1 << 20)?;
        (bytes % self.bytes() == 0).then_some(bytes / self.bytes())
    }
}

impl fmt::Display for HugePages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HugePages {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, UnknownName> {
        match s {
            "2M" => Ok(Self::Size2M),
            "1G" => Ok(Self::Size1G),
            _ => Err(UnknownName {
                given: s.to_owned(),
                accepted: Self::NAMES,
            }),
        }
    }
}

/// Which entry point of the kernel to use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BootProtocol {
    /// PVH when the ELF has a PVH note, else the 64-bit Linux entry.
    #[default]
    Auto,
    /// The 64-bit Linux boot protocol (zero page in rsi), even when a PVH note exists.
    Linux,
    /// The PVH entry (32-bit protected mode, start info in ebx); fails without the note.
    Pvh,
}

impl BootProtocol {
    /// The accepted names, as written in the file and on the command line.
    pub const NAMES: &'static [&'static str] = &["auto", "linux", "pvh"];
}

impl FromStr for BootProtocol {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, UnknownName> {
        match s {
            "auto" => Ok(Self::Auto),
            "linux" => Ok(Self::Linux),
            "pvh" => Ok(Self::Pvh),
            _ => Err(UnknownName {
                given: s.to_owned(),
                accepted: Self::NAMES,
            }),
        }
    }
}

/// Whether and how the VMM installs its seccomp filters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SeccompMode {
    /// Calls outside a thread's list end the process with status 20 (default).
    #[default]
    On,
    /// Calls outside the list are allowed and logged by the kernel (audit log): for
    /// finding what a new code path needs, never for tenants.
    Log,
    /// No filters.
    Off,
}

impl SeccompMode {
    /// The accepted names, as written in the file and on the command line.
    pub const NAMES: &'static [&'static str] = &["on", "log", "off"];
}

impl FromStr for SeccompMode {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, UnknownName> {
        match s {
            "on" => Ok(Self::On),
            "log" => Ok(Self::Log),
            "off" => Ok(Self::Off),
            _ => Err(UnknownName {
                given: s.to_owned(),
                accepted: Self::NAMES,
            }),
        }
    }
}

/// One virtio-blk disk of a VM.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BlockConfig {
    /// Raw image file or block device.
    pub path: PathBuf,
    /// Present the disk read-only (default false).
    #[serde(default)]
    pub read_only: bool,
    /// Serial returned by GET_ID (at most [`MAX_DISK_ID_BYTES`] bytes; default derived from
    /// the file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Bandwidth and IOPS limits; none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitConfig>,
}

/// A disk's token-bucket limits. A request larger than a bucket's burst is let through
/// when the bucket is full and leaves it in debt, so it never starves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Sustained bytes per second (absent: no byte limit; zero is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_per_sec: Option<u64>,
    /// Burst in bytes (default: one second's worth).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_burst: Option<u64>,
    /// Sustained operations per second (absent: no operation limit; zero is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ops_per_sec: Option<u64>,
    /// Burst in operations (default: one second's worth).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ops_burst: Option<u64>,
}

/// The virtio-vsock device of a VM, hybrid-vsock style (as Firecracker's): host processes
/// connect to the Unix socket `uds_path` and write `CONNECT <port>\n`; the VMM answers
/// `OK <host port>\n` once the guest accepted. A guest connection to host port P goes to
/// the Unix socket `<uds_path>_P`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// The guest's CID ([`MIN_GUEST_CID`] to [`MAX_GUEST_CID`]).
    pub guest_cid: u64,
    /// The host Unix socket the VMM listens on.
    pub uds_path: PathBuf,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_are_refused_at_every_level_and_named() {
        for (doc, field) in [
            (r#"{"kernel":"/k","memory_gb":2}"#, "memory_gb"),
            (r#"{"disks":[{"path":"/d","readonly":true}]}"#, "readonly"),
            (r#"{"disks":[{"path":"/d","rate_limit":{"bps":1}}]}"#, "bps"),
            (
                r#"{"vsock":{"guest_cid":3,"uds_path":"/v","port":1}}"#,
                "port",
            ),
        ] {
            let err = VmConfigFile::from_json(doc).unwrap_err().to_string();
            assert!(err.contains(field), "{doc}: {err}");
        }
    }

    #[test]
    fn serial_is_one_string_in_the_file() {
        let file = VmConfigFile::from_json(r#"{"serial":"file:/log/serial.log"}"#).unwrap();
        assert_eq!(
            file.serial,
            Some(SerialConfig::File("/log/serial.log".into()))
        );
        assert!(file
            .to_json()
            .unwrap()
            .contains(r#""serial": "file:/log/serial.log""#));
        for bad in ["tty", "file:", ""] {
            let err = VmConfigFile::from_json(&format!(r#"{{"serial":"{bad}"}}"#))
                .unwrap_err()
                .to_string();
            assert!(err.contains("use stdout, none or file:PATH"), "{err}");
        }
        for form in ["stdout", "none", "file:/x"] {
            assert_eq!(form.parse::<SerialConfig>().unwrap().to_string(), form);
        }
    }

    #[test]
    fn enums_parse_from_their_names_only() {
        for name in BootProtocol::NAMES {
            let p: BootProtocol = name.parse().unwrap();
            assert_eq!(serde_json::to_string(&p).unwrap(), format!("\"{name}\""));
        }
        for name in SeccompMode::NAMES {
            let m: SeccompMode = name.parse().unwrap();
            assert_eq!(serde_json::to_string(&m).unwrap(), format!("\"{name}\""));
        }
        for name in HugePages::NAMES {
            let h: HugePages = name.parse().unwrap();
            assert_eq!(serde_json::to_string(&h).unwrap(), format!("\"{name}\""));
        }
        "2m".parse::<HugePages>().unwrap_err();
        let file = VmConfigFile::from_json(r#"{"hugepages":"1G"}"#).unwrap();
        assert_eq!(file.hugepages, Some(HugePages::Size1G));
        VmConfigFile::from_json(r#"{"hugepages":"4K"}"#).unwrap_err();
        let err = "maybe".parse::<SeccompMode>().unwrap_err().to_string();
        assert!(err.contains("on, log, off"), "{err}");
        "PVH".parse::<BootProtocol>().unwrap_err();
    }

    #[test]
    fn a_written_file_reads_back_the_same_and_leaves_out_absent_fields() {
        let file = VmConfigFile {
            kernel: Some("/vm/kernel".into()),
            memory_mib: Some(64),
            disks: Some(vec![BlockConfig {
                path: "/vm/disk0".into(),
                read_only: true,
                id: Some("disk0".into()),
                rate_limit: Some(RateLimitConfig {
                    bytes_per_sec: Some(1 << 20),
                    ops_per_sec: Some(100),
                    ..Default::default()
                }),
            }]),
            vsock: Some(VsockConfig {
                guest_cid: 3,
                uds_path: "/run/vsock.sock".into(),
            }),
            seccomp: Some(SeccompMode::On),
            ..Default::default()
        };
        let text = file.to_json().unwrap();
        assert_eq!(VmConfigFile::from_json(&text).unwrap(), file);
        assert!(!text.contains("null"), "{text}");
        assert!(!text.contains("initramfs"), "{text}");
    }

    #[test]
    fn huge_pages_count_whole_pages_only() {
        assert_eq!(HugePages::Size2M.pages_for(64), Some(32));
        assert_eq!(HugePages::Size2M.pages_for(3), None);
        assert_eq!(HugePages::Size1G.pages_for(2048), Some(2));
        assert_eq!(HugePages::Size1G.pages_for(1536), None);
        assert_eq!(HugePages::Size1G.sysfs_dir(), "hugepages-1048576kB");
    }

    #[test]
    fn flags_override_the_file_field_by_field() {
        let file = VmConfigFile {
            kernel: Some("/k".into()),
            vcpus: Some(2),
            memory_mib: Some(64),
            ..Default::default()
        };
        let flags = VmConfigFile {
            vcpus: Some(4),
            ..Default::default()
        };
        let merged = file.overridden_by(flags);
        assert_eq!((merged.vcpus, merged.memory_mib), (Some(4), Some(64)));
        assert_eq!(merged.kernel, Some("/k".into()));
    }
}
