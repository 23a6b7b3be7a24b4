//! Coordination `Lease`s: the operator's leader election and each node agent's heartbeat.
//!
//! Whether a lease expired is judged as client-go judges it, by local observation: a lease
//! whose renew time has not changed for its duration since this process first saw that
//! renew time is expired. Clocks of different machines are never compared, so a skewed
//! clock neither steals a live lease nor keeps a dead one.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio::sync::Mutex;

/// The namespace holding the leases (and the operator).
pub const NAMESPACE: &str = "tenantvm-system";
/// The operator's leader lease.
pub const LEADER_LEASE: &str = "tenantvm-operator";
/// Prefix of the node agents' heartbeat leases: `tenantvm-node-<node>`.
pub const NODE_LEASE_PREFIX: &str = "tenantvm-node-";

/// What one process saw of leases, and when.
#[derive(Debug, Default)]
pub struct Observer {
    seen: HashMap<String, (Option<Timestamp>, Option<String>, Instant)>,
}

impl Observer {
    /// Records `lease` as seen at `now`; returns whether it is expired: no holder, or its
    /// renew time and holder unchanged for longer than its duration (at least `floor`).
    pub fn expired(&mut self, lease: &Lease, now: Instant, floor: Duration) -> bool {
        let name = lease.metadata.name.clone().unwrap_or_default();
        let spec = lease.spec.clone().unwrap_or_default();
        let Some(holder) = spec.holder_identity else {
            return true;
        };
        let renew = spec.renew_time.map(|t| t.0);
        let duration =
            Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64).max(floor);
        let entry = self
            .seen
            .entry(name)
            .or_insert((renew, Some(holder.clone()), now));
        if entry.0 != renew || entry.1.as_deref() != Some(holder.as_str()) {
            *entry = (renew, Some(holder), now);
        }
        now.duration_since(entry.2) > duration
    }
}

/// A lease this process takes and renews.
pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    holder: String,
    duration: Duration,
    observer: Mutex<Observer>,
}

impl LeaseLock {
    /// The lease `name` in [`NAMESPACE`], held as `holder` for `duration` per renewal.
    pub fn new(client: Client, name: &str, holder: &str, duration: Duration) -> LeaseLock {
        LeaseLock {
            api: Api::namespaced(client, NAMESPACE),
            name: name.into(),
            holder: holder.into(),
            duration,
            observer: Mutex::default(),
        }
    }

    /// Takes the lease when it is free, expired or already ours, and renews it; returns
    /// whether this process holds it now. A race lost to another writer is `false`.
    pub async fn try_acquire(&self) -> Result<bool, kube::Error> {
        let now = MicroTime(Timestamp::now());
        let seconds = i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX);
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    namespace: Some(NAMESPACE.into()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.holder.clone()),
                    lease_duration_seconds: Some(seconds),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return conflict_is_false(self.api.create(&PostParams::default(), &lease).await);
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let mine = spec.holder_identity.as_deref() == Some(self.holder.as_str());
        let expired = self
            .observer
            .lock()
            .await
            .expired(&lease, Instant::now(), Duration::ZERO);
        if !mine && !expired {
            return Ok(false);
        }
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(self.holder.clone()),
            lease_duration_seconds: Some(seconds),
            acquire_time: if mine {
                spec.acquire_time
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(spec.lease_transitions.unwrap_or(0) + i32::from(!mine)),
            ..spec
        });
        // The resource version read above makes this a compare-and-swap.
        conflict_is_false(
            self.api
                .replace(&self.name, &PostParams::default(), &lease)
                .await,
        )
    }
}

fn conflict_is_false(r: Result<Lease, kube::Error>) -> Result<bool, kube::Error> {
    match r {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, renew_s: i64, duration_s: i32) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("l".into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_string),
                renew_time: Some(MicroTime(Timestamp::from_second(renew_s).unwrap())),
                lease_duration_seconds: Some(duration_s),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_lease_expires_by_what_this_process_saw_not_by_its_clock() {
        let mut o = Observer::default();
        let t0 = Instant::now();
        // Renewed "long ago" by the holder's clock: not expired, first seen now.
        assert!(!o.expired(&lease(Some("a"), 1, 10), t0, Duration::ZERO));
        assert!(!o.expired(
            &lease(Some("a"), 1, 10),
            t0 + Duration::from_secs(9),
            Duration::ZERO
        ));
        assert!(o.expired(
            &lease(Some("a"), 1, 10),
            t0 + Duration::from_secs(11),
            Duration::ZERO
        ));
        // A renewal restarts the count.
        assert!(!o.expired(
            &lease(Some("a"), 2, 10),
            t0 + Duration::from_secs(12),
            Duration::ZERO
        ));
        assert!(!o.expired(
            &lease(Some("a"), 2, 10),
            t0 + Duration::from_secs(21),
            Duration::ZERO
        ));
        assert!(o.expired(
            &lease(Some("a"), 2, 10),
            t0 + Duration::from_secs(23),
            Duration::ZERO
        ));
        // A floor lengthens a short lease; no holder is expired at once.
        assert!(!o.expired(
            &lease(Some("a"), 2, 10),
            t0 + Duration::from_secs(23),
            Duration::from_secs(60)
        ));
        assert!(o.expired(&lease(None, 3, 10), t0, Duration::ZERO));
    }
}
