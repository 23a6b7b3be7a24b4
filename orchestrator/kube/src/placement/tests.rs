use super::*;
use crate::hostspec::host_spec;
use crate::test_support::{inventory, tenant};
use serde_json::json;
use tenantvm_gpu::plan::place::place_on_host;

fn spec(name: &str, tier: Tier, gpu: serde_json::Value) -> HostSpec {
    host_spec(&tenant(name, tier, gpu)).unwrap()
}

fn node<'a>(name: &'a str, inv: &'a NodeInventory) -> Node<'a> {
    Node {
        name,
        inventory: inv,
        unavailable: None,
    }
}

fn bound(node: &str, d: &Decision, s: &HostSpec, tier: Tier) -> Bound {
    Bound {
        node: node.into(),
        host_name: s.name.to_string(),
        tier,
        memory_mib: u64::from(s.memory_mib),
        vcpus: u64::from(s.vcpus),
        share: d.share.clone(),
    }
}

/// Places `n` tenants one after another, each beside those before it; returns their nodes.
fn place_all(nodes: &[Node<'_>], specs: &[(HostSpec, Tier)], policy: Policy) -> Vec<Decision> {
    let mut b = Vec::new();
    let mut out = Vec::new();
    for (s, tier) in specs {
        let d = place(
            nodes,
            &b,
            Request {
                spec: s,
                tier: *tier,
            },
            policy,
        )
        .unwrap();
        b.push(bound(&d.node, &d, s, *tier));
        out.push(d);
    }
    out
}

#[test]
fn pack_fills_a_node_first_and_spread_evens_them_out() {
    let (a, b) = (inventory(&["h100-80gb"]), inventory(&["h100-80gb"]));
    let nodes = [node("node-a", &a), node("node-b", &b)];
    let specs: Vec<(HostSpec, Tier)> = (0..3)
        .map(|i| {
            (
                spec(&format!("t{i}"), Tier::Slice, json!({"profile": "1g.10gb"})),
                Tier::Slice,
            )
        })
        .collect();
    let packed: Vec<String> = place_all(&nodes, &specs, Policy::Pack)
        .into_iter()
        .map(|d| d.node)
        .collect();
    assert_eq!(packed, ["node-a", "node-a", "node-a"]);
    let spread: Vec<String> = place_all(&nodes, &specs, Policy::Spread)
        .into_iter()
        .map(|d| d.node)
        .collect();
    assert_eq!(spread, ["node-a", "node-b", "node-a"]);
    // The planned shares on one node never overlap.
    let shares: Vec<String> = place_all(&nodes, &specs, Policy::Pack)
        .iter()
        .map(|d| d.label().unwrap())
        .collect();
    let mut unique = shares.clone();
    unique.dedup();
    assert_eq!(unique.len(), 3, "{shares:?}");
}

#[test]
fn on_one_node_the_choice_is_the_daemons_own_planners() {
    let inv = inventory(&["a100-40gb", "h100-80gb", "h100-80gb"]);
    let gpus = inv.gpu_infos().unwrap();
    let nodes = [node("n", &inv)];
    let mut held = Vec::new();
    let mut b = Vec::new();
    for (i, gpu) in [
        json!({"profile": "1g.5gb"}),
        json!({"model": "llama-3-8b"}),
        json!({"whole_gpu": true}),
        json!({"profile": "2g.10gb"}),
    ]
    .into_iter()
    .enumerate()
    {
        let tier = if gpu.get("whole_gpu").is_some() {
            Tier::Card
        } else {
            Tier::Slice
        };
        let s = spec(&format!("t{i}"), tier, gpu);
        let d = place(&nodes, &b, Request { spec: &s, tier }, Policy::Pack).unwrap();
        let daemon =
            place_on_host(&gpus, &held, s.name.as_str(), &s.gpu, DEFAULT_NODE_BUDGET).unwrap();
        let mut want = daemon.held();
        want.gpu = daemon.pci_address.clone().unwrap();
        assert_eq!(d.share.as_ref(), Some(&want), "tenant {i}");
        held.push(want);
        b.push(bound("n", &d, &s, tier));
    }
}

#[test]
fn tier_host_takes_an_empty_host_and_keeps_it() {
    let (a, b) = (inventory(&["h100-80gb"]), inventory(&["h100-80gb"]));
    let nodes = [node("node-a", &a), node("node-b", &b)];
    let first = spec("first", Tier::Slice, json!({"profile": "1g.10gb"}));
    let d1 = place(
        &nodes,
        &[],
        Request {
            spec: &first,
            tier: Tier::Slice,
        },
        Policy::Pack,
    )
    .unwrap();
    assert_eq!(d1.node, "node-a");
    let mut bnd = vec![bound("node-a", &d1, &first, Tier::Slice)];
    let alone = spec("alone", Tier::Host, json!({"profile": "1g.10gb"}));
    let d2 = place(
        &nodes,
        &bnd,
        Request {
            spec: &alone,
            tier: Tier::Host,
        },
        Policy::Pack,
    )
    .unwrap();
    assert_eq!(
        d2.node, "node-b",
        "pack would take node-a, but it has a tenant"
    );
    bnd.push(bound("node-b", &d2, &alone, Tier::Host));
    // Nobody joins it, though node-a is the tighter fit either way.
    let third = spec("third", Tier::Slice, json!({}));
    let d3 = place(
        &nodes,
        &bnd,
        Request {
            spec: &third,
            tier: Tier::Slice,
        },
        Policy::Spread,
    )
    .unwrap();
    assert_eq!(d3.node, "node-a");
    // And a second tier-host tenant finds no host.
    let lonely = spec("lonely", Tier::Host, json!({}));
    let e = place(
        &nodes,
        &bnd,
        Request {
            spec: &lonely,
            tier: Tier::Host,
        },
        Policy::Pack,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("node-a: tier host needs a host of its own"),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("node-b: tier host needs a host of its own"),
        "{e}"
    );
}

#[test]
fn tenants_bound_but_not_made_yet_hold_their_room() {
    let mut inv = inventory(&["a100-40gb"]);
    inv.memory_mib = 1024;
    let nodes = [node("n", &inv)];
    let card = spec("card", Tier::Card, json!({}));
    let d = place(
        &nodes,
        &[],
        Request {
            spec: &card,
            tier: Tier::Card,
        },
        Policy::Pack,
    )
    .unwrap();
    let b = vec![bound("n", &d, &card, Tier::Card)];
    let slice = spec("slice", Tier::Slice, json!({"profile": "1g.5gb"}));
    let e = place(
        &nodes,
        &b,
        Request {
            spec: &slice,
            tier: Tier::Slice,
        },
        Policy::Pack,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("No room for tenant `slice-0a1b2c3d`"),
        "{e}"
    );
    // Control: without the bound card it fits.
    place(
        &nodes,
        &[],
        Request {
            spec: &slice,
            tier: Tier::Slice,
        },
        Policy::Pack,
    )
    .unwrap();
    // Memory: 1024 MiB less the card's 128 + 64 leaves 832.
    let mut big = spec("big", Tier::Slice, json!({}));
    big.memory_mib = 800;
    let e = place(
        &nodes,
        &b,
        Request {
            spec: &big,
            tier: Tier::Slice,
        },
        Policy::Pack,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("memory: it needs 864 MiB (guest + VMM), 832 MiB"),
        "{e}"
    );
    // Once the host has made it, its own figures count it (and the bound entry does not
    // count twice).
    let mut made = inv.clone();
    made.tenants.push(card.name.to_string());
    made.memory_held_mib = 192;
    let nodes = [node("n", &made)];
    big.memory_mib = 768;
    place(
        &nodes,
        &b,
        Request {
            spec: &big,
            tier: Tier::Slice,
        },
        Policy::Pack,
    )
    .unwrap();
}

#[test]
fn an_unsatisfiable_request_stays_with_the_planners_reason_from_every_node() {
    let (a, b) = (inventory(&["h100-80gb"]), inventory(&["l40s"]));
    let mut nodes = vec![node("node-a", &a), node("node-b", &b)];
    let s = spec("huge", Tier::Slice, json!({"profile": "9g.999gb"}));
    let e = place(
        &nodes,
        &[],
        Request {
            spec: &s,
            tier: Tier::Slice,
        },
        Policy::Pack,
    )
    .unwrap_err();
    assert_eq!(e.reasons.len(), 2);
    assert!(
        e.reasons[0].1.contains("which no GPU of this host has"),
        "{e}"
    );
    nodes[1].unavailable = Some("its lease expired".into());
    let e = place(
        &nodes,
        &[],
        Request {
            spec: &s,
            tier: Tier::Slice,
        },
        Policy::Pack,
    )
    .unwrap_err();
    assert_eq!(e.reasons[1], ("node-b".into(), "its lease expired".into()));
}

#[test]
fn a_slice_is_never_a_whole_card() {
    // An L40S has no MIG: the planner gives a sized model the card whole.
    let inv = inventory(&["l40s"]);
    let nodes = [node("n", &inv)];
    let gpu = json!({"model": "mistral-7b"});
    let s = spec("s", Tier::Slice, gpu.clone());
    let e = place(
        &nodes,
        &[],
        Request {
            spec: &s,
            tier: Tier::Slice,
        },
        Policy::Pack,
    )
    .unwrap_err();
    assert!(e.to_string().contains("use tier card"), "{e}");
    let c = spec("c", Tier::Card, gpu);
    let card = place(
        &nodes,
        &[],
        Request {
            spec: &c,
            tier: Tier::Card,
        },
        Policy::Pack,
    )
    .unwrap();
    assert_eq!(card.label().as_deref(), Some("whole"));
}

#[test]
fn a_plan_the_ledger_contradicts_is_left_out() {
    let mut inv = inventory(&["a100-40gb"]);
    inv.held.push(crate::crd::node::NodeHeld {
        gpu: "0000:10:00.0".into(),
        share: crate::crd::node::NodeHeldShare {
            kind: "whole".into(),
            profile: None,
            start: None,
        },
    });
    let nodes = [node("n", &inv)];
    let stale = Bound {
        node: "n".into(),
        host_name: "gone-0a1b2c3d".into(),
        tier: Tier::Slice,
        memory_mib: 128,
        vcpus: 1,
        share: Some(Held {
            gpu: "0000:10:00.0".into(),
            share: HeldShare::Mig {
                profile: "1g.5gb".into(),
                start: 0,
            },
        }),
    };
    let s = spec("cpu", Tier::Slice, json!({}));
    place(
        &nodes,
        &[stale],
        Request {
            spec: &s,
            tier: Tier::Slice,
        },
        Policy::Pack,
    )
    .unwrap();
}
