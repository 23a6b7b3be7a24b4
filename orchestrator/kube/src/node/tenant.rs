//! One bound `Tenant` against the node's tenantvmd.
//!
//! - Not on the host, not deleted: made (`POST /v1/tenants`), unless the host already
//!   holds a receipt under its host name (it left outside Kubernetes: never made twice).
//!   Creates go one at a time in binding order, each waited for until its GPU share is
//!   reserved, so the host's planner meets them as the operator planned them. The token
//!   create returns goes straight into the tenant's Secret.
//! - On the host: stopped or started to match `spec.stopped`; once running, an inference
//!   key for the front door is made and put in the Secret; the status mirrors the host's
//!   (phase, the GPU share it reserved, `Ready`, `TenantvmdReachable`).
//! - Deleted: the departure. `DELETE /v1/tenants/{name}` (again after a failed step, which
//!   resumes it); once the host no longer lists it, its receipt is read through the API
//!   and checked against the daemon's public key; digest and summary go into the status
//!   and an event, the Secret is deleted, and only then the finalizer. A receipt that does
//!   not verify keeps the finalizer (and says so).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource, ResourceExt};
use tenantvm::api::types::TenantView;
use tenantvm::domain::lifecycle::LifecycleState;
use tenantvm::receipt::LogEntry;

use super::{Agent, DaemonError};
use crate::crd::{condition, conditions, GpuAssignment, Phase, ReceiptStatus, Tenant};
use crate::hostspec::host_spec;
use crate::kubeio;

/// How long a create is waited for until its GPU share is reserved, before the next.
const RESERVE_WAIT: Duration = Duration::from_secs(30);

