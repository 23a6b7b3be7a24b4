//! Prefill, the work a prompt costs before its first token, and the optional prefix cache
//! that skips it for a prompt prefix seen before.
//!
//! **Cost model.** The n-gram model itself needs only the last `order - 1` words of a
//! prompt. It stands in for a transformer, whose prefill processes every prompt token
//! against the state left by all tokens before it (the KV cache). So each prompt token is
//! absorbed into a 64-bit context state by [`absorb`]: its hash, then `rounds` applications
//! of a 64-bit mixing function, each depending on the one before (a sequential chain the
//! compiler and CPU cannot shortcut). The state after the prompt seeds sampling, so the work
//! is used, and a state taken from the cache must equal a recomputed one (tests check it).
//! Each generated token is absorbed the same way (a decode step costs one token's prefill).
//!
//! **Prefix cache** (`--prefix-cache on`). Like vLLM's automatic prefix caching: the prompt
//! is cut into blocks of [`BLOCK_TOKENS`] tokens; the state after each full block is stored
//! under (its parent block, the block's exact tokens), so an entry is only ever found by a
//! prompt that starts with exactly the same tokens, for the same loaded model. A request
//! walks its blocks from the start while they are cached and computes only the rest.
//! Least-recently-used entries are evicted past a byte budget; a hit refreshes a block's
//! whole chain, children before parents, so a parent is never evicted before its children.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;

/// Tokens per cached block.
pub const BLOCK_TOKENS: usize = 16;
/// Default mixing rounds per token (18-20 µs per token on the shared 2-core development
/// machine in a release build; see docs/benchmarks.md).
pub const DEFAULT_ROUNDS_PER_TOKEN: u32 = 2048;
/// Bookkeeping bytes charged per cache entry on top of its tokens (map slots, LRU node).
const ENTRY_OVERHEAD_BYTES: usize = 160;

/// The initial context state, before any token.
const INITIAL_STATE: u64 = 0x7465_6e61_6e74_766d;

/// SplitMix64's output function: a bijective 64-bit mix.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Absorbs one token into the context state: the token's hash, then `rounds` (at least one)
/// chained mixes. This is the per-token cost of prefill and of each decode step.
pub fn absorb(state: u64, token: &str, rounds: u32) -> u64 {
    let mut s = state ^ fnv1a(token.as_bytes());
    for _ in 0..rounds.max(1) {
        s = mix(s);
    }
    s
}

/// What prefilling one prompt did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillOutcome {
    /// The context state after the whole prompt.
    pub state: u64,
    /// Tokens absorbed by this request.
    pub computed_tokens: usize,
    /// Tokens whose state came from the prefix cache.
    pub cached_tokens: usize,
}

/// Which cached block an entry continues from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Parent {
    /// The start of a prompt for the model with this load id.
    Root(u64),
    /// The entry with this id.
    Block(u64),
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct BlockKey {
    parent: Parent,
    tokens: Vec<String>,
}

#[derive(Debug)]
struct Entry {
    id: u64,
    state: u64,
    tick: u64,
    bytes: usize,
}

/// Prefix cache figures, for the serving and stats endpoints.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Blocks held.
    pub entries: usize,
    /// Bytes charged for them.
    pub used_bytes: usize,
    /// Budget.
    pub capacity_bytes: usize,
    /// Blocks found.
    pub hit_blocks: u64,
    /// Blocks looked for and not found.
    pub miss_blocks: u64,
    /// Blocks evicted to stay within the budget.
    pub evicted_blocks: u64,
}

/// The LRU block store.
#[derive(Debug)]
struct PrefixCache {
    entries: HashMap<Arc<BlockKey>, Entry>,
    lru: BTreeMap<u64, Arc<BlockKey>>,
    tick: u64,
    next_id: u64,
    stats: PrefixCacheStats,
}

impl PrefixCache {
    fn new(capacity_bytes: usize) -> Self {
        Self {
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            next_id: 1,
            stats: PrefixCacheStats {
                capacity_bytes,
                ..PrefixCacheStats::default()
            },
        }
    }

