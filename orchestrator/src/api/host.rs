//! `GET /v1/host`: what this host has and what its tenants hold, for a placer of many hosts
//! (the Kubernetes node agent publishes it as its `TenantvmNode`, docs/kubernetes.md): the
//! GPUs as the GPU backend lists them with their MIG instances, the shares the ledger holds
//! (reservations and quarantined slices, as `reserve-gpu` folds them into its placement),
//! and the memory and vCPUs that tenants not destroyed reserve of what the host gives them.
//! Admin only: it names every tenant of the host.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use tenantvm_gpu::backend::{GpuInfo, GpuInstance};
use tenantvm_gpu::mig::{self, VgpuSupport};
use tenantvm_gpu::plan::place::Held;

use super::lanes::{offload, Lane};
use super::{authorization, ApiError, ApiState};
use crate::auth::{self, Caller};
use crate::tenant::admission::reservation;

/// The answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HostView {
    /// The GPUs, with their instances (empty without a GPU backend).
    pub gpus: Vec<HostGpuView>,
    /// The shares the ledger holds: reservations of tenants and quarantined slices.
    pub held: Vec<Held>,
    /// MiB of memory tenants may reserve in all (the host's less its reserve, times the
    /// memory overcommit).
    pub memory_mib: u64,
    /// MiB reserved by tenants not destroyed (guest memory + VMM overhead each).
    pub memory_held_mib: u64,
    /// vCPUs tenants may reserve in all (the CPUs times the vCPU overcommit).
    pub vcpus: u64,
    /// vCPUs reserved by tenants not destroyed.
    pub vcpus_held: u64,
    /// MiB one tenant reserves beyond its guest memory (the VMM's overhead).
    pub vmm_overhead_mib: u64,
    /// The tenants not destroyed, by name.
    pub tenants: Vec<String>,
}

/// One GPU as the backend lists it ([`GpuInfo`], with owned text so it reads back).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HostGpuView {
    /// Index on the host.
    pub index: u32,
    /// Product name.
    pub name: String,
    /// The database model key (absent: a GPU the MIG database does not know).
    pub model: Option<String>,
    /// PCI address.
    pub pci_address: String,
    /// PCI device id.
    pub pci_device_id: u16,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// MIG mode.
    pub mig_enabled: bool,
    /// Handed out whole.
    pub assigned_whole: bool,
    /// IOMMU group, if known.
    pub iommu_group: Option<u32>,
    /// Major version of the NVIDIA driver, if known.
    pub driver_major: Option<u32>,
    /// How MIG instances reach a VM.
    pub vgpu: VgpuSupport,
    /// Existing GPU instances.
    pub instances: Vec<GpuInstance>,
}

impl From<&GpuInfo> for HostGpuView {
    fn from(g: &GpuInfo) -> Self {
        HostGpuView {
            index: g.index,
            name: g.name.clone(),
            model: g.model.map(str::to_string),
            pci_address: g.pci_address.clone(),
            pci_device_id: g.pci_device_id,
            memory_mib: g.memory_mib,
            mig_enabled: g.mig_enabled,
            assigned_whole: g.assigned_whole,
            iommu_group: g.iommu_group,
            driver_major: g.driver_major,
            vgpu: g.vgpu.clone(),
            instances: g.instances.clone(),
        }
    }
}

impl HostGpuView {
    /// The backend's form again, as the planner takes it (a model key the database does not
    /// know reads as none, as the backend would list it).
    pub fn to_gpu_info(&self) -> GpuInfo {
        GpuInfo {
            index: self.index,
            name: self.name.clone(),
            model: self
                .model
                .as_deref()
                .and_then(|k| mig::model_by_key(k).ok())
                .map(|m| m.key),
            pci_address: self.pci_address.clone(),
            pci_device_id: self.pci_device_id,
            memory_mib: self.memory_mib,
            mig_enabled: self.mig_enabled,
            assigned_whole: self.assigned_whole,
            iommu_group: self.iommu_group,
            driver_major: self.driver_major,
            vgpu: self.vgpu.clone(),
            instances: self.instances.clone(),
        }
    }
}

/// `GET /v1/host`.
pub(super) async fn get(
    State(api): State<ApiState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let caller = auth::authenticate(api.svc.store(), authorization(&headers))?;
    if caller != Caller::Admin {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "Only the admin token may read the host's inventory",
        ));
    }
    let permit = api.lanes.enter(Lane::of(&caller))?;
    let svc = api.svc.clone();
    let view = offload(permit, move || -> Result<HostView, ApiError> {
        let internal = |e: String| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e);
        let inventory = svc.gpu_inventory()?;
        let held = inventory
            .held
            .iter()
            .map(|p| Held::from_label(p.gpu.clone(), &p.label))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| internal(e.to_string()))?;
        let tenants = svc
            .store()
            .list_tenants(false)
            .map_err(|e| internal(e.to_string()))?;
        let overhead = svc.config().vmm_overhead_mib;
        let (mut memory_held_mib, mut vcpus_held) = (0, 0);
        for t in &tenants {
            let r = reservation(&t.spec, overhead);
            memory_held_mib += r.memory_mib;
            vcpus_held += r.vcpus;
        }
        let cap = &svc.config().capacity;
        let scaled = |n: u64, ratio: f64| (n as f64 * ratio).floor() as u64;
        Ok(HostView {
            gpus: inventory.gpus.iter().map(HostGpuView::from).collect(),
            held,
            memory_mib: scaled(cap.memory_mib, cap.memory_overcommit),
            memory_held_mib,
            vcpus: scaled(cap.cpus, cap.vcpu_overcommit),
            vcpus_held,
            vmm_overhead_mib: overhead,
            tenants: tenants.iter().map(|t| t.name.to_string()).collect(),
        })
    })
    .await??;
    Ok((StatusCode::OK, Json(view)).into_response())
}
