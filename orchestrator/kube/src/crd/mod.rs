//! The custom resources, generated from these Rust types (kube-rs `CustomResource`), and the
//! names shared by the operator and the node agents. `deploy/crds.yaml` is [`crds_yaml`]'s
//! output, committed and checked for drift by a test.

pub mod condition;
pub mod node;
pub mod schema;
pub mod tenant;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps,
};
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
/// The annotation holding the operator's placement ([`crate::operator::Binding`]).
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

/// The `Tenant` CRD: the generated one, with the tenant-name rule on `metadata.name` (the
/// one restriction of metadata a CRD's schema may make), so the API server refuses a name
/// the host could not take before anything is stored.
pub fn tenant_crd() -> CustomResourceDefinition {
    let mut crd = Tenant::crd();
    for version in &mut crd.spec.versions {
        let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        else {
            continue;
        };
        let name = JSONSchemaProps {
            type_: Some("string".into()),
            pattern: Some(format!(
                "^[a-z0-9][a-z0-9-]{{0,{}}}$",
                crate::naming::MAX_NAME_LEN - 1
            )),
            max_length: Some(crate::naming::MAX_NAME_LEN as i64),
            ..Default::default()
        };
        let metadata = JSONSchemaProps {
            type_: Some("object".into()),
            properties: Some([("name".to_string(), name)].into()),
            ..Default::default()
        };
        schema
            .properties
            .get_or_insert_with(Default::default)
            .insert("metadata".into(), metadata);
    }
    crd
}

/// Both CRDs as one YAML stream (what `deploy/crds.yaml` holds).
pub fn crds_yaml() -> String {
    let mut out = String::from(
        "# Generated from orchestrator/kube/src/crd by `tenantvm-operator crds`; do not edit.\n",
    );
    for crd in [tenant_crd(), TenantvmNode::crd()] {
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
        let crd = serde_json::to_value(tenant_crd()).unwrap();
        let root = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        let pattern = root["properties"]["metadata"]["properties"]["name"]["pattern"]
            .as_str()
            .unwrap();
        assert_eq!(pattern, "^[a-z0-9][a-z0-9-]{0,53}$");
        // The same rule as the host's, on the longest name and one past it.
        let longest = "a".repeat(crate::naming::MAX_NAME_LEN);
        crate::naming::host_name(&longest, "0a1b2c3d").unwrap();
        assert_eq!(
            root["properties"]["metadata"]["properties"]["name"]["maxLength"],
            54
        );
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
