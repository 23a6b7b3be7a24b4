//! `tenantvm-operator`: places `Tenant`s on nodes and writes the binding; marks the tenants
//! of a node whose heartbeat stopped `NodeLost`. It never touches a host: the node agents
//! do (crate::node). Several replicas may run: one leads (the `tenantvm-operator` Lease),
//! the others wait; a binding is a compare-and-swap on the `Tenant`'s resource version, so
//! even two leaders could not bind one tenant twice.
//!
//! One loop, woken by any change of a `Tenant`, a `TenantvmNode` or a lease, and every
//! `resync` besides, goes through every tenant:
//! - a new `Tenant` gets the departure finalizer before anything else;
//! - a `Tenant` deleted before it was bound loses it at once (nothing exists on any host);
//! - an unbound `Tenant` is checked (name, tier, the host's own spec validation) and placed
//!   ([`crate::placement`], oldest first) beside every tenant bound so far; the binding is
//!   the `tenantvm.dev/node` label and the placement annotation, then the status
//!   (`Scheduled`, the node, the planned GPU share) and an event; one that cannot be
//!   placed stays `Pending` with the reason in its `Placed` condition and an event;
//! - a bound `Tenant` whose node's lease expired gets `NodeLost` (phase and condition, a
//!   warning event) and stays bound: its encrypted disk and its GPU share live on that
//!   host. When the node's agent is back, the condition is cleared and the node agent
//!   reports the phase again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde::{Deserialize, Serialize};
use tenantvm_gpu::plan::place::Held;
use tokio::sync::Notify;

use crate::crd::{
    condition, conditions, GpuAssignment, Phase, Tenant, TenantvmNode, FINALIZER, NODE_LABEL,
    PLACEMENT_ANNOTATION,
};
use crate::hostspec::host_spec;
use crate::kubeio::{self, Events};
use crate::lease::{self, LeaseLock, Observer};
use crate::placement::{self, Bound, Node, Policy, Request};

/// The operator's settings.
#[derive(Debug, Clone)]
pub struct OperatorConfig {
    /// This replica's name in the leader lease.
    pub identity: String,
    /// Pack or spread.
    pub policy: Policy,
    /// How long a leader's lease lasts without renewal.
    pub leader_lease: Duration,
    /// The least time a node's lease must go unrenewed before its tenants are `NodeLost`
    /// (the lease's own duration when longer).
    pub node_lost_after: Duration,
    /// How often the loop runs without being woken.
    pub resync: Duration,
}

/// Why the operator stopped.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    /// The API server refused or failed a request the operator cannot go on without.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Another replica holds the leader lease now.
    #[error(
        "Lost the leader lease `{}` to another replica: stopping so only one places tenants",
        lease::LEADER_LEASE
    )]
    LostLead,
}

/// The operator's placement, kept in the placement annotation of a bound `Tenant`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    /// The node.
    pub node: String,
    /// The planned GPU share: the GPU's PCI address and the ledger's label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<(String, String)>,
    /// Order of binding (ms since the epoch × 1000 + rank): the node agent creates tenants
    /// in this order, so its host's planner meets them as the operator planned them.
    pub seq: u64,
}

impl Binding {
    /// The binding of `t`, if it has one.
    pub fn of(t: &Tenant) -> Option<Binding> {
        let node = t.labels().get(NODE_LABEL)?;
        let mut b: Binding = t
            .annotations()
            .get(PLACEMENT_ANNOTATION)
            .and_then(|a| serde_json::from_str(a).ok())
            .unwrap_or(Binding {
                node: node.clone(),
                gpu: None,
                seq: 0,
            });
        b.node.clone_from(node);
        Some(b)
    }
}

