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

use crate::domain::spec::{Quotas, TenantSpec};

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

/// Why a tenant was refused at create: the host cannot hold it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CapacityError {
    /// Not enough memory left.
    #[error("Tenant {tenant:?} needs {need_mib} MiB of memory (guest memory + VMM overhead), but only {free_mib} of the {total_mib} MiB this host gives tenants are free ({held_mib} MiB held by {others} other tenant(s){overcommit}); shrink memory_mib, destroy a tenant, or start tenantvmd with --memory-overcommit RATIO")]
    Memory {
        /// The tenant.
        tenant: String,
        /// What it needs.
        need_mib: u64,
        /// What is left.
        free_mib: u64,
        /// What tenants may hold in all (overcommit included).
        total_mib: u64,
        /// What the others hold.
        held_mib: u64,
        /// How many others.
        others: usize,
        /// The overcommit in force, described.
        overcommit: String,
    },
    /// Not enough vCPUs left.
    #[error("Tenant {tenant:?} needs {need} vCPU(s), but only {free} of the {total} this host gives tenants are free ({held} held by {others} other tenant(s){overcommit}); ask for fewer vcpus, destroy a tenant, or start tenantvmd with --vcpu-overcommit RATIO")]
    Vcpus {
        /// The tenant.
        tenant: String,
        /// What it needs.
        need: u64,
        /// What is left.
        free: u64,
        /// What tenants may hold in all (overcommit included).
        total: u64,
        /// What the others hold.
        held: u64,
        /// How many others.
        others: usize,
        /// The overcommit in force, described.
        overcommit: String,
    },
}

/// What one tenant reserves of the host: memory (guest + VMM overhead) and vCPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reservation {
    /// MiB of memory.
    pub memory_mib: u64,
    /// vCPUs.
    pub vcpus: u64,
}

/// What this host gives tenants, and how far past it the operator lets them go. Every
/// tenant that is not destroyed holds its reservation (a stopped one keeps it, so that it
/// can always start again); a create that would go past the total is refused before
/// anything is recorded. Overcommit is explicit and off (1.0) by default.
#[derive(Debug, Clone)]
pub struct HostCapacity {
    /// MiB of memory for tenants: the host's memory less its own reserve.
    pub memory_mib: u64,
    /// CPUs for tenants.
    pub cpus: u64,
    /// How many times `memory_mib` tenants may reserve in all (1.0: no overcommit).
    pub memory_overcommit: f64,
    /// How many times `cpus` tenants may reserve in all (1.0: no overcommit).
    pub vcpu_overcommit: f64,
    /// Held from the check to the tenant's insertion, so two creates cannot both take the
    /// last room.
    lock: Arc<Mutex<()>>,
}

/// Memory kept for the host itself by default (the daemon, the kernel, page cache).
pub const DEFAULT_HOST_RESERVED_MIB: u64 = 1024;

impl HostCapacity {
    /// This host: `MemTotal` of /proc/meminfo less `reserved_mib`, and the CPUs this process
    /// may run on; no overcommit.
    pub fn detect(reserved_mib: u64) -> std::io::Result<Self> {
        let meminfo = std::fs::read_to_string("/proc/meminfo")?;
        let total_kib: u64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "no MemTotal in /proc/meminfo",
                )
            })?;
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        Ok(Self::fixed(
            (total_kib / 1024).saturating_sub(reserved_mib),
            cpus,
        ))
    }

    /// A host of this size (tests, and hosts described rather than detected); no overcommit.
    pub fn fixed(memory_mib: u64, cpus: u64) -> Self {
        HostCapacity {
            memory_mib,
            cpus,
            memory_overcommit: 1.0,
            vcpu_overcommit: 1.0,
            lock: Arc::default(),
        }
    }

    /// The same host with these overcommit ratios (at least 1.0 each).
    pub fn with_overcommit(mut self, memory: f64, vcpus: f64) -> Self {
        self.memory_overcommit = memory.max(1.0);
        self.vcpu_overcommit = vcpus.max(1.0);
        self
    }

    /// Taken while checking and recording a new tenant.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Checks that the host can hold `spec` beside `others` (the specs of every tenant that
    /// is not destroyed). Call it with [`HostCapacity::lock`] held until the tenant is
    /// recorded.
    pub fn check_room<'a>(
        &self,
        others: impl Iterator<Item = &'a TenantSpec>,
        vmm_overhead_mib: u64,
        spec: &TenantSpec,
    ) -> Result<(), CapacityError> {
        let mut held = Reservation::default();
        let mut count = 0;
        for other in others {
            let r = reservation(other, vmm_overhead_mib);
            held.memory_mib += r.memory_mib;
            held.vcpus += r.vcpus;
            count += 1;
        }
        self.check(&spec.name, reservation(spec, vmm_overhead_mib), held, count)
    }

    /// Whether `want` fits beside `held` (what `others` tenants reserve already).
    pub fn check(
        &self,
        tenant: &str,
        want: Reservation,
        held: Reservation,
        others: usize,
    ) -> Result<(), CapacityError> {
        let scaled = |n: u64, ratio: f64| (n as f64 * ratio).floor() as u64;
        let describe = |ratio: f64| {
            if ratio > 1.0 {
                format!(", overcommit {ratio}x")
            } else {
                ", no overcommit".to_string()
            }
        };
        let total_mib = scaled(self.memory_mib, self.memory_overcommit);
        let free_mib = total_mib.saturating_sub(held.memory_mib);
        if want.memory_mib > free_mib {
            return Err(CapacityError::Memory {
                tenant: tenant.to_string(),
                need_mib: want.memory_mib,
                free_mib,
                total_mib,
                held_mib: held.memory_mib,
                others,
                overcommit: describe(self.memory_overcommit),
            });
        }
        let total = scaled(self.cpus, self.vcpu_overcommit);
        let free = total.saturating_sub(held.vcpus);
        if want.vcpus > free {
            return Err(CapacityError::Vcpus {
                tenant: tenant.to_string(),
                need: want.vcpus,
                free,
                total,
                held: held.vcpus,
                others,
                overcommit: describe(self.vcpu_overcommit),
            });
        }
        Ok(())
    }
}

