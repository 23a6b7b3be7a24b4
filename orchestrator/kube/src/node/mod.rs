//! `tenantvm-node`: the node agent, one per host (a DaemonSet in production, a plain process
//! per simulated host in tests). It is the only part of the Kubernetes tier that touches a
//! host, and it does so only through its tenantvmd's admin API.
//!
//! - heartbeat: renews the `tenantvm-node-<node>` Lease (the operator marks the node's
//!   tenants `NodeLost` when it stops);
//! - inventory: `GET /v1/host` published as the `TenantvmNode`'s status whenever it
//!   changes, with a `TenantvmdReachable` condition (down or wedged: the deadline on every
//!   call says which);
//! - tenants: the `Tenant`s bound to this node (label `tenantvm.dev/node`) are made,
//!   stopped, started and departed in tenantvmd (the `tenant` module), their status and Secret kept.

mod daemon;
mod tenant;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ed25519_dalek::VerifyingKey;
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use tokio::sync::Notify;

pub use daemon::{Daemon, DaemonError};

use crate::crd::{
    condition, conditions, NodeInventory, Tenant, TenantvmNode, TenantvmNodeSpec,
    TenantvmNodeStatus, NODE_LABEL,
};
use crate::kubeio::{self, Events};
use crate::lease::{self, LeaseLock};
use crate::operator::Binding;

/// The node agent's settings.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The node's name (its `TenantvmNode`).
    pub node: String,
    /// tenantvmd's API socket.
    pub socket: PathBuf,
    /// tenantvmd's admin token.
    pub token: String,
    /// The public key tenantvmd signs receipts with (`audit/receipt-signing.key.pub` under
    /// its state directory).
    pub receipt_key: VerifyingKey,
    /// The front door clients reach this host's tenants at, if it serves one.
    pub endpoint: Option<String>,
    /// The heartbeat lease's duration (renewed every third of it).
    pub lease: Duration,
    /// The deadline of one call to tenantvmd.
    pub daemon_timeout: Duration,
    /// How often the loop runs without being woken.
    pub resync: Duration,
}

