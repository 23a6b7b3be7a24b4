//! The VM's configuration: the `--config` JSON file, command-line overrides, and the
//! validated result.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tenantvm_devices::virtio::block::BlockConfig;
use tenantvm_devices::virtio::vsock::VsockConfig;

use super::devices::DeviceFlagError;
use crate::boot::BootProtocol;
use crate::seccomp::SeccompMode;

/// Guest RAM when none is given.
pub const DEFAULT_MEMORY_MIB: u64 = 128;
/// Most guest RAM accepted (1 TiB).
pub const MAX_MEMORY_MIB: u64 = 1 << 20;
/// Kernel command line when none is given.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1";
/// Most virtio devices (PCI bus 0 has 32 slots; the host bridge takes one).
pub const MAX_PCI_DEVICES: usize = 31;

/// The `--config` file: every field optional, unknown fields refused.
///
/// Field names and meanings match the command-line flags (docs/vmm.md).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfigFile {
    /// Kernel image: ELF vmlinux or bzImage.
    pub kernel: Option<PathBuf>,
    /// Initramfs (cpio, optionally compressed) loaded at the top of low memory.
    pub initramfs: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: Option<String>,
    /// Guest RAM in MiB.
    pub memory_mib: Option<u64>,
    /// Number of vCPUs.
    pub vcpus: Option<u32>,
    /// Serial output: `stdout`, `file:PATH` or `none`.
    pub serial: Option<String>,
    /// Path of the control socket.
    pub api_sock: Option<PathBuf>,
    /// Kernel entry point: `auto`, `linux` or `pvh`.
    pub boot: Option<BootProtocol>,
    /// virtio-blk disks, in PCI slot order.
    pub disks: Option<Vec<BlockConfig>>,
    /// The virtio-vsock device.
    pub vsock: Option<VsockConfig>,
    /// Whether the guest gets a virtio-rng device (default true).
    pub rng: Option<bool>,
    /// Seccomp filters on the VMM's threads: `on` (default), `log` or `off`.
    pub seccomp: Option<SeccompMode>,
}

impl VmConfigFile {
    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// Returns `self` with every field set in `over` replaced.
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
        }
    }
}

/// Where the guest's serial output goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SerialConfig {
    /// The VMM's stdout; stdin feeds the guest's serial input.
    Stdout,
    /// A file, opened for appending (created if missing).
    File(PathBuf),
    /// Discarded.
    None,
}

impl FromStr for SerialConfig {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "stdout" => Ok(SerialConfig::Stdout),
            "none" => Ok(SerialConfig::None),
            _ => match s.strip_prefix("file:") {
                Some(path) if !path.is_empty() => Ok(SerialConfig::File(PathBuf::from(path))),
                _ => Err(ConfigError::Serial(s.to_owned())),
            },
        }
    }
}

/// A validated VM configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmConfig {
    /// Kernel image path.
    pub kernel: PathBuf,
    /// Initramfs path.
    pub initramfs: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// vCPU count (at least 1; the upper bound is checked against KVM).
    pub vcpus: u32,
    /// Serial output.
    pub serial: SerialConfig,
    /// Control socket path.
    pub api_sock: Option<PathBuf>,
    /// Kernel entry point.
    pub boot: BootProtocol,
    /// virtio-blk disks.
    pub disks: Vec<BlockConfig>,
    /// The virtio-vsock device.
    pub vsock: Option<VsockConfig>,
    /// Whether a virtio-rng device is present.
    pub rng: bool,
    /// Seccomp filters on the VMM's threads.
    pub seccomp: SeccompMode,
}

