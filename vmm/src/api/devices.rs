//! The `--disk` and `--vsock` flag syntax: comma-separated `key=value` lists turned into
//! the device crate's serde configs (the same ones the config file holds).

use std::path::PathBuf;

use tenantvm_devices::virtio::block::{BlockConfig, RateLimitConfig};
use tenantvm_devices::virtio::vsock::VsockConfig;

/// Why a `--disk` or `--vsock` value is unusable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceFlagError {
    /// An item is not `key=value`.
    #[error(
        "Invalid --{flag} item {item:?}; write key=value pairs separated by commas, e.g. {example}"
    )]
    Syntax {
        /// The flag.
        flag: &'static str,
        /// The offending item.
        item: String,
        /// A correct value.
        example: &'static str,
    },
    /// An unknown key.
    #[error("Unknown --{flag} key {key:?}; accepted keys: {accepted}")]
    UnknownKey {
        /// The flag.
        flag: &'static str,
        /// The key.
        key: String,
        /// What is accepted.
        accepted: &'static str,
    },
    /// A value of the wrong form.
    #[error("Invalid --{flag} value {key}={value:?}: {expected}")]
    Value {
        /// The flag.
        flag: &'static str,
        /// The key.
        key: String,
        /// The value.
        value: String,
        /// What is expected.
        expected: &'static str,
    },
    /// A key given twice.
    #[error("--{flag} key {key:?} is given twice")]
    Repeated {
        /// The flag.
        flag: &'static str,
        /// The key.
        key: String,
    },
    /// A required key is missing.
    #[error("--{flag} needs {key}=...; e.g. {example}")]
    Missing {
        /// The flag.
        flag: &'static str,
        /// The key.
        key: &'static str,
        /// A correct value.
        example: &'static str,
    },
}

const DISK_EXAMPLE: &str =
    "--disk path=/var/lib/t1/disk.img,readonly=on,id=root,bps=104857600,iops=5000";
const VSOCK_EXAMPLE: &str = "--vsock cid=3,socket=/run/t1/vsock.sock";

fn pairs(
    flag: &'static str,
    value: &str,
    example: &'static str,
) -> Result<Vec<(String, String)>, DeviceFlagError> {
    let mut out: Vec<(String, String)> = Vec::new();
    for item in value.split(',') {
        let (k, v) = item
            .split_once('=')
            .filter(|(k, v)| !k.is_empty() && !v.is_empty())
            .ok_or_else(|| DeviceFlagError::Syntax {
                flag,
                item: item.to_owned(),
                example,
            })?;
        if out.iter().any(|(seen, _)| seen == k) {
            return Err(DeviceFlagError::Repeated {
                flag,
                key: k.to_owned(),
            });
        }
        out.push((k.to_owned(), v.to_owned()));
    }
    Ok(out)
}

fn number(flag: &'static str, key: &str, value: &str) -> Result<u64, DeviceFlagError> {
    value.parse().map_err(|_| DeviceFlagError::Value {
        flag,
        key: key.to_owned(),
        value: value.to_owned(),
        expected: "a whole number",
    })
}

/// Parses `path=PATH[,readonly=on|off][,id=ID][,bps=N][,iops=N]`.
pub fn parse_disk(value: &str) -> Result<BlockConfig, DeviceFlagError> {
    const FLAG: &str = "disk";
    let mut path = None;
    let mut read_only = false;
    let mut id = None;
    let mut limit = RateLimitConfig {
        bytes_per_sec: None,
        bytes_burst: None,
        ops_per_sec: None,
        ops_burst: None,
    };
    for (k, v) in pairs(FLAG, value, DISK_EXAMPLE)? {
        match k.as_str() {
            "path" => path = Some(PathBuf::from(v)),
            "readonly" => {
                read_only = match v.as_str() {
                    "on" | "true" => true,
                    "off" | "false" => false,
                    _ => {
                        return Err(DeviceFlagError::Value {
                            flag: FLAG,
                            key: k,
                            value: v,
                            expected: "on or off",
                        })
                    }
                }
            }
            "id" => id = Some(v),
            "bps" => limit.bytes_per_sec = Some(number(FLAG, &k, &v)?),
            "iops" => limit.ops_per_sec = Some(number(FLAG, &k, &v)?),
            _ => {
                return Err(DeviceFlagError::UnknownKey {
                    flag: FLAG,
                    key: k,
                    accepted: "path, readonly, id, bps, iops",
                })
            }
        }
    }
    let path = path.ok_or(DeviceFlagError::Missing {
        flag: FLAG,
        key: "path",
        example: DISK_EXAMPLE,
    })?;
    let limited = limit.bytes_per_sec.is_some() || limit.ops_per_sec.is_some();
    Ok(BlockConfig {
        path,
        read_only,
        id,
        rate_limit: limited.then_some(limit),
    })
}

