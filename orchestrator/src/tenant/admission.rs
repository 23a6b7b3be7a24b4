//! Admission of inference requests, per tenant: a token bucket for the request rate
//! (`quotas.requests_per_s`, burst one second's worth) and a count of requests in flight
//! (`quotas.max_concurrency`).
//!
//! Every inference request reaches a guest through the daemon (guests have no network),
//! so this is the one gate. Each tenant has its own bucket and counter, keyed by tenant
//! id: a tenant that exhausts its budget slows only itself, and a new tenant that reuses
//! a destroyed one's name starts afresh. A refused request does no work and takes no
//! token from later ones.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::domain::spec::Quotas;

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refused {
    /// The tenant's request rate is spent; a token comes back after `retry_after`.
    #[error("Tenant {tenant:?} is over its request rate ({limit} per second); retry in {} ms", retry_after.as_millis())]
    Rate {
        /// The tenant's name.
        tenant: String,
        /// Its `requests_per_s`.
        limit: u32,
        /// When the next token is due.
        retry_after: Duration,
    },
    /// The tenant is leaving: its route is closed for good.
    #[error("Tenant {tenant:?} is being destroyed; it takes no more requests")]
    Closed {
        /// The tenant's name.
        tenant: String,
    },
    /// The tenant already has `limit` requests in flight.
    #[error("Tenant {tenant:?} already has {limit} requests in flight (its max_concurrency); retry when one finishes")]
    Concurrency {
        /// The tenant's name.
        tenant: String,
        /// Its `max_concurrency`.
        limit: u32,
    },
}

impl Refused {
    /// Whole seconds for a `Retry-After` header (at least 1).
    pub fn retry_after_secs(&self) -> u64 {
        match self {
            Refused::Rate { retry_after, .. } => retry_after.as_secs_f64().ceil().max(1.0) as u64,
            Refused::Concurrency { .. } | Refused::Closed { .. } => 1,
        }
    }
}

/// One tenant's bucket and in-flight count.
#[derive(Debug)]
struct Gate {
    tokens: f64,
    refilled: Instant,
    in_flight: u32,
    closed: bool,
}

impl Gate {
    /// A gate first seen at `now`, holding `tokens`.
    fn new(tokens: f64, now: Instant, closed: bool) -> Self {
        Gate {
            tokens,
            refilled: now,
            in_flight: 0,
            closed,
        }
    }
}

/// The admission state of every tenant.
#[derive(Debug, Default)]
pub struct Admission {
    gates: Mutex<HashMap<String, Gate>>,
}

/// A request in flight; dropping it frees its place.
#[derive(Debug)]
pub struct Permit {
    admission: Arc<Admission>,
    tenant_id: String,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut gates = self.admission.lock();
        if let Some(gate) = gates.get_mut(&self.tenant_id) {
            gate.in_flight = gate.in_flight.saturating_sub(1);
        }
    }
}

