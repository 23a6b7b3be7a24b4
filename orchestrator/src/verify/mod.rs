//! `tenantvm verify`: the pre-deployment isolation checklist, run as probes against the live
//! host (docs/verify.md).
//!
//! Each [`Check`] ends [`Verdict::Pass`], [`Verdict::Fail`], [`Verdict::Inconclusive`] or
//! [`Verdict::NotApplicable`] (nothing on this host for it to judge: never a pass) with
//! its evidence as numbers ([`Measure`]) and findings in words. Checks see the host only
//! through [`VerifyHost`] (the live implementation is [`live::LiveHost`]: the daemon's API
//! plus read-only looks at the host's cgroups and files), and create short-lived probe
//! tenants through [`probe::Probes`], which names them so they cannot collide with real
//! tenants, records them in a ledger before creating them, destroys them when they go out of
//! scope, and sweeps the ledger's leftovers at the start of the next run.
//!
//! A check that cannot reach a conclusion (an API error, no probe image, a positive control
//! that did not detect anything) is inconclusive, never a pass: the run exits 0 only when
//! every selected check passed.
//!
//! The checks are in [`checks`], one file per family; the rest of this module is their host
//! support: the host seam ([`host`], live: [`live`]), probe tenants ([`probe`]; with a GPU
//! slice: [`gpu_probe`]), the statistics check 5 judges with ([`stats`]), loads in probe
//! guests ([`guest_load`]), the front door's callers ([`callers`], [`door`], [`cross_key`]),
//! the host scan ([`scan`]), the audit trail ([`audit`]) and the report ([`report`]).

pub mod audit;
pub mod callers;
pub mod checks;
pub mod cross_key;
pub mod door;
pub mod gpu_probe;
pub mod guest_load;
pub mod host;
pub mod live;
mod live_gpu;
pub mod probe;
mod procs;
pub mod report;
pub mod scan;
pub mod stats;

#[cfg(test)]
pub(crate) mod fake;
#[cfg(test)]
mod gpu_tests;
#[cfg(test)]
mod live_tests;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use host::{HostError, VerifyHost};
pub use probe::Probes;
pub use report::Report;

/// How a check ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// The property holds, and the check showed it could have seen otherwise.
    Pass,
    /// The property does not hold on this host.
    Fail,
    /// The check could not decide (see its findings); never counted as a pass.
    Inconclusive,
    /// The host has nothing for the check to judge (checks 2 and 3 with no GPU tenant):
    /// nothing was shown either way; never counted as a pass, and the report says so.
    NotApplicable,
}

impl Verdict {
    /// `pass`, `fail`, `inconclusive` or `not-applicable`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
            Verdict::Inconclusive => "inconclusive",
            Verdict::NotApplicable => "not-applicable",
        }
    }
}

/// One number of evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measure {
    /// What was measured (`memory_limit_bytes`, `ks_p_value`, ...).
    pub name: String,
    /// The value.
    pub value: f64,
    /// Its unit (`bytes`, `ms`, `ratio`, `count`, ...).
    pub unit: String,
}

/// What a check found: its verdict, numbers and words.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Outcome {
    /// The verdict.
    pub verdict: Verdict,
    /// The numbers.
    pub evidence: Vec<Measure>,
    /// What was seen, one finding per line (failures first say what is wrong).
    pub findings: Vec<String>,
}

impl Outcome {
    /// An outcome with no evidence yet.
    pub fn new(verdict: Verdict) -> Outcome {
        Outcome {
            verdict,
            evidence: Vec::new(),
            findings: Vec::new(),
        }
    }

    /// Inconclusive because of `why`.
    pub fn inconclusive(why: impl Into<String>) -> Outcome {
        Outcome::new(Verdict::Inconclusive).finding(why)
    }

    /// Adds a number.
    pub fn measure(mut self, name: &str, value: f64, unit: &str) -> Outcome {
        self.add(name, value, unit);
        self
    }

    /// Adds a number in place.
    pub fn add(&mut self, name: &str, value: f64, unit: &str) {
        self.evidence.push(Measure {
            name: name.to_string(),
            value,
            unit: unit.to_string(),
        });
    }

    /// Adds a finding.
    pub fn finding(mut self, text: impl Into<String>) -> Outcome {
        self.findings.push(text.into());
        self
    }