impl VmConfig {
    /// Applies defaults and checks every value that can be checked without the host.
    pub fn resolve(file: VmConfigFile) -> Result<Self, ConfigError> {
        let kernel = file.kernel.ok_or(ConfigError::MissingKernel)?;
        let memory_mib = file.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
        if memory_mib == 0 || memory_mib > MAX_MEMORY_MIB {
            return Err(ConfigError::Memory(memory_mib));
        }
        let vcpus = file.vcpus.unwrap_or(1);
        if vcpus == 0 {
            return Err(ConfigError::ZeroVcpus);
        }
        let serial = match file.serial {
            Some(s) => s.parse()?,
            None => SerialConfig::Stdout,
        };
        let disks = file.disks.unwrap_or_default();
        let rng = file.rng.unwrap_or(true);
        let devices = disks.len() + usize::from(file.vsock.is_some()) + usize::from(rng);
        if devices > MAX_PCI_DEVICES {
            return Err(ConfigError::TooManyDevices(devices));
        }
        if let Some(disk) = disks.iter().find(|d| d.path.as_os_str().is_empty()) {
            return Err(ConfigError::DiskPath(disk.id.clone().unwrap_or_default()));
        }
        Ok(Self {
            kernel,
            initramfs: file.initramfs,
            cmdline: file.cmdline.unwrap_or_else(|| DEFAULT_CMDLINE.to_owned()),
            memory_mib,
            vcpus,
            serial,
            api_sock: file.api_sock,
            boot: file.boot.unwrap_or_default(),
            disks,
            vsock: file.vsock,
            rng,
            seccomp: file.seccomp.unwrap_or_default(),
        })
    }
}

