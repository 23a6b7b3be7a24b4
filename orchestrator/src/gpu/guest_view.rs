//! `tenantvm gpu-info`: what the daemon assigned to a tenant ([`AssignedGpu`], from its
//! ledger placement, its device record and the GPU backend: [`super::Describe::describe`])
//! beside what the guest reports (`gpu-info`, [`GpuInfoReply`]), and the [`Finding`]s of
//! comparing the two.
//!
//! The comparison rules (docs/gpu.md, "What the guest sees"):
//! - a device handed over must appear in the guest: a PCI function with the host device's
//!   vendor and device ids (whole card), or an NVIDIA display-class function (vGPU, whose
//!   ids in the guest are the vGPU's own);
//! - where the image has `nvidia-smi`, it must list exactly one GPU for a slice and none
//!   without one, and that GPU's `memory.total` must be within [`MEMORY_TOLERANCE_PERCENT`]
//!   of the slice's memory;
//! - a simulated host hands nothing over: nothing is expected in the guest, and the
//!   findings say so.

use serde::{Deserialize, Serialize};
use tenantvm_agent_protocol::{GpuInfoReply, NvidiaSmi};

use super::types::AssignedGpu;

/// How far `nvidia-smi`'s `memory.total` in the guest may be from the slice's memory, in
/// percent of the slice's memory. The slice's figure is NVML's `memorySizeMB` for a MIG
/// profile (already below the nominal `.10gb`) or the card's total for a whole card; a
/// driver in a guest reports framebuffer less its own reservations, a few percent at most.
/// Any two memory sizes one card offers differ by 2x or more, so 5 % never takes one profile
/// for another.
pub const MEMORY_TOLERANCE_PERCENT: u64 = 5;
/// How much a finding matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FindingLevel {
    /// The guest's view contradicts the assignment.
    Mismatch,
    /// Worth knowing; not a contradiction (nothing to check, a simulated host, ...).
    Note,
}

/// One result of the comparison.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Finding {
    /// Mismatch or note.
    pub level: FindingLevel,
    /// What, for people.
    pub message: String,
}

fn mismatch(message: impl Into<String>) -> Finding {
    Finding {
        level: FindingLevel::Mismatch,
        message: message.into(),
    }
}

fn note(message: impl Into<String>) -> Finding {
    Finding {
        level: FindingLevel::Note,
        message: message.into(),
    }
}

/// Whether `guest` MiB is within [`MEMORY_TOLERANCE_PERCENT`] of `slice` MiB.
pub fn memory_matches(guest: u64, slice: u64) -> bool {
    guest.abs_diff(slice).saturating_mul(100) <= slice.saturating_mul(MEMORY_TOLERANCE_PERCENT)
}

/// Compares the guest's view with the assignment (None: the tenant has no GPU share).
pub fn compare(assigned: Option<&AssignedGpu>, guest: &GpuInfoReply) -> Vec<Finding> {
    let mut out = Vec::new();
    if guest.pci_truncated {
        out.push(note(
            "the guest has more PCI functions than the reply lists; the rest were not checked",
        ));
    }
    let attached = assigned.filter(|a| a.attaches());
    match (assigned, attached) {
        (None, _) => out.push(note("no GPU share is assigned to this tenant")),
        (Some(a), None) => out.push(note(match &a.not_attached {
            Some(why) => format!("nothing is handed to the VM: {why}"),
            None => "the device is not handed to the VM yet".into(),
        })),
        (Some(_), Some(a)) => out.extend(check_pci(a, guest)),
    }
    out.extend(check_smi(attached, assigned.is_some(), &guest.nvidia_smi));
    out
}

fn check_pci(a: &AssignedGpu, guest: &GpuInfoReply) -> Option<Finding> {
    match (a.vendor, a.device) {
        (Some(v), Some(d)) => {
            let seen = guest.pci.iter().any(|f| f.vendor == v && f.device == d);
            (!seen).then(|| {
                mismatch(format!(
                    "the guest sees no PCI function {v:04x}:{d:04x}, the device handed over ({})",
                    a.host_devices.join(", ")
                ))
            })
        }
        (Some(v), None) => {
            let seen = guest
                .pci
                .iter()
                .any(|f| f.vendor == v && f.class >> 16 == 0x03);
            (!seen).then(|| {
                mismatch(format!(
                    "the guest sees no display-class PCI function of vendor {v:04x} ({} handed over)",
                    a.route
                ))
            })
        }
        _ => Some(note(
            "the ids of the device handed over are unknown here; the guest's PCI list is not checked",
        )),
    }
}

fn check_smi(attached: Option<&AssignedGpu>, assigned: bool, smi: &NvidiaSmi) -> Vec<Finding> {
    match smi {
        NvidiaSmi::Absent { .. } => vec![note(
            "the guest image has no nvidia-smi: the driver's view and the memory are not checked",
        )],
        NvidiaSmi::Failed {
            exit_code, message, ..
        } => {
            let text = format!(
                "nvidia-smi in the guest failed (exit {}): {message}",
                exit_code.map_or("none".into(), |c| c.to_string())
            );
            vec![if attached.is_some() {
                mismatch(text)
            } else {
                note(text)
            }]
        }
        NvidiaSmi::TimedOut { after_ms, .. } => {
            let text = format!("nvidia-smi in the guest did not finish within {after_ms} ms");
            vec![if attached.is_some() {
                mismatch(text)
            } else {
                note(text)
            }]
        }
        NvidiaSmi::Ran { gpus, .. } => {
            let Some(a) = attached else {
                return if gpus.is_empty() {
                    Vec::new()
                } else if assigned {
                    vec![mismatch(format!(
                        "nvidia-smi in the guest lists {} GPU(s), but no device was handed to the VM",
                        gpus.len()
                    ))]
                } else {
                    vec![mismatch(format!(
                        "nvidia-smi in the guest lists {} GPU(s), but the tenant has no GPU share",
                        gpus.len()
                    ))]
                };
            };
            if gpus.len() != 1 {
                return vec![mismatch(format!(
                    "nvidia-smi in the guest lists {} GPUs; the tenant was given one",
                    gpus.len()
                ))];
            }
            match (gpus[0].memory_total_mib, a.memory_mib) {
                (Some(g), Some(s)) if !memory_matches(g, s) => vec![mismatch(format!(
                    "nvidia-smi in the guest reports {g} MiB; the slice has {s} MiB (tolerance {MEMORY_TOLERANCE_PERCENT} %)"
                ))],
                (Some(_), Some(_)) => Vec::new(),
                (None, _) => vec![mismatch(
                    "nvidia-smi in the guest reports no memory.total for its GPU",
                )],
                (Some(_), None) => vec![note(
                    "the slice's memory is unknown here; the guest's memory.total is not checked",
                )],
            }
        }
    }
}

#[cfg(test)]
#[path = "guest_view_tests.rs"]
mod tests;
