//! The fake host's GPU slices: placed as the daemon would (a MIG instance and a VF with a
//! vGPU type, or a whole GPU, bound to vfio-pci) and released by a departure's GPU steps.

use std::collections::BTreeSet;

use super::{step, FakeVerifyHost, State};
use crate::api::types::GpuSlice;
use crate::receipt::{Assurance, DepartureStep, StepRecord, StepResult};
use crate::verify::host::HostError;

/// What a slice put into the fake host's GPU state: its MIG instance, reservation, VF type
/// and vfio binding (each `None` where it has none).
#[derive(Debug, Default, Clone)]
pub(super) struct SliceItems {
    instance: Option<String>,
    reservation: String,
    vf_type: Option<String>,
    bound: String,
    id: String,
}

impl FakeVerifyHost {
    /// Places a GPU request as the daemon would: a MIG profile on the first GPU that has
    /// it (its instance, a VF with a vGPU type, bound to vfio-pci), or a whole non-MIG GPU
    /// no tenant holds (bound to vfio-pci).
    pub(super) fn place(
        &self,
        st: &mut State,
        name: &str,
        req: &crate::domain::spec::GpuRequest,
    ) -> Result<GpuSlice, HostError> {
        let n = st.slices.len() as u32;
        let none_free = || HostError::Api {
            status: 409,
            message: "no GPU slice free for this request".into(),
        };
        let (gpu, label, items) = match &req.profile {
            Some(profile) => {
                let (g, p) = self
                    .gpus
                    .iter()
                    .find_map(|g| g.model.profile(profile).ok().map(|p| (g, p)))
                    .ok_or_else(none_free)?;
                let label = format!("{}@{n}", p.name);
                let vf = format!("{}.{}", &g.pci_address[..g.pci_address.len() - 2], n + 4);
                let items = SliceItems {
                    instance: Some(format!(
                        "{} gi {} profile {} @{n}",
                        g.pci_address,
                        n + 1,
                        p.id
                    )),
                    reservation: format!("{}/{label}", g.pci_address),
                    vf_type: Some(format!("{vf} current_vgpu_type 557")),
                    bound: vf,
                    id: format!("{}/{label}", g.pci_address),
                };
                (g.pci_address.clone(), label, items)
            }
            None => {
                let held: BTreeSet<&str> = st
                    .tenants
                    .values()
                    .filter_map(|t| t.view.gpu.as_ref().map(|s| s.gpu.as_str()))
                    .collect();
                let g = self
                    .gpus
                    .iter()
                    .find(|g| !g.model.has_mig() && !held.contains(g.pci_address.as_str()))
                    .ok_or_else(none_free)?;
                let items = SliceItems {
                    instance: None,
                    reservation: format!("{}/whole", g.pci_address),
                    vf_type: None,
                    bound: g.pci_address.clone(),
                    id: format!("{}/whole", g.pci_address),
                };
                (g.pci_address.clone(), "whole".to_string(), items)
            }
        };
        let gs = &mut st.gpu;
        gs.instances.extend(items.instance.clone());
        gs.reservations.insert(items.reservation.clone());
        gs.vf_types.extend(items.vf_type.clone());
        gs.vfio_bound.insert(items.bound.clone());
        st.slices.insert(name.to_string(), items);
        Ok(GpuSlice {
            gpu,
            slots: vec![n],
            label,
        })
    }

    /// A departure's GPU steps on the fake: each undone unless [`Broken`](super::Broken) says otherwise,
    /// and recorded in the receipt.
    pub(super) fn release_slice(
        &self,
        st: &mut State,
        items: &SliceItems,
        steps: &mut Vec<StepRecord>,
    ) {
        let b = self.broken;
        let gs = &mut st.gpu;
        if !b.gpu_instance_left {
            if let Some(i) = &items.instance {
                gs.instances.remove(i);
            }
        }
        if !b.vf_type_left {
            if let Some(t) = &items.vf_type {
                gs.vf_types.remove(t);
            }
        }
        if !b.reservation_left {
            gs.reservations.remove(&items.reservation);
        }
        let quarantined = b.gpu_quarantined || b.quarantine_unrecorded;
        if !b.vfio_left_bound && !quarantined {
            gs.vfio_bound.remove(&items.bound);
        }
        if quarantined {
            gs.quarantined.insert(items.id.clone());
        }
        steps.push(step(DepartureStep::DeviceReset, Assurance::Simulated));
        let scrub = if b.gpu_scrub_skipped {
            StepRecord::new(
                DepartureStep::GpuScrub,
                "fake",
                StepResult::Skipped,
                Assurance::NotApplicable,
                "2026-01-01T00:00:00Z".into(),
                "2026-01-01T00:00:01Z".into(),
            )
        } else if b.gpu_quarantined {
            StepRecord::new(
                DepartureStep::GpuScrub,
                "fake",
                StepResult::Failed,
                Assurance::Unverified,
                "2026-01-01T00:00:00Z".into(),
                "2026-01-01T00:00:01Z".into(),
            )
            .with_evidence("quarantined", true)
            .failed("fake: residue found after the scrub")
        } else {
            step(DepartureStep::GpuScrub, Assurance::Simulated)
        };
        steps.push(scrub);
        steps.push(step(DepartureStep::GpuRelease, Assurance::Simulated));
    }
}
