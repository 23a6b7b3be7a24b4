//! What a tenant uses and what the host holds, read for the layers above the service
//! (metrics at scrape, `GET /v1/host`, the front door's forwarding), so that none of them
//! reaches into the service's step context. Reads only: nothing here changes a tenant.

use std::time::Duration;

use tenantvm_gpu::backend::{GpuInfo, SliceUsage};

use crate::backend::DiskCounters;
use crate::jail::CgroupHandle;
use crate::store::{GpuPlacement, TenantRecord};
use crate::tenant::infer::{AdmittedInfer, InferError, PayloadRequest, PayloadResponse};
use crate::tenant::service::TenantService;
use crate::tenant::service_error::TenantServiceError;

/// One reading of a tenant's VM and GPU slice; each part absent where it could not be read.
#[derive(Debug, Default)]
pub struct TenantUsage {
    /// The VM's cgroup(s), if it runs (read by the metrics at once).
    pub cgroup: Option<CgroupHandle>,
    /// Its VMM's disk counters.
    pub disk: Option<DiskCounters>,
    /// Its GPU slice's memory and utilisation.
    pub gpu: Option<SliceUsage>,
}

/// The host's GPUs and the shares of them held (by tenants and by quarantine).
#[derive(Debug)]
pub struct GpuInventory {
    /// The GPUs as the GPU backend lists them.
    pub gpus: Vec<GpuInfo>,
    /// The shares held.
    pub held: Vec<GpuPlacement>,
}

impl TenantService {
    /// Reads `record`'s VM and GPU slice, waiting at most `vmm_timeout` for its VMM (which
    /// runs as the tenant: a silent one costs this reading that much and no more). Blocks.
    pub fn usage(&self, record: &TenantRecord, vmm_timeout: Duration) -> TenantUsage {
        let name = record.name.as_str();
        let ctx = self.ctx();
        let vm = crate::tenant::context::Tenant::load(&ctx, record)
            .ok()
            .and_then(|t| t.vm);
        let disk = vm.as_ref().and_then(|vm| {
            ctx.backend
                .disk_counters(vm, vmm_timeout)
                .map_err(|e| tracing::debug!(tenant = %name, error = %e, "no disk counters"))
                .ok()
                .flatten()
        });
        let gpu = ctx
            .store
            .gpu_placement(record.id)
            .ok()
            .flatten()
            .and_then(|placement| {
                crate::tenant::steps::gpu::usage(&ctx, &placement)
                    .map_err(|e| tracing::debug!(tenant = %name, error = %e, "no GPU usage"))
                    .ok()
                    .flatten()
            });
        TenantUsage {
            cgroup: vm.map(|vm| vm.cgroup),
            disk,
            gpu,
        }
    }

    /// The host's GPUs and the shares held (`GET /v1/host`).
    pub fn gpu_inventory(&self) -> Result<GpuInventory, TenantServiceError> {
        let ctx = self.ctx();
        Ok(GpuInventory {
            gpus: crate::tenant::steps::gpu::host_gpus(&ctx)?,
            held: crate::tenant::steps::gpu::held_shares(ctx.store)?,
        })
    }

    /// Forwards an admitted front-door request to the tenant's payload (blocks until the
    /// guest answers with its head or its deadline passes).
    pub fn forward_payload(
        &self,
        admitted: AdmittedInfer,
        request: PayloadRequest,
    ) -> Result<PayloadResponse, InferError> {
        crate::tenant::infer::forward_http(&self.ctx(), admitted, request)
    }
}