    /// The value of the measure `name`, if recorded.
    pub fn value(&self, name: &str) -> Option<f64> {
        self.evidence
            .iter()
            .find(|m| m.name == name)
            .map(|m| m.value)
    }
}

/// The ten checks, in the order of the checklist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckId {
    /// 1. The threat model is written down.
    ThreatModel,
    /// 2. Every GPU tenants share supports MIG in its SKU.
    MigSku,
    /// 3. Every tenant's sized need fits its slice; the host holds them all.
    PartitionArithmetic,
    /// 4. Memory partitions are enforced.
    MemoryPartition,
    /// 5. No prefix cache is shared across tenants (timing test).
    PrefixCache,
    /// 6. Batching does not cross tenants.
    Batching,
    /// 7. No cross-tenant visibility in logs and metrics.
    Visibility,
    /// 8. A noisy neighbour stays within its quota.
    NoisyNeighbour,
    /// 9. Weights are separated at rest with per-tenant keys.
    WeightsAtRest,
    /// 10. A departure leaves nothing behind.
    Departure,
}

impl CheckId {
    /// All checks in order.
    pub const ALL: [CheckId; 10] = [
        CheckId::ThreatModel,
        CheckId::MigSku,
        CheckId::PartitionArithmetic,
        CheckId::MemoryPartition,
        CheckId::PrefixCache,
        CheckId::Batching,
        CheckId::Visibility,
        CheckId::NoisyNeighbour,
        CheckId::WeightsAtRest,
        CheckId::Departure,
    ];

    /// Its number in the checklist (1-10).
    pub fn number(self) -> u8 {
        CheckId::ALL
            .iter()
            .position(|c| *c == self)
            .map_or(0, |i| i as u8 + 1)
    }

    /// Its name on the command line (`threat-model`, ...).
    pub fn key(self) -> &'static str {
        match self {
            CheckId::ThreatModel => "threat-model",
            CheckId::MigSku => "mig-sku",
            CheckId::PartitionArithmetic => "partition-arithmetic",
            CheckId::MemoryPartition => "memory-partition",
            CheckId::PrefixCache => "prefix-cache",
            CheckId::Batching => "batching",
            CheckId::Visibility => "visibility",
            CheckId::NoisyNeighbour => "noisy-neighbour",
            CheckId::WeightsAtRest => "weights-at-rest",
            CheckId::Departure => "departure",
        }
    }

    /// One line saying what it checks.
    pub fn title(self) -> &'static str {
        match self {
            CheckId::ThreatModel => "threat model written down",
            CheckId::MigSku => "shared GPUs are MIG-capable SKUs",
            CheckId::PartitionArithmetic => "every sized need fits its slice and the host",
            CheckId::MemoryPartition => "memory partitions enforced",
            CheckId::PrefixCache => "no prefix cache shared across tenants (timing)",
            CheckId::Batching => "batching does not cross tenants",
            CheckId::Visibility => "no cross-tenant visibility in logs and metrics",
            CheckId::NoisyNeighbour => "noisy neighbour held to its quota",
            CheckId::WeightsAtRest => "weights separated at rest, per-tenant keys",
            CheckId::Departure => "departure leaves nothing behind",
        }
    }
}

/// A `--checks` entry that names no check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Unknown check {0:?}: give numbers 1-10 or names ({names})", names = CheckId::ALL.map(CheckId::key).join(", "))]
pub struct UnknownCheck(pub String);

impl FromStr for CheckId {
    type Err = UnknownCheck;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Ok(n) = s.parse::<usize>() {
            return n
                .checked_sub(1)
                .and_then(|i| CheckId::ALL.get(i).copied())
                .ok_or_else(|| UnknownCheck(s.to_string()));
        }
        CheckId::ALL
            .into_iter()
            .find(|c| c.key() == s.to_ascii_lowercase())
            .ok_or_else(|| UnknownCheck(s.to_string()))
    }
}

/// Parses a `--checks` list (`1,4,prefix-cache`): each check once, in checklist order.
pub fn parse_selection(list: &str) -> Result<Vec<CheckId>, UnknownCheck> {
    let mut out = Vec::new();
    for part in list.split(',').filter(|p| !p.trim().is_empty()) {
        let id: CheckId = part.parse()?;
        if !out.contains(&id) {
            out.push(id);
        }
    }
    if out.is_empty() {
        return Err(UnknownCheck(list.to_string()));
    }
    out.sort();
    Ok(out)
}

