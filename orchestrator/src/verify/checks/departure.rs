//! Check 10: a departure leaves nothing behind. A probe tenant with a disk (a request
//! through its payload, so it has logs and disk contents, and a pushed model, tenant data
//! the crypto-shred must cover) is destroyed; afterwards no file,
//! key, log, cgroup or process of its uid may remain, and its receipt must be in the audit
//! log with every step ended `ok` or `skipped` and every effect `verified`, honestly
//! `simulated`, or not applicable (a step that failed, or a host-side step that ran
//! `unverified`, fails the check). The route-off and agent-shutdown steps may be
//! `unverified`: they rest on what the guest reports, and the host-side steps after them
//! (reset, scrub, release, crypto-shred, log removal) are what must be verified; they are
//! counted as guest-reported. When the model was pushed, the receipt must say that the
//! shredded disk held it (the crypto-shred step's `tenant_data` evidence); a push the host
//! refuses is reported, not judged.
//!
//! With GPU probes (`--gpu-probes auto` on a host whose GPU backend shows GPUs) the probe
//! also holds the smallest slice the host can give, and [`super::gpu_departure`] judges
//! what that slice left: MIG instances, reservations, VF vGPU types, vfio-pci bindings,
//! the receipt's GPU steps and a quarantine the receipt declares. A GPU step that failed
//! and quarantined its slice is an honest outcome, judged there against the daemon's
//! quarantine list.

use super::gpu_departure;
use crate::receipt::{Assurance, DepartureStep, LogEntry, StepResult};
use crate::verify::gpu_probe::{self, GpuPlan};
use crate::verify::{Check, CheckId, Ctx, HostError, Outcome, Verdict};

/// Check 10.
pub struct DepartureCheck;

/// Name of the model check 10 pushes to its probe.
const DEPART_MODEL: &str = "tvm-verify-depart";

/// Whether the last receipt's crypto-shred step says the disk held the tenant's pushed
/// models (its `tenant_data` evidence names them).
pub fn receipt_covers_models(receipts: &[LogEntry]) -> bool {
    receipts.last().is_some_and(|e| {
        e.receipt.steps.iter().any(|s| {
            s.step == DepartureStep::CryptoShred
                && s.evidence
                    .get("tenant_data")
                    .is_some_and(|d| d.contains("model"))
        })
    })
}

/// Judges what is left of a departed tenant and its receipts.
pub fn judge_departure(
    name: &str,
    still_listed: bool,
    leftovers: &[String],
    receipts: &[LogEntry],
) -> Outcome {
    let mut out = Outcome::new(Verdict::Pass);
    if still_listed {
        out.verdict = Verdict::Fail;
        out.findings
            .push(format!("{name}: still listed by the daemon after destroy"));
    }
    out.add("leftovers", leftovers.len() as f64, "count");
    for l in leftovers {
        out.verdict = Verdict::Fail;
        out.findings.push(format!("{name}: left behind: {l}"));
    }
    let Some(entry) = receipts.last() else {
        out.verdict = Verdict::Fail;
        out.findings
            .push(format!("{name}: no departure receipt in the audit log"));
        return out;
    };
    let r = &entry.receipt;
    let mut simulated = 0;
    let mut unverified_courtesy = 0;
    for s in &r.steps {
        let step = format!("{:?}", s.step);
        match (s.result, s.assurance) {
            // A GPU step that failed and quarantined its slice said so honestly; the GPU half
            // (gpu_departure) checks the quarantine against the daemon's list.
            (StepResult::Failed, _)
                if super::gpu_departure::GPU_STEPS.contains(&s.step)
                    && s.evidence.get("quarantined").is_some_and(|v| v == "true") => {}
            (StepResult::Failed, _) => {
                out.verdict = Verdict::Fail;
                out.findings.push(format!(
                    "{name}: receipt step {step} failed: {}",
                    crate::untrusted::one_line(s.error.as_deref().unwrap_or(""))
                ));
            }
            // The courtesy steps (the route off, the guest's own shutdown) rest on what a
            // guest reports; the host-side steps after them destroy what matters.
            (_, Assurance::Unverified)
                if matches!(
                    s.step,
                    DepartureStep::GatewayRouteOff | DepartureStep::AgentShutdown
                ) =>
            {
                unverified_courtesy += 1;
            }
            (_, Assurance::Unverified) => {
                out.verdict = Verdict::Fail;
                out.findings.push(format!(
                    "{name}: receipt step {step} ran ({}) but its effect was not verified",
                    crate::untrusted::one_line(&s.method)
                ));
            }
            (_, Assurance::Simulated) => simulated += 1,
            _ => {}
        }
    }
    for needed in [DepartureStep::CryptoShred, DepartureStep::LogsRemoved] {
        if !r.steps.iter().any(|s| s.step == needed) {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{name}: the receipt has no {needed:?} step: it was not done"
            ));
        }
    }
    out.add("receipt_steps", r.steps.len() as f64, "count");
    out.add("receipt_steps_simulated", f64::from(simulated), "count");
    out.add(
        "receipt_guest_reported_steps",
        f64::from(unverified_courtesy),
        "count",
    );
    if simulated > 0 {
        out.findings.push(format!(
            "{name}: {simulated} receipt step(s) honestly marked simulated (no real hardware behind them)"
        ));
    }
    out
}

