//! OpenAPI schemas of the spec's nested tables, whose types belong to the host (the planner's
//! `GpuRequest`, the daemon's `GuestImage` and `Quotas`) and so carry no schema of their own.
//! Written here by hand, structural as Kubernetes requires (every property typed), and held
//! to the types by the tests below: every field a type writes is in its schema and every
//! enum value of the schema reads back.

use schemars::{json_schema, Schema, SchemaGenerator};

/// `spec.gpu`: [`tenantvm_gpu::plan::GpuRequest`].
pub fn gpu_request(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "description": "The planner's request (docs/gpu.md): a model preset or custom shape sized with dtype, kv_dtype, context, concurrency and overhead_gib; or an explicit MIG profile; or whole_gpu. Empty: no GPU.",
        "properties": {
            "model": { "type": "string", "description": "Model preset (llama-3-8b, llama-3-70b, mistral-7b, qwen2.5-32b)" },
            "custom": {
                "type": "object",
                "description": "A model's figures instead of a preset",
                "required": ["params", "layers", "kv_heads", "head_dim"],
                "properties": {
                    "params": { "type": "integer", "minimum": 0 },
                    "layers": { "type": "integer", "minimum": 0 },
                    "kv_heads": { "type": "integer", "minimum": 0 },
                    "head_dim": { "type": "integer", "minimum": 0 }
                }
            },
            "dtype": { "type": "string", "enum": ["bf16", "fp8", "int4"] },
            "kv_dtype": { "type": "string", "enum": ["fp16", "fp8"] },
            "context": { "type": "integer", "minimum": 1 },
            "concurrency": { "type": "integer", "minimum": 1 },
            "overhead_gib": { "type": "number", "minimum": 0, "maximum": 1024 },
            "profile": { "type": "string", "description": "A MIG profile, e.g. 3g.40gb" },
            "whole_gpu": { "type": "boolean" }
        }
    })
}

/// `spec.image`: [`tenantvm::domain::spec::GuestImage`].
pub fn guest_image(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "description": "What the guest boots: `name` (a named image of the host's image directory) or `kernel` (an absolute host path under it), not both.",
        "properties": {
            "name": { "type": "string", "pattern": "^[a-z0-9][a-z0-9_-]{0,62}$" },
            "kernel": { "type": "string", "pattern": "^/" },
            "initramfs": { "type": "string", "pattern": "^/" },
            "cmdline": { "type": "string", "maxLength": 2048 }
        }
    })
}

/// `spec.quotas`: [`tenantvm::domain::spec::Quotas`].
pub fn quotas(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "description": "Per-tenant limits (docs/orchestrator.md, Tenant spec).",
        "properties": {
            "requests_per_s": { "type": "integer", "minimum": 1, "maximum": 1000000 },
            "max_concurrency": { "type": "integer", "minimum": 1, "maximum": 65536 },
            "disk_iops": { "type": "integer", "minimum": 1, "maximum": 10000000 },
            "disk_mib_per_s": { "type": "integer", "minimum": 1, "maximum": 1000000 },
            "max_request_bytes": { "type": "integer", "minimum": 1024, "maximum": tenantvm::domain::spec::MAX_REQUEST_BYTES_LIMIT }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;
    use std::collections::BTreeSet;
    use tenantvm::domain::spec::{GpuRequest, GuestImage, Quotas};
    use tenantvm_gpu::plan::request::OverheadGib;
    use tenantvm_gpu::plan::sizing::{KvDtype, ModelShape, WeightDtype};

    fn properties(schema: &Schema) -> BTreeSet<String> {
        schema
            .get("properties")
            .and_then(Value::as_object)
            .unwrap()
            .keys()
            .cloned()
            .collect()
    }

    fn keys(v: &impl serde::Serialize) -> BTreeSet<String> {
        serde_json::to_value(v)
            .unwrap()
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect()
    }

    fn enum_values(schema: &Schema, field: &str) -> Vec<String> {
        schema.get("properties").unwrap()[field]["enum"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn every_field_the_host_types_write_is_in_their_schema() {
        let mut g = SchemaGenerator::default();
        let full_gpu = GpuRequest {
            model: Some("m".into()),
            custom: Some(ModelShape {
                params: 1,
                layers: 1,
                kv_heads: 1,
                head_dim: 1,
            }),
            dtype: Some(WeightDtype::Fp8),
            kv_dtype: Some(KvDtype::Fp8),
            context: Some(1),
            concurrency: Some(1),
            overhead_gib: Some(OverheadGib(1.0)),
            profile: Some("p".into()),
            whole_gpu: true,
        };
        assert_eq!(keys(&full_gpu), properties(&gpu_request(&mut g)));
        let full_image = GuestImage {
            name: Some("n".into()),
            kernel: Some("/k".into()),
            initramfs: Some("/i".into()),
            cmdline: Some("c".into()),
        };
        assert_eq!(keys(&full_image), properties(&guest_image(&mut g)));
        assert_eq!(keys(&Quotas::default()), properties(&quotas(&mut g)));
        // A control: a field the schema lacks is seen.
        let mut less = properties(&quotas(&mut g));
        less.remove("disk_iops");
        assert_ne!(keys(&Quotas::default()), less);
    }

    fn text<T: serde::Serialize>(v: &T) -> String {
        serde_json::to_value(v)
            .unwrap()
            .as_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn the_enums_are_the_types_own_values() {
        use clap::ValueEnum;
        let mut g = SchemaGenerator::default();
        let s = gpu_request(&mut g);
        let dtypes: Vec<String> = WeightDtype::value_variants().iter().map(text).collect();
        assert_eq!(dtypes, enum_values(&s, "dtype"));
        let kv: Vec<String> = KvDtype::value_variants().iter().map(text).collect();
        assert_eq!(kv, enum_values(&s, "kv_dtype"));
    }
}
