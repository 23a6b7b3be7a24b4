//! GPU memory scrub for departure: zero every byte of device memory that can be allocated,
//! read it back, check it.
//!
//! The real scrub ([`scrub_gpu`]) drives the CUDA driver API, loaded from `libcuda.so.1` at run
//! time, on the released GPU or MIG instance: it allocates as much memory as the device will
//! give in chunks, zeroes it with `cuMemsetD8`, reads it back with `cuMemcpyDtoH` (all of it,
//! or sampled windows: the outcome says which), frees it and reports bytes scrubbed and
//! verified and the zeroing bandwidth. A MIG instance is addressed by running the scrub in a
//! child process whose `CUDA_VISIBLE_DEVICES` names the instance's UUID ([`scrub_in_child`]).
//!
//! The simulated GPU backend uses [`simulate_scrub`], whose outcome says `simulated` and never
//! `verified`.

mod cli;
mod cuda;
mod gpu;

use std::collections::BTreeMap;
use std::io;

use serde::{Deserialize, Serialize};

use crate::receipt::{Assurance, DepartureStep, StepRecord, StepResult};

pub use cli::{run_scrub, scrub_in_child, ScrubArgs};
pub use gpu::{scrub_gpu, DeviceSelector, ScrubOptions};

/// The library name the driver API is loaded from.
pub const CUDA_LIBRARY: &str = "libcuda.so.1";
/// The environment variable that names a GPU for the hardware test (an index or a UUID).
pub const TEST_GPU_ENV: &str = "TENANTVM_TEST_GPU";

/// Errors of the scrub.
#[derive(Debug, thiserror::Error)]
pub enum ScrubError {
    /// No usable NVIDIA driver library.
    #[error("Cannot load the CUDA driver library {library}: {reason}; install the NVIDIA driver (or use the simulated GPU backend)")]
    DriverMissing {
        /// The library asked for.
        library: String,
        /// The loader's message.
        reason: String,
    },
    /// The driver lacks an entry point (too old).
    #[error(
        "The CUDA driver has no {symbol} ({reason}); a driver for CUDA 11.4 or later is needed"
    )]
    DriverSymbol {
        /// The missing function.
        symbol: String,
        /// The loader's message.
        reason: String,
    },
    /// A driver call failed.
    #[error("CUDA call {call} failed with {name} ({code})")]
    Cuda {
        /// The function called.
        call: &'static str,
        /// The `CUresult`.
        code: i32,
        /// Its name.
        name: String,
    },
    /// No visible device matches the selector.
    #[error("No visible CUDA device matches {0}; check the UUID with nvidia-smi -L and CUDA_VISIBLE_DEVICES")]
    NoSuchDevice(String),
    /// The device would not give any memory to scrub.
    #[error("Could not allocate any memory on {0} to scrub; is another process still using it?")]
    NothingAllocated(String),
    /// The scrub child process could not be run or failed.
    #[error("The scrub process {program} failed: {reason}")]
    Child {
        /// The program.
        program: String,
        /// Exit status and stderr tail, or the spawn error.
        reason: String,
    },
    /// Writing the result failed.
    #[error("Cannot write the scrub result: {0}")]
    Output(#[from] io::Error),
    /// The result could not be (de)serialized.
    #[error("Scrub result JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// How the zeroed memory is read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum VerifyMode {
    /// Every byte is copied back to the host and checked.
    Full,
    /// The first and last 64 KiB of each chunk and 16 random 64 KiB windows are checked.
    Sampled,
}

/// What a scrub did and found; the evidence for the departure receipt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScrubOutcome {
    /// The device scrubbed (UUID, or the simulated slice's id).
    pub device: String,
    /// The device's name as the driver reports it.
    pub device_name: String,
    /// How it was done.
    pub method: String,
    /// `verified` (hardware, read back), `simulated`, or `unverified`.
    pub assurance: Assurance,
    /// Every allocated byte was zeroed and every byte read back was zero. For a simulated
    /// scrub: the simulated result (which proves nothing about hardware).
    pub passed: bool,
    /// Read-back mode.
    pub verify_mode: VerifyMode,
    /// The device's memory size.
    pub total_bytes: u64,
    /// Bytes allocated and zeroed.
    pub scrubbed_bytes: u64,
    /// Bytes read back and checked.
    pub verified_bytes: u64,
    /// Non-zero bytes found in the read-back.
    pub nonzero_bytes: u64,
    /// Where the first non-zero byte was, counted over the allocated chunks.
    pub first_nonzero_at: Option<u64>,
    /// Allocation chunks used.
    pub chunks: u64,
    /// Seconds spent zeroing (memset + synchronize).
    pub zero_seconds: f64,
    /// Seconds spent reading back and checking.
    pub verify_seconds: f64,
    /// Zeroing bandwidth in GB/s (10^9 bytes per second).
    pub zero_gbps: f64,
    /// The device's theoretical memory bandwidth in GB/s, from its clock and bus width.
    pub peak_gbps: Option<f64>,
    /// CUDA driver version (e.g. 12040), 0 when simulated.
    pub driver_version: i32,
}