/// Why the configuration is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file cannot be read.
    #[error("Cannot read config file {}: {source}", path.display())]
    Read {
        /// The path given.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The config file is not valid (serde's message names the field).
    #[error("Invalid config file {}: {message}", path.display())]
    Parse {
        /// The path given.
        path: PathBuf,
        /// What is wrong, naming the field.
        message: String,
    },
    /// No kernel was given.
    #[error("No kernel given; pass --kernel PATH or set \"kernel\" in the config file")]
    MissingKernel,
    /// The memory size is out of range.
    #[error("Invalid memory size {0} MiB; --memory-mib must be between 1 and {MAX_MEMORY_MIB}")]
    Memory(u64),
    /// Zero vCPUs.
    #[error("A VM needs at least one vCPU; pass --vcpus 1 or more")]
    ZeroVcpus,
    /// The serial setting is not one of the accepted forms.
    #[error("Invalid serial setting {0:?}; use stdout, none or file:PATH")]
    Serial(String),
    /// A `--disk` or `--vsock` value is malformed.
    #[error(transparent)]
    DeviceFlag(#[from] DeviceFlagError),
    /// More devices than PCI slots.
    #[error("{0} virtio devices requested, but PCI bus 0 holds at most {MAX_PCI_DEVICES}; remove some disks")]
    TooManyDevices(usize),
    /// A disk without a path.
    #[error("Disk {0:?} has an empty path; give path=FILE")]
    DiskPath(String),
}

impl ConfigError {
    /// The process exit status documented in docs/vmm.md.
    pub fn exit_status(&self) -> i32 {
        match self {
            ConfigError::ZeroVcpus => 14,
            _ => 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_kernel() -> VmConfigFile {
        VmConfigFile {
            kernel: Some("/k".into()),
            ..Default::default()
        }
    }

    #[test]
    fn seccomp_defaults_on_and_reads_from_the_file() {
        assert_eq!(
            VmConfig::resolve(with_kernel()).unwrap().seccomp,
            SeccompMode::On
        );
        let file: VmConfigFile =
            serde_json::from_str(r#"{"kernel":"/k","seccomp":"log"}"#).unwrap();
        assert_eq!(VmConfig::resolve(file).unwrap().seccomp, SeccompMode::Log);
        let err = serde_json::from_str::<VmConfigFile>(r#"{"kernel":"/k","seccomp":"maybe"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("maybe"), "{err}");
    }

    #[test]
    fn defaults_apply() {
        let c = VmConfig::resolve(with_kernel()).unwrap();
        assert_eq!((c.memory_mib, c.vcpus), (DEFAULT_MEMORY_MIB, 1));
        assert_eq!(c.serial, SerialConfig::Stdout);
        assert_eq!(c.cmdline, DEFAULT_CMDLINE);
        assert_eq!(c.boot, BootProtocol::Auto);
    }

    #[test]
    fn unknown_field_error_names_the_field() {
        let err = serde_json::from_str::<VmConfigFile>(r#"{"kernel":"/k","memory_gb":2}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("memory_gb"), "{err}");
    }

    #[test]
    fn device_fields_parse_and_rng_defaults_on() {
        let file: VmConfigFile = serde_json::from_str(
            r#"{"kernel":"/k","disks":[{"path":"/d.img","read_only":true,"id":"root",
                "rate_limit":{"bytes_per_sec":1000}}],
                "vsock":{"guest_cid":3,"uds_path":"/run/v.sock"}}"#,
        )
        .unwrap();
        let c = VmConfig::resolve(file).unwrap();
        assert_eq!(c.disks.len(), 1);
        assert!(c.disks[0].read_only);
        assert_eq!(c.vsock.unwrap().guest_cid, 3);
        assert!(c.rng);
    }

    #[test]
    fn unknown_field_inside_a_disk_is_refused() {
        let err = serde_json::from_str::<VmConfigFile>(
            r#"{"kernel":"/k","disks":[{"path":"/d","readonly":true}]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("readonly"), "{err}");
    }

    #[test]
    fn more_devices_than_slots_or_an_empty_disk_path_are_refused() {
        let disk = BlockConfig {
            path: "/d".into(),
            read_only: false,
            id: None,
            rate_limit: None,
        };
        let many = VmConfig::resolve(VmConfigFile {
            disks: Some(vec![disk.clone(); MAX_PCI_DEVICES]),
            ..with_kernel()
        })
        .unwrap_err();
        assert!(matches!(many, ConfigError::TooManyDevices(32)));
        assert_eq!(many.exit_status(), 2);
        let empty = VmConfig::resolve(VmConfigFile {
            disks: Some(vec![BlockConfig {
                path: "".into(),
                ..disk
            }]),
            ..with_kernel()
        })
        .unwrap_err();
        assert!(matches!(empty, ConfigError::DiskPath(_)));
    }

    #[test]
    fn wrong_type_error_names_the_problem() {
        let err = serde_json::from_str::<VmConfigFile>(r#"{"vcpus":"two"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("invalid type"), "{err}");
    }

    #[test]
    fn command_line_overrides_file() {
        let file = VmConfigFile {
            vcpus: Some(2),
            memory_mib: Some(64),
            ..with_kernel()
        };
        let cli = VmConfigFile {
            vcpus: Some(4),
            ..Default::default()
        };
        let merged = file.overridden_by(cli);
        assert_eq!((merged.vcpus, merged.memory_mib), (Some(4), Some(64)));
        assert_eq!(merged.kernel, Some("/k".into()));
    }

    #[test]
    fn bad_values_are_refused_with_their_status() {
        let zero = VmConfig::resolve(VmConfigFile {
            vcpus: Some(0),
            ..with_kernel()
        })
        .unwrap_err();
        assert_eq!(zero.exit_status(), 14);
        let mem = VmConfig::resolve(VmConfigFile {
            memory_mib: Some(0),
            ..with_kernel()
        })
        .unwrap_err();
        assert_eq!(mem.exit_status(), 2);
        let missing = VmConfig::resolve(VmConfigFile::default()).unwrap_err();
        assert!(matches!(missing, ConfigError::MissingKernel));
    }

    #[test]
    fn serial_forms_parse() {
        assert_eq!(
            "stdout".parse::<SerialConfig>().unwrap(),
            SerialConfig::Stdout
        );
        assert_eq!("none".parse::<SerialConfig>().unwrap(), SerialConfig::None);
        assert_eq!(
            "file:/tmp/x".parse::<SerialConfig>().unwrap(),
            SerialConfig::File("/tmp/x".into())
        );
        assert!("file:".parse::<SerialConfig>().is_err());
        assert!("tty".parse::<SerialConfig>().is_err());
    }
}
