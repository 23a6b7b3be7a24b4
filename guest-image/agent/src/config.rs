//! The image's agent configuration, `/etc/tenantvm/agent.json` in the initramfs, written
//! by the image recipe (guest-image/build.sh).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Where the agent reads its configuration.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/tenantvm/agent.json";

/// Why the configuration could not be loaded.
#[derive(Debug, Error)]
pub enum AgentConfigError {
    /// The file is missing or unreadable.
    #[error("Cannot read the agent config {path}: {source}; rebuild the image with guest-image/build.sh")]
    Read {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The JSON does not match the schema.
    #[error("Agent config {path} is invalid: {source}")]
    Parse {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: serde_json::Error,
    },
    /// A value is out of range.
    #[error("Agent config is invalid: {0}")]
    Invalid(&'static str),
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// Kernel modules to load at boot, by name; their dependencies come from modules.dep.
    pub modules: Vec<String>,
    /// The encrypted data disk.
    pub disk: DiskConfig,
    /// The inference server.
    pub payload: PayloadConfig,
}

/// The encrypted data disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    /// Block device holding the LUKS2 image (the first virtio-blk disk is `/dev/vda`).
    pub device: PathBuf,
    /// dm-crypt mapping name (`/dev/mapper/<name>`).
    pub mapper_name: String,
    /// Where the file system is mounted.
    pub mount_point: PathBuf,
    /// cryptsetup binary in the initramfs.
    pub cryptsetup: PathBuf,
    /// mke2fs binary in the initramfs (used on first use).
    pub mkfs: PathBuf,
}

/// The inference server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PayloadConfig {
    /// Program and arguments.
    pub command: Vec<String>,
    /// Environment (the payload gets only this plus PATH).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory.
    pub workdir: PathBuf,
    /// TCP port on 127.0.0.1 the server listens on.
    pub port: u16,
    /// Path answered with 200 once the server is ready.
    pub health_path: String,
    /// Run it in its own root as an unprivileged user ([`crate::confine`]); `command` and
    /// `workdir` are then paths inside that root. Absent: it runs in the initramfs as the
    /// agent does (the CI n-gram payload).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confine: Option<crate::confine::ConfineConfig>,
}

impl AgentConfig {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Self, AgentConfigError> {
        let text = std::fs::read(path).map_err(|source| AgentConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let cfg: Self =
            serde_json::from_slice(&text).map_err(|source| AgentConfigError::Parse {
                path: path.to_path_buf(),
                source,
            })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks values serde cannot.
    pub fn validate(&self) -> Result<(), AgentConfigError> {
        if self.payload.command.is_empty() {
            return Err(AgentConfigError::Invalid("payload.command is empty"));
        }
        if self.payload.port == 0 {
            return Err(AgentConfigError::Invalid("payload.port is 0"));
        }
        if !self.payload.health_path.starts_with('/') {
            return Err(AgentConfigError::Invalid(
                "payload.health_path must start with '/'",
            ));
        }
        if let Some(c) = &self.payload.confine {
            c.validate().map_err(|e| match e {
                crate::confine::ConfineError::Invalid(why) => AgentConfigError::Invalid(why),
                _ => AgentConfigError::Invalid("payload.confine is invalid"),
            })?;
        }
        let name = &self.disk.mapper_name;
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(AgentConfigError::Invalid(
                "disk.mapper_name must be non-empty [A-Za-z0-9_-]",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{
        "modules": ["virtio_pci"],
        "disk": {"device": "/dev/vda", "mapper_name": "tenantdata", "mount_point": "/data",
                 "cryptsetup": "/sbin/cryptsetup", "mkfs": "/sbin/mke2fs"},
        "payload": {"command": ["/payload/bin/srv"], "env": {"A": "1"}, "workdir": "/data",
                    "port": 8000, "health_path": "/health"}
    }"#;

    #[test]
    fn good_config_loads() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("agent.json");
        std::fs::write(&p, GOOD).unwrap();
        let cfg = AgentConfig::load(&p).unwrap();
        assert_eq!(cfg.payload.port, 8000);
        assert_eq!(cfg.payload.confine, None);
        std::fs::write(
            &p,
            GOOD.replace(
                "\"health_path\": \"/health\"",
                "\"health_path\": \"/health\", \"confine\": {\"root\": \"/payload\", \"uid\": 1000}",
            ),
        )
        .unwrap();
        let cfg = AgentConfig::load(&p).unwrap();
        assert_eq!(cfg.payload.confine.unwrap().uid, 1000);
    }

    #[test]
    fn bad_configs_are_refused_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("agent.json");
        assert!(matches!(
            AgentConfig::load(&p),
            Err(AgentConfigError::Read { .. })
        ));
        std::fs::write(
            &p,
            GOOD.replace("\"modules\"", "\"unknown\": 1, \"modules\""),
        )
        .unwrap();
        assert!(matches!(
            AgentConfig::load(&p),
            Err(AgentConfigError::Parse { .. })
        ));
        for (from, to) in [
            ("[\"/payload/bin/srv\"]", "[]"),
            ("8000", "0"),
            ("\"/health\"", "\"health\""),
            ("\"tenantdata\"", "\"../x\""),
            (
                "\"health_path\": \"/health\"",
                "\"health_path\": \"/health\", \"confine\": {\"root\": \"/payload\", \"uid\": 0}",
            ),
            (
                "\"health_path\": \"/health\"",
                "\"health_path\": \"/health\", \"confine\": {\"root\": \"/\", \"uid\": 1000}",
            ),
        ] {
            std::fs::write(&p, GOOD.replace(from, to)).unwrap();
            assert!(
                matches!(AgentConfig::load(&p), Err(AgentConfigError::Invalid(_))),
                "{to}"
            );
        }
    }
}
