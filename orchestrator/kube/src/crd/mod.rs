//! The custom resources, generated from these Rust types (kube-rs `CustomResource`), and the
//! names shared by the operator and the node agents. `deploy/crds.yaml` is [`crds_yaml`]'s
//! output, committed and checked for drift by a test.

pub mod condition;
pub mod node;
pub mod schema;
pub mod tenant;

use kube::CustomResourceExt;

pub use condition::Condition;
pub use node::{NodeInventory, TenantvmNode, TenantvmNodeSpec, TenantvmNodeStatus};
pub use tenant::{GpuAssignment, Phase, ReceiptStatus, Tenant, TenantSpec, TenantStatus, Tier};

/// The API group.
pub const GROUP: &str = "tenantvm.dev";
/// The finalizer a `Tenant` carries until its departure's receipt is verified.
pub const FINALIZER: &str = "tenantvm.dev/departure";
/// The label naming the node a `Tenant` is bound to (the binding; node agents watch it).
pub const NODE_LABEL: &str = "tenantvm.dev/node";
/// The annotation holding the operator's placement ([`crate::binding::Binding`]).
pub const PLACEMENT_ANNOTATION: &str = "tenantvm.dev/placement";
/// Condition types.
pub mod conditions {
    /// Placed on a node (the operator).
    pub const PLACED: &str = "Placed";
    /// Its VM runs (the node agent).
    pub const READY: &str = "Ready";
    /// The node's tenantvmd answers within its deadline (the node agent).
    pub const TENANTVMD_REACHABLE: &str = "TenantvmdReachable";
    /// The node's lease expired (the operator).
    pub const NODE_LOST: &str = "NodeLost";
    /// The departure ended with a verified receipt (the node agent).
    pub const DEPARTED: &str = "Departed";
}

/// Both CRDs as one YAML stream (what `deploy/crds.yaml` holds).
pub fn crds_yaml() -> String {
    let mut out = String::from(
        "# Generated from orchestrator/kube/src/crd by `tenantvm-operator crds`; do not edit.\n",
    );
    for crd in [Tenant::crd(), TenantvmNode::crd()] {
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(&crd).expect("a CRD serialises"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_crds_are_the_types() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/crds.yaml");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == crds_yaml(),
            "{path} is not what the types generate: run `cargo run -p tenantvm-kube --bin tenantvm-operator -- crds > orchestrator/kube/deploy/crds.yaml`"
        );
    }

    #[test]
    fn the_tenant_crd_validates_what_the_host_would_refuse() {
        let crd = serde_json::to_value(Tenant::crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        assert_eq!(spec["properties"]["vcpus"]["maximum"].as_f64(), Some(64.0));
        assert_eq!(
            spec["properties"]["memory_mib"]["minimum"].as_f64(),
            Some(16.0)
        );
        assert_eq!(
            spec["properties"]["tier"]["enum"],
            serde_json::json!(["slice", "card", "host"])
        );
        assert_eq!(spec["required"], serde_json::json!(["image"]));
        let columns = &crd["spec"]["versions"][0]["additionalPrinterColumns"];
        let names: Vec<&str> = columns
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["Phase", "Node", "GPU", "Age"]);
        assert_eq!(crd["spec"]["scope"], "Namespaced");
        let node = serde_json::to_value(TenantvmNode::crd()).unwrap();
        assert_eq!(node["spec"]["scope"], "Cluster");
    }
}
