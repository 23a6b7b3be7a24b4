//! Values for the unit tests: `Tenant`s as the API server would hand them over, and node
//! inventories of database GPU models.

use kube::api::ObjectMeta;
use tenantvm::domain::spec::{GuestImage, Quotas};

use crate::crd::node::{NodeGpu, NodeVgpu};
use crate::crd::{NodeInventory, Tenant, TenantSpec, Tier};

/// The uid every test tenant has (its host name ends `-0a1b2c3d`).
pub const UID: &str = "0a1b2c3d-0000-4000-8000-000000000000";

/// A `Tenant` `name` in namespace `ns-a` with this tier and GPU request (JSON), 1 vCPU and
/// 128 MiB, booting the named image `idle`.
pub fn tenant(name: &str, tier: Tier, gpu: serde_json::Value) -> Tenant {
    Tenant {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns-a".into()),
            uid: Some(UID.into()),
            ..Default::default()
        },
        spec: TenantSpec {
            tier,
            vcpus: 1,
            memory_mib: 128,
            disk_gib: 0,
            gpu: serde_json::from_value(gpu).unwrap(),
            image: GuestImage {
                name: Some("idle".into()),
                ..Default::default()
            },
            quotas: Quotas::default(),
            hugepages: None,
            stopped: false,
        },
        status: None,
    }
}

/// An empty host of these GPUs (database model keys), 64 GiB and 64 vCPUs for tenants.
pub fn inventory(models: &[&str]) -> NodeInventory {
    let gpus = models
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let m = tenantvm_gpu::mig::model_by_key(key).unwrap();
            NodeGpu {
                index: i as u32,
                name: m.name.into(),
                model: Some(m.key.into()),
                pci_address: format!("0000:{:02x}:00.0", 0x10 + i),
                pci_device_id: m.pci_device_ids[0],
                memory_mib: m.memory_mib,
                mig_enabled: m.has_mig(),
                assigned_whole: false,
                iommu_group: Some(i as u32),
                driver_major: None,
                vgpu: NodeVgpu {
                    kind: "simulated".into(),
                    total_vfs: None,
                    reason: None,
                },
                instances: Vec::new(),
            }
        })
        .collect();
    NodeInventory {
        gpus,
        held: Vec::new(),
        memory_mib: 64 * 1024,
        memory_held_mib: 0,
        vcpus: 64,
        vcpus_held: 0,
        vmm_overhead_mib: 64,
        tenants: Vec::new(),
    }
}
