//! Check 10's GPU half: what a departed probe's GPU slice leaves on the host. The host's GPU
//! state is read three times: before the probe is created, while it runs, and after its
//! departure ([`GpuSnapshot`], from the GPU backend's instances, the daemon's store of
//! reservations, its quarantine list, and sysfs: each VF's `nvidia/current_vgpu_type` and
//! which devices are bound to `vfio-pci`). What the probe added must be gone afterwards:
//! no MIG GPU/compute instance, no reservation, no VF with a vGPU type, no device bound to
//! vfio-pci (a quarantined slice may keep its device when the receipt says it was
//! quarantined). The snapshot taken while the probe ran is the positive control: it must
//! show the probe's own slice, else the view is blind and the GPU half inconclusive. The
//! receipt's GPU steps (device reset, scrub, release) must each be there and verified, or
//! honestly simulated, or failed with the slice quarantined; a verified scrub must show by
//! its counts that it covered the slice (`scrub::evidence_shortfall`).

use std::collections::BTreeSet;

use crate::api::types::GpuSlice;
use crate::receipt::{Assurance, DepartureStep, LogEntry, StepResult};
use crate::verify::{Outcome, Verdict};

/// The host's GPU state, each item in words that name it (addresses, ids, labels).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuSnapshot {
    /// MIG GPU instances (with their compute instance): `<gpu> gi <id> profile <id> @<start>`.
    pub instances: BTreeSet<String>,
    /// Reservations in the daemon's store: `<gpu>/<label>`.
    pub reservations: BTreeSet<String>,
    /// VFs with a vGPU type set: `<vf> current_vgpu_type <type>`.
    pub vf_types: BTreeSet<String>,
    /// Devices bound to vfio-pci (or, on a simulated host, GPUs assigned whole): `<address>`.
    pub vfio_bound: BTreeSet<String>,
    /// Quarantined slices: `<gpu>/<label>`.
    pub quarantined: BTreeSet<String>,
    /// What could not be looked at (no sysfs device for a simulated GPU, ...), in words.
    pub not_seen: Vec<String>,
}

/// `<gpu>/<label>`, as the store and the quarantine list name a slice.
pub fn slice_id(s: &GpuSlice) -> String {
    format!("{}/{}", s.gpu, s.label)
}

fn added<'a>(before: &BTreeSet<String>, now: &'a BTreeSet<String>) -> Vec<&'a String> {
    now.iter().filter(|i| !before.contains(*i)).collect()
}

/// The GPU steps of a departure receipt.
pub const GPU_STEPS: [DepartureStep; 3] = [
    DepartureStep::DeviceReset,
    DepartureStep::GpuScrub,
    DepartureStep::GpuRelease,
];

/// Whether a receipt step says it quarantined the slice.
fn says_quarantined(s: &crate::receipt::StepRecord) -> bool {
    s.evidence.get("quarantined").is_some_and(|v| v == "true")
}