    fn touch(&mut self, key: &Arc<BlockKey>) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.entries.get_mut(key) {
            self.lru.remove(&e.tick);
            e.tick = tick;
            self.lru.insert(tick, Arc::clone(key));
        }
    }

    /// The longest run of cached blocks at the start of `tokens`: (blocks, parent of the
    /// next block, state after them, the keys found).
    fn lookup(&mut self, root: u64, tokens: &[String]) -> (usize, Parent, u64, Vec<Arc<BlockKey>>) {
        let mut parent = Parent::Root(root);
        let mut state = INITIAL_STATE;
        let mut path = Vec::new();
        for block in tokens.chunks_exact(BLOCK_TOKENS) {
            let key = BlockKey {
                parent,
                tokens: block.to_vec(),
            };
            match self.entries.get_key_value(&key) {
                Some((k, e)) => {
                    parent = Parent::Block(e.id);
                    state = e.state;
                    path.push(Arc::clone(k));
                    self.stats.hit_blocks += 1;
                }
                None => {
                    self.stats.miss_blocks += 1;
                    break;
                }
            }
        }
        (path.len(), parent, state, path)
    }

    /// Stores `block` after `parent` with `state`; returns the entry's key and id.
    fn insert(&mut self, parent: Parent, block: &[String], state: u64) -> (Arc<BlockKey>, u64) {
        let key = Arc::new(BlockKey {
            parent,
            tokens: block.to_vec(),
        });
        if let Some((k, e)) = self.entries.get_key_value(&key) {
            // Another request stored it meanwhile (with the same state: absorb is pure).
            return (Arc::clone(k), e.id);
        }
        let bytes = ENTRY_OVERHEAD_BYTES
            + block
                .iter()
                .map(|t| t.len() + std::mem::size_of::<String>())
                .sum::<usize>();
        let id = self.next_id;
        self.next_id += 1;
        self.tick += 1;
        self.entries.insert(
            Arc::clone(&key),
            Entry {
                id,
                state,
                tick: self.tick,
                bytes,
            },
        );
        self.lru.insert(self.tick, Arc::clone(&key));
        self.stats.used_bytes += bytes;
        (key, id)
    }

    fn evict_to_budget(&mut self) {
        while self.stats.used_bytes > self.stats.capacity_bytes {
            let Some((_, key)) = self.lru.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&key) {
                self.stats.used_bytes -= e.bytes;
                self.stats.evicted_blocks += 1;
            }
        }
    }

    fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            entries: self.entries.len(),
            ..self.stats
        }
    }
}

/// Prefills prompts, with or without the prefix cache; counts the work.
#[derive(Debug)]
pub struct Prefiller {
    rounds: u32,
    cache: Option<Mutex<PrefixCache>>,
    computed_tokens: AtomicU64,
    cached_tokens: AtomicU64,
}

impl Prefiller {
    /// `rounds` mixing rounds per token; a prefix cache of `cache_bytes` if `Some`.
    pub fn new(rounds: u32, cache_bytes: Option<usize>) -> Self {
        Self {
            rounds: rounds.max(1),
            cache: cache_bytes.map(|b| Mutex::new(PrefixCache::new(b))),
            computed_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
        }
    }

    /// Mixing rounds per token.
    pub fn rounds(&self) -> u32 {
        self.rounds
    }

    /// Is the prefix cache on?
    pub fn cache_enabled(&self) -> bool {
        self.cache.is_some()
    }

    /// The prefix cache's figures, if it is on.
    pub fn cache_stats(&self) -> Option<PrefixCacheStats> {
        self.cache.as_ref().map(|c| lock(c).stats())
    }

    /// Tokens absorbed in prefill since start.
    pub fn computed_tokens(&self) -> u64 {
        self.computed_tokens.load(Ordering::Relaxed)
    }

    /// Prompt tokens served from the prefix cache since start.
    pub fn cached_tokens(&self) -> u64 {
        self.cached_tokens.load(Ordering::Relaxed)
    }

