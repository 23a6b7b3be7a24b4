//! Counters of the work this server did, for `GET /v1/tenantvm/stats`: tests compare them
//! (work skipped by the prefix cache, requests really in flight at once) instead of timing.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Live counters; all monotonic except the gauges `in_flight`, `queued`, `connections`.
#[derive(Debug, Default)]
pub struct Stats {
    /// Requests answered 2xx.
    pub requests_ok: AtomicU64,
    /// Requests answered 4xx.
    pub requests_client_error: AtomicU64,
    /// Requests answered 5xx (overload included).
    pub requests_server_error: AtomicU64,
    /// Connections closed for not sending a request in time.
    pub read_timeouts: AtomicU64,
    /// Generations running now.
    pub in_flight: AtomicU64,
    /// Most generations ever running at once.
    pub peak_in_flight: AtomicU64,
    /// Requests waiting for a generation slot now.
    pub queued: AtomicU64,
    /// Client connections open now.
    pub connections: AtomicU64,
    /// Tokens generated.
    pub decode_tokens: AtomicU64,
    /// Streams ended because the client went away.
    pub client_disconnects: AtomicU64,
}

/// A copy of the counters.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Requests answered 2xx.
    pub requests_ok: u64,
    /// Requests answered 4xx.
    pub requests_client_error: u64,
    /// Requests answered 5xx.
    pub requests_server_error: u64,
    /// Connections closed for not sending a request in time.
    pub read_timeouts: u64,
    /// Generations running now.
    pub in_flight: u64,
    /// Most generations ever running at once.
    pub peak_in_flight: u64,
    /// Requests waiting for a generation slot now.
    pub queued: u64,
    /// Client connections open now.
    pub connections: u64,
    /// Prompt tokens absorbed in prefill.
    pub prefill_tokens_computed: u64,
    /// Prompt tokens whose prefill came from the prefix cache.
    pub prefill_tokens_cached: u64,
    /// Tokens generated.
    pub decode_tokens: u64,
    /// Streams ended because the client went away.
    pub client_disconnects: u64,
}

impl Stats {
    /// Counts one answered request by its status.
    pub fn count_status(&self, status: u16) {
        let c = match status {
            200..=299 => &self.requests_ok,
            400..=499 => &self.requests_client_error,
            _ => &self.requests_server_error,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// A generation started.
    pub fn begin_generation(&self) {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak_in_flight.fetch_max(now, Ordering::SeqCst);
    }

    /// A generation ended.
    pub fn end_generation(&self) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    /// The counters now, with the prefill figures from the prefiller.
    pub fn snapshot(&self, prefill_computed: u64, prefill_cached: u64) -> StatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::SeqCst);
        StatsSnapshot {
            requests_ok: g(&self.requests_ok),
            requests_client_error: g(&self.requests_client_error),
            requests_server_error: g(&self.requests_server_error),
            read_timeouts: g(&self.read_timeouts),
            in_flight: g(&self.in_flight),
            peak_in_flight: g(&self.peak_in_flight),
            queued: g(&self.queued),
            connections: g(&self.connections),
            prefill_tokens_computed: prefill_computed,
            prefill_tokens_cached: prefill_cached,
            decode_tokens: g(&self.decode_tokens),
            client_disconnects: g(&self.client_disconnects),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_in_flight_remembers_the_most_at_once() {
        let s = Stats::default();
        s.begin_generation();
        s.begin_generation();
        s.end_generation();
        s.begin_generation();
        s.end_generation();
        s.end_generation();
        let snap = s.snapshot(0, 0);
        assert_eq!((snap.in_flight, snap.peak_in_flight), (0, 2));
        s.count_status(200);
        s.count_status(404);
        s.count_status(503);
        let snap = s.snapshot(5, 6);
        assert_eq!(
            (
                snap.requests_ok,
                snap.requests_client_error,
                snap.requests_server_error,
                snap.prefill_tokens_computed,
                snap.prefill_tokens_cached
            ),
            (1, 1, 1, 5, 6)
        );
    }
}