/// Judges the GPU half of a departure of `name`, which held `slice`: the snapshots `before`
/// its creation, `during` its life and `after` its departure, and its receipts.
pub fn judge_gpu_departure(
    out: &mut Outcome,
    name: &str,
    slice: &GpuSlice,
    before: &GpuSnapshot,
    during: &GpuSnapshot,
    after: &GpuSnapshot,
    receipts: &[LogEntry],
) {
    let id = slice_id(slice);
    out.findings.push(format!("{name}: held GPU slice {id}"));
    // The positive control: the view showed the probe's own slice while it ran.
    let seen_reserved = added(&before.reservations, &during.reservations).len();
    let seen_instances = added(&before.instances, &during.instances).len();
    let seen_bound = added(&before.vfio_bound, &during.vfio_bound).len();
    let seen_types = added(&before.vf_types, &during.vf_types).len();
    out.add(
        "gpu_seen_while_running_reservations",
        seen_reserved as f64,
        "count",
    );
    out.add(
        "gpu_seen_while_running_instances",
        seen_instances as f64,
        "count",
    );
    out.add(
        "gpu_seen_while_running_vfio_bound",
        seen_bound as f64,
        "count",
    );
    out.add(
        "gpu_seen_while_running_vf_types",
        seen_types as f64,
        "count",
    );
    let not_seen: BTreeSet<&String> = during.not_seen.iter().chain(&after.not_seen).collect();
    for n in not_seen {
        out.findings.push(format!("not looked at: {n}"));
    }
    let blind = seen_reserved == 0;
    if blind && out.verdict == Verdict::Pass {
        out.verdict = Verdict::Inconclusive;
    }
    if blind {
        out.findings.push(format!(
            "{name}: the host's view showed no reservation of its slice {id} while it ran: a leftover would not be seen either (GPU half inconclusive)"
        ));
    }
    // The receipt's GPU steps, and a quarantine it declares.
    let steps = receipts
        .last()
        .map_or(&[][..], |e| e.receipt.steps.as_slice());
    let mut receipt_quarantined = false;
    let (mut verified, mut simulated) = (0u32, 0u32);
    for wanted in GPU_STEPS {
        let Some(s) = steps.iter().find(|s| s.step == wanted) else {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{name}: the receipt has no {wanted:?} step although it held GPU slice {id}"
            ));
            continue;
        };
        if says_quarantined(s) {
            receipt_quarantined = true;
        }
        match (s.result, s.assurance) {
            // A verified scrub must show it covered the slice (the scrub's own rule).
            (StepResult::Ok, Assurance::Verified) if wanted == DepartureStep::GpuScrub => {
                match crate::gpu::scrub::evidence_shortfall(&s.evidence) {
                    None => verified += 1,
                    Some(why) => {
                        out.verdict = Verdict::Fail;
                        out.findings.push(format!(
                            "{name}: the receipt's scrub of GPU slice {id} says verified, but did not cover the slice: {why}"
                        ));
                    }
                }
            }
            (StepResult::Ok, Assurance::Verified) => verified += 1,
            (StepResult::Ok, Assurance::Simulated) => simulated += 1,
            // An honest failure: the slice was taken out of service (judged below).
            (StepResult::Failed, _) if says_quarantined(s) => {}
            (result, assurance) => {
                out.verdict = Verdict::Fail;
                out.findings.push(format!(
                    "{name}: the receipt's {wanted:?} step ended {result:?} / {assurance:?} for GPU slice {id}: neither verified nor honestly simulated"
                ));
            }
        }
    }
    out.add("gpu_receipt_steps_verified", f64::from(verified), "count");
    out.add("gpu_receipt_steps_simulated", f64::from(simulated), "count");
    if simulated > 0 {
        out.findings.push(format!(
            "{name}: {simulated} of its GPU steps honestly marked simulated (a simulated GPU backend)"
        ));
    }
    // Quarantine: what the receipt says and what the daemon lists must agree.
    let listed = after.quarantined.contains(&id) && !before.quarantined.contains(&id);
    out.add("gpu_quarantined", f64::from(u8::from(listed)), "bool");
    match (receipt_quarantined, listed) {
        (true, true) => out.findings.push(format!(
            "{name}: its slice {id} was quarantined (its scrub or reset did not verify), as the receipt says: no tenant gets it until `tenantvm gpu scrub` clears it"
        )),
        (true, false) => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{name}: the receipt says slice {id} was quarantined, but the daemon does not list it as quarantined"
            ));
        }
        (false, true) => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{name}: slice {id} is quarantined, but the receipt does not say so"
            ));
        }
        (false, false) => {}
    }
    // What the probe added and left.
    let mut left = |what: &str, unit: &str, items: Vec<&String>, excused: bool| {
        out.add(&format!("gpu_left_{unit}"), items.len() as f64, "count");
        for i in items {
            if excused {
                out.findings.push(format!(
                    "{name}: {what} {i} kept for its quarantined slice (as the receipt says)"
                ));
            } else {
                out.verdict = Verdict::Fail;
                out.findings
                    .push(format!("{name}: left behind: {what} {i}"));
            }
        }
    };
    left(
        "MIG instance",
        "mig_instances",
        added(&before.instances, &after.instances),
        false,
    );
    left(
        "GPU reservation",
        "reservations",
        added(&before.reservations, &after.reservations),
        false,
    );
    left(
        "VF with a vGPU type",
        "vf_types",
        added(&before.vf_types, &after.vf_types),
        false,
    );
    left(
        "device bound to vfio-pci",
        "vfio_bound",
        added(&before.vfio_bound, &after.vfio_bound),
        receipt_quarantined && listed,
    );
}