impl Admission {
    /// The gate's key for a tenant: its row id and name, so that a new tenant under a
    /// destroyed one's name starts afresh.
    pub fn key(id: i64, name: &str) -> String {
        format!("{id}:{name}")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Gate>> {
        self.gates.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits one request of tenant `tenant_id` (named `name` in messages) at `now`
    /// under `quotas`, or says why not.
    pub fn admit(
        self: &Arc<Self>,
        tenant_id: &str,
        name: &str,
        quotas: &Quotas,
        now: Instant,
    ) -> Result<Permit, Refused> {
        let rate = f64::from(quotas.requests_per_s.max(1));
        let burst = rate;
        let mut gates = self.lock();
        let gate = gates
            .entry(tenant_id.to_string())
            .or_insert_with(|| Gate::new(burst, now, false));
        if gate.closed {
            return Err(Refused::Closed {
                tenant: name.to_string(),
            });
        }
        let elapsed = now.saturating_duration_since(gate.refilled).as_secs_f64();
        gate.tokens = (gate.tokens + elapsed * rate).min(burst);
        gate.refilled = gate.refilled.max(now);
        if gate.in_flight >= quotas.max_concurrency {
            return Err(Refused::Concurrency {
                tenant: name.to_string(),
                limit: quotas.max_concurrency,
            });
        }
        if gate.tokens < 1.0 {
            return Err(Refused::Rate {
                tenant: name.to_string(),
                limit: quotas.requests_per_s,
                retry_after: Duration::from_secs_f64((1.0 - gate.tokens) / rate),
            });
        }
        gate.tokens -= 1.0;
        gate.in_flight += 1;
        Ok(Permit {
            admission: self.clone(),
            tenant_id: tenant_id.to_string(),
        })
    }

    /// Closes a departing tenant's route: every later request is refused. Returns how
    /// many requests were still in flight (they end with the guest's shutdown).
    pub fn close(&self, tenant_id: &str) -> u32 {
        let mut gates = self.lock();
        let gate = gates
            .entry(tenant_id.to_string())
            .or_insert_with(|| Gate::new(0.0, Instant::now(), true));
        gate.closed = true;
        gate.in_flight
    }

    /// Drops a destroyed tenant's state.
    pub fn forget(&self, tenant_id: &str) {
        self.lock().remove(tenant_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quotas(rps: u32, concurrency: u32) -> Quotas {
        Quotas {
            requests_per_s: rps,
            max_concurrency: concurrency,
            ..Quotas::default()
        }
    }

    #[test]
    fn a_burst_of_one_seconds_worth_then_the_rate() {
        let a = Arc::new(Admission::default());
        let q = quotas(4, 100);
        let t0 = Instant::now();
        for i in 0..4 {
            drop(
                a.admit("id-a", "a", &q, t0)
                    .unwrap_or_else(|e| panic!("request {i}: {e}")),
            );
        }
        let refused = a.admit("id-a", "a", &q, t0).unwrap_err();
        match &refused {
            Refused::Rate {
                retry_after, limit, ..
            } => {
                assert_eq!(*limit, 4);
                assert!(
                    (retry_after.as_secs_f64() - 0.25).abs() < 1e-6,
                    "{retry_after:?}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(refused.retry_after_secs(), 1);
        // A quarter second later one token is back, not two.
        let t1 = t0 + Duration::from_millis(250);
        drop(a.admit("id-a", "a", &q, t1).unwrap());
        assert!(a.admit("id-a", "a", &q, t1).is_err());
        // A long idle spell refills to the burst, no further.
        let t2 = t1 + Duration::from_secs(60);
        for _ in 0..4 {
            drop(a.admit("id-a", "a", &q, t2).unwrap());
        }
        assert!(a.admit("id-a", "a", &q, t2).is_err());
    }

    #[test]
    fn requests_in_flight_are_capped_and_freed_on_drop() {
        let a = Arc::new(Admission::default());
        let q = quotas(1000, 2);
        let now = Instant::now();
        let first = a.admit("id-a", "a", &q, now).unwrap();
        let _second = a.admit("id-a", "a", &q, now).unwrap();
        assert_eq!(
            a.admit("id-a", "a", &q, now).unwrap_err(),
            Refused::Concurrency {
                tenant: "a".into(),
                limit: 2
            }
        );
        drop(first);
        assert!(a.admit("id-a", "a", &q, now).is_ok());
    }

    #[test]
    fn refused_requests_take_no_tokens() {
        let a = Arc::new(Admission::default());
        let q = quotas(2, 1);
        let now = Instant::now();
        let held = a.admit("id-a", "a", &q, now).unwrap();
        for _ in 0..10 {
            assert!(matches!(
                a.admit("id-a", "a", &q, now),
                Err(Refused::Concurrency { .. })
            ));
        }
        drop(held);
        // One token left of the two: the ten refusals cost nothing.
        assert!(a.admit("id-a", "a", &q, now).is_ok());
    }

    #[test]
    fn one_tenant_spending_its_budget_leaves_others_untouched() {
        let a = Arc::new(Admission::default());
        let q = quotas(1, 1);
        let now = Instant::now();
        let _hog = a.admit("id-a", "a", &q, now).unwrap();
        assert!(a.admit("id-a", "a", &q, now).is_err());
        assert!(a.admit("id-b", "b", &q, now).is_ok());
    }

    #[test]
    fn a_closed_route_refuses_everything_and_counts_what_was_in_flight() {
        let a = Arc::new(Admission::default());
        let q = quotas(100, 10);
        let now = Instant::now();
        let in_flight = a.admit("id-a", "a", &q, now).unwrap();
        assert_eq!(a.close("id-a"), 1);
        assert_eq!(
            a.admit("id-a", "a", &q, now).unwrap_err(),
            Refused::Closed { tenant: "a".into() }
        );
        drop(in_flight);
        assert!(a
            .admit("id-a", "a", &q, now + Duration::from_secs(5))
            .is_err());
        // Closing a tenant never seen still closes it.
        assert_eq!(a.close("id-b"), 0);
        assert!(a.admit("id-b", "b", &q, now).is_err());
    }

    #[test]
    fn a_forgotten_tenant_starts_afresh() {
        let a = Arc::new(Admission::default());
        let q = quotas(1, 10);
        let now = Instant::now();
        drop(a.admit("id-a", "a", &q, now).unwrap());
        assert!(a.admit("id-a", "a", &q, now).is_err());
        a.forget("id-a");
        assert!(a.admit("id-a", "a", &q, now).is_ok());
    }
}
