//! The few ways the operator and the node agents write to the API server: status updates
//! that never lose another writer's change, conditional metadata patches, finalizers,
//! events, and watched caches that wake a reconcile loop.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::Notify;

use crate::crd::{Tenant, TenantStatus, FINALIZER};

/// Tries of a read-modify-write before giving up to the next reconcile.
const CONFLICT_TRIES: usize = 8;

/// Whether `e` is the API server's answer `code`.
pub fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// Changes `name`'s status with `change` (read, change, write with the resource version
/// read; again on a conflict), so a writer never undoes another's fields. Returns the
/// object as written, or as read when `change` left it as it was; None when it is gone.
pub async fn update_status(
    api: &Api<Tenant>,
    name: &str,
    change: impl Fn(&mut TenantStatus),
) -> Result<Option<Tenant>, kube::Error> {
    for _ in 0..CONFLICT_TRIES {
        let Some(mut t) = api.get_opt(name).await? else {
            return Ok(None);
        };
        let before = t.status.clone().unwrap_or_default();
        let mut after = before.clone();
        change(&mut after);
        if after == before {
            return Ok(Some(t));
        }
        t.status = Some(after);
        match api.replace_status(name, &PostParams::default(), &t).await {
            Ok(t) => return Ok(Some(t)),
            Err(e) if is_status(&e, 409) => continue,
            Err(e) if is_status(&e, 404) => return Ok(None),
            Err(e) => return Err(e),
        }
    }
    Err(conflict(name))
}

fn conflict(name: &str) -> kube::Error {
    kube::Error::Api(Box::new(
        kube::core::Status::failure(
            &format!("{name}: the status kept changing under {CONFLICT_TRIES} tries"),
            "Conflict",
        )
        .with_code(409),
    ))
}

/// A JSON merge patch of `obj`'s metadata, applied only if `obj` is unchanged since it was
/// read (its resource version travels in the patch). Ok(false) when it changed meanwhile.
pub async fn patch_metadata_if_unchanged<K>(
    api: &Api<K>,
    obj: &K,
    metadata: serde_json::Value,
) -> Result<bool, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let mut metadata = metadata;
    metadata["resourceVersion"] =
        serde_json::Value::String(obj.resource_version().unwrap_or_default());
    let patch = serde_json::json!({ "metadata": metadata });
    match api
        .patch(
            &obj.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(e) if is_status(&e, 409) || is_status(&e, 404) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Adds the departure finalizer (a no-op when present). Ok(false) when the object changed
/// meanwhile, or is being deleted (the API server refuses a new finalizer then).
pub async fn add_finalizer(api: &Api<Tenant>, t: &Tenant) -> Result<bool, kube::Error> {
    if t.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(true);
    }
    if t.metadata.deletion_timestamp.is_some() {
        return Ok(false);
    }
    let mut list = t.finalizers().to_vec();
    list.push(FINALIZER.into());
    match patch_metadata_if_unchanged(api, t, serde_json::json!({ "finalizers": list })).await {
        Err(e) if is_status(&e, 422) => Ok(false),
        other => other,
    }
}

/// Takes the departure finalizer off: the API server then lets the object go.
pub async fn remove_finalizer(api: &Api<Tenant>, t: &Tenant) -> Result<bool, kube::Error> {
    let list: Vec<&String> = t.finalizers().iter().filter(|f| *f != FINALIZER).collect();
    patch_metadata_if_unchanged(api, t, serde_json::json!({ "finalizers": list })).await
}

/// Publishes events as one controller; a failure to publish is logged, never fatal.
#[derive(Clone)]
pub struct Events {
    recorder: Recorder,
}

impl Events {
    /// Events reported by `controller` (its `instance` names the process).
    pub fn new(client: Client, controller: &str, instance: &str) -> Events {
        Events {
            recorder: Recorder::new(
                client,
                Reporter {
                    controller: controller.into(),
                    instance: Some(instance.into()),
                },
            ),
        }
    }

    /// A `Normal` (or, `warning`, `Warning`) event `reason` about `obj`.
    pub async fn publish<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        warning: bool,
        reason: &str,
        note: &str,
    ) {
        let event = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            note: Some(bounded(note, 1000)),
            action: reason.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &obj.object_ref(&())).await {
            tracing::warn!(error = %e, reason, "event not published");
        }
    }
}

/// `text` cut to at most `max` bytes on a character boundary.
pub fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max.saturating_sub(3);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// A cache of `api`'s objects matching `config`, kept by a watch in the background; every
/// change wakes `wake`. The watch retries with backoff while the API server is away.
pub fn watch<K>(api: Api<K>, config: watcher::Config, wake: Arc<Notify>) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(
        writer,
        watcher(api, config).backoff(RetryBackoff::default()),
    );
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => wake.notify_one(),
                Err(e) => tracing::warn!(error = %e, "watch interrupted; retrying"),
            }
        }
    });
    reader
}

/// How a watch retries while the API server is away: from 200 ms, doubling, at most every
/// 2 s (kube-rs's default climbs to 30 s and forgets only after two quiet minutes, which
/// left a node agent blind for most of a minute after an outage).
#[derive(Debug, Default)]
pub struct RetryBackoff {
    next: Option<Duration>,
}

/// The longest wait between two tries of a watch.
pub const RETRY_MAX: Duration = Duration::from_secs(2);

impl Iterator for RetryBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let now = self.next.unwrap_or(Duration::from_millis(200));
        self.next = Some((now * 2).min(RETRY_MAX));
        Some(now)
    }
}

impl kube::runtime::utils::Backoff for RetryBackoff {
    fn reset(&mut self) {
        self.next = None;
    }
}

/// The objects of `store`, sorted by namespace and name.
pub fn sorted<K: Resource + Clone>(store: &Store<K>) -> Vec<Arc<K>>
where
    K::DynamicType: Eq + Hash + Clone,
{
    let mut all = store.state();
    all.sort_by_key(|o| (o.namespace(), o.name_any()));
    all
}

/// Serialises `value` for an annotation.
pub fn to_annotation<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("annotation values serialise")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::utils::Backoff;

    #[test]
    fn a_watch_retries_at_most_every_two_seconds_and_starts_over_after_a_success() {
        let mut b = RetryBackoff::default();
        let waits: Vec<Duration> = b.by_ref().take(6).collect();
        assert_eq!(waits[0], Duration::from_millis(200));
        assert_eq!(waits[5], RETRY_MAX);
        assert!(waits.iter().all(|w| *w <= RETRY_MAX));
        b.reset();
        assert_eq!(b.next(), Some(Duration::from_millis(200)));
    }
}
