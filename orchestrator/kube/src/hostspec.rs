//! A `Tenant` as its host takes it: the daemon's own spec ([`HostSpec`]), named with
//! [`crate::naming::host_name`], with the tier applied to the GPU request and checked by the
//! daemon's own validation, so the cluster refuses what a host would (one rule, one place).

use tenantvm::domain::spec::{HugePagesSetting, TenantSpec as HostSpec, TenantSpecError};

use crate::crd::{Tenant, Tier};
use crate::naming::{self, NameError};

/// Why a `Tenant` cannot become a host tenant.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The name (or uid) cannot name a host tenant.
    #[error(transparent)]
    Name(#[from] NameError),
    /// The tier and the GPU request contradict each other.
    #[error("Tier {tier}: {why}")]
    Tier {
        /// The tier.
        tier: &'static str,
        /// Why, and what to change.
        why: &'static str,
    },
    /// The host's validation refused it.
    #[error(transparent)]
    Spec(#[from] TenantSpecError),
    /// The object has no uid yet (never stored by the API server).
    #[error("The Tenant has no uid: it was not read from the API server")]
    NoUid,
}

/// The host's spec of `tenant`.
pub fn host_spec(tenant: &Tenant) -> Result<HostSpec, SpecError> {
    let uid = tenant.metadata.uid.as_deref().ok_or(SpecError::NoUid)?;
    let name = naming::host_name(tenant.metadata.name.as_deref().unwrap_or_default(), uid)?;
    let s = &tenant.spec;
    let mut gpu = s.gpu.clone();
    match s.tier {
        Tier::Slice if gpu.whole_gpu => {
            return Err(SpecError::Tier {
                tier: "slice",
                why: "a slice is a share of a card; `whole_gpu` asks for the card: use tier card",
            })
        }
        Tier::Card if gpu.profile.is_some() => {
            return Err(SpecError::Tier {
                tier: "card",
                why: "a card is a whole GPU; `profile` asks for a share of one: drop it, or use tier slice",
            })
        }
        // A card is a whole GPU: with a model, one that holds it.
        Tier::Card => gpu.whole_gpu = true,
        Tier::Slice | Tier::Host => {}
    }
    let hugepages = s
        .hugepages
        .clone()
        .map(HugePagesSetting::try_from)
        .transpose()
        .map_err(TenantSpecError::Toml)?;
    let spec = HostSpec {
        name,
        vcpus: s.vcpus,
        memory_mib: s.memory_mib,
        disk_gib: s.disk_gib,
        gpu,
        image: s.image.clone(),
        quotas: s.quotas.clone(),
        hugepages,
        // A vGPU licence is a secret: a `Tenant` would name a Secret that the node agent
        // reads, which is not built yet (docs/kubernetes.md), so none is passed on.
        vgpu_licence: None,
    };
    spec.validate()?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::tenant;

    #[test]
    fn the_tier_shapes_the_gpu_request() {
        let card = host_spec(&tenant(
            "c",
            Tier::Card,
            serde_json::json!({"model": "llama-3-8b"}),
        ))
        .unwrap();
        assert!(card.gpu.whole_gpu);
        assert_eq!(card.gpu.model.as_deref(), Some("llama-3-8b"));
        let e = host_spec(&tenant(
            "c",
            Tier::Card,
            serde_json::json!({"profile": "1g.10gb"}),
        ))
        .unwrap_err();
        assert!(e.to_string().contains("drop it"), "{e}");
        let e = host_spec(&tenant(
            "s",
            Tier::Slice,
            serde_json::json!({"whole_gpu": true}),
        ))
        .unwrap_err();
        assert!(e.to_string().contains("use tier card"), "{e}");
        let slice = host_spec(&tenant(
            "s",
            Tier::Slice,
            serde_json::json!({"profile": "1g.10gb"}),
        ))
        .unwrap();
        assert!(!slice.gpu.whole_gpu);
        assert_eq!(slice.name.as_str(), "s-0a1b2c3d");
    }

    #[test]
    fn the_hosts_own_validation_refuses_what_it_would() {
        let mut t = tenant("v", Tier::Slice, serde_json::json!({}));
        t.spec.vcpus = 65;
        assert!(matches!(
            host_spec(&t),
            Err(SpecError::Spec(TenantSpecError::OutOfRange {
                field: "vcpus",
                ..
            }))
        ));
        let mut t = tenant("v", Tier::Slice, serde_json::json!({"context": 4}));
        t.spec.vcpus = 1;
        assert!(matches!(
            host_spec(&t),
            Err(SpecError::Spec(TenantSpecError::Gpu(_)))
        ));
        let mut t = tenant("v", Tier::Slice, serde_json::json!({}));
        t.spec.hugepages = Some("4K".into());
        host_spec(&t).unwrap_err();
        let t = tenant("Bad.Name", Tier::Slice, serde_json::json!({}));
        assert!(matches!(host_spec(&t), Err(SpecError::Name(_))));
    }
}
