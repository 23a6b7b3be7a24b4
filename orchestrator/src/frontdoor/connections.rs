//! Who may hold the front door's connections, so that no anonymous client can fill it:
//!
//! - every connection holds one of [`DoorLimits::places`] (sized from the process's file
//!   descriptors, [`DoorLimits::for_fd_limit`]) from `accept` until it closes; when all are
//!   taken the door stops calling `accept` (the kernel's backlog waits) instead of failing
//!   it;
//! - a connection is **unauthenticated** until a request on it carries a good inference
//!   key. The unauthenticated share a small pool ([`DoorLimits::unauthenticated`]), at most
//!   [`DoorLimits::per_source`] from one source (an IPv4 address, an IPv6 /64). A new
//!   connection is never refused for lack of room there: it **evicts** the oldest
//!   unauthenticated connection of its own source when that source is at its limit, else,
//!   when the pool is full, the oldest of the source holding the most (with equal shares,
//!   the oldest of all); within a source, one that has sent nothing yet goes first. So a
//!   flood from a few sources turns over only its own connections, and every newcomer gets
//!   its turn;
//! - an unauthenticated connection must also keep moving ([`watch`]): its first byte within
//!   [`FIRST_BYTE_TIMEOUT`], then at least [`MIN_BYTES_PER_S`] on average after
//!   [`RATE_GRACE`], and a good key within [`UNAUTHENTICATED_LIFETIME`] in all (TLS
//!   handshake and request heads included);
//! - a good key moves the connection to its tenant's own pool ([`Slot::claim`]): at most
//!   [`DoorLimits::per_tenant`] per tenant and [`DoorLimits::authenticated`] in all, never
//!   evicted by newcomers; the first key used on a connection owns it until it closes.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

/// How long a new connection has to send its first byte.
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(2);
/// The least average rate (bytes received per second, counted after [`RATE_GRACE`]) of an
/// unauthenticated connection: a TLS handshake and a request head are a few hundred bytes
/// sent at once, a trickle is cut within seconds.
pub const MIN_BYTES_PER_S: u64 = 128;
/// How long an unauthenticated connection may go before [`MIN_BYTES_PER_S`] applies.
pub const RATE_GRACE: Duration = Duration::from_secs(1);
/// The longest a connection may stay unauthenticated (handshake and heads included).
pub const UNAUTHENTICATED_LIFETIME: Duration = Duration::from_secs(10);
/// How often an unauthenticated connection's progress is checked.
const WATCH_TICK: Duration = Duration::from_millis(250);

/// Most connections one tenant's clients may hold (its `max_concurrency` bounds its work;
/// this bounds its idle sockets).
pub const MAX_TENANT_CONNECTIONS: u32 = 64;
/// Most unauthenticated connections at once, however many descriptors the process has.
pub const MAX_UNAUTHENTICATED: usize = 256;
/// Most authenticated connections at once, however many descriptors the process has.
pub const MAX_AUTHENTICATED: usize = 16_384;
/// Descriptors never given to the front door: the admin API, the store, logs, launches
/// (at least this many, or an eighth of the limit if that is more).
pub const FD_RESERVE: u64 = 256;

/// The front door's connection limits (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoorLimits {
    /// Connections open at once, of every kind.
    pub places: usize,
    /// Unauthenticated connections at once.
    pub unauthenticated: usize,
    /// Unauthenticated connections from one source at once.
    pub per_source: usize,
    /// Authenticated connections at once, all tenants together.
    pub authenticated: usize,
    /// Authenticated connections of one tenant at once.
    pub per_tenant: u32,
}