impl Check for DepartureCheck {
    fn id(&self) -> CheckId {
        CheckId::Departure
    }

    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError> {
        let mut gpu = gpu_probe::plan(ctx)?;
        // The GPU state before the probe; unreadable, the departure is judged without a GPU.
        let before = match &gpu {
            GpuPlan::Ask(_) => match ctx.host.gpu_snapshot() {
                Ok(s) => Some(s),
                Err(e) => {
                    gpu = GpuPlan::NoSlice(format!("the host's GPU state could not be read: {e}"));
                    None
                }
            },
            _ => None,
        };
        let p = gpu_probe::create_with_slice(ctx.probes, "depart", &mut gpu, |s| s.disk_gib = 1)?;
        let name = p.name.clone();
        // Give it logs and disk contents to leave behind.
        let _ = ctx
            .host
            .complete(&p.name, &p.token, "a departing tenant", 4);
        let model = super::at_rest::marker_model(&super::at_rest::new_marker("depart"));
        let pushed = ctx.host.push_model(&p.name, &p.token, DEPART_MODEL, &model);
        let view = ctx.host.tenant(&name)?;
        let uid = view.as_ref().and_then(|t| t.uid);
        let slice = view.and_then(|t| t.gpu);
        // The GPU view while the probe runs: the positive control of its leftovers.
        let during = match (&before, &slice) {
            (Some(_), Some(_)) => Some(ctx.host.gpu_snapshot()?),
            _ => None,
        };
        // A departure that does not complete is a failed departure: judge what it left.
        let destroyed = p.destroy_now();
        let still = ctx.host.tenant(&name)?.is_some();
        let leftovers = ctx.host.leftovers(&name, uid)?;
        let receipts = ctx.host.receipts(&name)?;
        let mut out = judge_departure(&name, still, &leftovers, &receipts);
        out.add("model_pushed", f64::from(u8::from(pushed.is_ok())), "bool");
        match pushed {
            Ok(()) if receipt_covers_models(&receipts) => out.findings.push(format!(
                "{name}: its pushed model was on the shredded disk, as the receipt says"
            )),
            Ok(()) => {
                out.verdict = Verdict::Fail;
                out.findings.push(format!(
                    "{name}: a model was pushed, but the receipt's crypto-shred step does not say the disk held it"
                ));
            }
            Err(e) => out.findings.push(format!(
                "{name}: no model pushed ({e}): its departure was judged without one"
            )),
        }
        if let Err(e) = destroyed {
            out.verdict = Verdict::Fail;
            out.findings
                .insert(0, format!("{name}: the departure did not complete: {e}"));
        }
        out.add("gpu_probe", f64::from(u8::from(slice.is_some())), "bool");
        match (gpu, before, during, slice) {
            (GpuPlan::Ask(_), Some(before), Some(during), Some(slice)) => {
                let after = ctx.host.gpu_snapshot()?;
                gpu_departure::judge_gpu_departure(
                    &mut out, &name, &slice, &before, &during, &after, &receipts,
                );
            }
            (GpuPlan::Ask(req), ..) => {
                if out.verdict == Verdict::Pass {
                    out.verdict = Verdict::Inconclusive;
                }
                out.findings.push(format!(
                    "{name}: asked for {} but the daemon shows no GPU slice for it: the GPU half was not judged",
                    gpu_probe::describe(&req)
                ));
            }
            (GpuPlan::NoSlice(why), ..) => {
                if out.verdict == Verdict::Pass {
                    out.verdict = Verdict::Inconclusive;
                }
                out.findings.push(format!("GPU half inconclusive: {why}"));
            }
            (GpuPlan::NotRun(why), ..) => out.findings.push(why),
        }
        Ok(out)
    }
}
