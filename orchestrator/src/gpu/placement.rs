//! [`Placement`] over a tenantvm-gpu backend: the exact planner
//! (`tenantvm_gpu::plan::place::place_on_host`) over the host's GPUs and instances, the
//! ledger's reservations and quarantined slices, and the new request; the MIG instance of a
//! reserved placement created and destroyed (found again from its GPU, profile and start),
//! and the card's MIG mode turned off again after its last MIG tenant.

use tenantvm_gpu::plan::place::{place_on_host, Held};
use tenantvm_gpu::plan::search::DEFAULT_NODE_BUDGET;

use super::backend::{find_gpu, BackendPlanner};
use super::error::{plan_err, GpuError};
use super::seam::Placement;
use super::types::MigRestore;
use crate::domain::spec::GpuRequest;
use crate::store::GpuPlacement;

impl Placement for BackendPlanner {
    fn place(
        &self,
        tenant: &str,
        request: &GpuRequest,
        held: &[GpuPlacement],
    ) -> Result<GpuPlacement, GpuError> {
        let gpus = self.backend().gpus().map_err(plan_err)?;
        let held = held
            .iter()
            .map(|p| Held::from_label(p.gpu.clone(), &p.label))
            .collect::<Result<Vec<_>, _>>()
            .map_err(plan_err)?;
        let placement =
            place_on_host(&gpus, &held, tenant, request, DEFAULT_NODE_BUDGET).map_err(plan_err)?;
        Ok(GpuPlacement {
            gpu: placement.held().gpu,
            slots: placement.slots.clone(),
            label: placement.label(),
        })
    }

    fn materialize(&self, placement: &GpuPlacement) -> Result<(), GpuError> {
        let Some((gpu, profile, start)) = self.mig_of(placement)? else {
            return Ok(());
        };
        let gpus = self.backend().gpus().map_err(plan_err)?;
        let exists = gpus.iter().any(|g| {
            g.index == gpu
                && g.instances
                    .iter()
                    .any(|i| i.profile_id == profile.id && i.start == start)
        });
        // The planner may choose a GPU whose MIG mode is off (prepare-gpu-host turns it on
        // for a vGPU card; on the other routes it is turned on here).
        let mig_off = gpus.iter().any(|g| g.index == gpu && !g.mig_enabled);
        if !exists && mig_off {
            self.backend().set_mig_mode(gpu, true).map_err(plan_err)?;
        }
        if !exists {
            self.backend()
                .create_instance(gpu, profile.id, start)
                .map_err(plan_err)?;
        }
        Ok(())
    }

    fn release(&self, placement: &GpuPlacement) -> Result<(), GpuError> {
        let Some((gpu, profile, start)) = self.mig_of(placement)? else {
            return Ok(());
        };
        let gpus = self.backend().gpus().map_err(plan_err)?;
        let found = gpus
            .iter()
            .filter(|g| g.index == gpu)
            .flat_map(|g| g.instances.iter())
            .find(|i| i.profile_id == profile.id && i.start == start);
        if let Some(i) = found {
            self.backend()
                .destroy_instance(gpu, i.gi_id)
                .map_err(plan_err)?;
        }
        Ok(())
    }

    fn mig_enabled(&self, gpu: &str) -> Result<Option<bool>, GpuError> {
        let gpus = self.backend().gpus().map_err(plan_err)?;
        Ok(find_gpu(&gpus, gpu).map(|g| g.mig_enabled))
    }

    /// The card's last MIG tenant gone: MIG off again on `gpu`, unless it is off already or
    /// instances remain on it (not this daemon's to destroy: MIG stays on and the outcome
    /// says why).
    fn restore_mig_off(&self, gpu: &str) -> Result<MigRestore, GpuError> {
        let info = self.gpu_info(gpu)?;
        if !info.mig_enabled {
            return Ok(MigRestore::AlreadyOff);
        }
        if !info.instances.is_empty() {
            return Ok(MigRestore::LeftOn(format!(
                "GPU instances {:?} remain on it",
                info.instances.iter().map(|i| i.gi_id).collect::<Vec<_>>()
            )));
        }
        self.backend()
            .set_mig_mode(info.index, false)
            .map_err(plan_err)?;
        Ok(MigRestore::TurnedOff)
    }
}
