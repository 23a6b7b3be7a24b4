//! The Kubernetes tier against a real API server (kube-apiserver 1.20 over etcd, built by
//! scripts/kube-apiserver.sh): three simulated GPU hosts, each a real tenantvmd running the
//! idle test guest under tenantvm-vmm on this host's KVM with a simulated GPU inventory of
//! its own, and its node agent; two operator replicas. One run goes through the issue's
//! cases in turn (each phase prints when it starts):
//!
//! 1. a dozen `Tenant`s of mixed tiers and sizes: each runs where the planner put it (the
//!    operator's planned share is the share the host reserved), tier host alone on its
//!    node, the unfittable one `Pending` with the planner's reason and an event;
//! 2. RBAC: one client namespace's service account reads its own Tenants and Secrets and
//!    neither of another namespace;
//! 3. delete: the `Tenant` goes only after the departure, with the receipt's digest in an
//!    event matching the host's signed receipt;
//! 4. SIGKILL of a node agent mid-create and mid-delete, of the leading operator
//!    mid-create: everything converges, one host tenant per `Tenant`, nothing left over;
//! 5. a node agent stopped: `NodeLost` after its lease expires; restarted: back to Running;
//! 6. bad input: schema refusals, a name the host cannot take, tenantvmd wedged and down,
//!    the API server gone for a minute (`TENANTVM_KUBE_OUTAGE_S`, default 60): nothing lost.
//!
//! About two to three minutes besides the outage; worth it: it is the only proof that the
//! operator, the node agents and the RBAC work against a real API server.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::api::{DeleteParams, ListParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use support::cluster::{self, Cluster};
use support::host::{self, Host};
use support::{apply, describe, eventually, phase, tenant, tenants, Operator};
use tenantvm_kube::crd::{condition, conditions, Tenant, NODE_LABEL, PLACEMENT_ANNOTATION};
use tenantvm_kube::operator::Binding;

struct Bench {
    cluster: Cluster,
    admin: Client,
    hosts: Vec<Host>,
    operators: Vec<Operator>,
    started: Instant,
}

impl Bench {
    fn phase(&self, what: &str) {
        eprintln!(
            "==== kube tier: {what} ({} s in)",
            self.started.elapsed().as_secs()
        );
    }

    /// Everything a failure needs to be understood.
    async fn report(&self, what: &str) -> String {
        let mut out = format!(
            "{what}\n--- tenants and nodes\n{}",
            describe(&self.admin).await
        );
        let tail = |s: String| {
            s.lines()
                .rev()
                .take(40)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        };
        for o in &self.operators {
            out.push_str(&format!("--- operator {}\n{}\n", o.identity, tail(o.log())));
        }
        for h in &self.hosts {
            out.push_str(&format!(
                "--- {} agent\n{}\n",
                h.name,
                tail(h.log("agent.log"))
            ));
            out.push_str(&format!(
                "--- {} daemon\n{}\n",
                h.name,
                tail(h.log("daemon.log"))
            ));
        }
        out.push_str(&format!(
            "--- apiserver\n{}\n",
            tail(self.cluster.apiserver_log())
        ));
        out
    }

    /// Waits until `check` holds over the tenants; fails the test with the report otherwise.
    async fn wait(
        &self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&BTreeMap<String, Tenant>) -> bool,
    ) {
        let admin = self.admin.clone();
        let ok = eventually(timeout, || {
            let admin = admin.clone();
            let check = &check;
            async move { check(&tenants(&admin).await) }
        })
        .await;
        if !ok {
            panic!(
                "{}",
                self.report(&format!("timed out after {timeout:?} waiting for: {what}"))
                    .await
            );
        }
    }

    fn host(&mut self, name: &str) -> &mut Host {
        self.hosts.iter_mut().find(|h| h.name == name).unwrap()
    }

    /// Host tenant names per node, as each tenantvmd lists them.
    async fn on_hosts(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut out = BTreeMap::new();
        for h in &self.hosts {
            let names = h
                .admin()
                .list()
                .await
                .map(|l| l.tenants.into_iter().map(|t| t.name).collect())
                .unwrap_or_default();
            out.insert(h.name.clone(), names);
        }
        out
    }

    /// Every bound `Tenant` is on its node's host exactly once, and nothing else is on any
    /// host.
    async fn one_host_tenant_per_tenant(&self) {
        let on_hosts = self.on_hosts().await;
        let mut want: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for t in tenants(&self.admin).await.values() {
            if let (Some(node), Some(host_name)) = (
                t.labels().get(NODE_LABEL),
                t.status.as_ref().and_then(|s| s.host_name.clone()),
            ) {
                want.entry(node.clone()).or_default().insert(host_name);
            }
        }
        for h in &self.hosts {
            let got = on_hosts.get(&h.name).cloned().unwrap_or_default();
            let w = want.get(&h.name).cloned().unwrap_or_default();
            if got != w {
                panic!(
                    "{}",
                    self.report(&format!(
                        "{}: the host holds {got:?}, the Tenants bound there are {w:?}",
                        h.name
                    ))
                    .await
                );
            }
        }
    }
}

