//! In-flight budgets of the API, so that no caller can stall another.
//!
//! A request is authenticated and admitted on the async threads, before any blocking work
//! (a short store read; see [`super`]). Its blocking work (SQLite, log files, a guest's
//! answer) then runs on a thread of its own ([`offload`]), never on a pool shared with
//! other callers, under the budget of whoever it waits for:
//!
//! - inference requests: the target tenant's admission gate ([`crate::tenant::admission`]:
//!   `quotas.max_concurrency` in flight, `requests_per_s`), taken before the work starts;
//! - every other request of a tenant token: [`TENANT_IN_FLIGHT`] in flight per tenant;
//! - the admin's requests: [`ADMIN_IN_FLIGHT`] in flight;
//! - the health check: no blocking work at all.
//!
//! Over a budget the answer is 429 `too_many_in_flight` at once. A tenant whose guest never
//! answers therefore holds at most its own `max_concurrency` threads, and the admin, the
//! health check and every other tenant keep their own room.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::auth::Caller;

/// Requests of the admin token in flight at once (besides inference, which counts against
/// the target tenant).
pub const ADMIN_IN_FLIGHT: u32 = 64;
/// Requests of one tenant's token in flight at once, besides its inference requests.
pub const TENANT_IN_FLIGHT: u32 = 8;

/// Whose budget a request spends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// The operator.
    Admin,
    /// One tenant (row id).
    Tenant(i64),
}

impl Lane {
    /// The lane of a caller's own requests.
    pub fn of(caller: &Caller) -> Lane {
        match caller {
            Caller::Admin => Lane::Admin,
            Caller::Tenant(id) => Lane::Tenant(*id),
        }
    }

    /// Its budget.
    pub fn budget(self) -> u32 {
        match self {
            Lane::Admin => ADMIN_IN_FLIGHT,
            Lane::Tenant(_) => TENANT_IN_FLIGHT,
        }
    }
}

/// A lane's budget is spent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} already has {limit} requests in flight; retry when one finishes", who(.lane))]
pub struct LaneFull {
    /// The lane.
    pub lane: Lane,
    /// Its budget.
    pub limit: u32,
}

fn who(lane: &Lane) -> &'static str {
    match lane {
        Lane::Admin => "The admin token",
        Lane::Tenant(_) => "This tenant's token",
    }
}

/// Requests in flight per lane.
#[derive(Debug, Default)]
pub struct Lanes {
    in_flight: Mutex<HashMap<Lane, u32>>,
}

/// A request in flight on a lane; dropping it (when the work ends, not when the client
/// goes away) frees its place.
#[derive(Debug)]
pub struct LanePermit {
    lanes: Arc<Lanes>,
    lane: Lane,
}

impl Drop for LanePermit {
    fn drop(&mut self) {
        let mut map = self.lanes.lock();
        if let Some(n) = map.get_mut(&self.lane) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.lane);
            }
        }
    }
}

impl Lanes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Lane, u32>> {
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes a place on `lane`, or says that its budget is spent. Never blocks.
    pub fn enter(self: &Arc<Self>, lane: Lane) -> Result<LanePermit, LaneFull> {
        let mut map = self.lock();
        let n = map.entry(lane).or_insert(0);
        if *n >= lane.budget() {
            return Err(LaneFull {
                lane,
                limit: lane.budget(),
            });
        }
        *n += 1;
        Ok(LanePermit {
            lanes: self.clone(),
            lane,
        })
    }

    /// Requests in flight on `lane`.
    pub fn in_flight(&self, lane: Lane) -> u32 {
        self.lock().get(&lane).copied().unwrap_or(0)
    }
}

/// Why offloaded work produced no answer.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    /// No thread could be started (the host is out of threads or memory).
    #[error("Cannot start a thread for the request: {0}")]
    Spawn(std::io::Error),
    /// The work panicked.
    #[error("The request's work ended without an answer (it panicked)")]
    Lost,
}

/// Runs blocking `work` on a thread of its own, holding `permit` until the work ends, and
/// awaits its result. The thread belongs to this request only: nothing another caller does
/// can delay its start.
pub async fn offload<P, T, F>(permit: P, work: F) -> Result<T, OffloadError>
where
    P: Send + 'static,
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("tenantvmd-api".into())
        .spawn(move || {
            let result = work();
            drop(permit);
            let _ = tx.send(result);
        })
        .map_err(OffloadError::Spawn)?;
    rx.await.map_err(|_| OffloadError::Lost)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_lane_has_its_own_budget() {
        let lanes = Arc::new(Lanes::default());
        let held: Vec<_> = (0..TENANT_IN_FLIGHT)
            .map(|_| lanes.enter(Lane::Tenant(1)).unwrap())
            .collect();
        assert_eq!(
            lanes.enter(Lane::Tenant(1)).unwrap_err(),
            LaneFull {
                lane: Lane::Tenant(1),
                limit: TENANT_IN_FLIGHT
            }
        );
        // Another tenant and the admin are untouched.
        lanes.enter(Lane::Tenant(2)).unwrap();
        lanes.enter(Lane::Admin).unwrap();
        drop(held);
        assert_eq!(lanes.in_flight(Lane::Tenant(1)), 0);
        lanes.enter(Lane::Tenant(1)).unwrap();
    }

    #[tokio::test]
    async fn offloaded_work_holds_its_permit_until_it_ends() {
        let lanes = Arc::new(Lanes::default());
        let permit = lanes.enter(Lane::Admin).unwrap();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let l2 = lanes.clone();
        let task = tokio::spawn(offload(permit, move || {
            go_rx.recv().unwrap();
            l2.in_flight(Lane::Admin)
        }));
        tokio::task::yield_now().await;
        assert_eq!(lanes.in_flight(Lane::Admin), 1);
        go_tx.send(()).unwrap();
        assert_eq!(task.await.unwrap().unwrap(), 1);
        assert_eq!(lanes.in_flight(Lane::Admin), 0);
    }
}