/// Runs the operator until it loses the lead or the API server refuses it for good.
pub async fn run(client: Client, cfg: OperatorConfig) -> Result<(), OperatorError> {
    let lock = Arc::new(LeaseLock::new(
        client.clone(),
        lease::LEADER_LEASE,
        &cfg.identity,
        cfg.leader_lease,
    ));
    loop {
        match lock.try_acquire().await {
            Ok(true) => break,
            Ok(false) => tracing::info!("another replica leads; waiting"),
            Err(e) => tracing::warn!(error = %e, "cannot read the leader lease; retrying"),
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    tracing::info!(identity = %cfg.identity, "leading");
    let (lost_tx, mut lost_rx) = tokio::sync::watch::channel(false);
    let renew = lock.clone();
    let every = cfg.leader_lease / 3;
    let renewed = Arc::new(std::sync::Mutex::new(Instant::now()));
    let last_renewal = renewed.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            match renew.try_acquire().await {
                Ok(true) => {
                    *last_renewal.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
                }
                Ok(false) => {
                    let _ = lost_tx.send(true);
                    return;
                }
                // The API server away: nothing can be written anyway; keep trying.
                Err(e) => tracing::warn!(error = %e, "cannot renew the leader lease"),
            }
        }
    });
    let wake = Arc::new(Notify::new());
    let tenants: Api<Tenant> = Api::all(client.clone());
    let nodes: Api<TenantvmNode> = Api::all(client.clone());
    let leases: Api<Lease> = Api::namespaced(client.clone(), lease::NAMESPACE);
    let mut op = Operator {
        tenants_api: tenants.clone(),
        tenants: kubeio::watch(tenants, watcher::Config::default(), wake.clone()),
        nodes: kubeio::watch(nodes, watcher::Config::default(), wake.clone()),
        leases: kubeio::watch(leases, watcher::Config::default(), wake.clone()),
        events: Events::new(client, "tenantvm-operator", &cfg.identity),
        observer: Observer::default(),
        recent: HashMap::new(),
        renewed,
        cfg,
    };
    loop {
        if *lost_rx.borrow() {
            return Err(OperatorError::LostLead);
        }
        if op.tenants.wait_until_ready().await.is_ok() {
            op.reconcile().await;
        }
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep(op.cfg.resync) => {}
            _ = lost_rx.changed() => {}
        }
        // Let a burst of changes land before the next pass.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Operator {
    cfg: OperatorConfig,
    tenants_api: Api<Tenant>,
    tenants: Store<Tenant>,
    nodes: Store<TenantvmNode>,
    leases: Store<Lease>,
    events: Events,
    observer: Observer,
    /// Bindings written that the cache may not show yet, by uid.
    recent: HashMap<String, Bound>,
    /// When the leader lease was last renewed: the API server answered then.
    renewed: Arc<std::sync::Mutex<Instant>>,
}

/// A node's standing this pass.
struct NodeState {
    node: Arc<TenantvmNode>,
    unavailable: Option<String>,
    lost: bool,
}

impl Operator {
    async fn reconcile(&mut self) {
        let now = Instant::now();
        // While the API server was away no lease could be renewed, nor seen renewed: the
        // observation starts again once it answers, so an outage loses no node.
        let answered = self
            .renewed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed();
        if answered > self.cfg.leader_lease / 3 + Duration::from_secs(2) {
            self.observer = Observer::default();
        }
        let leases = self.leases.state();
        let mut states = Vec::new();
        for n in kubeio::sorted(&self.nodes) {
            let name = n.name_any();
            let lease = leases
                .iter()
                .find(|l| l.name_any() == format!("{}{name}", lease::NODE_LEASE_PREFIX));
            let lost = match lease {
                None => true,
                Some(l) => self.observer.expired(l, now, self.cfg.node_lost_after),
            };
            let status = n.status.clone().unwrap_or_default();
            let unreachable = condition::get(&status.conditions, conditions::TENANTVMD_REACHABLE)
                .filter(|c| c.status != "True");
            let unavailable = if lost {
                Some("its node agent's lease expired (NodeLost)".to_string())
            } else if !n.spec.schedulable {
                Some("cordoned (spec.schedulable is false)".into())
            } else if let Some(c) = unreachable {
                Some(format!("its tenantvmd does not answer: {}", c.message))
            } else if status.inventory.is_none() {
                Some("no inventory published yet".into())
            } else {
                None
            };
            states.push(NodeState {
                node: n,
                unavailable,
                lost,
            });
        }
        let tenants = kubeio::sorted(&self.tenants);
        // What the cache shows bound supersedes what this process remembers binding.
        for t in &tenants {
            if Binding::of(t).is_some() {
                self.recent.remove(&t.uid().unwrap_or_default());
            }
        }
        let mut bound: Vec<Bound> = tenants.iter().filter_map(|t| bound_of(t)).collect();
        bound.extend(self.recent.values().cloned());
        let mut unbound = Vec::new();
        for t in &tenants {
            if let Err(e) = self.tend(t, &states).await {
                tracing::warn!(tenant = %t.name_any(), error = %e, "reconcile failed; again at the next pass");
            }
            let placeable = Binding::of(t).is_none()
                && t.metadata.deletion_timestamp.is_none()
                && t.finalizers().iter().any(|f| f == FINALIZER)
                && !self.recent.contains_key(&t.uid().unwrap_or_default());
            if placeable {
                unbound.push(t.clone());
            }
        }
        unbound.sort_by_key(|t| {
            (
                t.creation_timestamp().map(|c| c.0),
                t.namespace(),
                t.name_any(),
            )
        });
        let ms = k8s_openapi::jiff::Timestamp::now().as_millisecond().max(0) as u64;
        for (rank, t) in unbound.iter().enumerate() {
            match self
                .place(t, &states, &bound, ms * 1000 + rank as u64)
                .await
            {
                Ok(Some(b)) => {
                    self.recent.insert(t.uid().unwrap_or_default(), b.clone());
                    bound.push(b);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(tenant = %t.name_any(), error = %e, "placement not written");
                }
            }
        }
    }