impl DoorLimits {
    /// The limits for a process that may open `nofile` descriptors: [`FD_RESERVE`] (or an
    /// eighth) kept for the rest of the daemon; an authenticated connection counts twice
    /// (its request's connection to the guest); the unauthenticated get a quarter of the
    /// rest, at most [`MAX_UNAUTHENTICATED`], half of it for one source at most (a client
    /// application's pool of connections opened at once must fit; a full pool evicts from
    /// the heaviest source first anyway).
    pub fn for_fd_limit(nofile: u64) -> DoorLimits {
        let reserve = FD_RESERVE.max(nofile / 8);
        let budget = usize::try_from(nofile.saturating_sub(reserve))
            .unwrap_or(usize::MAX)
            .max(16);
        let unauthenticated = (budget / 4).clamp(4, MAX_UNAUTHENTICATED);
        let authenticated =
            ((budget - unauthenticated.min(budget)) / 2).clamp(2, MAX_AUTHENTICATED);
        DoorLimits {
            places: unauthenticated + authenticated,
            unauthenticated,
            per_source: (unauthenticated / 2).max(2),
            authenticated,
            per_tenant: MAX_TENANT_CONNECTIONS
                .min(u32::try_from(authenticated).unwrap_or(u32::MAX)),
        }
    }
}

/// Where a connection comes from, for the per-source limit: an IPv4 address (an IPv4-mapped
/// IPv6 one counts as IPv4), or an IPv6 /64 (one host's share of addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source(u128);

impl Source {
    /// The source of a peer address.
    pub fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(v4) => Source(u128::from(u32::from(v4))),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source(u128::from(u32::from(v4))),
                None => Source((u128::from(v6) >> 64 << 64) | 1),
            },
        }
    }
}

/// One unauthenticated connection in the pool.
struct Waiting {
    source: Source,
    evict: Arc<Notify>,
    received: Arc<Received>,
}

#[derive(Default)]
struct Pool {
    next_id: u64,
    /// Unauthenticated connections by id (ids grow with age: a smaller one is older).
    waiting: HashMap<u64, Waiting>,
    /// Each source's unauthenticated connections, oldest first.
    by_source: HashMap<Source, VecDeque<u64>>,
    /// Authenticated connections in all.
    authenticated: usize,
    /// Authenticated connections per tenant (row id).
    tenants: HashMap<i64, u32>,
    /// Connections evicted so far (for tests and the log).
    evicted: u64,
}

impl Pool {
    fn remove_waiting(&mut self, id: u64) -> Option<Waiting> {
        let w = self.waiting.remove(&id)?;
        if let Some(q) = self.by_source.get_mut(&w.source) {
            q.retain(|&i| i != id);
            if q.is_empty() {
                self.by_source.remove(&w.source);
            }
        }
        Some(w)
    }

    /// Evicts the oldest unauthenticated connection of `source`, or of the source holding
    /// the most (ties: the oldest of them): the oldest that has sent nothing yet if there is
    /// one (a client that means it sends its TLS hello at once), else the oldest.
    fn evict_oldest(&mut self, source: Option<Source>) {
        let source = source.or_else(|| {
            self.by_source
                .iter()
                .max_by(|(_, a), (_, b)| {
                    // More connections first; then the older front (smaller id).
                    a.len()
                        .cmp(&b.len())
                        .then_with(|| b.front().cmp(&a.front()))
                })
                .map(|(s, _)| *s)
        });
        let Some(queue) = source.and_then(|s| self.by_source.get(&s)) else {
            return;
        };
        let silent = queue.iter().find(|id| {
            self.waiting
                .get(id)
                .is_some_and(|w| w.received.bytes() == 0)
        });
        let Some(id) = silent.or(queue.front()).copied() else {
            return;
        };
        if let Some(w) = self.remove_waiting(id) {
            self.evicted += 1;
            w.evict.notify_one();
        }
    }
}

/// The front door's connections (see the module's documentation).
pub struct Connections {
    limits: DoorLimits,
    pool: Mutex<Pool>,
    places: Arc<tokio::sync::Semaphore>,
}

impl Connections {
    /// An empty door with `limits`.
    pub fn new(limits: DoorLimits) -> Arc<Connections> {
        Arc::new(Connections {
            limits,
            pool: Mutex::default(),
            places: Arc::new(tokio::sync::Semaphore::new(limits.places)),
        })
    }

    /// The limits.
    pub fn limits(&self) -> DoorLimits {
        self.limits
    }