fn running(t: &Tenant) -> bool {
    phase(t) == "Running"
}

fn all_running_but(ts: &BTreeMap<String, Tenant>, but: &[&str], count: usize) -> bool {
    let relevant: Vec<&Tenant> = ts
        .iter()
        .filter(|(k, _)| !but.contains(&k.as_str()))
        .map(|(_, t)| t)
        .collect();
    relevant.len() == count && relevant.iter().all(|t| running(t))
}

async fn events_of(admin: &Client, ns: &str, name: &str) -> Vec<Event> {
    let api: Api<Event> = Api::namespaced(admin.clone(), ns);
    api.list(&ListParams::default())
        .await
        .map(|l| {
            l.items
                .into_iter()
                .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
                .collect()
        })
        .unwrap_or_default()
}

/// How many times a `NodeLost` event was published, in every namespace.
async fn node_lost_events(admin: &Client) -> i32 {
    let api: Api<Event> = Api::all(admin.clone());
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("NodeLost"))
        .map(|e| e.series.as_ref().map_or(1, |s| s.count))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_across_three_hosts_against_a_real_api_server() {
    if let Some(why) = cluster::skip_reason().or_else(host::skip_reason) {
        tenantvm_skip::skip!("{why}");
    }
    let started = Instant::now();
    let cluster = Cluster::start();
    let admin = cluster.client("admin").await;
    cluster.install(&admin).await;
    for ns in ["client-a", "client-b"] {
        cluster.client_namespace(&admin, ns).await;
    }
    let gpus: [(&str, Vec<(&str, &str)>); 3] = [
        ("node-a", vec![("h100-80gb", "0000:10:00.0")]),
        (
            "node-b",
            vec![
                ("a100-40gb", "0000:20:00.0"),
                ("a100-40gb", "0000:21:00.0"),
                ("a100-40gb", "0000:23:00.0"),
                ("l40s", "0000:22:00.0"),
            ],
        ),
        (
            "node-c",
            vec![
                ("h100-80gb", "0000:30:00.0"),
                ("h100-80gb", "0000:31:00.0"),
                ("l40s", "0000:32:00.0"),
            ],
        ),
    ];
    let hosts: Vec<Host> = gpus
        .iter()
        .enumerate()
        .map(|(i, (name, g))| Host::start(name, g, &cluster.kubeconfig(name), i as u32))
        .collect();
    let operators = ["op-1", "op-2"]
        .iter()
        .map(|id| Operator::start(id, &cluster.kubeconfig("operator"), cluster.dir.path(), &[]))
        .collect();
    let mut b = Bench {
        cluster,
        admin: admin.clone(),
        hosts,
        operators,
        started,
    };

    // 1. A dozen tenants of mixed tiers and sizes.
    b.phase("a dozen tenants");
    let manifests = [
        tenant("client-a", "alone", "host", json!({})),
        tenant("client-a", "s1", "slice", json!({"profile": "1g.10gb"})),
        tenant("client-a", "s2", "slice", json!({"profile": "3g.40gb"})),
        tenant(
            "client-b",
            "s3",
            "slice",
            json!({"model": "llama-3-8b", "context": 4096}),
        ),
        tenant("client-b", "s4", "slice", json!({"profile": "2g.10gb"})),
        tenant("client-a", "c1", "card", json!({})),
        tenant("client-b", "c2", "card", json!({"model": "mistral-7b"})),
        tenant("client-a", "n1", "slice", json!({})),
        tenant("client-a", "n2", "slice", json!({})),
        tenant("client-b", "n3", "slice", json!({})),
        tenant("client-b", "n4", "slice", json!({})),
        tenant("client-b", "u1", "slice", json!({"profile": "7g.141gb"})),
    ];
    // One at a time, each placed before the next arrives: the operator places in arrival
    // order, so the outcome is the same in every run.
    for t in &manifests {
        apply(&admin, t).await.unwrap();
        let key = format!("{}/{}", t.namespace().unwrap(), t.name_any());
        b.wait(
            &format!("{key} placed or refused"),
            Duration::from_secs(30),
            |ts| {
                ts.get(&key).is_some_and(|t| {
                    t.status.as_ref().is_some_and(|s| {
                        condition::get(&s.conditions, conditions::PLACED).is_some()
                    })
                })
            },
        )
        .await;
    }
    b.wait("11 Running, u1 Pending", Duration::from_secs(180), |ts| {
        all_running_but(ts, &["client-b/u1"], 11)
            && ts.get("client-b/u1").is_some_and(|u| phase(u) == "Pending")
    })
    .await;
    let ts = tenants(&admin).await;
    // The unfittable stays Pending with the planner's reason, and an event says so.
    let u1 = &ts["client-b/u1"];
    let placed =
        condition::get(&u1.status.as_ref().unwrap().conditions, conditions::PLACED).unwrap();
    assert_eq!(
        (placed.status.as_str(), placed.reason.as_str()),
        ("False", "NoRoom"),
        "{placed:?}"
    );
    assert!(
        placed.message.contains("which no GPU of this host has"),
        "{}",
        placed.message
    );
    assert!(events_of(&admin, "client-b", "u1")
        .await
        .iter()
        .any(|e| e.reason.as_deref() == Some("NoRoom")));
    assert!(u1.labels().get(NODE_LABEL).is_none());
    // Each runs where the planner put it: the share the host reserved is the planned one.
    for (key, t) in &ts {
        if key == "client-b/u1" {
            continue;
        }
        let binding = Binding::of(t).unwrap_or_else(|| panic!("{key} has no binding"));
        let s = t.status.as_ref().unwrap();
        let reserved = s
            .gpu
            .as_ref()
            .filter(|g| g.reserved)
            .map(|g| (g.gpu.clone(), g.label.clone()));
        assert_eq!(
            reserved,
            binding.gpu,
            "{key}: reserved vs planned ({})",
            t.annotations()[PLACEMENT_ANNOTATION]
        );
        assert_eq!(s.node.as_deref(), Some(binding.node.as_str()));
    }
    // Tier card got whole cards, tier slice MIG shares, tier host a node of its own.
    for key in ["client-a/c1", "client-b/c2"] {
        assert_eq!(
            ts[key].status.as_ref().unwrap().gpu.as_ref().unwrap().label,
            "whole",
            "{key}"
        );
    }
    for key in ["client-a/s1", "client-a/s2", "client-b/s3", "client-b/s4"] {
        assert!(
            ts[key]
                .status
                .as_ref()
                .unwrap()
                .gpu
                .as_ref()
                .unwrap()
                .label
                .contains('@'),
            "{key}"
        );
    }
    let alone_node = ts["client-a/alone"].labels()[NODE_LABEL].clone();
    let with_alone: Vec<&String> = ts
        .iter()
        .filter(|(_, t)| t.labels().get(NODE_LABEL) == Some(&alone_node))
        .map(|(k, _)| k)
        .collect();
    assert_eq!(with_alone, ["client-a/alone"]);
    b.one_host_tenant_per_tenant().await;
    // Each tenant's Secret holds its token and an inference key.
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), "client-a");
    let s1 = secrets.get("s1-tenantvm").await.unwrap();
    let data = s1.data.unwrap();
    assert!(
        data.contains_key("token") && data.contains_key("inference-key"),
        "{:?}",
        data.keys()
    );

    // 2. RBAC.
    b.phase("RBAC");
    let token = b.cluster.service_account_token(&admin, "client-a").await;
    let app = b.cluster.client_with_token(&token).await;
    let own: Api<Tenant> = Api::namespaced(app.clone(), "client-a");
    assert!(own.list(&ListParams::default()).await.unwrap().items.len() >= 4);
    let own_secrets: Api<Secret> = Api::namespaced(app.clone(), "client-a");
    assert!(
        own_secrets.get("s1-tenantvm").await.is_ok(),
        "the control: its own Secret reads"
    );
    let other: Api<Tenant> = Api::namespaced(app.clone(), "client-b");
    let e = other.list(&ListParams::default()).await.unwrap_err();
    assert!(matches!(&e, kube::Error::Api(s) if s.code == 403), "{e}");
    let other_secrets: Api<Secret> = Api::namespaced(app.clone(), "client-b");
    let e = other_secrets.get("s3-tenantvm").await.unwrap_err();
    assert!(matches!(&e, kube::Error::Api(s) if s.code == 403), "{e}");
    let all: Api<Tenant> = Api::all(app.clone());
    assert!(
        all.list(&ListParams::default()).await.is_err(),
        "no cluster-wide read"
    );

    // 3. Delete: the departure, then the receipt, then the object goes.
    b.phase("delete waits for the departure and its receipt");
    let n1 = ts["client-a/n1"].clone();
    let n1_node = n1.labels()[NODE_LABEL].clone();
    let n1_host = n1.status.as_ref().unwrap().host_name.clone().unwrap();
    Api::<Tenant>::namespaced(admin.clone(), "client-a")
        .delete("n1", &DeleteParams::default())
        .await
        .unwrap();
    b.wait("n1 gone", Duration::from_secs(60), |ts| {
        !ts.contains_key("client-a/n1")
    })
    .await;
    let receipts = b
        .host(&n1_node)
        .admin()
        .receipts(Some(&n1_host))
        .await
        .unwrap()
        .receipts;
    assert_eq!(receipts.len(), 1, "one receipt for {n1_host}");
    let digest = receipts[0].digest().unwrap();
    let departed = events_of(&admin, "client-a", "n1").await;
    assert!(
        departed
            .iter()
            .any(|e| e.reason.as_deref() == Some("Departed")
                && e.note.as_deref().unwrap_or_default().contains(&digest)),
        "no Departed event with the receipt's digest {digest}: {departed:?}"
    );
    assert!(
        secrets.get_opt("n1-tenantvm").await.unwrap().is_none(),
        "its Secret went with it"
    );
    b.one_host_tenant_per_tenant().await;

    // 4. SIGKILL mid-create and mid-delete.
    b.phase("node agent SIGKILLed mid-create");
    let k1 = apply(
        &admin,
        &tenant("client-a", "k1", "slice", json!({"profile": "1g.10gb"})),
    )
    .await
    .unwrap();
    let node = loop {
        let t = Api::<Tenant>::namespaced(admin.clone(), "client-a")
            .get("k1")
            .await
            .unwrap();
        if let Some(n) = t.labels().get(NODE_LABEL) {
            break n.clone();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    b.host(&node).signal_agent(libc::SIGKILL);
    tokio::time::sleep(Duration::from_millis(300)).await;
    b.host(&node).start_agent();
    b.wait(
        "k1 Running after its agent's SIGKILL",
        Duration::from_secs(60),
        |ts| ts.get("client-a/k1").is_some_and(running),
    )
    .await;
    b.one_host_tenant_per_tenant().await;
    let k1_host = tenantvm_kube::naming::host_name("k1", &k1.uid().unwrap())
        .unwrap()
        .to_string();

    b.phase("node agent SIGKILLed mid-delete");
    Api::<Tenant>::namespaced(admin.clone(), "client-a")
        .delete("k1", &DeleteParams::default())
        .await
        .unwrap();
    b.wait("k1 departing", Duration::from_secs(30), |ts| {
        ts.get("client-a/k1")
            .is_none_or(|t| phase(t) == "Departing")
    })
    .await;
    b.host(&node).signal_agent(libc::SIGKILL);
    tokio::time::sleep(Duration::from_millis(300)).await;
    b.host(&node).start_agent();
    b.wait(
        "k1 gone after its agent's SIGKILL",
        Duration::from_secs(60),
        |ts| !ts.contains_key("client-a/k1"),
    )
    .await;
    let receipts = b
        .host(&node)
        .admin()
        .receipts(Some(&k1_host))
        .await
        .unwrap()
        .receipts;
    assert_eq!(receipts.len(), 1, "exactly one departure of {k1_host}");
    b.one_host_tenant_per_tenant().await;

    b.phase("leading operator SIGKILLed mid-create");
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(admin.clone(), "tenantvm-system");
    let leader = leases
        .get("tenantvm-operator")
        .await
        .unwrap()
        .spec
        .unwrap()
        .holder_identity
        .unwrap();
    for name in ["k2", "k3"] {
        apply(&admin, &tenant("client-b", name, "slice", json!({})))
            .await
            .unwrap();
    }
    let i = b
        .operators
        .iter()
        .position(|o| o.identity == leader)
        .unwrap();
    b.operators[i].kill();
    b.wait(
        "k2, k3 Running under the other replica",
        Duration::from_secs(90),
        |ts| {
            ["client-b/k2", "client-b/k3"]
                .iter()
                .all(|k| ts.get(*k).is_some_and(running))
        },
    )
    .await;
    let now_leading = leases
        .get("tenantvm-operator")
        .await
        .unwrap()
        .spec
        .unwrap()
        .holder_identity
        .unwrap();
    assert_ne!(now_leading, leader);
    b.operators[i] = Operator::start(
        &leader,
        &b.cluster.kubeconfig("operator"),
        b.cluster.dir.path(),
        &[],
    );
    b.one_host_tenant_per_tenant().await;

    // 5. A node agent stopped: NodeLost; restarted: Running again.
    b.phase("node agent stopped: NodeLost");
    let lost = "node-c";
    b.host(lost).signal_agent(libc::SIGTERM);
    let on_lost = |ts: &BTreeMap<String, Tenant>| -> Vec<String> {
        ts.iter()
            .filter(|(_, t)| t.labels().get(NODE_LABEL).map(String::as_str) == Some(lost))
            .map(|(k, _)| k.clone())
            .collect()
    };
    let bound_there = on_lost(&tenants(&admin).await);
    assert!(!bound_there.is_empty(), "{lost} holds tenants");
    b.wait(
        "NodeLost on node-c's tenants",
        Duration::from_secs(60),
        |ts| {
            on_lost(ts).iter().all(|k| {
                phase(&ts[k]) == "NodeLost"
                    && condition::is_true(
                        &ts[k].status.as_ref().unwrap().conditions,
                        conditions::NODE_LOST,
                    )
            })
        },
    )
    .await;
    // Not made elsewhere: still bound there, still on that host.
    assert_eq!(on_lost(&tenants(&admin).await), bound_there);
    b.host(lost).start_agent();
    b.wait(
        "node-c's tenants Running again",
        Duration::from_secs(60),
        |ts| {
            on_lost(ts).iter().all(|k| {
                running(&ts[k])
                    && !condition::is_true(
                        &ts[k].status.as_ref().unwrap().conditions,
                        conditions::NODE_LOST,
                    )
            })
        },
    )
    .await;

    // 6. Bad input.
    b.phase("bad input: schema, name");
    let api_a: Api<Tenant> = Api::namespaced(admin.clone(), "client-a");
    let erased = kube::discovery::ApiResource::erase::<Tenant>(&());
    let raw: Api<kube::api::DynamicObject> =
        Api::namespaced_with(admin.clone(), "client-a", &erased);
    for (spec, field) in [
        (json!({"vcpus": 0, "image": {"name": "idle"}}), "vcpus"),
        (json!({"tier": "gold", "image": {"name": "idle"}}), "tier"),
        (json!({"vcpus": 1}), "image"),
    ] {
        let bad = kube::api::DynamicObject::new("bad", &erased)
            .within("client-a")
            .data(json!({ "spec": spec }));
        let e = raw.create(&Default::default(), &bad).await.unwrap_err();
        assert!(
            matches!(&e, kube::Error::Api(s) if s.code == 422 && s.message.contains(field)),
            "{field}: {e}"
        );
    }
    // A name the host could not take: the schema's name rule refuses it.
    let e = apply(
        &admin,
        &tenant("client-a", "dotted.name", "slice", json!({})),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&e, kube::Error::Api(s) if s.code == 422 && s.message.contains("metadata.name")),
        "{e}"
    );
    // What only the host's own validation refuses: Pending, InvalidSpec, an event.
    apply(
        &admin,
        &tenant(
            "client-a",
            "contradict",
            "card",
            json!({"profile": "1g.10gb"}),
        ),
    )
    .await
    .unwrap();
    b.wait(
        "contradict Pending as an invalid spec",
        Duration::from_secs(30),
        |ts| {
            ts.get("client-a/contradict").is_some_and(|t| {
                phase(t) == "Pending"
                    && t.status
                        .as_ref()
                        .and_then(|s| condition::get(&s.conditions, conditions::PLACED))
                        .is_some_and(|c| {
                            c.reason == "InvalidSpec" && c.message.contains("Tier card")
                        })
            })
        },
    )
    .await;
    assert!(events_of(&admin, "client-a", "contradict")
        .await
        .iter()
        .any(|e| e.reason.as_deref() == Some("InvalidSpec")));
    api_a
        .delete("contradict", &DeleteParams::default())
        .await
        .unwrap();
    b.wait("contradict gone", Duration::from_secs(30), |ts| {
        !ts.contains_key("client-a/contradict")
    })
    .await;

    b.phase("bad input: tenantvmd wedged, then down");
    let sick = "node-b";
    let on_sick = |ts: &BTreeMap<String, Tenant>| -> Vec<String> {
        ts.iter()
            .filter(|(_, t)| t.labels().get(NODE_LABEL).map(String::as_str) == Some(sick))
            .map(|(k, _)| k.clone())
            .collect()
    };
    let reach = |ts: &BTreeMap<String, Tenant>, reason: &str| {
        let keys = on_sick(ts);
        !keys.is_empty()
            && keys.iter().all(|k| {
                ts[k]
                    .status
                    .as_ref()
                    .and_then(|s| condition::get(&s.conditions, conditions::TENANTVMD_REACHABLE))
                    .is_some_and(|c| c.reason == reason)
            })
    };
    b.host(sick).signal_daemon(libc::SIGSTOP);
    b.wait(
        "TenantvmdReachable Wedged on node-b's tenants",
        Duration::from_secs(60),
        |ts| reach(ts, "Wedged"),
    )
    .await;
    b.host(sick).signal_daemon(libc::SIGCONT);
    b.wait("TenantvmdReachable again", Duration::from_secs(60), |ts| {
        reach(ts, "Answers")
    })
    .await;
    b.host(sick).signal_daemon(libc::SIGKILL);
    b.wait(
        "TenantvmdReachable Down on node-b's tenants",
        Duration::from_secs(60),
        |ts| reach(ts, "Down"),
    )
    .await;
    b.host(sick).start_daemon();
    b.wait(
        "node-b's tenants Running after tenantvmd's restart",
        Duration::from_secs(90),
        |ts| reach(ts, "Answers") && on_sick(ts).iter().all(|k| running(&ts[k])),
    )
    .await;
    b.one_host_tenant_per_tenant().await;

    let outage: u64 = std::env::var("TENANTVM_KUBE_OUTAGE_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    b.phase(&format!("bad input: the API server gone for {outage} s"));
    let before = tenants(&admin).await.keys().cloned().collect::<Vec<_>>();
    let hosts_before = b.on_hosts().await;
    let lost_before = node_lost_events(&admin).await;
    b.cluster.stop_apiserver();
    tokio::time::sleep(Duration::from_secs(outage)).await;
    // Meanwhile the hosts kept their tenants.
    assert_eq!(b.on_hosts().await, hosts_before);
    b.cluster.start_apiserver();
    b.wait(
        "everything as it was after the outage",
        Duration::from_secs(90),
        |ts| {
            ts.keys().cloned().collect::<Vec<_>>() == before
                && all_running_but(ts, &["client-b/u1"], before.len() - 1)
        },
    )
    .await;
    b.one_host_tenant_per_tenant().await;
    // No lease could be renewed while the API server was away: no node was lost for it.
    assert_eq!(
        node_lost_events(&admin).await,
        lost_before,
        "an outage of the API server is no lost node"
    );

    // The end: every tenant departs; nothing is left on any host.
    b.phase("every tenant departs");
    for (key, _) in tenants(&admin).await {
        let (ns, name) = key.split_once('/').unwrap();
        Api::<Tenant>::namespaced(admin.clone(), ns)
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    b.wait("every Tenant gone", Duration::from_secs(120), |ts| {
        ts.is_empty()
    })
    .await;
    for (node, names) in b.on_hosts().await {
        assert!(names.is_empty(), "{node} still holds {names:?}");
    }
    b.phase("done");
}