/// What `spec` would reserve: its memory plus the VMM's overhead, and its vCPUs.
pub fn reservation(spec: &TenantSpec, vmm_overhead_mib: u64) -> Reservation {
    Reservation {
        memory_mib: u64::from(spec.memory_mib) + vmm_overhead_mib,
        vcpus: u64::from(spec.vcpus),
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
        a.admit("id-a", "a", &q, t1).unwrap_err();
        // A long idle spell refills to the burst, no further.
        let t2 = t1 + Duration::from_secs(60);
        for _ in 0..4 {
            drop(a.admit("id-a", "a", &q, t2).unwrap());
        }
        a.admit("id-a", "a", &q, t2).unwrap_err();
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
        a.admit("id-a", "a", &q, now).unwrap();
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
        a.admit("id-a", "a", &q, now).unwrap();
    }

    #[test]
    fn one_tenant_spending_its_budget_leaves_others_untouched() {
        let a = Arc::new(Admission::default());
        let q = quotas(1, 1);
        let now = Instant::now();
        let _hog = a.admit("id-a", "a", &q, now).unwrap();
        a.admit("id-a", "a", &q, now).unwrap_err();
        a.admit("id-b", "b", &q, now).unwrap();
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
        a.admit("id-a", "a", &q, now + Duration::from_secs(5))
            .unwrap_err();
        // Closing a tenant never seen still closes it.
        assert_eq!(a.close("id-b"), 0);
        a.admit("id-b", "b", &q, now).unwrap_err();
    }

    #[test]
    fn a_forgotten_tenant_starts_afresh() {
        let a = Arc::new(Admission::default());
        let q = quotas(1, 10);
        let now = Instant::now();
        drop(a.admit("id-a", "a", &q, now).unwrap());
        a.admit("id-a", "a", &q, now).unwrap_err();
        a.forget("id-a");
        a.admit("id-a", "a", &q, now).unwrap();
    }

    #[test]
    fn capacity_counts_what_others_hold_and_overcommit_is_explicit() {
        let host = HostCapacity::fixed(24 * 1024, 2);
        let r = |memory_mib, vcpus| Reservation { memory_mib, vcpus };
        assert!(host.check("a", r(1 << 20, 1), r(0, 0), 0).is_err());
        host.check("a", r(8 * 1024, 1), r(0, 0), 0).unwrap();
        let err = host
            .check("b", r(20 * 1024, 1), r(8 * 1024, 1), 1)
            .unwrap_err();
        assert!(matches!(err, CapacityError::Memory { free_mib, .. } if free_mib == 16 * 1024));
        let err = host.check("c", r(64, 2), r(64, 1), 1).unwrap_err();
        assert!(matches!(err, CapacityError::Vcpus { free: 1, .. }), "{err}");
        assert!(err.to_string().contains("--vcpu-overcommit"));
        let roomy = host.with_overcommit(2.0, 4.0);
        roomy.check("c", r(64, 2), r(64, 1), 1).unwrap();
        roomy.check("d", r(40 * 1024, 1), r(0, 0), 0).unwrap();
        assert!(roomy.check("d", r(49 * 1024, 1), r(0, 0), 0).is_err());
    }

    #[test]
    fn a_tenant_the_host_cannot_hold_is_refused_and_nothing_is_recorded() {
        use crate::auth::Caller;
        use crate::tenant::fault::FaultHook;
        use crate::tenant::service::{TenantCommand, TenantServiceError};
        use crate::tenant::test_utils::Harness;
        let h = Harness::new(FaultHook::default());
        let huge = TenantSpec::from_toml(
            "name = \"huge\"\nmemory_mib = 1048576\n[image]\nname = \"hello\"\n",
        )
        .unwrap();
        let err = h
            .svc
            .execute(&Caller::Admin, TenantCommand::Create(huge))
            .unwrap_err();
        assert!(
            matches!(err, TenantServiceError::Capacity(_)),
            "a 1 TiB tenant was not refused: {err:?}"
        );
        assert!(err.to_string().contains("--memory-overcommit"), "{err}");
        assert!(h.svc.store().tenant("huge").unwrap().is_none());
    }
}