/// Parses `cid=N,socket=PATH`.
pub fn parse_vsock(value: &str) -> Result<VsockConfig, DeviceFlagError> {
    const FLAG: &str = "vsock";
    let mut cid = None;
    let mut socket = None;
    for (k, v) in pairs(FLAG, value, VSOCK_EXAMPLE)? {
        match k.as_str() {
            "cid" => cid = Some(number(FLAG, &k, &v)?),
            "socket" => socket = Some(PathBuf::from(v)),
            _ => {
                return Err(DeviceFlagError::UnknownKey {
                    flag: FLAG,
                    key: k,
                    accepted: "cid, socket",
                })
            }
        }
    }
    Ok(VsockConfig {
        guest_cid: cid.ok_or(DeviceFlagError::Missing {
            flag: FLAG,
            key: "cid",
            example: VSOCK_EXAMPLE,
        })?,
        uds_path: socket.ok_or(DeviceFlagError::Missing {
            flag: FLAG,
            key: "socket",
            example: VSOCK_EXAMPLE,
        })?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_disk_flag_parses_with_limits() {
        let d = parse_disk("path=/d.img,readonly=on,id=root,bps=1000,iops=50").unwrap();
        assert_eq!(d.path, PathBuf::from("/d.img"));
        assert!(d.read_only);
        assert_eq!(d.id.as_deref(), Some("root"));
        let limit = d.rate_limit.unwrap();
        assert_eq!(limit.bytes_per_sec, Some(1000));
        assert_eq!(limit.ops_per_sec, Some(50));
    }

    #[test]
    fn plain_disk_flag_is_writable_and_unlimited() {
        let d = parse_disk("path=/d.img").unwrap();
        assert!(!d.read_only);
        assert!(d.rate_limit.is_none());
    }

    #[test]
    fn disk_flag_errors_name_the_problem() {
        assert!(matches!(
            parse_disk("readonly=on"),
            Err(DeviceFlagError::Missing { key: "path", .. })
        ));
        assert!(matches!(
            parse_disk("path=/d,size=3"),
            Err(DeviceFlagError::UnknownKey { .. })
        ));
        assert!(matches!(
            parse_disk("path=/d,readonly=maybe"),
            Err(DeviceFlagError::Value { .. })
        ));
        assert!(matches!(
            parse_disk("path=/d,bps=lots"),
            Err(DeviceFlagError::Value { .. })
        ));
        assert!(matches!(
            parse_disk("/d.img"),
            Err(DeviceFlagError::Syntax { .. })
        ));
        assert!(matches!(
            parse_disk("path=/a,path=/b"),
            Err(DeviceFlagError::Repeated { .. })
        ));
        let msg = parse_disk("path=/d,x=1").unwrap_err().to_string();
        assert!(msg.starts_with("Unknown --disk key"), "{msg}");
    }

    #[test]
    fn vsock_flag_needs_cid_and_socket() {
        let v = parse_vsock("cid=3,socket=/run/v.sock").unwrap();
        assert_eq!(v.guest_cid, 3);
        assert_eq!(v.uds_path, PathBuf::from("/run/v.sock"));
        assert!(matches!(
            parse_vsock("cid=3"),
            Err(DeviceFlagError::Missing { key: "socket", .. })
        ));
        assert!(matches!(
            parse_vsock("socket=/s"),
            Err(DeviceFlagError::Missing { key: "cid", .. })
        ));
        assert!(matches!(
            parse_vsock("cid=x,socket=/s"),
            Err(DeviceFlagError::Value { .. })
        ));
    }
}
