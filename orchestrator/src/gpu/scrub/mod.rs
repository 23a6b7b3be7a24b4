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
//! A scrub passes only when it covered the slice's memory less what the driver held when it
//! began ([`coverage`]); anything less is a failed scrub, whatever it read back.
//!
//! The simulated GPU backend uses [`simulate_scrub`], whose outcome says `simulated` and never
//! `verified`. The departure's reset and scrub of a released placement, over the GPU
//! backend, are in [`departure`].

mod cli;
pub mod coverage;
mod cuda;
pub mod departure;
mod gpu;

use std::collections::BTreeMap;
use std::io;

use serde::{Deserialize, Serialize};

use crate::receipt::{Assurance, DepartureStep, StepRecord, StepResult};

pub use cli::{run_scrub, scrub_in_child, ScrubArgs};
pub use gpu::{scrub_gpu, DeviceSelector, ScrubOptions};

/// How far apart the scrubbed device's memory and the slice's may be, in percent: a driver
/// reports its framebuffer less its own reservations, a few percent at most, and two sizes
/// one card offers differ by 2x or more (the rule of `gpu-info`, docs/gpu.md).
pub const SLICE_SIZE_TOLERANCE_PERCENT: u64 = 5;
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
    /// Bytes the driver (and anything else) held when the scrub began, after its own
    /// context existed: the device's total less CUDA's free figure. The scrub could not
    /// reach them; [`coverage`] bounds them.
    #[serde(default)]
    pub held_bytes: u64,
    /// Bytes the scrub had to zero to pass: the total less the held bytes (at most
    /// `max_bytes`).
    #[serde(default)]
    pub required_bytes: u64,
    /// A limit asked for (tests, benchmarks); the daemon's scrubs have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    /// The slice's memory as the daemon placed it (a MIG profile's, or the whole card's),
    /// when the daemon judged the outcome against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slice_bytes: Option<u64>,
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

    /// Why the scrub did not cover what it had to ([`coverage::judge`] on its counts), or
    /// scrubbed another size of memory than the slice's; `None` when it covered it.
    pub fn coverage_shortfall(&self) -> Option<String> {
        let judged = coverage::judge(
            self.total_bytes,
            self.held_bytes,
            self.scrubbed_bytes,
            self.max_bytes,
        );
        if let Some(why) = judged.shortfall {
            return Some(why);
        }
        let slice = self.slice_bytes?;
        let tolerance = slice / 100 * SLICE_SIZE_TOLERANCE_PERCENT;
        (self.total_bytes.abs_diff(slice) > tolerance).then(|| {
            format!(
                "the scrubbed device has {} bytes, the slice {slice}: not the slice's memory (more than {SLICE_SIZE_TOLERANCE_PERCENT} % apart)",
                self.total_bytes
            )
        })
    }

    /// Judges the outcome from its counts: it passes only when every byte read back was
    /// zero, a full read-back read every zeroed byte, and the zeroed bytes covered the
    /// slice ([`Self::coverage_shortfall`]); only then is it `verified`. `slice_bytes` is
    /// the slice's memory as the daemon placed it (None where the caller does not know
    /// it). A simulated outcome is left as it is.
    pub fn judge(&mut self, slice_bytes: Option<u64>) {
        if self.assurance == Assurance::Simulated {
            return;
        }
        if slice_bytes.is_some() {
            self.slice_bytes = slice_bytes;
        }
        self.required_bytes = coverage::judge(
            self.total_bytes,
            self.held_bytes,
            self.scrubbed_bytes,
            self.max_bytes,
        )
        .required_bytes;
        let read_back = match self.verify_mode {
            VerifyMode::Full => self.verified_bytes == self.scrubbed_bytes,
            VerifyMode::Sampled => true,
        };
        self.passed = self.nonzero_bytes == 0
            && self.verified_bytes > 0
            && read_back
            && self.coverage_shortfall().is_none();
        self.assurance = if self.passed {
            Assurance::Verified
        } else {
            Assurance::Unverified
        };
    }

    /// The receipt's record of this scrub. A scrub that did not pass is a failed step (and its
    /// slice must stay quarantined until a later scrub passes).
    pub fn step_record(&self, started_at: String, finished_at: String) -> StepRecord {
        let error = (!self.passed).then(|| match self.assurance {
            Assurance::Simulated => "simulated scrub failure".to_string(),
            _ if self.nonzero_bytes > 0 => format!(
                "{} non-zero bytes read back after zeroing (first at byte {})",
                self.nonzero_bytes,
                self.first_nonzero_at
                    .map_or_else(|| "-".to_string(), |o| o.to_string())
            ),
            _ => match self.coverage_shortfall() {
                Some(why) => format!("the scrub did not cover the slice: {why}"),
                None => format!(
                    "read back {} of the {} bytes zeroed",
                    self.verified_bytes, self.scrubbed_bytes
                ),
            },
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
        e.insert("held_bytes".into(), self.held_bytes.to_string());
        e.insert("required_bytes".into(), self.required_bytes.to_string());
        if let Some(max) = self.max_bytes {
            e.insert("max_bytes".into(), max.to_string());
        }
        if let Some(slice) = self.slice_bytes {
            e.insert("slice_bytes".into(), slice.to_string());
        }
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

/// Why a receipt's scrub step, by its evidence ([`ScrubOutcome::evidence`]), did not cover
/// its slice: the coverage rule again on the counts it states (`tenantvm verify`, check
/// 10). A step without the counts, or capped on request, did not show that it covered it.
pub fn evidence_shortfall(evidence: &BTreeMap<String, String>) -> Option<String> {
    let number = |name: &str| evidence.get(name).and_then(|v| v.parse::<u64>().ok());
    let (Some(total_bytes), Some(scrubbed_bytes)) =
        (number("total_bytes"), number("scrubbed_bytes"))
    else {
        return Some(
            "the step states no coverage (total_bytes, scrubbed_bytes): nothing shows it covered the slice"
                .into(),
        );
    };
    if let Some(max) = number("max_bytes") {
        return Some(format!(
            "the scrub was capped at {max} bytes on request: not a whole slice's scrub"
        ));
    }
    let outcome = ScrubOutcome {
        assurance: Assurance::Unverified,
        total_bytes,
        scrubbed_bytes,
        // A receipt from before the driver's share was stated: all of it had to be covered.
        held_bytes: number("held_bytes").unwrap_or(0),
        slice_bytes: number("slice_bytes"),
        ..simulate_scrub("receipt", total_bytes, false)
    };
    outcome.coverage_shortfall()
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
        held_bytes: 0,
        required_bytes: 0,
        max_bytes: None,
        slice_bytes: None,
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

    /// A hardware outcome (not simulated) of a device of `total` bytes, `held` of them held
    /// by the driver, `scrubbed` zeroed and read back clean.
    fn hardware(total: u64, held: u64, scrubbed: u64) -> ScrubOutcome {
        let mut out = ScrubOutcome {
            device: "MIG-1".into(),
            device_name: "test".into(),
            method: "test".into(),
            assurance: Assurance::Unverified,
            verified_bytes: scrubbed,
            held_bytes: held,
            scrubbed_bytes: scrubbed,
            total_bytes: total,
            ..simulate_scrub("MIG-1", total, false)
        };
        out.judge(None);
        out
    }

    #[test]
    fn only_a_scrub_that_covers_the_slice_is_verified() {
        let total = 9_984u64 << 20;
        let full = hardware(total, 300 << 20, total - (300 << 20));
        assert!(full.passed, "{full:?}");
        assert_eq!(full.assurance, Assurance::Verified);
        assert_eq!(full.required_bytes, total - (300 << 20));
        // The same with a quarter of the device zeroed: read back clean, and still failed.
        let part = hardware(total, 300 << 20, total / 4);
        assert!(!part.passed);
        assert_eq!(part.assurance, Assurance::Unverified);
        let rec = part.step_record("a".into(), "b".into());
        assert_eq!(rec.result, StepResult::Failed);
        assert!(rec.error.unwrap().contains("never scrubbed"));
        // A full read-back that read less than it zeroed is no verification either.
        let mut short_read = hardware(total, 300 << 20, total - (300 << 20));
        short_read.verified_bytes /= 2;
        short_read.judge(None);
        assert!(!short_read.passed);
    }

    #[test]
    fn the_daemon_judges_the_outcome_against_the_slice_it_placed() {
        let total = 9_984u64 << 20;
        let mut out = hardware(total, 300 << 20, total - (300 << 20));
        out.judge(Some(total));
        assert!(out.passed, "{out:?}");
        assert_eq!(out.evidence()["slice_bytes"], total.to_string());
        // The child scrubbed a device four times smaller than the slice (another instance).
        let mut wrong = hardware(total / 4, 300 << 20, total / 4 - (300 << 20));
        assert!(wrong.passed);
        wrong.judge(Some(total));
        assert!(!wrong.passed);
        assert!(wrong
            .coverage_shortfall()
            .unwrap()
            .contains("not the slice's memory"));
        // A simulated outcome stays what it is.
        let mut sim = simulate_scrub("sim0", total, false);
        sim.judge(Some(1));
        assert_eq!((sim.passed, sim.assurance), (true, Assurance::Simulated));
    }

    #[test]
    fn a_receipts_evidence_is_judged_by_the_same_rule() {
        let total = 9_984u64 << 20;
        let covered = hardware(total, 300 << 20, total - (300 << 20));
        assert_eq!(evidence_shortfall(&covered.evidence()), None);
        let part = hardware(total, 300 << 20, total / 2);
        assert!(evidence_shortfall(&part.evidence()).is_some());
        // No counts at all: nothing shows coverage.
        assert!(evidence_shortfall(&BTreeMap::new())
            .unwrap()
            .contains("states no coverage"));
        // An older receipt without held_bytes: the whole device had to be covered.
        let mut old = covered.evidence();
        old.remove("held_bytes");
        assert!(evidence_shortfall(&old).is_some());
    }

    #[test]
    fn evidence_names_mode_and_counts() {
        let e = simulate_scrub("sim0", 1024, false).evidence();
        assert_eq!(e["verify_mode"], "full");
        assert_eq!(e["total_bytes"], "1024");
        assert_eq!(e["coverage"], "0.0000");
    }
}
