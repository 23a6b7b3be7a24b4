//! Sizing arithmetic: how much GPU memory one tenant's inference server needs.
//!
//! need = weights + KV cache + runtime overhead, where
//! weights = parameters × bytes per parameter, and
//! KV cache = 2 × layers × kv_heads × head_dim × bytes per element × context × sequences.
//! docs/sizing.md walks through worked examples.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Bytes in one GiB.
pub const GIB: u64 = 1 << 30;

/// Errors of the sizing arithmetic.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum SizingError {
    /// A model preset the planner does not know.
    #[error("Unknown model preset `{0}`: use one of {1}, or give custom parameters")]
    UnknownPreset(String, String),
    /// A field that must be positive was zero.
    #[error("Model field `{0}` must be greater than zero")]
    Zero(&'static str),
    /// The arithmetic overflowed 64 bits: the input is absurd.
    #[error(
        "Memory need overflows 64 bits: check context ({context}) and concurrency ({concurrency})"
    )]
    Overflow {
        /// Context length asked for.
        context: u64,
        /// Concurrent sequences asked for.
        concurrency: u64,
    },
}

/// Data type of the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    /// bfloat16: 2 bytes per parameter.
    Bf16,
    /// 8-bit floating point: 1 byte per parameter.
    Fp8,
    /// 4-bit integer: half a byte per parameter.
    Int4,
}

impl WeightDtype {
    /// Bytes for `params` parameters.
    pub fn bytes_for(self, params: u64) -> u64 {
        match self {
            WeightDtype::Bf16 => params.saturating_mul(2),
            WeightDtype::Fp8 => params,
            WeightDtype::Int4 => params.div_ceil(2),
        }
    }
}

/// Data type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// 16-bit (fp16 or bf16): 2 bytes per element.
    Fp16,
    /// 8-bit floating point: 1 byte per element.
    Fp8,
}

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            KvDtype::Fp16 => 2,
            KvDtype::Fp8 => 1,
        }
    }
}

/// The architecture figures sizing needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// Parameters (e.g. 8_030_000_000).
    pub params: u64,
    /// Transformer layers.
    pub layers: u64,
    /// Key/value heads (grouped-query attention: fewer than query heads).
    pub kv_heads: u64,
    /// Dimension of one head.
    pub head_dim: u64,
}

/// The model presets: (name, shape). Parameters from the model cards.
pub static PRESETS: &[(&str, ModelShape)] = &[
    (
        "llama-3-8b",
        ModelShape {
            params: 8_030_000_000,
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
        },
    ),
    (
        "llama-3-70b",
        ModelShape {
            params: 70_600_000_000,
            layers: 80,
            kv_heads: 8,
            head_dim: 128,
        },
    ),
    (
        "mistral-7b",
        ModelShape {
            params: 7_240_000_000,
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
        },
    ),
    (
        "qwen2.5-32b",
        ModelShape {
            params: 32_500_000_000,
            layers: 64,
            kv_heads: 8,
            head_dim: 128,
        },
    ),
];

/// Looks a preset up by name, case-insensitively (`Llama-3-8B`).
pub fn preset(name: &str) -> Result<ModelShape, SizingError> {
    let norm = name.trim().to_ascii_lowercase();
    PRESETS
        .iter()
        .find(|(n, _)| *n == norm)
        .map(|(_, s)| *s)
        .ok_or_else(|| {
            SizingError::UnknownPreset(
                name.to_string(),
                PRESETS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", "),
            )
        })
}

/// Runtime overhead (CUDA context, activations, CUDA graphs) when the tenant gives none:
/// 512 MiB plus 64 MiB per billion parameters (rounded to the nearest billion), i.e. 1 GiB
/// for an 8B model and 4.9 GiB for a 70B one.
pub fn default_overhead(params: u64) -> u64 {
    let billions = params.saturating_add(500_000_000) / 1_000_000_000;
    512 * 1024 * 1024 + billions.saturating_mul(64 * 1024 * 1024)
}

/// One tenant's memory need, broken down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Need {
    /// Bytes of weights.
    pub weights: u64,
    /// Bytes of KV cache per token (all layers, keys and values).
    pub kv_per_token: u64,
    /// Bytes of KV cache for context × concurrent sequences.
    pub kv_cache: u64,
    /// Bytes of runtime overhead.
    pub overhead: u64,
    /// The sum.
    pub total: u64,
}

