//! The Kubernetes tier's test bench: a real API server, simulated GPU hosts (tenantvmd and
//! node agent each), operator replicas, and the waits and views the tests share.

#![allow(dead_code)]

pub mod cluster;
pub mod host;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kube::api::{ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use tenantvm_kube::crd::{Tenant, TenantvmNode};

/// An operator replica.
pub struct Operator {
    /// Its identity in the leader lease.
    pub identity: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Operator {
    /// Starts a replica named `identity` with the kubeconfig at `kubeconfig`.
    pub fn start(
        identity: &str,
        kubeconfig: &std::path::Path,
        dir: &std::path::Path,
        extra: &[&str],
    ) -> Operator {
        let log = dir.join(format!("operator-{identity}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tenantvm-operator"))
            .args([
                "--identity",
                identity,
                "--leader-lease-s",
                "6",
                "--node-lost-after-s",
                "8",
                "--resync-s",
                "2",
            ])
            .args(extra)
            .env("KUBECONFIG", kubeconfig)
            .env("TENANTVM_LOG", "info,kube=warn")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        Operator {
            identity: identity.into(),
            child: Some(child),
            log,
        }
    }

    /// Its pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILLs it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on the pid of a child this process spawned and has not reaped.
            unsafe { libc::kill(c.id() as i32, libc::SIGKILL) };
            let _ = c.wait();
        }
    }

    /// Its log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `Tenant` manifest.
pub fn tenant(ns: &str, name: &str, tier: &str, gpu: serde_json::Value) -> Tenant {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "tenantvm.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": { "name": name, "namespace": ns },
        "spec": { "tier": tier, "vcpus": 1, "memory_mib": 64, "gpu": gpu, "image": { "name": "idle" } }
    }))
    .unwrap()
}

/// Creates `t` as `client`.
pub async fn apply(client: &Client, t: &Tenant) -> Result<Tenant, kube::Error> {
    let api: Api<Tenant> = Api::namespaced(client.clone(), &t.namespace().unwrap());
    api.create(&PostParams::default(), t).await
}

/// Every `Tenant`, by `namespace/name`.
pub async fn tenants(client: &Client) -> BTreeMap<String, Tenant> {
    let api: Api<Tenant> = Api::all(client.clone());
    match api.list(&ListParams::default()).await {
        Ok(l) => l
            .items
            .into_iter()
            .map(|t| (format!("{}/{}", t.namespace().unwrap(), t.name_any()), t))
            .collect(),
        Err(_) => BTreeMap::new(),
    }
}

/// The phase of a tenant, as text ("" when none).
pub fn phase(t: &Tenant) -> String {
    t.status
        .as_ref()
        .and_then(|s| s.phase)
        .map(|p| p.as_str().to_string())
        .unwrap_or_default()
}

/// `kubectl get tenants -A` as text, with each tenant's conditions: for failure messages.
pub async fn describe(client: &Client) -> String {
    let mut out = String::new();
    for (key, t) in tenants(client).await {
        let s = t.status.clone().unwrap_or_default();
        out.push_str(&format!(
            "{key}: phase={} node={:?} gpu={:?} labels={:?} deleting={}\n",
            phase(&t),
            s.node,
            s.gpu_summary,
            t.labels(),
            t.metadata.deletion_timestamp.is_some()
        ));
        for c in s.conditions {
            out.push_str(&format!(
                "    {} {} {}: {}\n",
                c.type_, c.status, c.reason, c.message
            ));
        }
    }
    let nodes: Api<TenantvmNode> = Api::all(client.clone());
    if let Ok(l) = nodes.list(&ListParams::default()).await {
        for n in l.items {
            let s = n.status.unwrap_or_default();
            out.push_str(&format!(
                "node {}: tenants={} free={:?} unowned={:?} conditions={:?}\n",
                n.metadata.name.unwrap_or_default(),
                s.tenant_count,
                s.gpu_free,
                s.unowned,
                s.conditions
                    .iter()
                    .map(|c| format!("{} {} {}", c.type_, c.status, c.reason))
                    .collect::<Vec<_>>()
            ));
        }
    }
    out
}

/// Polls `check` every 200 ms until it holds or `timeout` passes; returns whether it held.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