/// The operator's settings of a run (command-line flags; defaults as documented).
#[derive(Debug, Clone)]
pub struct VerifyConfig {
    /// The threat model file (check 1).
    pub threat_model: Option<PathBuf>,
    /// Named image (the daemon's --image-dir) the probe tenants run: the n-gram payload.
    pub probe_image: Option<String>,
    /// Named image of the prefix-cache control probe, whose payload runs with its prefix cache
    /// on (check 5); the probe image when absent.
    pub control_image: Option<String>,
    /// Guest memory of a probe tenant, MiB.
    pub probe_memory_mib: u32,
    /// Most memory a cgroup may allow above the guest's memory (VMM overhead), MiB.
    pub max_overhead_mib: u64,
    /// Timing samples per arm (check 5).
    pub samples_per_arm: usize,
    /// Words of the distinctive prefix (check 5).
    pub prefix_words: usize,
    /// Significance level of the timing test (check 5).
    pub alpha: f64,
    /// Latency samples per phase (check 8).
    pub latency_samples: usize,
    /// Largest p99 ratio loaded/idle the noisy-neighbour check accepts (check 8).
    pub max_latency_ratio: f64,
    /// Seed of the prompts and of each hit/miss pair's order (a fresh one when absent; recorded in the report).
    pub seed: Option<u64>,
    /// How long to wait for a probe tenant to start or go.
    pub probe_timeout: Duration,
    /// Whether checks 4, 8 and 10 give their probes a GPU slice (`--gpu-probes`).
    pub gpu_probes: gpu_probe::GpuProbes,
    /// Seconds of each GPU compute measurement of check 8's GPU half.
    pub gpu_compute_seconds: u32,
}

impl Default for VerifyConfig {
    fn default() -> Self {
        VerifyConfig {
            threat_model: None,
            probe_image: None,
            control_image: None,
            probe_memory_mib: 128,
            max_overhead_mib: 512,
            samples_per_arm: 250,
            prefix_words: 3000,
            alpha: 1e-3,
            latency_samples: 200,
            max_latency_ratio: 3.0,
            seed: None,
            probe_timeout: Duration::from_secs(180),
            gpu_probes: gpu_probe::GpuProbes::Auto,
            gpu_compute_seconds: 5,
        }
    }
}

/// What a check is given.
pub struct Ctx<'a> {
    /// The host.
    pub host: &'a dyn VerifyHost,
    /// Probe tenants of this run.
    pub probes: &'a Probes<'a>,
    /// Settings.
    pub config: &'a VerifyConfig,
    /// The seed of this run's randomness.
    pub seed: u64,
}

/// One check of the checklist.
pub trait Check {
    /// Which one.
    fn id(&self) -> CheckId;
    /// Runs it. An `Err` (the host could not be asked) becomes inconclusive.
    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError>;
}

/// One check's result in the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckResult {
    /// Checklist number.
    pub number: u8,
    /// Which check.
    pub check: CheckId,
    /// What it checks.
    pub title: String,
    /// How long it ran, ms.
    pub elapsed_ms: u64,
    /// What it found.
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// Runs the selected checks in order, each with its own probes cleaned up before the next
/// starts; a host error becomes an inconclusive result, never a pass.
pub fn run_checks(
    host: &dyn VerifyHost,
    probes: &Probes<'_>,
    config: &VerifyConfig,
    seed: u64,
    selection: &[CheckId],
) -> Vec<CheckResult> {
    let ctx = Ctx {
        host,
        probes,
        config,
        seed,
    };
    selection
        .iter()
        .map(|id| {
            let started = Instant::now();
            let check = checks::check_for(*id);
            let mut outcome = match check.run(&ctx) {
                Ok(o) => o,
                Err(e) => Outcome::inconclusive(format!("the host could not be asked: {e}")),
            };
            // Whatever the check did, its probe tenants go now.
            for problem in probes.release_all() {
                outcome.findings.push(format!("cleanup: {problem}"));
            }
            CheckResult {
                number: id.number(),
                check: *id,
                title: id.title().to_string(),
                elapsed_ms: started.elapsed().as_millis() as u64,
                outcome,
            }
        })
        .collect()
}
