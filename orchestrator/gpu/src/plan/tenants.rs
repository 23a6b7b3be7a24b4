//! The tenants file: who needs what. TOML (`[[tenants]]` tables) or JSON (`{"tenants": [...]}`).
//!
//! ```toml
//! [[tenants]]
//! name = "acme"
//! model = "llama-3-8b"      # a preset, or `custom = { params, layers, kv_heads, head_dim }`
//! dtype = "fp8"             # bf16 (default), fp8, int4
//! kv_dtype = "fp16"         # fp16 (default), fp8
//! context = 8192
//! concurrency = 4
//! # profile = "3g.40gb"     # or an explicit MIG profile
//! # whole_gpu = true        # or a whole GPU
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::request::{GpuRequest, GpuRequestError};
use super::search::Demand;
use super::sizing::{ModelShape, Need, SizingError};

pub use super::request::DEFAULT_CONTEXT;

/// Errors reading a tenants file.
#[derive(Debug, Error)]
pub enum TenantsFileError {
    /// The file could not be read.
    #[error("Cannot read tenants file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// TOML syntax or schema error.
    #[error("Tenants file {path} is not valid TOML for tenantvm: {message}")]
    Toml {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
    /// JSON syntax or schema error.
    #[error("Tenants file {path} is not valid JSON for tenantvm: {source}")]
    Json {
        /// The file.
        path: String,
        /// The cause.
        source: serde_json::Error,
    },
    /// A tenant entry that makes no sense.
    #[error("Tenant `{tenant}`: {reason}")]
    Invalid {
        /// Tenant name.
        tenant: String,
        /// What is wrong and what to do.
        reason: String,
    },
    /// The sizing arithmetic refused the entry.
    #[error("Tenant `{tenant}`: {source}")]
    Sizing {
        /// Tenant name.
        tenant: String,
        /// The cause.
        source: SizingError,
    },
}

impl TenantsFileError {
    /// A request error of tenant `tenant`.
    pub fn of(tenant: &str, e: GpuRequestError) -> Self {
        match e {
            GpuRequestError::Invalid(reason) => TenantsFileError::Invalid {
                tenant: tenant.to_string(),
                reason,
            },
            GpuRequestError::Sizing(source) => TenantsFileError::Sizing {
                tenant: tenant.to_string(),
                source,
            },
        }
    }
}

/// A tenants file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantsFile {
    /// The tenants, in priority order.
    pub tenants: Vec<TenantSpec>,
}

/// One tenant's entry: its name and its [`GpuRequest`], flat in the entry (the same fields a
/// tenant spec's `gpu = { ... }` table takes, checked as strictly).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawEntry")]
pub struct TenantSpec {
    /// Unique name: letters, digits, `-`, `_`, `.`; at most 64 characters.
    pub name: String,
    /// What it asks for.
    #[serde(flatten)]
    pub request: GpuRequest,
}

/// An entry as written: the name, and the rest, which must be a [`GpuRequest`]. (Serde's
/// `flatten` cannot refuse unknown fields; reading the rest as its own table can.)
#[derive(Deserialize)]
struct RawEntry {
    name: String,
    #[serde(flatten)]
    rest: serde_json::Map<String, serde_json::Value>,
}

impl TryFrom<RawEntry> for TenantSpec {
    type Error = String;

    fn try_from(raw: RawEntry) -> Result<Self, String> {
        let request = GpuRequest::deserialize(serde_json::Value::Object(raw.rest))
            .map_err(|e| format!("tenant `{}`: {e}", raw.name))?;
        Ok(TenantSpec {
            name: raw.name,
            request,
        })
    }
}

impl TenantSpec {
    /// A tenant with a request.
    pub fn new(name: impl Into<String>, request: GpuRequest) -> Self {
        TenantSpec {
            name: name.into(),
            request,
        }
    }
}

impl TenantsFile {
    /// Reads a `.json` file as JSON and anything else as TOML, then validates it.
    pub fn load(path: &Path) -> Result<Self, TenantsFileError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TenantsFileError::Read {
            path: shown.clone(),
            source,
        })?;
        let file: TenantsFile = if path.extension().is_some_and(|e| e == "json") {
            serde_json::from_str(&text).map_err(|source| TenantsFileError::Json {
                path: shown,
                source,
            })?
        } else {
            toml::from_str(&text).map_err(|e| TenantsFileError::Toml {
                path: shown,
                message: e.message().to_string(),
            })?
        };
        file.validate()?;
        Ok(file)
    }

    /// Checks names (non-empty, allowed characters, unique) and each entry.
    pub fn validate(&self) -> Result<(), TenantsFileError> {
        let mut seen = std::collections::HashSet::new();
        for t in &self.tenants {
            let bad = |reason: &str| TenantsFileError::Invalid {
                tenant: t.name.clone(),
                reason: reason.into(),
            };
            if t.name.is_empty()
                || t.name.len() > 64
                || !t
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            {
                return Err(bad("name must be 1-64 letters, digits, `-`, `_` or `.`"));
            }
            if !seen.insert(t.name.as_str()) {
                return Err(bad("name appears twice: give each tenant its own name"));
            }
            t.need()?;
            t.demand()?;
        }
        Ok(())
    }
}

