//! How much of a GPU slice its tenant uses now: memory and utilisation, as a backend reads
//! them (NVML on a live host, the file of a SIMULATED host), with where they came from.

use serde::Serialize;

/// Where a [`SliceUsage`] was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UsageSource {
    /// The driver, through NVML.
    Nvml,
    /// A simulated host's file (`--gpu-backend sim:FILE`): figures for demos and tests,
    /// not measured on any GPU.
    Simulated,
}

impl UsageSource {
    /// The word for a metric label (`nvml`, `simulated`).
    pub const fn label(self) -> &'static str {
        match self {
            UsageSource::Nvml => "nvml",
            UsageSource::Simulated => "simulated",
        }
    }
}

/// Memory and utilisation of one slice (a whole GPU or one GPU instance).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SliceUsage {
    /// Memory in use, bytes.
    pub memory_used_bytes: u64,
    /// The slice's memory, bytes.
    pub memory_total_bytes: u64,
    /// Share of time the slice's engines were busy over the driver's last sample period, in
    /// percent; None where the backend cannot tell (NVML reports no utilisation for a MIG
    /// instance).
    pub utilization_percent: Option<u32>,
    /// Where the figures came from.
    pub source: UsageSource,
}
