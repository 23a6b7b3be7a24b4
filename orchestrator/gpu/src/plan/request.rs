//! A tenant's GPU request: one type for both places a request is written, an entry of the
//! `tenantvm plan` tenants file and the `gpu = { ... }` table of a tenant spec, so both size
//! and place a tenant the same way.
//!
//! ```toml
//! gpu = { model = "llama-3-8b", dtype = "fp8", kv_dtype = "fp16", context = 8192, concurrency = 4 }
//! gpu = { custom = { params = 1_500_000_000, layers = 28, kv_heads = 2, head_dim = 128 } }
//! gpu = { profile = "3g.40gb" }      # an explicit MIG profile
//! gpu = { whole_gpu = true }         # a whole GPU (with `model`: one that holds it)
//! ```
//! Left out (or empty): no GPU.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::search::Demand;
use super::sizing::{self, KvDtype, ModelShape, Need, SizingError, WeightDtype, GIB};

/// Default context length.
pub const DEFAULT_CONTEXT: u64 = 4096;

/// Why a request is unusable.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum GpuRequestError {
    /// The fields contradict each other or are out of range.
    #[error("{0}")]
    Invalid(String),
    /// The sizing arithmetic refused the model.
    #[error(transparent)]
    Sizing(#[from] SizingError),
}

/// A runtime overhead in GiB (finite, 0 to 1024 once checked). Compared by value, so a
/// request can be `Eq`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OverheadGib(pub f64);

impl PartialEq for OverheadGib {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Eq for OverheadGib {}

/// What a tenant asks of the GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuRequest {
    /// A model preset (`llama-3-8b`, `llama-3-70b`, `mistral-7b`, `qwen2.5-32b`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Custom model figures instead of a preset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom: Option<ModelShape>,
    /// Weight data type (default bf16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<WeightDtype>,
    /// KV-cache data type (default fp16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_dtype: Option<KvDtype>,
    /// Context length in tokens (default 4096).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<u64>,
    /// Concurrent sequences (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u64>,
    /// Runtime overhead in GiB instead of the default estimate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overhead_gib: Option<OverheadGib>,
    /// An explicit MIG profile name (e.g. `3g.40gb`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// A whole GPU.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub whole_gpu: bool,
}

fn invalid(reason: &str) -> GpuRequestError {
    GpuRequestError::Invalid(reason.into())
}

impl GpuRequest {
    /// Whether anything is asked for (an empty request means no GPU).
    pub fn wants_gpu(&self) -> bool {
        *self != GpuRequest::default()
    }

    /// The model shape, if the request names one.
    pub fn shape(&self) -> Result<Option<ModelShape>, GpuRequestError> {
        match (&self.model, &self.custom) {
            (Some(_), Some(_)) => Err(invalid("give either `model` or `custom`, not both")),
            (Some(m), None) => Ok(Some(sizing::preset(m)?)),
            (None, Some(c)) => Ok(Some(*c)),
            (None, None) => {
                let sizing_fields = self.dtype.is_some()
                    || self.kv_dtype.is_some()
                    || self.context.is_some()
                    || self.concurrency.is_some()
                    || self.overhead_gib.is_some();
                if sizing_fields {
                    return Err(invalid(
                        "dtype, kv_dtype, context, concurrency and overhead_gib size a model: give `model` or `custom` too",
                    ));
                }
                Ok(None)
            }
        }
    }

    /// The memory need, if the request names a model.
    pub fn need(&self) -> Result<Option<Need>, GpuRequestError> {
        let Some(shape) = self.shape()? else {
            return Ok(None);
        };
        let overhead = match self.overhead_gib {
            None => None,
            Some(OverheadGib(g)) if g.is_finite() && (0.0..=1024.0).contains(&g) => {
                Some((g * GIB as f64) as u64)
            }
            Some(_) => return Err(invalid("overhead_gib must be between 0 and 1024")),
        };
        Ok(Some(sizing::need(
            &shape,
            self.dtype.unwrap_or(WeightDtype::Bf16),
            self.kv_dtype.unwrap_or(KvDtype::Fp16),
            self.context.unwrap_or(DEFAULT_CONTEXT),
            self.concurrency.unwrap_or(1),
            overhead,
        )?))
    }

    /// What the request asks the placement search for.
    pub fn demand(&self) -> Result<Demand, GpuRequestError> {
        let need = self.need()?.map(|n| n.total);
        match (&self.profile, self.whole_gpu, need) {
            (Some(_), true, _) => Err(invalid("give either `profile` or `whole_gpu`, not both")),
            (Some(p), false, _) if p.trim().is_empty() => Err(invalid(
                "`profile` must name a MIG profile, e.g. \"3g.40gb\"",
            )),
            (Some(p), false, _) => Ok(Demand::Profile(p.trim().to_string())),
            (None, true, n) => Ok(Demand::WholeGpu(n.unwrap_or(0))),
            (None, false, Some(n)) => Ok(Demand::Memory(n)),
            (None, false, None) => Err(invalid(
                "say what it needs: `model` or `custom` (sized), `profile`, or `whole_gpu = true`",
            )),
        }
    }

    /// Checks the request: sizes it and derives its demand.
    pub fn validate(&self) -> Result<(), GpuRequestError> {
        self.need()?;
        self.demand()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Spec {
        #[serde(default)]
        gpu: GpuRequest,
    }

    fn spec(toml_text: &str) -> Result<GpuRequest, String> {
        toml::from_str::<Spec>(toml_text)
            .map(|s| s.gpu)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_spec_table_takes_the_tenants_file_fields() {
        let r = spec(
            "gpu = { model = \"llama-3-8b\", dtype = \"fp8\", kv_dtype = \"fp8\", context = 8192, concurrency = 4 }",
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("llama-3-8b"));
        assert!(matches!(r.demand().unwrap(), Demand::Memory(_)));
        let n = r.need().unwrap().unwrap();
        assert_eq!(n.kv_per_token, 2 * 32 * 8 * 128);
        assert!(!spec("").unwrap().wants_gpu(), "absent: no GPU");
        assert!(spec("gpu = { whole_gpu = true }").unwrap().wants_gpu());
        let e = spec("gpu = { kind = \"mig\" }").unwrap_err();
        assert!(e.contains("unknown field"), "{e}");
    }

    #[test]
    fn contradictions_and_bad_values_are_refused_with_the_fix() {
        let e = spec("gpu = { profile = \"1g.10gb\", whole_gpu = true }")
            .unwrap()
            .demand()
            .unwrap_err();
        assert!(e.to_string().contains("not both"), "{e}");
        let e = spec("gpu = { context = 8192 }")
            .unwrap()
            .need()
            .unwrap_err();
        assert!(e.to_string().contains("give `model`"), "{e}");
        let e = spec("gpu = { model = \"x\", overhead_gib = nan }")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("Unknown model preset"), "{e}");
        let e = spec("gpu = { model = \"mistral-7b\", overhead_gib = -1.0 }")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("overhead_gib"), "{e}");
        let e = spec("gpu = { profile = \" \" }")
            .unwrap()
            .demand()
            .unwrap_err();
        assert!(e.to_string().contains("MIG profile"), "{e}");
        let r = spec("gpu = { model = \"mistral-7b\", overhead_gib = 1 }").unwrap();
        assert_eq!(
            r.need().unwrap().unwrap().overhead,
            GIB,
            "an integer is a GiB count"
        );
        assert_eq!(r, r.clone());
    }
}
