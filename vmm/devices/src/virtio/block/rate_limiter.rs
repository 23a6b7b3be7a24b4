//! Token-bucket rate limiting of a disk: one bucket for bytes, one for operations, each
//! with a sustained rate and a burst size. A request larger than a bucket's burst is let
//! through when the bucket is full and leaves it in debt, so it cannot starve forever.
//! Time is passed in, so the arithmetic is tested without clocks.

use std::time::{Duration, Instant};

/// A disk's limits (config file and command line): part of the VMM's contract, defined in
/// tenantvm-vmm-api.
pub use tenantvm_vmm_api::RateLimitConfig;

/// Why limits were refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RateLimitError {
    /// A rate or burst of zero would block the disk forever.
    #[error("Rate limit {0} must be greater than zero; omit it for no limit")]
    Zero(&'static str),
}

#[derive(Debug, Clone)]
struct TokenBucket {
    capacity: f64,
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    fn new(
        rate: u64,
        burst: Option<u64>,
        now: Instant,
        name: &'static str,
    ) -> Result<Self, RateLimitError> {
        let burst = burst.unwrap_or(rate);
        if rate == 0 || burst == 0 {
            return Err(RateLimitError::Zero(name));
        }
        Ok(Self {
            capacity: burst as f64,
            rate: rate as f64,
            tokens: burst as f64,
            last: now,
        })
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.capacity);
        self.last = now;
    }

    /// Time until `amount` (capped at the burst) is available; zero if it is now.
    fn wait(&self, amount: u64) -> Duration {
        let need = (amount as f64).min(self.capacity);
        if self.tokens >= need {
            Duration::ZERO
        } else {
            // At least a millisecond, so a timer always makes progress.
            Duration::from_secs_f64((need - self.tokens) / self.rate).max(Duration::from_millis(1))
        }
    }
}

/// Byte and operation buckets of one disk.
#[derive(Debug, Clone)]
pub struct RateLimiter {
    bytes: Option<TokenBucket>,
    ops: Option<TokenBucket>,
}

impl RateLimiter {
    /// A limiter from `config`, buckets full at `now`.
    pub fn new(config: &RateLimitConfig, now: Instant) -> Result<Self, RateLimitError> {
        Ok(Self {
            bytes: config
                .bytes_per_sec
                .map(|r| TokenBucket::new(r, config.bytes_burst, now, "bytes_per_sec"))
                .transpose()?,
            ops: config
                .ops_per_sec
                .map(|r| TokenBucket::new(r, config.ops_burst, now, "ops_per_sec"))
                .transpose()?,
        })
    }

    /// A limiter that lets everything through.
    pub fn unlimited() -> Self {
        Self {
            bytes: None,
            ops: None,
        }
    }

    /// Takes one operation of `bytes` if both buckets allow it; otherwise takes nothing
    /// and says how long to wait.
    pub fn try_consume(&mut self, bytes: u64, now: Instant) -> Result<(), Duration> {
        let mut wait = Duration::ZERO;
        for (bucket, amount) in [(&mut self.bytes, bytes), (&mut self.ops, 1)] {
            if let Some(b) = bucket {
                b.refill(now);
                wait = wait.max(b.wait(amount));
            }
        }
        if wait > Duration::ZERO {
            return Err(wait);
        }
        if let Some(b) = &mut self.bytes {
            b.tokens -= bytes as f64;
        }
        if let Some(b) = &mut self.ops {
            b.tokens -= 1.0;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(bytes: Option<u64>, ops: Option<u64>) -> RateLimitConfig {
        RateLimitConfig {
            bytes_per_sec: bytes,
            bytes_burst: None,
            ops_per_sec: ops,
            ops_burst: None,
        }
    }

    #[test]
    fn ops_bucket_allows_burst_then_waits_for_refill() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(&cfg(None, Some(10)), t0).unwrap();
        for _ in 0..10 {
            rl.try_consume(4096, t0).unwrap();
        }
        let wait = rl.try_consume(4096, t0).unwrap_err();
        assert!(wait >= Duration::from_millis(99) && wait <= Duration::from_millis(101));
        rl.try_consume(4096, t0 + Duration::from_millis(100))
            .unwrap();
    }

    #[test]
    fn bytes_bucket_limits_throughput() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(&cfg(Some(1 << 20), None), t0).unwrap();
        rl.try_consume(1 << 20, t0).unwrap();
        assert!(rl.try_consume(512, t0).is_err());
        // Half a second refills half a MiB.
        let t1 = t0 + Duration::from_millis(500);
        rl.try_consume(256 << 10, t1).unwrap();
        rl.try_consume(256 << 10, t1).unwrap();
        assert!(rl.try_consume(4096, t1).is_err());
    }

    #[test]
    fn oversized_request_passes_when_full_and_leaves_debt() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(&cfg(Some(1000), None), t0).unwrap();
        rl.try_consume(5000, t0).unwrap();
        // 4000 bytes of debt plus the next 1000: five seconds.
        let wait = rl.try_consume(1000, t0).unwrap_err();
        assert!(wait >= Duration::from_millis(4999));
    }

    #[test]
    fn refused_request_takes_no_tokens() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(&cfg(Some(1000), Some(1)), t0).unwrap();
        rl.try_consume(10, t0).unwrap();
        assert!(rl.try_consume(10, t0).is_err());
        let t1 = t0 + Duration::from_secs(1);
        rl.try_consume(990, t1).unwrap();
    }

    #[test]
    fn zero_rates_are_refused_and_unlimited_never_waits() {
        let now = Instant::now();
        assert_eq!(
            RateLimiter::new(&cfg(Some(0), None), now).unwrap_err(),
            RateLimitError::Zero("bytes_per_sec")
        );
        let mut rl = RateLimiter::unlimited();
        for _ in 0..1000 {
            rl.try_consume(u64::MAX, now).unwrap();
        }
    }
}
