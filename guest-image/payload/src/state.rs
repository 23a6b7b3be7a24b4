//! The state every request shares ([`AppState`]) and how the server runs
//! ([`ServeConfig`]): at most `--max-concurrency` generations at once, more wait for a
//! slot up to `--queue-timeout-ms`, then get 503.

use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::history::History;
use crate::http::HttpLimits;
use crate::openai::ApiError;
use crate::prefill::{Prefiller, DEFAULT_ROUNDS_PER_TOKEN};
use crate::registry::Registry;
use crate::stats::Stats;

/// How the server runs (the `serve` flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeConfig {
    /// Connection limits and deadlines.
    pub http: HttpLimits,
    /// Generations running at once.
    pub max_concurrency: usize,
    /// Open client connections.
    pub max_connections: usize,
    /// How long a request waits for a generation slot.
    pub queue_timeout: Duration,
    /// Largest `max_tokens`.
    pub max_tokens: usize,
    /// Largest prompt tokens + `max_tokens` of one choice.
    pub max_context_tokens: usize,
    /// Mixing rounds per token of prefill and decode (see `prefill`).
    pub prefill_rounds: u32,
    /// Prefix cache budget in bytes; `None` = off.
    pub prefix_cache_bytes: Option<usize>,
    /// Inference requests rescan the models directory at most this often.
    pub rescan_interval: Duration,
    /// Where `completions.jsonl` is kept.
    pub data_dir: Option<PathBuf>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            http: HttpLimits::default(),
            max_concurrency: 8,
            max_connections: 64,
            queue_timeout: Duration::from_secs(30),
            max_tokens: 4096,
            max_context_tokens: 262_144,
            prefill_rounds: DEFAULT_ROUNDS_PER_TOKEN,
            prefix_cache_bytes: None,
            rescan_interval: Duration::from_secs(1),
            data_dir: None,
        }
    }
}

/// Generation slots: a counting semaphore with a deadline.
#[derive(Debug)]
struct Slots {
    free: Mutex<usize>,
    freed: Condvar,
}

/// A held generation slot; frees it (and ends the in-flight count) when dropped.
pub struct SlotGuard<'a> {
    state: &'a AppState,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.state.stats.end_generation();
        *lock(&self.state.slots.free) += 1;
        self.state.slots.freed.notify_one();
    }
}

/// Everything requests share.
#[derive(Debug)]
pub struct AppState {
    /// Configuration.
    pub config: ServeConfig,
    /// The models.
    pub registry: Registry,
    /// Prefill and the prefix cache.
    pub prefiller: Prefiller,
    /// Counters.
    pub stats: Stats,
    /// The completion record.
    pub history: History,
    /// Random per process: two tenants answering with the same id share one server.
    pub instance_id: String,
    /// Unix seconds at start.
    pub started: u64,
    slots: Slots,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn random_instance_id() -> String {
    let mut bytes = [0u8; 16];
    let from_kernel =
        std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if from_kernel.is_err() {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        let a = crate::prefill::mix(now ^ u64::from(std::process::id()));
        bytes[..8].copy_from_slice(&a.to_le_bytes());
        bytes[8..].copy_from_slice(&crate::prefill::mix(a).to_le_bytes());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl AppState {
    /// The shared state for `registry` under `config`.
    pub fn new(registry: Registry, config: ServeConfig) -> Self {
        let max = config.max_concurrency.max(1);
        Self {
            prefiller: Prefiller::new(config.prefill_rounds, config.prefix_cache_bytes),
            history: History::new(config.data_dir.as_deref()),
            registry,
            stats: Stats::default(),
            instance_id: random_instance_id(),
            started: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            slots: Slots {
                free: Mutex::new(max),
                freed: Condvar::new(),
            },
            config,
        }
    }

    /// Waits up to the queue timeout for a generation slot.
    pub fn acquire_slot(&self) -> Result<SlotGuard<'_>, ApiError> {
        let deadline = Instant::now() + self.config.queue_timeout;
        self.stats.queued.fetch_add(1, Ordering::SeqCst);
        let mut free = lock(&self.slots.free);
        while *free == 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(free);
                self.stats.queued.fetch_sub(1, Ordering::SeqCst);
                return Err(ApiError::overloaded(format!(
                    "All {} generation slots stayed busy for {} ms (--max-concurrency, \
                     --queue-timeout-ms); retry later",
                    self.config.max_concurrency,
                    self.config.queue_timeout.as_millis()
                )));
            }
            free = self
                .slots
                .freed
                .wait_timeout(free, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *free -= 1;
        drop(free);
        self.stats.queued.fetch_sub(1, Ordering::SeqCst);
        self.stats.begin_generation();
        Ok(SlotGuard { state: self })
    }
}
