//! The VM's configuration, validated: the `--config` file (its types are the contract in
//! tenantvm-vmm-api) with command-line overrides applied, defaults filled in and every
//! value checked that can be checked without the host.

use std::path::{Path, PathBuf};

use serde::Serialize;
use tenantvm_vmm_api::config::{
    DEFAULT_CMDLINE, DEFAULT_MEMORY_MIB, MAX_MEMORY_MIB, MAX_PCI_DEVICES,
};
use tenantvm_vmm_api::{
    BlockConfig, BootProtocol, ExitStatus, HugePages, PassthroughConfig, SeccompMode, SerialConfig,
    VmConfigFile, VmUuid, VsockConfig, MAX_PASSTHROUGH_DEVICES,
};

use super::devices::DeviceFlagError;

/// Reads and parses a config file.
pub fn load(path: &Path) -> Result<VmConfigFile, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    VmConfigFile::from_json(&text).map_err(|e| ConfigError::Parse {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// A validated VM configuration (`--check` prints it as JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
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
    /// PCI devices passed through over VFIO, in PCI slot order after the virtio devices.
    pub devices: Vec<PassthroughConfig>,
    /// Model GPUs to attach (a test fake: only builds with the `test-model-gpu` feature
    /// accept `--device model-gpu`; never in the config file).
    #[serde(skip_serializing_if = "is_zero")]
    pub test_model_gpus: usize,
    /// The VM's UUID.
    pub uuid: Option<VmUuid>,
    /// Where the exit report goes.
    pub exit_report: Option<PathBuf>,
    /// Huge pages backing the guest's RAM (ordinary pages when `None`).
    pub hugepages: Option<HugePages>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl VmConfig {
    /// Applies defaults and checks every value that can be checked without the host.
    pub fn resolve(file: VmConfigFile) -> Result<Self, ConfigError> {
        let kernel = file.kernel.ok_or(ConfigError::MissingKernel)?;
        let memory_mib = file.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
        if memory_mib == 0 || memory_mib > MAX_MEMORY_MIB {
            return Err(ConfigError::Memory(memory_mib));
        }
        if let Some(h) = file.hugepages {
            if h.pages_for(memory_mib).is_none() {
                return Err(ConfigError::HugePageMultiple {
                    memory_mib,
                    pages: h,
                });
            }
        }
        let vcpus = file.vcpus.unwrap_or(1);
        if vcpus == 0 {
            return Err(ConfigError::ZeroVcpus);
        }
        let serial = file.serial.unwrap_or(SerialConfig::Stdout);
        let disks = file.disks.unwrap_or_default();
        let rng = file.rng.unwrap_or(true);
        let devices = disks.len() + usize::from(file.vsock.is_some()) + usize::from(rng);
        if devices > MAX_PCI_DEVICES {
            return Err(ConfigError::TooManyDevices(devices));
        }
        let passthrough = file.devices.unwrap_or_default();
        if passthrough.len() > MAX_PASSTHROUGH_DEVICES {
            return Err(ConfigError::TooManyPassthrough(passthrough.len()));
        }
        if devices + passthrough.len() > MAX_PCI_DEVICES {
            return Err(ConfigError::TooManyDevices(devices + passthrough.len()));
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
            devices: passthrough,
            test_model_gpus: 0,
            uuid: file.uuid,
            exit_report: file.exit_report,
            hugepages: file.hugepages,
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
    /// Guest RAM that is not a whole number of the huge pages asked for.
    #[error("{memory_mib} MiB of guest memory is not a whole number of {pages} huge pages; give --memory-mib a multiple of the page size")]
    HugePageMultiple {
        /// The guest RAM.
        memory_mib: u64,
        /// The page size.
        pages: HugePages,
    },
    /// A `--disk` or `--vsock` value is malformed.
    #[error(transparent)]
    DeviceFlag(#[from] DeviceFlagError),
    /// More devices than PCI slots.
    #[error("{0} virtio devices requested, but PCI bus 0 holds at most {MAX_PCI_DEVICES}; remove some disks")]
    TooManyDevices(usize),
    /// More passed-through devices than allowed.
    #[error("{0} passed-through devices requested; a VM takes at most {MAX_PASSTHROUGH_DEVICES}")]
    TooManyPassthrough(usize),
    /// A disk without a path.
    #[error("Disk {0:?} has an empty path; give path=FILE")]
    DiskPath(String),
}

impl ConfigError {
    /// The process exit status documented in docs/vmm.md.
    pub fn exit_status(&self) -> ExitStatus {
        match self {
            ConfigError::ZeroVcpus => ExitStatus::VcpuCount,
            _ => ExitStatus::ConfigError,
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
        assert_eq!(many.exit_status(), ExitStatus::ConfigError);
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
    fn bad_values_are_refused_with_their_status() {
        let zero = VmConfig::resolve(VmConfigFile {
            vcpus: Some(0),
            ..with_kernel()
        })
        .unwrap_err();
        assert_eq!(zero.exit_status(), ExitStatus::VcpuCount);
        let mem = VmConfig::resolve(VmConfigFile {
            memory_mib: Some(0),
            ..with_kernel()
        })
        .unwrap_err();
        assert_eq!(mem.exit_status(), ExitStatus::ConfigError);
        let missing = VmConfig::resolve(VmConfigFile::default()).unwrap_err();
        assert!(matches!(missing, ConfigError::MissingKernel));
    }
}