/// Why one tenant's reconcile stopped.
#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    /// tenantvmd failed.
    #[error(transparent)]
    Daemon(#[from] DaemonError),
    /// The API server failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// The `Tenant` API of `t`'s namespace.
pub fn api_of(client: &Client, t: &Tenant) -> Api<Tenant> {
    Api::namespaced(client.clone(), &t.namespace().unwrap_or_default())
}

/// The name of `t`'s Secret.
pub fn secret_name(t: &Tenant) -> String {
    format!("{}-tenantvm", t.name_any())
}

/// Reconciles `t` (bound to this node) with the host's `views`.
pub(super) async fn reconcile(
    agent: &mut Agent,
    t: &Tenant,
    views: &HashMap<String, &TenantView>,
) -> Result<(), TenantError> {
    let api = api_of(&agent.client, t);
    let spec = match host_spec(t) {
        Ok(s) => s,
        Err(e) => {
            // The operator never binds such a tenant; one bound by hand is refused here.
            set_status(&api, t, |s| {
                s.phase = Some(Phase::Failed);
                condition::set(
                    &mut s.conditions,
                    conditions::READY,
                    false,
                    "InvalidSpec",
                    &e.to_string(),
                );
            })
            .await?;
            return Ok(());
        }
    };
    let name = spec.name.to_string();
    let view = views.get(&name).copied();
    if t.metadata.deletion_timestamp.is_some() {
        return depart(agent, &api, t, &name, view).await;
    }
    let Some(view) = view else {
        if let Some(entry) = receipt_of(agent, &name).await? {
            let message = format!(
                "The host {} holds a receipt for {name} (departure {}): it left outside Kubernetes and is not made again; delete the Tenant",
                agent.cfg.node, entry.receipt.departure_id
            );
            if set_status(&api, t, |s| {
                s.phase = Some(Phase::Failed);
                condition::set(
                    &mut s.conditions,
                    conditions::READY,
                    false,
                    "DepartedOutside",
                    &message,
                );
            })
            .await?
            {
                agent
                    .events
                    .publish(t, true, "DepartedOutside", &message)
                    .await;
            }
            return Ok(());
        }
        return create(agent, &api, t, &spec).await;
    };
    // Stop or start to match the spec (the host refuses, and says why, in other states).
    let d = &agent.daemon;
    match (t.spec.stopped, view.state) {
        (true, LifecycleState::Running) if !view.recovering => {
            refused_is_fine(d.call(d.client.stop(&name)).await)?;
        }
        (false, LifecycleState::Stopped) if !view.recovering => {
            refused_is_fine(d.call(d.client.start(&name)).await)?;
        }
        _ => {}
    }
    if view.state == LifecycleState::Running && !agent.keys_written.contains(&name) {
        ensure_inference_key(agent, t, &name).await?;
    }
    let phase = phase_of(view.state);
    let gpu = view.gpu.as_ref().map(|g| GpuAssignment {
        gpu: g.gpu.clone(),
        label: g.label.clone(),
        reserved: true,
    });
    let (ready, reason, message) = match view.state {
        LifecycleState::Running => (true, "Running", "Its VM runs".to_string()),
        LifecycleState::Failed => (
            false,
            "Failed",
            view.error.clone().unwrap_or_else(|| "failed".into()),
        ),
        other => (
            false,
            phase.as_str(),
            match view.steps.last() {
                Some(step) => format!("{other}: step {} {}", step.step, step.status),
                None => other.to_string(),
            },
        ),
    };
    let message = kubeio::bounded(
        &tenantvm::untrusted::GuestLine::bounded(&message, 2000).into_string(),
        2000,
    );
    let before = t.status.as_ref().and_then(|s| s.phase);
    let node = agent.cfg.node.clone();
    let endpoint = agent.cfg.endpoint.clone();
    let secret = secret_name(t);
    let changed = set_status(&api, t, |s| {
        if !view.recovering {
            s.phase = Some(phase);
        }
        s.node = Some(node.clone());
        s.host_name = Some(name.clone());
        s.gpu_summary = gpu
            .as_ref()
            .map(GpuAssignment::summary)
            .or(s.gpu_summary.take());
        if gpu.is_some() {
            s.gpu.clone_from(&gpu);
        }
        s.endpoint.clone_from(&endpoint);
        s.secret = Some(secret.clone());
        condition::set(
            &mut s.conditions,
            conditions::READY,
            ready,
            reason,
            &message,
        );
        condition::set(
            &mut s.conditions,
            conditions::TENANTVMD_REACHABLE,
            true,
            "Answers",
            "tenantvmd answers its admin API",
        );
    })
    .await?;
    if changed && before != Some(phase) && !view.recovering {
        let warning = phase == Phase::Failed;
        agent
            .events
            .publish(t, warning, phase.as_str(), &message)
            .await;
    }
    Ok(())
}

/// Makes `t` on the host, writes its token to its Secret, and waits (bounded) until its
/// GPU share is reserved.
async fn create(
    agent: &mut Agent,
    api: &Api<Tenant>,
    t: &Tenant,
    spec: &tenantvm::domain::TenantSpec,
) -> Result<(), TenantError> {
    let name = spec.name.to_string();
    let d = agent.daemon.clone();
    let created = match d.call(d.client.create(spec)).await {
        Ok(c) => c,
        Err(e) if e.unreachable() => return Err(e.into()),
        Err(DaemonError::Refused { code, .. }) if code == "name_taken" => return Ok(()),
        Err(e) => {
            let message = format!("Node {} refused it: {e}", agent.cfg.node);
            if set_status(api, t, |s| {
                s.phase = Some(Phase::Failed);
                condition::set(
                    &mut s.conditions,
                    conditions::READY,
                    false,
                    "HostRefused",
                    &message,
                );
            })
            .await?
            {
                agent.events.publish(t, true, "HostRefused", &message).await;
            }
            return Ok(());
        }
    };
    write_secret(agent, t, &name, &[("token", created.token.as_str())]).await?;
    agent
        .events
        .publish(
            t,
            false,
            "Creating",
            &format!("Made on node {} as {name}", agent.cfg.node),
        )
        .await;
    let deadline = Instant::now() + RESERVE_WAIT;
    while Instant::now() < deadline {
        let v = d.call(d.client.status(&name)).await?;
        let reserved = v.state != LifecycleState::Provisioning
            || v.steps
                .iter()
                .any(|s| s.step == "reserve-gpu" && s.status != "started");
        if reserved {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The departure of a deleted `t`.
async fn depart(
    agent: &mut Agent,
    api: &Api<Tenant>,
    t: &Tenant,
    name: &str,
    view: Option<&TenantView>,
) -> Result<(), TenantError> {
    if let Some(v) = view {
        let d = &agent.daemon;
        let resume = v.state != LifecycleState::Destroying || v.error.is_some();
        if resume && !v.recovering {
            refused_is_fine(d.call(d.client.destroy(name)).await)?;
        }
        let message = match (&v.error, v.steps.last()) {
            (Some(e), _) => format!("The departure stopped at a failed step and is resumed: {e}"),
            (None, Some(s)) => format!("The departure runs: step {} {}", s.step, s.status),
            (None, None) => "The departure runs".to_string(),
        };
        let message = tenantvm::untrusted::GuestLine::bounded(&message, 2000).into_string();
        set_status(api, t, |s| {
            s.phase = Some(Phase::Departing);
            condition::set(
                &mut s.conditions,
                conditions::DEPARTED,
                false,
                "Departing",
                &message,
            );
        })
        .await?;
        return Ok(());
    }
    let entry = receipt_of(agent, name).await?;
    let Some(entry) = entry else {
        // Bound, never made here: nothing to depart.
        delete_secret(agent, t).await?;
        if kubeio::remove_finalizer(api, t).await? {
            agent
                .events
                .publish(
                    t,
                    false,
                    "Departed",
                    &format!("Nothing was made on node {}", agent.cfg.node),
                )
                .await;
        }
        return Ok(());
    };
    let verified = entry.signed_by(&agent.cfg.receipt_key);
    let succeeded = entry.receipt.succeeded();
    if !verified || !succeeded {
        let why = if verified {
            "a step of the departure failed"
        } else {
            "its signature does not check against the daemon's public key"
        };
        let message = format!(
            "The receipt of {name} (departure {}) does not verify: {why}. The Tenant is kept until someone looks (tenantvm receipt verify on node {})",
            entry.receipt.departure_id, agent.cfg.node
        );
        if set_status(api, t, |s| {
            condition::set(
                &mut s.conditions,
                conditions::DEPARTED,
                false,
                "ReceiptUnverified",
                &message,
            );
        })
        .await?
        {
            agent
                .events
                .publish(t, true, "ReceiptUnverified", &message)
                .await;
        }
        return Ok(());
    }
    let receipt = ReceiptStatus {
        digest: entry.digest().unwrap_or_default(),
        departure_id: entry.receipt.departure_id.clone(),
        finished_at: entry.receipt.finished_at.clone(),
        summary: summary(&entry),
        key_id: entry.key_id.clone(),
    };
    let message = format!(
        "Receipt {} (sha256 {}): {}",
        receipt.departure_id, receipt.digest, receipt.summary
    );
    set_status(api, t, |s| {
        s.receipt = Some(receipt.clone());
        condition::set(
            &mut s.conditions,
            conditions::DEPARTED,
            true,
            "ReceiptVerified",
            &message,
        );
    })
    .await?;
    agent.events.publish(t, false, "Departed", &message).await;
    delete_secret(agent, t).await?;
    // Fresh: the status write above changed the resource version.
    if let Some(now) = api.get_opt(&t.name_any()).await? {
        kubeio::remove_finalizer(api, &now).await?;
    }
    agent.keys_written.remove(name);
    Ok(())
}

/// The newest departure receipt the host holds for `name`.
async fn receipt_of(agent: &Agent, name: &str) -> Result<Option<LogEntry>, TenantError> {
    let d = &agent.daemon;
    let list = d.call(d.client.receipts(Some(name))).await?;
    Ok(list
        .receipts
        .into_iter()
        .rev()
        .find(|e| e.receipt.tenant == name && e.receipt.verification.is_none()))
}

/// The receipt's steps and results in one line.
fn summary(entry: &LogEntry) -> String {
    let r = &entry.receipt;
    let word = |v: serde_json::Result<serde_json::Value>| {
        v.ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    };
    let steps: Vec<String> = r
        .steps
        .iter()
        .map(|s| {
            format!(
                "{} {}",
                word(serde_json::to_value(s.step)),
                word(serde_json::to_value(s.result))
            )
        })
        .collect();
    let simulated = if r.simulated() {
        " (simulated GPU)"
    } else {
        ""
    };
    format!("{} steps: {}{simulated}", steps.len(), steps.join(", "))
}

fn phase_of(state: LifecycleState) -> Phase {
    match state {
        LifecycleState::Pending | LifecycleState::Provisioning => Phase::Provisioning,
        LifecycleState::Running => Phase::Running,
        LifecycleState::Stopping => Phase::Stopping,
        LifecycleState::Stopped => Phase::Stopped,
        LifecycleState::Destroying | LifecycleState::Destroyed => Phase::Departing,
        LifecycleState::Failed => Phase::Failed,
    }
}

/// A refusal (busy, wrong state) waits for the next pass; an unreachable daemon does not.
fn refused_is_fine<T>(r: Result<T, DaemonError>) -> Result<(), TenantError> {
    match r {
        Ok(_) => Ok(()),
        Err(e) if e.unreachable() => Err(e.into()),
        Err(e) => {
            tracing::info!(error = %e, "tenantvmd refused; again at the next pass");
            Ok(())
        }
    }
}

/// Writes `t`'s status when `change` changes the cached copy; returns whether it wrote.
async fn set_status(
    api: &Api<Tenant>,
    t: &Tenant,
    change: impl Fn(&mut crate::crd::TenantStatus),
) -> Result<bool, kube::Error> {
    let before = t.status.clone().unwrap_or_default();
    let mut after = before.clone();
    change(&mut after);
    if after == before {
        return Ok(false);
    }
    kubeio::update_status(api, &t.name_any(), change).await?;
    Ok(true)
}

async fn ensure_inference_key(
    agent: &mut Agent,
    t: &Tenant,
    name: &str,
) -> Result<(), TenantError> {
    let secrets: Api<Secret> =
        Api::namespaced(agent.client.clone(), &t.namespace().unwrap_or_default());
    let has = secrets
        .get_opt(&secret_name(t))
        .await?
        .and_then(|s| s.data)
        .is_some_and(|d| d.contains_key("inference-key"));
    if !has {
        let d = &agent.daemon;
        let key = match d.call(d.client.create_key(name)).await {
            Ok(k) => k,
            Err(e) if e.unreachable() => return Err(e.into()),
            Err(e) => {
                tracing::warn!(tenant = name, error = %e, "no inference key made");
                return Ok(());
            }
        };
        write_secret(agent, t, name, &[("inference-key", key.key.as_str())]).await?;
    }
    agent.keys_written.insert(name.to_string());
    Ok(())
}

/// Merges `entries` into `t`'s Secret (made if absent, owned by `t`).
async fn write_secret(
    agent: &Agent,
    t: &Tenant,
    host_name: &str,
    entries: &[(&str, &str)],
) -> Result<(), kube::Error> {
    let ns = t.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(agent.client.clone(), &ns);
    let mut data: BTreeMap<String, String> = entries
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    data.insert("host-name".into(), host_name.into());
    data.insert("node".into(), agent.cfg.node.clone());
    if let Some(e) = &agent.cfg.endpoint {
        data.insert("endpoint".into(), e.clone());
    }
    let name = secret_name(t);
    let patch = serde_json::json!({ "stringData": data });
    match secrets
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => return Ok(()),
        Err(e) if kubeio::is_status(&e, 404) => {}
        Err(e) => return Err(e),
    }
    let owner = OwnerReference {
        api_version: Tenant::api_version(&()).into_owned(),
        kind: Tenant::kind(&()).into_owned(),
        name: t.name_any(),
        uid: t.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    };
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name),
            namespace: Some(ns),
            owner_references: Some(vec![owner]),
            labels: Some([("tenantvm.dev/tenant".to_string(), t.name_any())].into()),
            ..Default::default()
        },
        string_data: Some(data),
        type_: Some("Opaque".into()),
        ..Default::default()
    };
    secrets.create(&PostParams::default(), &secret).await?;
    Ok(())
}

async fn delete_secret(agent: &Agent, t: &Tenant) -> Result<(), kube::Error> {
    let secrets: Api<Secret> =
        Api::namespaced(agent.client.clone(), &t.namespace().unwrap_or_default());
    match secrets
        .delete(&secret_name(t), &DeleteParams::default())
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if kubeio::is_status(&e, 404) => Ok(()),
        Err(e) => Err(e),
    }
}