    /// Prefills `tokens` for the model loaded as `model_load_id`.
    pub fn prefill(&self, model_load_id: u64, tokens: &[String]) -> PrefillOutcome {
        let Some(cache) = &self.cache else {
            let state = tokens
                .iter()
                .fold(INITIAL_STATE, |s, t| absorb(s, t, self.rounds));
            self.computed_tokens
                .fetch_add(tokens.len() as u64, Ordering::Relaxed);
            return PrefillOutcome {
                state,
                computed_tokens: tokens.len(),
                cached_tokens: 0,
            };
        };
        let (blocks, mut parent, mut state, mut path) = lock(cache).lookup(model_load_id, tokens);
        let cached = blocks * BLOCK_TOKENS;
        // The expensive part runs without the lock; full blocks' states are kept to store.
        let mut fresh: Vec<(usize, u64)> = Vec::new();
        for (i, t) in tokens.iter().enumerate().skip(cached) {
            state = absorb(state, t, self.rounds);
            if (i + 1) % BLOCK_TOKENS == 0 {
                fresh.push((i + 1, state));
            }
        }
        {
            let mut c = lock(cache);
            for (end, block_state) in fresh {
                let (key, id) = c.insert(parent, &tokens[end - BLOCK_TOKENS..end], block_state);
                path.push(key);
                parent = Parent::Block(id);
            }
            // Children first, so that every parent is more recent than its children.
            for key in path.iter().rev() {
                c.touch(key);
            }
            c.evict_to_budget();
        }
        let computed = tokens.len() - cached;
        self.computed_tokens
            .fetch_add(computed as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
        PrefillOutcome {
            state,
            computed_tokens: computed,
            cached_tokens: cached,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(prefix: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{prefix}{i:03}")).collect()
    }

    #[test]
    fn absorb_depends_on_every_token_and_its_order() {
        let a = ["x", "y"]
            .iter()
            .fold(INITIAL_STATE, |s, t| absorb(s, t, 8));
        let b = ["y", "x"]
            .iter()
            .fold(INITIAL_STATE, |s, t| absorb(s, t, 8));
        assert_ne!(a, b);
        assert_ne!(absorb(1, "x", 8), absorb(1, "x", 9));
    }

    #[test]
    fn cached_state_equals_recomputed_state_and_skips_the_prefix() {
        let uncached = Prefiller::new(16, None);
        let cached = Prefiller::new(16, Some(1 << 20));
        let mut prompt = words("p", 100);
        let first = cached.prefill(7, &prompt);
        assert_eq!(first, uncached.prefill(7, &prompt));
        assert_eq!(first.cached_tokens, 0);

        prompt.extend(words("q", 10));
        let second = cached.prefill(7, &prompt);
        // 100 tokens = 6 full blocks (96 tokens) cached; the rest computed.
        assert_eq!(second.cached_tokens, 96);
        assert_eq!(second.computed_tokens, 110 - 96);
        assert_eq!(second.state, uncached.prefill(7, &prompt).state);
        assert_eq!(cached.cached_tokens(), 96);
        assert_eq!(cached.computed_tokens(), 100 + 14);
    }

    #[test]
    fn cache_matches_exact_prefixes_of_the_same_model_only() {
        let p = Prefiller::new(4, Some(1 << 20));
        let prompt = words("w", 64);
        p.prefill(1, &prompt);
        assert_eq!(p.prefill(2, &prompt).cached_tokens, 0, "another model");
        let mut changed = prompt.clone();
        changed[0] = "other".into();
        assert_eq!(
            p.prefill(1, &changed).cached_tokens,
            0,
            "first token differs"
        );
        let mut late = prompt.clone();
        late[40] = "other".into();
        assert_eq!(
            p.prefill(1, &late).cached_tokens,
            32,
            "blocks before the change"
        );
        let stats = p.cache_stats().unwrap();
        assert!(stats.hit_blocks >= 2 && stats.miss_blocks >= 3, "{stats:?}");
    }

    #[test]
    fn cache_stays_within_its_budget_and_evicts_least_recently_used() {
        let one_block = ENTRY_OVERHEAD_BYTES + BLOCK_TOKENS * (4 + std::mem::size_of::<String>());
        let p = Prefiller::new(1, Some(4 * one_block));
        let a = words("a", 32); // two blocks of 4-byte words
        let b = words("b", 32);
        let c = words("c", 32);
        p.prefill(1, &a);
        p.prefill(1, &b);
        assert_eq!(p.cache_stats().unwrap().entries, 4);
        p.prefill(1, &a); // refresh a
        p.prefill(1, &c); // evicts b, the least recently used
        let s = p.cache_stats().unwrap();
        assert!(s.used_bytes <= s.capacity_bytes, "{s:?}");
        assert_eq!(s.evicted_blocks, 2);
        assert_eq!(p.prefill(1, &a).cached_tokens, 32);
        assert_eq!(p.prefill(1, &b).cached_tokens, 0);
    }

    #[test]
    fn eviction_takes_children_before_their_parents() {
        let one_block = ENTRY_OVERHEAD_BYTES + BLOCK_TOKENS * (4 + std::mem::size_of::<String>());
        let p = Prefiller::new(1, Some(3 * one_block));
        let a = words("a", 48); // three blocks: fills the budget
        p.prefill(1, &a);
        let b = words("b", 16); // one more block: one of a's must go
        p.prefill(1, &b);
        // The deepest block of a went, so a's first two blocks still hit.
        assert_eq!(p.prefill(1, &a).cached_tokens, 32);
    }

    #[test]
    fn a_zero_budget_keeps_nothing() {
        let p = Prefiller::new(1, Some(0));
        let a = words("a", 32);
        p.prefill(1, &a);
        assert_eq!(p.prefill(1, &a).cached_tokens, 0);
        assert_eq!(p.cache_stats().unwrap().used_bytes, 0);
    }
}