impl ScrubOutcome {
    /// The fraction of the device's memory that was zeroed.
    pub fn coverage(&self) -> f64 {
        if self.total_bytes == 0 {
            0.0
        } else {
            self.scrubbed_bytes as f64 / self.total_bytes as f64
        }
    }

    /// The receipt's record of this scrub. A scrub that did not pass is a failed step (and its
    /// slice must stay quarantined until a later scrub passes).
    pub fn step_record(&self, started_at: String, finished_at: String) -> StepRecord {
        let error = (!self.passed).then(|| match self.assurance {
            Assurance::Simulated => "simulated scrub failure".to_string(),
            _ => format!(
                "{} non-zero bytes read back after zeroing (first at byte {})",
                self.nonzero_bytes,
                self.first_nonzero_at
                    .map_or_else(|| "-".to_string(), |o| o.to_string())
            ),
        });
        StepRecord {
            step: DepartureStep::GpuScrub,
            method: self.method.clone(),
            result: if self.passed {
                StepResult::Ok
            } else {
                StepResult::Failed
            },
            assurance: self.assurance,
            started_at,
            finished_at,
            evidence: self.evidence(),
            error,
        }
    }

    /// The outcome as receipt evidence (named strings).
    pub fn evidence(&self) -> BTreeMap<String, String> {
        let mut e = BTreeMap::new();
        e.insert("device".into(), self.device.clone());
        e.insert("device_name".into(), self.device_name.clone());
        e.insert("passed".into(), self.passed.to_string());
        e.insert(
            "verify_mode".into(),
            serde_json::to_value(self.verify_mode)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
        );
        e.insert("total_bytes".into(), self.total_bytes.to_string());
        e.insert("scrubbed_bytes".into(), self.scrubbed_bytes.to_string());
        e.insert("verified_bytes".into(), self.verified_bytes.to_string());
        e.insert("nonzero_bytes".into(), self.nonzero_bytes.to_string());
        e.insert("coverage".into(), format!("{:.4}", self.coverage()));
        e.insert("zero_gbps".into(), format!("{:.1}", self.zero_gbps));
        if let Some(peak) = self.peak_gbps {
            e.insert("peak_gbps".into(), format!("{peak:.1}"));
        }
        e
    }
}

/// The simulated GPU backend's scrub: touches nothing, says so. `fail` makes it report a
/// failed scrub, which is how tests drive quarantine.
pub fn simulate_scrub(device: &str, memory_bytes: u64, fail: bool) -> ScrubOutcome {
    ScrubOutcome {
        device: device.to_string(),
        device_name: "simulated GPU".to_string(),
        method: "simulated: no GPU memory was touched".to_string(),
        assurance: Assurance::Simulated,
        passed: !fail,
        verify_mode: VerifyMode::Full,
        total_bytes: memory_bytes,
        scrubbed_bytes: 0,
        verified_bytes: 0,
        nonzero_bytes: 0,
        first_nonzero_at: None,
        chunks: 0,
        zero_seconds: 0.0,
        verify_seconds: 0.0,
        zero_gbps: 0.0,
        peak_gbps: None,
        driver_version: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_scrub_says_simulated_and_never_verified() {
        let ok = simulate_scrub("sim-gpu0-mig1", 10 << 30, false);
        assert_eq!(ok.assurance, Assurance::Simulated);
        assert!(ok.passed);
        assert_eq!(ok.verified_bytes, 0);
        assert!(ok.method.contains("simulated"));
        let json = serde_json::to_string(&ok).unwrap();
        assert!(!json.contains("verified\""), "{json}");
        let failed = simulate_scrub("sim-gpu0-mig1", 10 << 30, true);
        assert!(!failed.passed);
        assert_eq!(failed.assurance, Assurance::Simulated);
    }

    #[test]
    fn failed_scrub_is_a_failed_step() {
        let rec = simulate_scrub("sim0", 1024, true).step_record("a".into(), "b".into());
        assert_eq!(rec.step, DepartureStep::GpuScrub);
        assert_eq!(rec.result, StepResult::Failed);
        assert_eq!(rec.assurance, Assurance::Simulated);
        assert!(rec.error.unwrap().contains("simulated"));
        let ok = simulate_scrub("sim0", 1024, false).step_record("a".into(), "b".into());
        assert_eq!(ok.result, StepResult::Ok);
        assert!(ok.error.is_none());
    }

    #[test]
    fn evidence_names_mode_and_counts() {
        let e = simulate_scrub("sim0", 1024, false).evidence();
        assert_eq!(e["verify_mode"], "full");
        assert_eq!(e["total_bytes"], "1024");
        assert_eq!(e["coverage"], "0.0000");
    }
}