/// Why the node agent stopped.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The API server refused a request the agent cannot go on without.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// Runs the node agent.
pub async fn run(client: Client, cfg: NodeConfig) -> Result<(), NodeError> {
    let nodes: Api<TenantvmNode> = Api::all(client.clone());
    ensure_node(&nodes, &cfg.node).await?;
    let heartbeat = LeaseLock::new(
        client.clone(),
        &format!("{}{}", lease::NODE_LEASE_PREFIX, cfg.node),
        &cfg.node,
        cfg.lease,
    );
    let every = cfg.lease / 3;
    tokio::spawn(async move {
        loop {
            match heartbeat.try_acquire().await {
                Ok(true) => {}
                Ok(false) => tracing::warn!("another agent holds this node's lease"),
                Err(e) => tracing::warn!(error = %e, "heartbeat not renewed"),
            }
            tokio::time::sleep(every).await;
        }
    });
    let wake = Arc::new(Notify::new());
    let selector = format!("{NODE_LABEL}={}", cfg.node);
    let tenants = kubeio::watch(
        Api::<Tenant>::all(client.clone()),
        watcher::Config::default().labels(&selector),
        wake.clone(),
    );
    let mut agent = Agent {
        daemon: Daemon {
            client: tenantvm::client::Client::new(&cfg.socket, cfg.token.clone()),
            timeout: cfg.daemon_timeout,
        },
        events: Events::new(client.clone(), "tenantvm-node", &cfg.node),
        client,
        nodes,
        tenants,
        published: None,
        reachable: None,
        keys_written: Default::default(),
        cfg,
    };
    loop {
        if agent.tenants.wait_until_ready().await.is_ok() {
            agent.pass().await;
        }
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep(agent.cfg.resync) => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn ensure_node(nodes: &Api<TenantvmNode>, name: &str) -> Result<(), kube::Error> {
    let node = TenantvmNode {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: TenantvmNodeSpec { schedulable: true },
        status: None,
    };
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => Ok(()),
        Err(e) if kubeio::is_status(&e, 409) => Ok(()),
        Err(e) => Err(e),
    }
}

struct Agent {
    cfg: NodeConfig,
    client: Client,
    daemon: Daemon,
    events: Events,
    nodes: Api<TenantvmNode>,
    tenants: Store<Tenant>,
    /// The status last written, and when.
    published: Option<(TenantvmNodeStatus, Instant)>,
    /// Whether tenantvmd answered at the last pass, and if not why.
    reachable: Option<Result<(), DaemonError>>,
    /// Tenants whose Secret holds an inference key, by host name.
    keys_written: std::collections::HashSet<String>,
}

impl Agent {
    async fn pass(&mut self) {
        let host = self.daemon.call(self.daemon.client.host()).await;
        let views = match &host {
            Ok(_) => self
                .daemon
                .call(self.daemon.client.list())
                .await
                .map(|l| l.tenants),
            Err(e) => Err(e.clone()),
        };
        let views = match views {
            Ok(v) => v,
            Err(e) => {
                self.unreachable(e).await;
                return;
            }
        };
        let mut tenants: Vec<Arc<Tenant>> = self.tenants.state();
        tenants.sort_by_key(|t| (Binding::of(t).map(|b| b.seq), t.namespace(), t.name_any()));
        let by_name: HashMap<String, &tenantvm::api::types::TenantView> =
            views.iter().map(|v| (v.name.clone(), v)).collect();
        let mut ours = Vec::new();
        for t in &tenants {
            if let Ok(spec) = crate::hostspec::host_spec(t) {
                ours.push(spec.name.to_string());
            }
            if let Err(e) = self.reconcile(t, &by_name).await {
                tracing::warn!(tenant = %t.name_any(), error = %e, "reconcile failed; again at the next pass");
                if let tenant::TenantError::Daemon(d) = &e {
                    if d.unreachable() {
                        self.unreachable(d.clone()).await;
                        return;
                    }
                }
            }
        }
        self.became_reachable().await;
        // The inventory after this pass's changes.
        let host = match self.daemon.call(self.daemon.client.host()).await {
            Ok(h) => h,
            Err(e) => return self.unreachable(e).await,
        };
        let unowned: Vec<String> = host
            .tenants
            .iter()
            .filter(|n| !ours.contains(n))
            .cloned()
            .collect();
        match NodeInventory::from_host(&host) {
            Ok(inv) => self.publish(Some(inv), unowned, Ok(())).await,
            Err(e) => tracing::error!(error = %e, "inventory not published"),
        }
    }

    async fn reconcile(
        &mut self,
        t: &Tenant,
        views: &HashMap<String, &tenantvm::api::types::TenantView>,
    ) -> Result<(), tenant::TenantError> {
        tenant::reconcile(self, t, views).await
    }

    /// tenantvmd did not answer: the node's condition and every bound tenant's say so.
    async fn unreachable(&mut self, e: DaemonError) {
        let previous = self.reachable.replace(Err(e.clone()));
        let changed = !matches!(&previous, Some(Err(p)) if p.reason() == e.reason());
        let message = format!("{e} (socket {})", self.cfg.socket.display());
        let last = self
            .published
            .as_ref()
            .map(|(s, _)| s.clone())
            .unwrap_or_default();
        self.publish(
            last.inventory,
            last.unowned,
            Err((e.reason(), message.clone())),
        )
        .await;
        if !changed {
            return;
        }
        if let Ok(Some(node)) = self.nodes.get_opt(&self.cfg.node).await {
            self.events
                .publish(&node, true, &format!("Tenantvmd{}", e.reason()), &message)
                .await;
        }
        for t in self.tenants.state() {
            let api = tenant::api_of(&self.client, &t);
            let r = kubeio::update_status(&api, &t.name_any(), |s| {
                condition::set(
                    &mut s.conditions,
                    conditions::TENANTVMD_REACHABLE,
                    false,
                    e.reason(),
                    &message,
                );
            })
            .await;
            if let Err(err) = r {
                tracing::warn!(error = %err, "status not written");
            }
        }
    }

    /// tenantvmd answers again (or for the first time): say so once.
    async fn became_reachable(&mut self) {
        let previous = self.reachable.replace(Ok(()));
        if let Some(Err(_)) = previous {
            if let Ok(Some(node)) = self.nodes.get_opt(&self.cfg.node).await {
                self.events
                    .publish(
                        &node,
                        false,
                        "TenantvmdReachable",
                        "tenantvmd answers again",
                    )
                    .await;
            }
        }
    }

    /// Writes the node's status when it changed (and at least once a minute).
    async fn publish(
        &mut self,
        inventory: Option<NodeInventory>,
        unowned: Vec<String>,
        reachable: Result<(), (&str, String)>,
    ) {
        let mut status = self
            .published
            .as_ref()
            .map(|(s, _)| s.clone())
            .unwrap_or_default();
        let before = status.clone();
        status.gpu_free = inventory.as_ref().map(crate::placement::free_summary);
        status.tenant_count = inventory.as_ref().map_or(0, |i| i.tenants.len() as u32);
        status.inventory = inventory;
        status.unowned = unowned;
        match reachable {
            Ok(()) => condition::set(
                &mut status.conditions,
                conditions::TENANTVMD_REACHABLE,
                true,
                "Answers",
                "tenantvmd answers its admin API",
            ),
            Err((reason, message)) => condition::set(
                &mut status.conditions,
                conditions::TENANTVMD_REACHABLE,
                false,
                reason,
                &message,
            ),
        };
        let fresh = self
            .published
            .as_ref()
            .is_some_and(|(_, at)| at.elapsed() < Duration::from_secs(60));
        if status == before && fresh {
            return;
        }
        status.updated = Some(condition::now_rfc3339());
        match self.write_node_status(&status).await {
            Ok(()) => self.published = Some((status, Instant::now())),
            Err(e) => tracing::warn!(error = %e, "node status not written"),
        }
    }

    async fn write_node_status(&self, status: &TenantvmNodeStatus) -> Result<(), kube::Error> {
        ensure_node(&self.nodes, &self.cfg.node).await?;
        for _ in 0..8 {
            let mut node = self.nodes.get(&self.cfg.node).await?;
            node.status = Some(status.clone());
            match self
                .nodes
                .replace_status(&self.cfg.node, &PostParams::default(), &node)
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if kubeio::is_status(&e, 409) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}