    fn lock(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a free place: call before `accept`, so that the door never holds more
    /// descriptors than [`DoorLimits::places`].
    pub async fn place(&self) -> Place {
        let permit = self
            .places
            .clone()
            .acquire_owned()
            .await
            .expect("the places semaphore is never closed");
        Place { _permit: permit }
    }

    /// Admits a new connection from `source` as unauthenticated, evicting to make room
    /// (never refusing it); `received` counts what it sends.
    pub fn admit(self: &Arc<Self>, place: Place, source: Source, received: Arc<Received>) -> Slot {
        let evict = Arc::new(Notify::new());
        let mut pool = self.lock();
        let of_source = pool.by_source.get(&source).map_or(0, VecDeque::len);
        if of_source >= self.limits.per_source {
            pool.evict_oldest(Some(source));
        } else if pool.waiting.len() >= self.limits.unauthenticated {
            pool.evict_oldest(None);
        }
        let id = pool.next_id;
        pool.next_id += 1;
        pool.waiting.insert(
            id,
            Waiting {
                source,
                evict: evict.clone(),
                received,
            },
        );
        pool.by_source.entry(source).or_default().push_back(id);
        drop(pool);
        Slot {
            door: self.clone(),
            id,
            evict,
            tenant: Mutex::new(None),
            authenticated: AtomicBool::new(false),
            _place: place,
        }
    }

    /// Unauthenticated connections now, authenticated ones now, and evictions so far.
    pub fn counts(&self) -> (usize, usize, u64) {
        let pool = self.lock();
        (pool.waiting.len(), pool.authenticated, pool.evicted)
    }
}

/// One of the door's places, held from before `accept` until the connection closes.
pub struct Place {
    _permit: tokio::sync::OwnedSemaphorePermit,
}

/// Why a key's tenant may not have the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimRefused {
    /// The tenant's clients hold [`DoorLimits::per_tenant`] connections already.
    TenantFull,
    /// The door's authenticated connections are all taken.
    DoorFull,
    /// The connection was evicted while its request was being checked.
    Evicted,
}

/// A connection's place at the door, released when dropped (the connection closed).
pub struct Slot {
    door: Arc<Connections>,
    id: u64,
    evict: Arc<Notify>,
    tenant: Mutex<Option<i64>>,
    authenticated: AtomicBool,
    _place: Place,
}

impl Slot {
    /// Moves the connection to `tenant_id`'s pool (a no-op once it belongs to a tenant:
    /// the first key used on a connection owns it).
    pub fn claim(&self, tenant_id: i64) -> Result<(), ClaimRefused> {
        let mut tenant = self.tenant.lock().unwrap_or_else(PoisonError::into_inner);
        if tenant.is_some() {
            return Ok(());
        }
        let limits = self.door.limits;
        let mut pool = self.door.lock();
        if !pool.waiting.contains_key(&self.id) {
            return Err(ClaimRefused::Evicted);
        }
        let held = pool.tenants.get(&tenant_id).copied().unwrap_or(0);
        if held >= limits.per_tenant {
            return Err(ClaimRefused::TenantFull);
        }
        if pool.authenticated >= limits.authenticated {
            return Err(ClaimRefused::DoorFull);
        }
        pool.remove_waiting(self.id);
        pool.authenticated += 1;
        *pool.tenants.entry(tenant_id).or_insert(0) += 1;
        *tenant = Some(tenant_id);
        self.authenticated.store(true, Ordering::Release);
        Ok(())
    }

    /// The door's limits.
    pub fn limits(&self) -> DoorLimits {
        self.door.limits
    }

    fn is_authenticated(&self) -> bool {
        self.authenticated.load(Ordering::Acquire)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let tenant = *self.tenant.lock().unwrap_or_else(PoisonError::into_inner);
        let mut pool = self.door.lock();
        match tenant {
            None => {
                pool.remove_waiting(self.id);
            }
            Some(t) => {
                pool.authenticated = pool.authenticated.saturating_sub(1);
                if let Some(n) = pool.tenants.get_mut(&t) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        pool.tenants.remove(&t);
                    }
                }
            }
        }
    }
}

/// Why [`watch`] ended a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// A newer connection took its place.
    Evicted,
    /// Nothing arrived within [`FIRST_BYTE_TIMEOUT`].
    NoFirstByte,
    /// Bytes arrived slower than [`MIN_BYTES_PER_S`].
    TooSlow,
    /// No good key within [`UNAUTHENTICATED_LIFETIME`].
    TooLong,
}

