//! The tenant spec: what an operator asks for, as a TOML file or CLI flags.
//!
//! Every field is checked here, once, before anything touches the host. The name is a
//! [`TenantName`], checked when the document is parsed.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tenantvm_vmm_api::HugePages;
use thiserror::Error;

use super::licence::VgpuLicence;
use super::name::TenantName;

/// Largest vCPU count a spec may ask for.
pub const MAX_VCPUS: u32 = 64;
/// Smallest guest memory, in MiB.
pub const MIN_MEMORY_MIB: u32 = 16;
/// Largest guest memory, in MiB (1 TiB).
pub const MAX_MEMORY_MIB: u32 = 1 << 20;
/// Largest disk, in GiB.
pub const MAX_DISK_GIB: u32 = 16 * 1024;
/// Longest kernel command line accepted.
pub const MAX_CMDLINE_LEN: usize = 2048;

/// Why a tenant spec was refused. Each message says what to change.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TenantSpecError {
    /// A number is outside its range.
    #[error("Field `{field}` is {value}, but must be between {min} and {max}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The value given.
        value: u64,
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
    },
    /// The guest image names neither a known image nor a kernel, or both.
    #[error("Guest image: give either `image.name` (a named image) or `image.kernel` (a host path), not both and not neither")]
    ImageChoice,
    /// A host path is not absolute or contains `..`.
    #[error("Field `{field}` must be an absolute host path without `..` components, got {path:?}")]
    BadPath {
        /// The field.
        field: &'static str,
        /// The path given.
        path: PathBuf,
    },
    /// The image name breaks the naming rule.
    #[error("Invalid image name {0:?}: use 1-63 characters from a-z, 0-9, '-' and '_', starting with a letter or digit")]
    InvalidImageName(String),
    /// The command line is too long or holds control characters.
    #[error("Kernel command line must be at most {MAX_CMDLINE_LEN} printable characters")]
    BadCmdline,
    /// The GPU request cannot be sized or contradicts itself.
    #[error("GPU request: {0}")]
    Gpu(String),
    /// Guest memory that is not a whole number of the huge pages asked for.
    #[error("memory_mib {memory_mib} is not a whole number of {pages} huge pages: give a multiple of the page size, or another `hugepages`")]
    HugePages {
        /// The guest memory.
        memory_mib: u32,
        /// The page size asked for.
        pages: HugePages,
    },
    /// A vGPU licence for a tenant without a GPU.
    #[error("vgpu_licence is for a tenant with a GPU share (a MIG-backed vGPU needs it): add a `gpu` request or leave the licence out")]
    LicenceWithoutGpu,
    /// The TOML document did not parse (syntax, types, unknown fields).
    #[error("Tenant spec is not valid TOML for this schema: {0}")]
    Toml(String),
}

/// A tenant spec, as submitted to `POST /v1/tenants` or read from a TOML file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// Tenant name, `[a-z0-9][a-z0-9-]{0,62}` (checked when the spec is parsed).
    pub name: TenantName,
    /// Number of vCPUs (1..=64).
    #[serde(default = "default_vcpus")]
    pub vcpus: u32,
    /// Guest memory in MiB.
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u32,
    /// Size of the tenant's encrypted disk in GiB; 0 means no disk.
    #[serde(default)]
    pub disk_gib: u32,
    /// The GPU share requested: the planner's request (`model`/`custom` with `dtype`,
    /// `kv_dtype`, `context`, `concurrency`, `overhead_gib`; or `profile`; or `whole_gpu`),
    /// the fields of a `tenantvm plan` tenants file. Absent: no GPU.
    #[serde(
        default,
        deserialize_with = "super::gpu_request::deserialize",
        skip_serializing_if = "is_no_gpu"
    )]
    pub gpu: GpuRequest,
    /// What the guest boots.
    pub image: GuestImage,
    /// Per-tenant limits enforced by the gateway and the VMM.
    #[serde(default)]
    pub quotas: Quotas,
    /// Huge pages for the guest's RAM: `"2M"`, `"1G"` (the host must have enough free),
    /// or `"off"`. Absent: the daemon's choice at each launch: a GPU tenant gets them where
    /// the host has enough reserved and free (1G first, then 2M), others ordinary pages
    /// (`backend::hugepages::choose`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugepages: Option<HugePagesSetting>,
    /// The tenant's NVIDIA vGPU licence: the text of the client configuration token
    /// (`client_configuration_token_*.tok`) the guest's licensing client reads. Write-only:
    /// at create the daemon takes it out of the spec, seals it under the host KEK and hands
    /// it to the guest agent at each boot; it is never stored with the spec nor shown.
    /// Needs a GPU request and a guest image with the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vgpu_licence: Option<VgpuLicence>,
}

