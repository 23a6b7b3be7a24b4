//! Loads generated inside a probe's guest (the agent's bounded `load` command, admin-only
//! through the daemon): starting one and waiting for its end with a deadline, and the
//! judgements of check 4's in-guest overrun and its neighbour's latency.

use std::time::{Duration, Instant};

use tenantvm_agent_protocol::{LoadKind, LoadReport, LoadSpec, LoadState};

use super::host::{HostError, VerifyHost};
use super::stats::quantile;
use super::{Outcome, Verdict};

/// How often a load's state is polled.
const POLL: Duration = Duration::from_millis(250);

/// Waits up to `timeout` for the load of `kind` in `name` to end; its last report.
pub fn wait_end(
    host: &dyn VerifyHost,
    name: &str,
    kind: LoadKind,
    timeout: Duration,
) -> Result<LoadReport, HostError> {
    let deadline = Instant::now() + timeout;
    loop {
        let r = host.guest_load_status(name, kind)?;
        if r.state != LoadState::Running {
            return Ok(r);
        }
        if Instant::now() >= deadline {
            return Err(HostError::Timeout {
                what: format!("the {} load in {name}", kind.as_str()),
                seconds: timeout.as_secs(),
            });
        }
        std::thread::sleep(POLL);
    }
}

/// How a load ended, in words: `exit N` and its error, if any (guest text, on one line).
pub fn exit_and_error(r: &LoadReport) -> String {
    format!(
        "exit {:?}{}",
        r.exit_code,
        r.error
            .as_deref()
            .map(|e| format!(", {}", crate::untrusted::one_line(e)))
            .unwrap_or_default()
    )
}

/// Records `finding` and makes a passing `out` inconclusive.
pub fn inconclusive(out: &mut Outcome, finding: String) {
    if out.verdict == Verdict::Pass {
        out.verdict = Verdict::Inconclusive;
    }
    out.findings.push(finding);
}

/// Starts `load` in `name`; a refusal makes `out` inconclusive, saying which load
/// (`what`) could not start. Returns whether it started.
pub fn start_or_inconclusive(
    host: &dyn VerifyHost,
    name: &str,
    load: LoadSpec,
    what: &str,
    out: &mut Outcome,
) -> bool {
    match host.guest_load(name, load) {
        Ok(()) => true,
        Err(e) => {
            inconclusive(
                out,
                format!("the {what} load could not be started in {name}: {e}"),
            );
            false
        }
    }
}

/// Judges a memory load that asked a guest of `guest_mib` for more than its RAM: the guest
/// kernel (its OOM killer) must stop it; one that got everything it asked shows the guest
/// has more memory than it was given.
pub fn judge_guest_overrun(out: &mut Outcome, name: &str, guest_mib: u32, r: &LoadReport) {
    let asked = r.spec.map_or(0, |s| s.amount);
    out.add("guest_overrun_asked_mib", f64::from(asked), "MiB");
    out.add("guest_overrun_reached_mib", r.progress as f64, "MiB");
    out.add("guest_mem_total_mib", r.guest_mem_total_mib as f64, "MiB");
    out.add("guest_oom_kills", r.oom_kills as f64, "count");
    out.add("guest_overrun_ms", r.elapsed_ms as f64, "ms");
    match r.state {
        LoadState::Killed => out.findings.push(format!(
            "inside {name} ({guest_mib} MiB, MemTotal {} MiB) a process touching {asked} MiB was stopped at {} MiB by {} (exit {}, {} OOM kill(s) in the guest)",
            r.guest_mem_total_mib,
            r.progress,
            if r.oom_kills > 0 { "the guest's OOM killer" } else { "a signal" },
            r.exit_code.unwrap_or(-1),
            r.oom_kills
        )),
        LoadState::Finished if r.progress >= u64::from(asked) => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "inside {name} a process touched all {asked} MiB it asked for, past the guest's {guest_mib} MiB: the guest has more memory than it was given"
            ));
        }
        other => inconclusive(
            out,
            format!(
                "the in-guest overrun in {name} ended {other:?} at {} MiB of {asked} (exit {:?}{}): it shows nothing",
                r.progress,
                r.exit_code,
                r.error.as_deref().map(|e| format!(", {e}")).unwrap_or_default()
            ),
        ),
    }
}

/// Judges the neighbour's completion latency (ms) during an overrun against its baseline:
/// the p50 ratio must stay within `max_ratio`.
pub fn judge_neighbour(
    out: &mut Outcome,
    name: &str,
    baseline: &[f64],
    during: &[f64],
    max_ratio: f64,
) {
    if baseline.is_empty() || during.is_empty() {
        inconclusive(
            out,
            format!("{name}: no latency samples around the in-guest overrun"),
        );
        return;
    }
    let (b50, d50) = (quantile(baseline, 0.5), quantile(during, 0.5));
    let dmax = during.iter().copied().fold(0.0, f64::max);
    let ratio = if b50 > 0.0 { d50 / b50 } else { f64::INFINITY };
    out.add("neighbour_baseline_p50_ms", b50, "ms");
    out.add("neighbour_during_overrun_p50_ms", d50, "ms");
    out.add("neighbour_during_overrun_max_ms", dmax, "ms");
    out.add("neighbour_p50_ratio", ratio, "ratio");
    out.add("max_neighbour_ratio", max_ratio, "ratio");
    if ratio > max_ratio {
        out.verdict = Verdict::Fail;
        out.findings.push(format!(
            "{name}'s median latency grew {ratio:.2}x (to {d50:.1} ms) while its neighbour overran its memory (limit {max_ratio:.2}x)"
        ));
    }
}

/// What an in-guest load did, for the report: `None` when it ran (running or finished),
/// else why it shows nothing.
pub fn not_run(r: &LoadReport) -> Option<String> {
    match r.state {
        LoadState::Running | LoadState::Finished => None,
        other => Some(format!(
            "ended {other:?} after {} ms (exit {:?}{})",
            r.elapsed_ms,
            r.exit_code,
            r.error
                .as_deref()
                .map(|e| format!(", {e}"))
                .unwrap_or_default()
        )),
    }
}

/// A spec, for the checks.
pub fn spec(kind: LoadKind, amount: u32, seconds: u32) -> LoadSpec {
    LoadSpec {
        kind,
        amount,
        seconds,
    }
}