/// Resolves when the connection must close: evicted, or too slow while unauthenticated
/// (see the module's documentation). Never resolves once the connection is authenticated.
pub async fn watch(slot: &Slot, received: &Received) -> Ended {
    let opened = Instant::now();
    loop {
        tokio::select! {
            () = slot.evict.notified() => return Ended::Evicted,
            () = tokio::time::sleep(WATCH_TICK) => {}
        }
        if slot.is_authenticated() {
            return std::future::pending().await;
        }
        let age = opened.elapsed();
        let bytes = received.bytes();
        if let Some(ended) = judge(age, bytes) {
            return ended;
        }
    }
}

/// The verdict on an unauthenticated connection `age` old that has sent `bytes`.
fn judge(age: Duration, bytes: u64) -> Option<Ended> {
    if bytes == 0 {
        return (age >= FIRST_BYTE_TIMEOUT).then_some(Ended::NoFirstByte);
    }
    if age >= UNAUTHENTICATED_LIFETIME {
        return Some(Ended::TooLong);
    }
    let owed = age.saturating_sub(RATE_GRACE).as_millis() as u64 * MIN_BYTES_PER_S / 1000;
    (bytes < owed).then_some(Ended::TooSlow)
}

/// Bytes received on a connection so far (shared by the connection and its [`watch`]).
#[derive(Debug, Default)]
pub struct Received(AtomicU64);

