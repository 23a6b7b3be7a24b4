//! The `TenantvmNode` resource: one GPU host as its node agent publishes it (cluster-scoped,
//! named after the node). The status is the host's own inventory, `GET /v1/host` of its
//! tenantvmd, under the daemon's field names, plus what is free per GPU; the node agent's
//! heartbeat is a coordination `Lease` (`tenantvm-node-<name>` in the operator's namespace).

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tenantvm::api::host::{HostGpuView, HostView};
use tenantvm_gpu::backend::GpuInfo;
use tenantvm_gpu::plan::place::Held;

use super::condition::Condition;

/// What an administrator sets on a node.
#[derive(CustomResource, Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "tenantvm.dev",
    version = "v1alpha1",
    kind = "TenantvmNode",
    plural = "tenantvmnodes",
    shortname = "tvn",
    status = "TenantvmNodeStatus",
    printcolumn = r#"{"name":"Schedulable","type":"boolean","jsonPath":".spec.schedulable"}"#,
    printcolumn = r#"{"name":"Tenants","type":"integer","jsonPath":".status.tenant_count"}"#,
    printcolumn = r#"{"name":"GPU free","type":"string","jsonPath":".status.gpu_free"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct TenantvmNodeSpec {
    /// Whether the operator may place new tenants here (false: cordoned; tenants already
    /// here stay).
    #[serde(default = "yes")]
    pub schedulable: bool,
}

fn yes() -> bool {
    true
}

/// What the node agent publishes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TenantvmNodeStatus {
    /// The host's inventory as its tenantvmd reported it last (absent: never reached).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inventory: Option<NodeInventory>,
    /// What is free, per GPU, in one line (`0000:07:00.0 5/7 free, ...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_free: Option<String>,
    /// Tenants on the host.
    #[serde(default)]
    pub tenant_count: u32,
    /// Host tenants no `Tenant` is bound to here (made outside Kubernetes, or a `Tenant`
    /// whose finalizer was taken off by hand).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unowned: Vec<String>,
    /// When the inventory was read (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated: Option<String>,
    /// Conditions: `TenantvmdReachable`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The daemon's `GET /v1/host` answer ([`HostView`]), with a schema.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct NodeInventory {
    /// The GPUs with their MIG instances.
    pub gpus: Vec<NodeGpu>,
    /// Shares the ledger holds (reservations and quarantined slices).
    pub held: Vec<NodeHeld>,
    /// MiB tenants may reserve in all.
    pub memory_mib: u64,
    /// MiB tenants reserve.
    pub memory_held_mib: u64,
    /// vCPUs tenants may reserve in all.
    pub vcpus: u64,
    /// vCPUs tenants reserve.
    pub vcpus_held: u64,
    /// MiB one tenant reserves beyond its guest memory.
    pub vmm_overhead_mib: u64,
    /// The host's tenants (not destroyed).
    pub tenants: Vec<String>,
}

/// One GPU ([`HostGpuView`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeGpu {
    /// Index on the host.
    pub index: u32,
    /// Product name.
    pub name: String,
    /// MIG database key.
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
    /// IOMMU group.
    pub iommu_group: Option<u32>,
    /// NVIDIA driver major version.
    pub driver_major: Option<u32>,
    /// How MIG instances reach a VM (vGPU capability).
    pub vgpu: NodeVgpu,
    /// Existing GPU instances.
    pub instances: Vec<NodeGpuInstance>,
}

/// How MIG instances of a GPU reach a VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeVgpu {
    /// `sriov`, `mdev`, `missing` or `simulated`.
    pub kind: String,
    /// SR-IOV: the GPU's `sriov_totalvfs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_vfs: Option<u32>,
    /// Missing: what is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// One MIG instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeGpuInstance {
    /// GPU-instance id.
    pub gi_id: u32,
    /// Profile id.
    pub profile_id: u32,
    /// Start slot.
    pub start: u32,
    /// Size in placement units.
    pub size: u32,
    /// Whether its compute instance exists.
    pub has_compute_instance: bool,
}

/// A share the ledger holds ([`Held`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeHeld {
    /// The GPU (PCI address, or index as text).
    pub gpu: String,
    /// What is held.
    pub share: NodeHeldShare,
}

/// What a [`NodeHeld`] holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeHeldShare {
    /// `mig` or `whole`.
    pub kind: String,
    /// MIG: the profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// MIG: the start slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<u32>,
}

/// The inventory and the daemon's answer disagree on a field (a daemon newer than this
/// agent).
#[derive(Debug, thiserror::Error)]
#[error("The host inventory does not convert: {0}")]
pub struct InventoryError(String);

fn convert<A: Serialize, B: serde::de::DeserializeOwned>(a: &A) -> Result<B, InventoryError> {
    serde_json::to_value(a)
        .and_then(serde_json::from_value)
        .map_err(|e| InventoryError(e.to_string()))
}

impl NodeInventory {
    /// From the daemon's answer.
    pub fn from_host(view: &HostView) -> Result<NodeInventory, InventoryError> {
        convert(view)
    }

    /// The GPUs as the planner takes them.
    pub fn gpu_infos(&self) -> Result<Vec<GpuInfo>, InventoryError> {
        self.gpus
            .iter()
            .map(|g| convert::<_, HostGpuView>(g).map(|v| v.to_gpu_info()))
            .collect()
    }

    /// The held shares as the planner takes them.
    pub fn held_shares(&self) -> Result<Vec<Held>, InventoryError> {
        self.held.iter().map(convert).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenantvm_gpu::backend::sim::SimBackend;
    use tenantvm_gpu::backend::GpuBackend;

    #[test]
    fn the_hosts_inventory_reads_back_as_the_planner_takes_it() {
        let fixture = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/hosts/sim-mixed.json"
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("host.json");
        std::fs::copy(fixture, &file).unwrap();
        let gpus = SimBackend::open(&file).unwrap().gpus().unwrap();
        let view = HostView {
            gpus: gpus.iter().map(HostGpuView::from).collect(),
            held: vec![
                Held::from_label("0000:0f:00.0", "1g.18gb@6").unwrap(),
                Held::from_label("0000:41:00.0", "whole").unwrap(),
            ],
            memory_mib: 1000,
            memory_held_mib: 10,
            vcpus: 4,
            vcpus_held: 1,
            vmm_overhead_mib: 64,
            tenants: vec!["a".into()],
        };
        let inv = NodeInventory::from_host(&view).unwrap();
        assert_eq!(inv.gpu_infos().unwrap(), gpus);
        assert_eq!(inv.held_shares().unwrap(), view.held);
        // Through the API server's JSON and back.
        let json = serde_json::to_string(&inv).unwrap();
        let back: NodeInventory = serde_json::from_str(&json).unwrap();
        assert_eq!(back, inv);
        assert!(
            !inv.gpus[0].instances.is_empty(),
            "the fixture's instance is carried"
        );
    }
}