/// Computes the need of `shape` served with the given data types, context length and
/// concurrent sequences; `overhead` overrides [`default_overhead`].
pub fn need(
    shape: &ModelShape,
    weights: WeightDtype,
    kv: KvDtype,
    context: u64,
    concurrency: u64,
    overhead: Option<u64>,
) -> Result<Need, SizingError> {
    for (name, v) in [
        ("params", shape.params),
        ("layers", shape.layers),
        ("kv_heads", shape.kv_heads),
        ("head_dim", shape.head_dim),
        ("context", context),
        ("concurrency", concurrency),
    ] {
        if v == 0 {
            return Err(SizingError::Zero(name));
        }
    }
    let overflow = SizingError::Overflow {
        context,
        concurrency,
    };
    let kv_per_token = 2u64
        .checked_mul(shape.layers)
        .and_then(|v| v.checked_mul(shape.kv_heads))
        .and_then(|v| v.checked_mul(shape.head_dim))
        .and_then(|v| v.checked_mul(kv.bytes()))
        .ok_or(overflow.clone())?;
    let kv_cache = kv_per_token
        .checked_mul(context)
        .and_then(|v| v.checked_mul(concurrency))
        .ok_or(overflow.clone())?;
    let weights = weights.bytes_for(shape.params);
    let overhead = overhead.unwrap_or_else(|| default_overhead(shape.params));
    let total = weights
        .checked_add(kv_cache)
        .and_then(|v| v.checked_add(overhead))
        .ok_or(overflow)?;
    Ok(Need {
        weights,
        kv_per_token,
        kv_cache,
        overhead,
        total,
    })
}

/// Formats bytes as GiB with two decimals.
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / GIB as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_3_8b_kv_per_token_matches_the_reference_table() {
        let n = need(
            &preset("Llama-3-8B").unwrap(),
            WeightDtype::Bf16,
            KvDtype::Fp16,
            1,
            1,
            None,
        )
        .unwrap();
        assert_eq!(n.kv_per_token, 131_072);
        // ≈ 15.0 GiB of bf16 weights.
        assert_eq!(format!("{:.1}", n.weights as f64 / GIB as f64), "15.0");
        assert_eq!(n.overhead, GIB, "about 1 GiB for an 8B model");
    }

    #[test]
    fn presets_match_the_reference_kv_and_weight_figures() {
        for (name, kv, w) in [
            ("llama-3-70b", 327_680, "131.5"),
            ("mistral-7b", 131_072, "13.5"),
            ("qwen2.5-32b", 262_144, "60.5"),
        ] {
            let n = need(
                &preset(name).unwrap(),
                WeightDtype::Bf16,
                KvDtype::Fp16,
                1,
                1,
                None,
            )
            .unwrap();
            assert_eq!(n.kv_per_token, kv, "{name}");
            assert_eq!(format!("{:.1}", n.weights as f64 / GIB as f64), w, "{name}");
        }
    }

    #[test]
    fn kv_cache_scales_with_context_sequences_and_dtype() {
        let s = preset("llama-3-8b").unwrap();
        let n = need(&s, WeightDtype::Fp8, KvDtype::Fp8, 8192, 4, Some(0)).unwrap();
        assert_eq!(n.kv_per_token, 65_536);
        assert_eq!(n.kv_cache, 65_536 * 8192 * 4);
        assert_eq!(n.weights, 8_030_000_000);
        assert_eq!(n.total, n.weights + n.kv_cache);
        let int4 = need(&s, WeightDtype::Int4, KvDtype::Fp8, 1, 1, Some(0)).unwrap();
        assert_eq!(int4.weights, 4_015_000_000);
    }

    #[test]
    fn zero_and_overflowing_inputs_are_refused() {
        let s = preset("mistral-7b").unwrap();
        assert_eq!(
            need(&s, WeightDtype::Bf16, KvDtype::Fp16, 0, 1, None),
            Err(SizingError::Zero("context"))
        );
        assert!(matches!(
            need(
                &s,
                WeightDtype::Bf16,
                KvDtype::Fp16,
                u64::MAX / 2,
                1 << 20,
                None
            ),
            Err(SizingError::Overflow { .. })
        ));
        assert!(preset("gpt-5")
            .unwrap_err()
            .to_string()
            .contains("llama-3-8b"));
    }
}