impl Received {
    fn bytes(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A stream that counts the bytes read from it into a [`Received`].
pub struct Counted<S> {
    inner: S,
    received: Arc<Received>,
}

impl<S> Counted<S> {
    /// `inner`, counted into `received`.
    pub fn new(inner: S, received: Arc<Received>) -> Self {
        Counted { inner, received }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len().saturating_sub(before) as u64;
        self.received.0.fetch_add(n, Ordering::Relaxed);
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(door: &Arc<Connections>) -> Place {
        Place {
            _permit: door.places.clone().try_acquire_owned().unwrap(),
        }
    }

    /// What a connection has sent so far.
    fn sent(bytes: u64) -> Arc<Received> {
        Arc::new(Received(AtomicU64::new(bytes)))
    }

    fn src(last: u8) -> Source {
        Source::of(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn limits_follow_the_descriptors_and_keep_a_reserve() {
        let low = DoorLimits::for_fd_limit(1024);
        // 768 descriptors for the door: a quarter for the unauthenticated, the rest
        // counted twice.
        assert_eq!(low.unauthenticated, 192);
        assert_eq!(low.authenticated, 288);
        assert!(low.places as u64 + low.authenticated as u64 <= 1024 - FD_RESERVE);
        assert_eq!(low.per_tenant, MAX_TENANT_CONNECTIONS);
        let high = DoorLimits::for_fd_limit(1 << 20);
        assert_eq!(high.unauthenticated, MAX_UNAUTHENTICATED);
        assert_eq!(high.authenticated, MAX_AUTHENTICATED);
        // However few, something is left for both kinds.
        let tiny = DoorLimits::for_fd_limit(64);
        assert!(
            tiny.unauthenticated >= 4 && tiny.authenticated >= 2,
            "{tiny:?}"
        );
    }

    #[test]
    fn sources_are_addresses_or_ipv6_64s() {
        let v6 = |s: &str| Source::of(s.parse().unwrap());
        assert_eq!(v6("2001:db8::1"), v6("2001:db8::ffff:1"));
        assert_ne!(v6("2001:db8::1"), v6("2001:db8:0:1::1"));
        assert_eq!(v6("::ffff:10.0.0.1"), src(1));
        assert_ne!(src(1), src(2));
    }

    #[test]
    fn a_full_source_turns_over_its_own_oldest_and_a_full_pool_the_heaviest() {
        let door = Connections::new(DoorLimits {
            places: 100,
            unauthenticated: 6,
            per_source: 3,
            authenticated: 10,
            per_tenant: 2,
        });
        let a: Vec<Slot> = (0..3)
            .map(|_| door.admit(place(&door), src(1), sent(1)))
            .collect();
        // A fourth from the same source evicts its oldest, not anyone else's.
        let b = door.admit(place(&door), src(2), sent(1));
        let a4 = door.admit(place(&door), src(1), sent(1));
        assert!(evicted(&a[0]) && !evicted(&a[1]) && !evicted(&b));
        // The pool holds 4; two more fit; a seventh from a new source evicts the oldest of
        // the heaviest source (a[1]), not b, the oldest of all.
        let c = door.admit(place(&door), src(3), sent(1));
        let d = door.admit(place(&door), src(4), sent(1));
        assert!(!evicted(&a[1]));
        let e = door.admit(place(&door), src(5), sent(1));
        assert!(evicted(&a[1]) && !evicted(&b) && !evicted(&c) && !evicted(&d) && !evicted(&e));
        assert_eq!(door.counts(), (6, 0, 2));
        drop((a, a4, b, c, d, e));
        assert_eq!(door.counts().0, 0);
    }

    #[test]
    fn a_connection_that_has_sent_nothing_goes_before_an_older_one_mid_handshake() {
        let door = Connections::new(DoorLimits {
            places: 100,
            unauthenticated: 8,
            per_source: 3,
            authenticated: 10,
            per_tenant: 2,
        });
        let talking = door.admit(place(&door), src(1), sent(300));
        let silent = door.admit(place(&door), src(1), sent(0));
        let newest = door.admit(place(&door), src(1), sent(0));
        let _fourth = door.admit(place(&door), src(1), sent(0));
        assert!(evicted(&silent) && !evicted(&talking) && !evicted(&newest));
        // With none silent, the oldest.
        let _fifth = door.admit(place(&door), src(1), sent(0));
        assert!(evicted(&newest) && !evicted(&talking));
    }

    #[test]
    fn a_good_key_moves_the_connection_to_its_tenants_pool() {
        let door = Connections::new(DoorLimits {
            places: 100,
            unauthenticated: 2,
            per_source: 2,
            authenticated: 3,
            per_tenant: 2,
        });
        let s: Vec<Slot> = (0..2)
            .map(|_| door.admit(place(&door), src(1), sent(1)))
            .collect();
        s[0].claim(7).unwrap();
        // Claimed twice: still one connection of tenant 7.
        s[0].claim(8).unwrap();
        s[1].claim(7).unwrap();
        assert_eq!(door.counts(), (0, 2, 0));
        // Authenticated connections are never evicted by newcomers.
        let more: Vec<Slot> = (0..3)
            .map(|_| door.admit(place(&door), src(1), sent(1)))
            .collect();
        assert!(!evicted(&s[0]) && !evicted(&s[1]) && evicted(&more[0]));
        // Tenant 7 is full; tenant 8 fits once, then the door is full.
        assert_eq!(more[1].claim(7), Err(ClaimRefused::TenantFull));
        more[1].claim(8).unwrap();
        assert_eq!(more[2].claim(9), Err(ClaimRefused::DoorFull));
        assert_eq!(more[0].claim(9), Err(ClaimRefused::Evicted));
        drop(s);
        more[2].claim(7).unwrap();
        assert_eq!(door.counts().1, 2);
    }

    #[test]
    fn slow_or_silent_unauthenticated_connections_are_judged() {
        let ms = Duration::from_millis;
        assert_eq!(judge(ms(1900), 0), None);
        assert_eq!(judge(FIRST_BYTE_TIMEOUT, 0), Some(Ended::NoFirstByte));
        // A handshake and a head sent at once (900 bytes) buy 7 s; more bytes, up to the
        // lifetime.
        assert_eq!(judge(ms(7_000), 900), None);
        assert_eq!(judge(ms(9_000), 900), Some(Ended::TooSlow));
        assert_eq!(judge(ms(9_900), 10_000), None);
        assert_eq!(
            judge(UNAUTHENTICATED_LIFETIME, 10_000),
            Some(Ended::TooLong)
        );
        // A byte a second falls behind soon after the grace.
        assert_eq!(judge(RATE_GRACE, 1), None);
        assert_eq!(judge(ms(1_500), 1), Some(Ended::TooSlow));
    }

    /// Evicted: out of the pool without a tenant. (The eviction's notification itself is
    /// seen by `watch`, in the flood test.)
    fn evicted(slot: &Slot) -> bool {
        !slot.is_authenticated() && !slot.door.lock().waiting.contains_key(&slot.id)
    }
}