    /// Everything but placement: the finalizer, departures of unbound tenants, NodeLost.
    async fn tend(&self, t: &Tenant, states: &[NodeState]) -> Result<(), kube::Error> {
        let api = self.api(t);
        let binding = Binding::of(t);
        if t.metadata.deletion_timestamp.is_some() {
            let remembered = self.recent.contains_key(&t.uid().unwrap_or_default());
            let ours = t.finalizers().iter().any(|f| f == FINALIZER);
            if binding.is_none() && !remembered && ours && kubeio::remove_finalizer(&api, t).await?
            {
                self.events
                    .publish(
                        t,
                        false,
                        "Departed",
                        "Deleted before it was placed: nothing was made on any host",
                    )
                    .await;
            }
            return Ok(());
        }
        if !t.finalizers().iter().any(|f| f == FINALIZER) {
            kubeio::add_finalizer(&api, t).await?;
            return Ok(());
        }
        let Some(binding) = binding else {
            return Ok(());
        };
        let lost = states
            .iter()
            .find(|s| s.node.name_any() == binding.node)
            .is_none_or(|s| s.lost);
        let status = t.status.clone().unwrap_or_default();
        let marked = condition::is_true(&status.conditions, conditions::NODE_LOST);
        if lost && !marked {
            let message = format!(
                "The heartbeat lease of node {} expired: its node agent (or the host) is gone. The tenant stays bound there (its encrypted disk and GPU share are on that host) and is not made elsewhere; see docs/kubernetes.md, \"A lost node\"",
                binding.node
            );
            kubeio::update_status(&api, &t.name_any(), |s| {
                s.phase = Some(Phase::NodeLost);
                condition::set(
                    &mut s.conditions,
                    conditions::NODE_LOST,
                    true,
                    "LeaseExpired",
                    &message,
                );
            })
            .await?;
            self.events.publish(t, true, "NodeLost", &message).await;
        } else if !lost && marked {
            let message = format!("Node {}'s heartbeat is back", binding.node);
            kubeio::update_status(&api, &t.name_any(), |s| {
                if s.phase == Some(Phase::NodeLost) {
                    s.phase = Some(Phase::Scheduled);
                }
                condition::set(
                    &mut s.conditions,
                    conditions::NODE_LOST,
                    false,
                    "LeaseRenewed",
                    &message,
                );
            })
            .await?;
            self.events.publish(t, false, "NodeBack", &message).await;
        } else if status.node.as_deref() != Some(binding.node.as_str()) {
            // Bound, but the status write after the binding never happened (a crash).
            self.write_scheduled(t, &binding).await?;
        }
        Ok(())
    }

