//! The `gpu = { ... }` table of a tenant spec: the planner's own request type
//! ([`tenantvm_gpu::plan::GpuRequest`]), with the same fields, defaults and strictness as an
//! entry of a `tenantvm plan` tenants file, so `tenantvm plan` and `tenantvm create` size and
//! place a tenant the same way:
//!
//! ```toml
//! gpu = { model = "llama-3-8b", dtype = "fp8", context = 8192, concurrency = 4 }
//! gpu = { profile = "3g.40gb" }
//! gpu = { whole_gpu = true }
//! ```
//!
//! The first spec format (`kind = "none" | "whole" | "mig" | "model"`, with `profile` or
//! `preset`) is still read, so stored specs and existing files keep working: `whole` is
//! `whole_gpu = true`, `mig` is `profile`, and `model` is the preset sized as that format
//! sized it (context [`LEGACY_MODEL_CONTEXT`], [`LEGACY_MODEL_CONCURRENCY`] sequences).
//! Specs are written back in the planner's form.

use serde::{Deserialize, Deserializer};
use tenantvm_gpu::plan::request::OverheadGib;
use tenantvm_gpu::plan::sizing::{KvDtype, ModelShape, WeightDtype};

pub use tenantvm_gpu::plan::GpuRequest;

/// Context length the first spec format sized a `kind = "model"` request for.
pub const LEGACY_MODEL_CONTEXT: u64 = 8192;
/// Concurrent sequences the first spec format sized a `kind = "model"` request for.
pub const LEGACY_MODEL_CONCURRENCY: u64 = 4;

/// Every field either format may hold; unknown fields are refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Input {
    kind: Option<String>,
    preset: Option<String>,
    model: Option<String>,
    custom: Option<ModelShape>,
    dtype: Option<WeightDtype>,
    kv_dtype: Option<KvDtype>,
    context: Option<u64>,
    concurrency: Option<u64>,
    overhead_gib: Option<OverheadGib>,
    profile: Option<String>,
    whole_gpu: Option<bool>,
}

impl Input {
    fn into_request(self) -> Result<GpuRequest, String> {
        let Some(kind) = self.kind.as_deref() else {
            if self.preset.is_some() {
                return Err(
                    "`preset` belongs to the old `kind = \"model\"` form: write model = \"<preset>\""
                        .into(),
                );
            }
            return Ok(GpuRequest {
                model: self.model,
                custom: self.custom,
                dtype: self.dtype,
                kv_dtype: self.kv_dtype,
                context: self.context,
                concurrency: self.concurrency,
                overhead_gib: self.overhead_gib,
                profile: self.profile,
                whole_gpu: self.whole_gpu.unwrap_or(false),
            });
        };
        let new_fields = self.model.is_some()
            || self.custom.is_some()
            || self.dtype.is_some()
            || self.kv_dtype.is_some()
            || self.context.is_some()
            || self.concurrency.is_some()
            || self.overhead_gib.is_some()
            || self.whole_gpu.is_some();
        if new_fields {
            return Err(format!(
                "`kind` is the old form and cannot be mixed with model, custom, dtype, kv_dtype, context, concurrency, overhead_gib or whole_gpu: drop `kind = {kind:?}` and use the planner's fields"
            ));
        }
        let mut request = GpuRequest::default();
        match (kind, self.profile, self.preset) {
            ("none", None, None) => {}
            ("whole", None, None) => request.whole_gpu = true,
            ("mig", Some(profile), None) if !profile.trim().is_empty() => {
                request.profile = Some(profile);
            }
            ("mig", _, _) => {
                return Err("kind = \"mig\" needs profile = \"<MIG profile>\" (e.g. \"1g.10gb\") and nothing else".into())
            }
            ("model", None, Some(preset)) if !preset.trim().is_empty() => {
                request.model = Some(preset);
                request.context = Some(LEGACY_MODEL_CONTEXT);
                request.concurrency = Some(LEGACY_MODEL_CONCURRENCY);
            }
            ("model", _, _) => {
                return Err("kind = \"model\" needs preset = \"<model>\" (e.g. \"llama-3-8b\") and nothing else; or write model = \"llama-3-8b\"".into())
            }
            ("none" | "whole", _, _) => {
                return Err(format!("kind = {kind:?} takes no profile or preset"))
            }
            (other, _, _) => {
                return Err(format!(
                    "unknown GPU kind {other:?}: write model = \"...\", profile = \"...\" or whole_gpu = true"
                ))
            }
        }
        Ok(request)
    }
}

/// Reads a `gpu` table in either format (see the module docs).
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<GpuRequest, D::Error> {
    Input::deserialize(d)?
        .into_request()
        .map_err(serde::de::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Doc {
        #[serde(default, deserialize_with = "deserialize")]
        gpu: GpuRequest,
    }

    fn read(text: &str) -> Result<GpuRequest, String> {
        toml::from_str::<Doc>(text)
            .map(|d| d.gpu)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_planners_fields_and_the_old_form_both_read() {
        let r = read("gpu = { model = \"llama-3-8b\", dtype = \"fp8\", context = 8192 }").unwrap();
        assert_eq!(r.model.as_deref(), Some("llama-3-8b"));
        assert_eq!(r.context, Some(8192));
        assert!(!read("").unwrap().wants_gpu());
        assert!(!read("gpu = { kind = \"none\" }").unwrap().wants_gpu());
        assert!(read("gpu = { kind = \"whole\" }").unwrap().whole_gpu);
        assert_eq!(
            read("gpu = { kind = \"mig\", profile = \"1g.10gb\" }").unwrap(),
            GpuRequest {
                profile: Some("1g.10gb".into()),
                ..Default::default()
            }
        );
        let old = read("gpu = { kind = \"model\", preset = \"mistral-7b\" }").unwrap();
        assert_eq!(
            (old.model.as_deref(), old.context, old.concurrency),
            (Some("mistral-7b"), Some(8192), Some(4))
        );
        // Written back in the planner's form, which reads back the same.
        let json = serde_json::to_string(&old).unwrap();
        assert!(!json.contains("kind"), "{json}");
        let back: GpuRequest = deserialize(&mut serde_json::Deserializer::from_str(&json)).unwrap();
        assert_eq!(back, old);
    }

    #[test]
    fn mixed_or_malformed_requests_are_refused_with_the_fix() {
        for (text, says) in [
            ("gpu = { kind = \"mig\" }", "needs profile"),
            ("gpu = { kind = \"mig\", profile = \" \" }", "needs profile"),
            ("gpu = { kind = \"model\" }", "needs preset"),
            (
                "gpu = { kind = \"whole\", whole_gpu = true }",
                "cannot be mixed",
            ),
            (
                "gpu = { kind = \"none\", profile = \"1g.10gb\" }",
                "takes no",
            ),
            ("gpu = { kind = \"vgpu\" }", "unknown GPU kind"),
            ("gpu = { preset = \"llama-3-8b\" }", "model = "),
            ("gpu = { modle = \"llama-3-8b\" }", "unknown field"),
        ] {
            let e = read(text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