/// A spec's `hugepages`: a page size, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum HugePagesSetting {
    /// Ordinary pages, even for a GPU tenant.
    Off,
    /// Huge pages of this size.
    Pages(HugePages),
}

impl TryFrom<String> for HugePagesSetting {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "off" => Ok(HugePagesSetting::Off),
            _ => s
                .parse()
                .map(HugePagesSetting::Pages)
                .map_err(|_| format!("hugepages {s:?} is not one of 2M, 1G, off")),
        }
    }
}

impl From<HugePagesSetting> for String {
    fn from(h: HugePagesSetting) -> String {
        match h {
            HugePagesSetting::Off => "off".into(),
            HugePagesSetting::Pages(p) => p.as_str().into(),
        }
    }
}

fn is_no_gpu(gpu: &GpuRequest) -> bool {
    !gpu.wants_gpu()
}

fn default_vcpus() -> u32 {
    1
}

fn default_memory_mib() -> u32 {
    128
}

pub use super::gpu_request::GpuRequest;

/// What the guest boots: a named image from the daemon's image directory, or host files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct GuestImage {
    /// A named image: `<image-dir>/<name>/kernel` (+ optional `initramfs`, `cmdline`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Absolute host path of the kernel (ELF vmlinux or bzImage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<PathBuf>,
    /// Absolute host path of an initramfs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initramfs: Option<PathBuf>,
    /// Kernel command line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
}

/// Per-tenant quotas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quotas {
    /// Inference requests per second (token bucket rate).
    #[serde(default = "default_rps")]
    pub requests_per_s: u32,
    /// Requests in flight at once.
    #[serde(default = "default_concurrency")]
    pub max_concurrency: u32,
    /// Disk I/O operations per second.
    #[serde(default = "default_iops")]
    pub disk_iops: u32,
    /// Disk bandwidth in MiB/s.
    #[serde(default = "default_disk_mib_s")]
    pub disk_mib_per_s: u32,
    /// Largest inference request body the front door accepts, in bytes (larger: 413).
    #[serde(default = "default_max_request_bytes")]
    pub max_request_bytes: u32,
}

/// Default of `quotas.max_request_bytes`: 1 MiB, room for retrieval-augmented prompts.
pub const DEFAULT_MAX_REQUEST_BYTES: u32 = 1024 * 1024;
/// Largest `quotas.max_request_bytes` (the agent frame that carries a request is 4 MiB,
/// and JSON escaping may double a body).
pub const MAX_REQUEST_BYTES_LIMIT: u32 = 2 * 1024 * 1024 - 64 * 1024;

fn default_max_request_bytes() -> u32 {
    DEFAULT_MAX_REQUEST_BYTES
}

fn default_rps() -> u32 {
    10
}
fn default_concurrency() -> u32 {
    4
}
fn default_iops() -> u32 {
    1000
}
fn default_disk_mib_s() -> u32 {
    100
}

impl Default for Quotas {
    fn default() -> Self {
        Quotas {
            requests_per_s: default_rps(),
            max_concurrency: default_concurrency(),
            disk_iops: default_iops(),
            disk_mib_per_s: default_disk_mib_s(),
            max_request_bytes: default_max_request_bytes(),
        }
    }
}

fn validate_image_name(name: &str) -> Result<(), TenantSpecError> {
    let bytes = name.as_bytes();
    let ok = !bytes.is_empty()
        && bytes.len() <= 63
        && bytes[0].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-' || *b == b'_');
    if ok {
        Ok(())
    } else {
        Err(TenantSpecError::InvalidImageName(name.to_string()))
    }
}

fn validate_host_path(field: &'static str, path: &Path) -> Result<(), TenantSpecError> {
    let bad = !path.is_absolute()
        || path
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir));
    if bad {
        return Err(TenantSpecError::BadPath {
            field,
            path: path.to_path_buf(),
        });
    }
    Ok(())
}

fn range(field: &'static str, value: u32, min: u32, max: u32) -> Result<(), TenantSpecError> {
    if value < min || value > max {
        return Err(TenantSpecError::OutOfRange {
            field,
            value: value.into(),
            min: min.into(),
            max: max.into(),
        });
    }
    Ok(())
}