impl TenantSpec {
    /// The model shape, if the tenant names one.
    pub fn shape(&self) -> Result<Option<ModelShape>, TenantsFileError> {
        self.request
            .shape()
            .map_err(|e| TenantsFileError::of(&self.name, e))
    }

    /// The memory need, if the tenant names a model.
    pub fn need(&self) -> Result<Option<Need>, TenantsFileError> {
        self.request
            .need()
            .map_err(|e| TenantsFileError::of(&self.name, e))
    }

    /// What the tenant asks the placement search for.
    pub fn demand(&self) -> Result<Demand, TenantsFileError> {
        self.request
            .demand()
            .map_err(|e| TenantsFileError::of(&self.name, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::sizing::GIB;

    fn parse(toml_text: &str) -> Result<TenantsFile, TenantsFileError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.toml");
        std::fs::write(&p, toml_text).unwrap();
        TenantsFile::load(&p)
    }

    #[test]
    fn toml_and_json_files_load_the_same_tenants() {
        let t =
            parse("[[tenants]]\nname = \"a\"\nmodel = \"llama-3-8b\"\ncontext = 8192\n").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.json");
        std::fs::write(
            &p,
            r#"{"tenants":[{"name":"a","model":"llama-3-8b","context":8192}]}"#,
        )
        .unwrap();
        assert_eq!(TenantsFile::load(&p).unwrap(), t);
        assert!(matches!(t.tenants[0].demand().unwrap(), Demand::Memory(_)));
    }

    #[test]
    fn unknown_fields_and_bad_entries_are_refused_with_the_fix() {
        let e = parse("[[tenants]]\nname = \"a\"\nmodle = \"x\"\n").unwrap_err();
        assert!(e.to_string().contains("unknown field"), "{e}");
        let e = parse("[[tenants]]\nname = \"a\"\n").unwrap_err();
        assert!(e.to_string().contains("say what it needs"), "{e}");
        let e = parse("[[tenants]]\nname = \"a b\"\nwhole_gpu = true\n").unwrap_err();
        assert!(e.to_string().contains("letters"), "{e}");
        let e = parse("[[tenants]]\nname = \"a\"\nwhole_gpu = true\n[[tenants]]\nname = \"a\"\nwhole_gpu = true\n")
            .unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        let e = parse("[[tenants]]\nname = \"a\"\nmodel = \"gpt-9\"\n").unwrap_err();
        assert!(e.to_string().contains("llama-3-8b"), "{e}");
        let e =
            parse("[[tenants]]\nname = \"a\"\nmodel = \"mistral-7b\"\ncontext = 0\n").unwrap_err();
        assert!(e.to_string().contains("context"), "{e}");
        let e = parse("[[tenants]]\nname = \"a\"\nprofile = \"1g.10gb\"\nwhole_gpu = true\n")
            .unwrap_err();
        assert!(e.to_string().contains("not both"), "{e}");
        let e = parse("[[tenants]]\nname = \"a\"\nmodel = \"mistral-7b\"\noverhead_gib = -1.0\n")
            .unwrap_err();
        assert!(e.to_string().contains("overhead_gib"), "{e}");
        parse("not toml [").unwrap_err();
    }

    #[test]
    fn custom_models_and_explicit_shares() {
        let t = parse(
            "[[tenants]]\nname = \"c\"\ncustom = { params = 1000000000, layers = 16, kv_heads = 4, head_dim = 64 }\n\
             dtype = \"int4\"\nkv_dtype = \"fp8\"\noverhead_gib = 0.5\n\
             [[tenants]]\nname = \"p\"\nprofile = \"2g.20gb\"\n",
        )
        .unwrap();
        let n = t.tenants[0].need().unwrap().unwrap();
        assert_eq!(n.weights, 500_000_000);
        assert_eq!(t.tenants[0].request.custom.unwrap().layers, 16);
        assert_eq!(n.kv_per_token, 2 * 16 * 4 * 64);
        assert_eq!(n.overhead, GIB / 2);
        assert_eq!(
            t.tenants[1].demand().unwrap(),
            Demand::Profile("2g.20gb".into())
        );
    }
}