    /// Places an unbound tenant; the `Bound` it now is, when it was bound.
    async fn place(
        &self,
        t: &Tenant,
        states: &[NodeState],
        bound: &[Bound],
        seq: u64,
    ) -> Result<Option<Bound>, kube::Error> {
        let api = self.api(t);
        let spec = match host_spec(t) {
            Ok(s) => s,
            Err(e) => {
                self.pending(t, "InvalidSpec", &e.to_string()).await?;
                return Ok(None);
            }
        };
        let inventories: Vec<_> = states
            .iter()
            .filter_map(|s| {
                s.node
                    .status
                    .as_ref()
                    .and_then(|st| st.inventory.clone())
                    .map(|inv| (s.node.name_any(), inv, s.unavailable.clone()))
            })
            .collect();
        let nodes: Vec<Node<'_>> = inventories
            .iter()
            .map(|(name, inv, unavailable)| Node {
                name,
                inventory: inv,
                unavailable: unavailable.clone(),
            })
            .collect();
        let request = Request {
            spec: &spec,
            tier: t.spec.tier,
        };
        let decision = match placement::place(&nodes, bound, request, self.cfg.policy) {
            Ok(d) => d,
            Err(no) => {
                self.pending(t, "NoRoom", &no.to_string()).await?;
                return Ok(None);
            }
        };
        let binding = Binding {
            node: decision.node.clone(),
            gpu: decision
                .share
                .as_ref()
                .map(|h| (h.gpu.clone(), placement::label(&h.share))),
            seq,
        };
        let metadata = serde_json::json!({
            "labels": { NODE_LABEL: binding.node },
            "annotations": { PLACEMENT_ANNOTATION: kubeio::to_annotation(&binding) },
        });
        if !kubeio::patch_metadata_if_unchanged(&api, t, metadata).await? {
            return Ok(None);
        }
        self.write_scheduled(t, &binding).await?;
        let gpu = binding
            .gpu
            .as_ref()
            .map(|(g, l)| format!(", GPU {g} {l}"))
            .unwrap_or_default();
        self.events
            .publish(
                t,
                false,
                "Placed",
                &format!(
                    "Bound to node {}{gpu} ({:?})",
                    binding.node, self.cfg.policy
                ),
            )
            .await;
        Ok(Some(Bound {
            node: binding.node,
            host_name: spec.name.to_string(),
            tier: t.spec.tier,
            memory_mib: u64::from(spec.memory_mib),
            vcpus: u64::from(spec.vcpus),
            share: decision.share,
        }))
    }

    async fn write_scheduled(&self, t: &Tenant, binding: &Binding) -> Result<(), kube::Error> {
        let host_name = host_spec(t).ok().map(|s| s.name.to_string());
        let gpu = binding.gpu.as_ref().map(|(gpu, label)| GpuAssignment {
            gpu: gpu.clone(),
            label: label.clone(),
            reserved: false,
        });
        let message = format!(
            "Bound to node {}{}",
            binding.node,
            gpu.as_ref()
                .map(|g| format!(", GPU {}", g.summary()))
                .unwrap_or_default()
        );
        kubeio::update_status(&self.api(t), &t.name_any(), |s| {
            if s.phase.is_none() || s.phase == Some(Phase::Pending) {
                s.phase = Some(Phase::Scheduled);
            }
            s.node = Some(binding.node.clone());
            s.host_name.clone_from(&host_name);
            if !s.gpu.as_ref().is_some_and(|g| g.reserved) {
                s.gpu.clone_from(&gpu);
                s.gpu_summary = gpu.as_ref().map(GpuAssignment::summary);
            }
            condition::set(
                &mut s.conditions,
                conditions::PLACED,
                true,
                "Placed",
                &message,
            );
        })
        .await?;
        Ok(())
    }

    /// Leaves `t` Pending with `reason`; an event when the reason is new.
    async fn pending(&self, t: &Tenant, reason: &str, message: &str) -> Result<(), kube::Error> {
        let message = kubeio::bounded(message, 4000);
        let before = t
            .status
            .as_ref()
            .and_then(|s| condition::get(&s.conditions, conditions::PLACED).cloned());
        let changed = before.is_none_or(|c| c.reason != reason || c.message != message);
        if !changed {
            return Ok(());
        }
        kubeio::update_status(&self.api(t), &t.name_any(), |s| {
            s.phase = Some(Phase::Pending);
            condition::set(
                &mut s.conditions,
                conditions::PLACED,
                false,
                reason,
                &message,
            );
        })
        .await?;
        self.events.publish(t, true, reason, &message).await;
        Ok(())
    }

    fn api(&self, t: &Tenant) -> Api<Tenant> {
        match t.namespace() {
            Some(ns) => Api::namespaced(self.tenants_api.clone().into_client(), &ns),
            None => self.tenants_api.clone(),
        }
    }
}

/// What a bound `Tenant` holds on its node: its share as the host reserved it, else as
/// planned.
pub fn bound_of(t: &Tenant) -> Option<Bound> {
    let binding = Binding::of(t)?;
    let spec = host_spec(t).ok()?;
    let status = t.status.clone().unwrap_or_default();
    let share = match status.gpu.filter(|g| g.reserved) {
        Some(g) => Some((g.gpu, g.label)),
        None => binding.gpu,
    };
    let share = share.and_then(|(gpu, label)| Held::from_label(gpu, &label).ok());
    Some(Bound {
        node: binding.node,
        host_name: spec.name.to_string(),
        tier: t.spec.tier,
        memory_mib: u64::from(spec.memory_mib),
        vcpus: u64::from(spec.vcpus),
        share,
    })
}