impl TenantSpec {
    /// Parses a TOML document and validates it.
    pub fn from_toml(text: &str) -> Result<TenantSpec, TenantSpecError> {
        let spec: TenantSpec =
            toml::from_str(text).map_err(|e| TenantSpecError::Toml(e.message().to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), TenantSpecError> {
        range("vcpus", self.vcpus, 1, MAX_VCPUS)?;
        range(
            "memory_mib",
            self.memory_mib,
            MIN_MEMORY_MIB,
            MAX_MEMORY_MIB,
        )?;
        range("disk_gib", self.disk_gib, 0, MAX_DISK_GIB)?;
        if self.gpu.wants_gpu() {
            self.gpu
                .validate()
                .map_err(|e| TenantSpecError::Gpu(e.to_string()))?;
        }
        if self.vgpu_licence.is_some() && !self.gpu.wants_gpu() {
            return Err(TenantSpecError::LicenceWithoutGpu);
        }
        let image = &self.image;
        match (&image.name, &image.kernel) {
            (Some(name), None) => validate_image_name(name)?,
            (None, Some(kernel)) => validate_host_path("image.kernel", kernel)?,
            _ => return Err(TenantSpecError::ImageChoice),
        }
        if let Some(initramfs) = &image.initramfs {
            validate_host_path("image.initramfs", initramfs)?;
        }
        if let Some(cmdline) = &image.cmdline {
            if cmdline.len() > MAX_CMDLINE_LEN || cmdline.chars().any(|c| c.is_control()) {
                return Err(TenantSpecError::BadCmdline);
            }
        }
        if let Some(HugePagesSetting::Pages(pages)) = self.hugepages {
            if pages.pages_for(self.memory_mib.into()).is_none() {
                return Err(TenantSpecError::HugePages {
                    memory_mib: self.memory_mib,
                    pages,
                });
            }
        }
        let q = &self.quotas;
        range("quotas.requests_per_s", q.requests_per_s, 1, 1_000_000)?;
        range("quotas.max_concurrency", q.max_concurrency, 1, 65_536)?;
        range("quotas.disk_iops", q.disk_iops, 1, 10_000_000)?;
        range("quotas.disk_mib_per_s", q.disk_mib_per_s, 1, 1_000_000)?;
        range(
            "quotas.max_request_bytes",
            q.max_request_bytes,
            1024,
            MAX_REQUEST_BYTES_LIMIT,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugepages_take_a_size_or_off_and_whole_pages_of_memory() {
        let with = |h: &str, mib: u32| {
            TenantSpec::from_toml(&format!(
                "name = \"h\"\nmemory_mib = {mib}\nhugepages = \"{h}\"\n[image]\nname = \"hello\"\n"
            ))
        };
        let two = with("2M", 256).unwrap();
        assert_eq!(
            two.hugepages,
            Some(HugePagesSetting::Pages(HugePages::Size2M))
        );
        assert_eq!(
            with("off", 256).unwrap().hugepages,
            Some(HugePagesSetting::Off)
        );
        assert_eq!(
            with("1G", 2048).unwrap().hugepages,
            Some(HugePagesSetting::Pages(HugePages::Size1G))
        );
        let err = with("1G", 1536).unwrap_err().to_string();
        assert!(err.contains("whole number of 1G huge pages"), "{err}");
        let err = with("4K", 256).unwrap_err().to_string();
        assert!(err.contains("2M, 1G, off"), "{err}");
        // Written back as it was given; absent stays absent.
        let json = serde_json::to_string(&two).unwrap();
        assert!(json.contains("\"hugepages\":\"2M\""), "{json}");
        let plain = TenantSpec::from_toml("name = \"p\"\n[image]\nname = \"hello\"\n").unwrap();
        assert_eq!(plain.hugepages, None);
        assert!(!serde_json::to_string(&plain).unwrap().contains("hugepages"));
    }

    const GOOD: &str = r#"
name = "alice"
vcpus = 2
memory_mib = 256
disk_gib = 10
gpu = { kind = "mig", profile = "1g.10gb" }
[image]
kernel = "/boot/vmlinux"
cmdline = "console=ttyS0"
[quotas]
requests_per_s = 5
"#;

    #[test]
    fn parses_a_complete_spec() {
        let spec = TenantSpec::from_toml(GOOD).unwrap();
        assert_eq!(spec.name, "alice");
        assert_eq!(spec.vcpus, 2);
        assert_eq!(
            spec.gpu,
            GpuRequest {
                profile: Some("1g.10gb".into()),
                ..Default::default()
            }
        );
        assert_eq!(spec.quotas.requests_per_s, 5);
        assert_eq!(spec.quotas.max_concurrency, 4);
    }

    #[test]
    fn hostile_names_are_refused_when_the_spec_is_parsed() {
        let long = "a".repeat(64);
        // (as written in TOML, the name itself)
        let cases = [
            ("", ""),
            ("../x", "../x"),
            ("Alice", "Alice"),
            ("a_b", "a_b"),
            (long.as_str(), long.as_str()),
            ("ä", "ä"),
            ("a\\u0000b", "a\0b"),
            ("a\\nb", "a\nb"),
        ];
        for (toml_text, name) in cases {
            let text = GOOD.replace("name = \"alice\"", &format!("name = \"{toml_text}\""));
            let err = TenantSpec::from_toml(&text).unwrap_err();
            assert!(matches!(err, TenantSpecError::Toml(_)), "{name:?}: {err}");
            assert!(
                err.to_string().contains("Invalid tenant name"),
                "{name:?}: {err}"
            );
            let json = serde_json::json!({"name": name, "image": {"name": "x"}});
            assert!(
                serde_json::from_value::<TenantSpec>(json).is_err(),
                "{name:?}"
            );
        }
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let text = GOOD.replace("vcpus = 2", "vcpus = 2\ncolour = \"red\"");
        let err = TenantSpec::from_toml(&text).unwrap_err();
        assert!(err.to_string().contains("colour"), "{err}");
    }

    #[test]
    fn unknown_gpu_fields_are_rejected() {
        let text = GOOD.replace("profile = \"1g.10gb\"", "profile = \"1g.10gb\", count = 2");
        TenantSpec::from_toml(&text).unwrap_err();
    }

    #[test]
    fn out_of_range_numbers_are_rejected() {
        let text = GOOD.replace("vcpus = 2", "vcpus = 0");
        assert!(matches!(
            TenantSpec::from_toml(&text),
            Err(TenantSpecError::OutOfRange { field: "vcpus", .. })
        ));
        let text = GOOD.replace("memory_mib = 256", "memory_mib = 1");
        assert!(matches!(
            TenantSpec::from_toml(&text),
            Err(TenantSpecError::OutOfRange {
                field: "memory_mib",
                ..
            })
        ));
    }

    #[test]
    fn image_needs_exactly_one_source() {
        let text = GOOD.replace("kernel = \"/boot/vmlinux\"", "");
        assert_eq!(
            TenantSpec::from_toml(&text),
            Err(TenantSpecError::ImageChoice)
        );
        let text = GOOD.replace("[image]", "[image]\nname = \"hello\"");
        assert_eq!(
            TenantSpec::from_toml(&text),
            Err(TenantSpecError::ImageChoice)
        );
    }

    #[test]
    fn relative_or_dotted_paths_are_rejected() {
        let text = GOOD.replace("/boot/vmlinux", "boot/vmlinux");
        assert!(matches!(
            TenantSpec::from_toml(&text),
            Err(TenantSpecError::BadPath { .. })
        ));
        let text = GOOD.replace("/boot/vmlinux", "/boot/../etc/shadow");
        assert!(matches!(
            TenantSpec::from_toml(&text),
            Err(TenantSpecError::BadPath { .. })
        ));
    }

    #[test]
    fn image_names_are_checked() {
        let text = GOOD.replace("kernel = \"/boot/vmlinux\"", "name = \"../etc\"");
        assert!(matches!(
            TenantSpec::from_toml(&text),
            Err(TenantSpecError::InvalidImageName(_))
        ));
    }

    #[test]
    fn control_characters_in_cmdline_are_rejected() {
        let text = GOOD.replace("console=ttyS0", "console=ttyS0\\n");
        assert_eq!(
            TenantSpec::from_toml(&text),
            Err(TenantSpecError::BadCmdline)
        );
    }

    #[test]
    fn malformed_toml_says_so() {
        let err = TenantSpec::from_toml("name = ").unwrap_err();
        assert!(matches!(err, TenantSpecError::Toml(_)));
    }

    #[test]
    fn defaults_fill_missing_fields() {
        let spec = TenantSpec::from_toml("name = \"b\"\n[image]\nname = \"hello\"\n").unwrap();
        assert_eq!(spec.vcpus, 1);
        assert_eq!(spec.memory_mib, 128);
        assert!(!spec.gpu.wants_gpu());
        assert_eq!(spec.quotas, Quotas::default());
    }
}
