//! What keeps a quota-store outage from becoming a gateway outage:
//!
//! - [`Breaker`]: after a few failed store calls in a row the gateway stops waiting on the store
//!   for each request; a background probe, the one trial while it is open, closes it once the
//!   store runs a script again (not merely answers `PING`), and exact shared counting resumes.
//! - [`LocalLimiter`]: while the store is out (`on_store_error = "local"`), each node holds a key
//!   to its windows of a minute or shorter on its own; longer windows (the day) pause. A key's
//!   concurrency is held on each node on its own whatever `on_store_error` says (but `closed`,
//!   which forwards nothing).
//! - [`BanCache`]: bans this node has seen stay enforced without asking the store, through an
//!   outage and on the hot path (a banned key costs no round trip; it is re-checked at most once
//!   a second). The store probe compares it with the store's list of bans every second, and a
//!   store answer that the key is not banned drops it, so a ban lifted on another node ends
//!   here within a second too and does not come back during a later outage.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::keys::limits::{Limits, WindowLimit, MAX_WINDOWS};
use crate::quota::crowded::Crowded;
use crate::quota::rules::{BanPolicy, Lease, Outcome, RateView, Verdict, MINUTE_SECS};
use crate::quota::store::memory::MemoryStore;
use crate::quota::store::{QuotaStore, StoreError};

/// The gateway's fault handling as one thing, passed whole: admission decides with it, the admin
/// listener clears the ban cache on a lift, the store probe closes the breaker, and the reloader
/// sweeps the caches. Clones share the same parts.
#[derive(Clone, Default)]
pub struct Resilience {
    /// Stops sending requests to a failing store; closed again by the probe.
    pub breaker: Arc<Breaker>,
    /// Bans this node knows of (not the ban *policy*, which is configuration).
    pub ban_cache: Arc<BanCache>,
    /// Counts on this node alone while the shared store fails (`on_store_error = "local"`).
    pub local: Arc<LocalLimiter>,
    /// Holders the store just refused for their concurrency.
    pub crowded: Arc<Crowded>,
}

/// Consecutive failures that open the breaker.
pub const BREAKER_THRESHOLD: u32 = 3;

#[derive(Debug, Default)]
pub struct Breaker {
    failures: AtomicU32,
    open: AtomicBool,
}

impl Breaker {
    /// False while the store is considered down: do not send it requests.
    pub fn allows(&self) -> bool {
        !self.open.load(Ordering::Relaxed)
    }

    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Relaxed)
    }

    pub fn success(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }

    /// Returns true when this failure opened the breaker.
    pub fn failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        n >= BREAKER_THRESHOLD && !self.open.swap(true, Ordering::Relaxed)
    }

    /// The probe saw the store answer: send it requests again.
    pub fn close(&self) -> bool {
        self.failures.store(0, Ordering::Relaxed);
        self.open.swap(false, Ordering::Relaxed)
    }
}

/// Per-node limits for when the shared store is out: a key's windows of a minute or shorter (or,
/// when it has none, its shortest enforced window), counted on this node alone by the very rules
/// of the stores (fixed windows, the request's cost in each, refused whole); longer windows
/// pause, nothing being known of them here. No ban starts here: the ban cache keeps enforcing the
/// bans already known.
#[derive(Default)]
pub struct LocalLimiter {
    counts: MemoryStore,
}

impl Resilience {
    /// With this node's own leases (taken while the store is away) lasting `lease_secs`, as the
    /// store's do.
    pub fn with_lease_secs(lease_secs: u64) -> Resilience {
        Resilience {
            local: Arc::new(LocalLimiter {
                counts: MemoryStore::new().with_lease_secs(lease_secs),
            }),
            ..Resilience::default()
        }
    }
}

/// Windows the local limiter enforces: a minute or shorter.
const LOCAL_LONGEST_SECS: u64 = MINUTE_SECS;

impl LocalLimiter {
    /// Decides one request costing `cost` on this node alone, at `now` (Unix seconds); with a
    /// concurrency, the lease it took on this node.
    pub fn check(
        &self,
        key_id: &Arc<str>,
        limits: Limits,
        cost: u64,
        now: u64,
    ) -> (Outcome, RateView, Lease) {
        let mut short: Vec<WindowLimit> = limits
            .windows()
            .iter()
            .filter(|w| w.every.nominal_secs() <= LOCAL_LONGEST_SECS)
            .copied()
            .collect();
        // A plan of longer windows only keeps its shortest enforced one here: never no limit.
        if !short.iter().any(|w| !w.shadow) {
            short.extend(limits.enforced().next().copied());
        }
        let mut counts = [0; MAX_WINDOWS];
        let (outcome, lease) = match Limits::new(&short) {
            // No window short enough: nothing to count here.
            Err(_) => self.slot(key_id, limits, now),
            Ok(local) => {
                let local = local.with_concurrency(limits.concurrency().unwrap_or(0));
                let never = BanPolicy {
                    strikes: u64::MAX,
                    ..BanPolicy::default()
                };
                let v = self.counts.decide(key_id, &local, cost, &never, now);
                for (k, w) in limits.windows().iter().enumerate() {
                    if let Some(j) = local.windows().iter().position(|l| l.every == w.every) {
                        counts[k] = v.counts[j];
                    }
                }
                (v.outcome, v.lease)
            }
        };
        let verdict = Verdict {
            outcome,
            now,
            counts,
            ban_until: 0,
            ban_started: false,
            lease,
        };
        (outcome, RateView::new(&verdict, limits, cost), lease)
    }

    /// The concurrency alone, on this node (`on_store_error = "open"` counts no window): a
    /// lease when `limits` have a concurrency and it has room, `ConcurrencyLimited` when not.
    pub fn slot(&self, key_id: &Arc<str>, limits: Limits, now: u64) -> (Outcome, Lease) {
        match limits.concurrency() {
            None => (Outcome::Admitted, Lease::default()),
            Some(most) => {
                let lease = self.counts.take_lease(key_id, most, now);
                if lease.taken() {
                    (Outcome::Admitted, lease)
                } else {
                    (Outcome::ConcurrencyLimited, lease)
                }
            }
        }
    }

    /// Gives back a lease taken on this node.
    pub fn release(&self, key_id: &Arc<str>, lease: Lease) {
        self.counts.release(key_id, lease);
    }

    /// Renews a lease taken on this node.
    pub async fn renew(&self, key_id: &Arc<str>, lease: Lease) -> Result<Lease, StoreError> {
        self.counts.renew(key_id, lease).await
    }

    /// Forgets keys whose windows have all ended.
    pub fn sweep(&self) {
        self.counts.sweep(crate::base::clock::unix_now());
    }
}

#[derive(Debug, Clone, Copy)]
struct CachedBan {
    until: u64,
    checked: Instant,
}

/// Bans this node knows of, by key id.
#[derive(Debug, Default)]
pub struct BanCache {
    bans: Mutex<HashMap<Arc<str>, CachedBan>>,
    /// Entries in `bans`, readable without the lock: almost always 0, and then every request
    /// skips the lock. Written only under the lock.
    len: AtomicUsize,
}

/// How long a cached ban is trusted before the store is asked again (while it answers).
pub const BAN_RECHECK: Duration = Duration::from_secs(1);

impl BanCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, CachedBan>> {
        self.bans.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The ban's end when `key_id` is known banned at `now`. `fresh_only`: only if it was
    /// confirmed by the store within [`BAN_RECHECK`] (when the store is up, older entries are
    /// re-checked so lifts elsewhere take effect).
    pub fn banned_until(&self, key_id: &str, now: u64, fresh_only: bool) -> Option<u64> {
        if self.len.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut bans = self.lock();
        match bans.get(key_id) {
            Some(b) if b.until <= now => {
                bans.remove(key_id);
                self.len.store(bans.len(), Ordering::Relaxed);
                None
            }
            Some(b) if !fresh_only || b.checked.elapsed() < BAN_RECHECK => Some(b.until),
            _ => None,
        }
    }

    pub fn remember(&self, key_id: &Arc<str>, until: u64) {
        let mut bans = self.lock();
        bans.insert(
            Arc::clone(key_id),
            CachedBan {
                until,
                checked: Instant::now(),
            },
        );
        self.len.store(bans.len(), Ordering::Relaxed);
    }

    pub fn forget(&self, key_id: &str) {
        let mut bans = self.lock();
        bans.remove(key_id);
        self.len.store(bans.len(), Ordering::Relaxed);
    }

    pub fn is_empty(&self) -> bool {
        self.len.load(Ordering::Relaxed) == 0
    }

    /// Drops the cached bans that the store's list of active bans (all of them, from one call)
    /// no longer holds: a ban lifted on another node ends here too, before an outage could make
    /// this cache its only source. It never marks an entry as freshly checked: the list is an
    /// index kept beside the bans, and only the key's own state may vouch for a ban, so a stale
    /// index entry cannot keep a lifted ban alive.
    pub fn keep_only(&self, active: &[crate::quota::store::Ban]) {
        let listed: HashMap<&str, u64> = active
            .iter()
            .map(|b| (b.key_id.as_str(), b.until))
            .collect();
        let mut bans = self.lock();
        bans.retain(|id, _| listed.contains_key(&**id));
        self.len.store(bans.len(), Ordering::Relaxed);
    }

    /// Drops ended bans.
    pub fn sweep(&self, now: u64) {
        let mut bans = self.lock();
        bans.retain(|_, b| b.until > now);
        self.len.store(bans.len(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breaker_opens_after_consecutive_failures_and_closes_on_a_probe() {
        let b = Breaker::default();
        assert!(!b.failure() && !b.failure());
        b.success();
        assert!(!b.failure() && !b.failure());
        assert!(b.failure(), "third failure in a row opens it");
        assert!(!b.allows());
        assert!(!b.failure(), "already open");
        assert!(b.close());
        assert!(b.allows());
    }

    #[test]
    fn the_local_limiter_holds_a_key_to_its_short_windows_only() {
        let l = LocalLimiter::default();
        let key: Arc<str> = "k".into();
        let other: Arc<str> = "other".into();
        let limits = Limits::minute_day(3, 3).unwrap();
        let now = 60 * 1_000 + 10;
        for remaining in [2, 1, 0] {
            let (outcome, view, _) = l.check(&key, limits, 1, now);
            assert_eq!((outcome, view.remaining), (Outcome::Admitted, remaining));
        }
        let (outcome, view, _) = l.check(&key, limits, 1, now);
        assert_eq!(outcome, Outcome::Limited);
        assert_eq!(view.retry_after, Some(50), "until the minute's end");
        assert_eq!(l.check(&other, limits, 1, now).0, Outcome::Admitted);
        // The day pauses: a new minute has room, though 3 went today.
        assert_eq!(l.check(&key, limits, 1, now + 60).0, Outcome::Admitted);
        // A cost is spent whole or not at all.
        assert_eq!(l.check(&other, limits, 3, now).0, Outcome::Limited);
        assert_eq!(l.check(&other, limits, 2, now).0, Outcome::Admitted);
        // A plan of an hour and a day keeps its hour here rather than no limit at all.
        let hourly = Limits::new(&[
            WindowLimit::new(crate::keys::limits::Every::Secs(3_600), 2).unwrap(),
            WindowLimit::new(crate::keys::limits::Every::DAY, 100).unwrap(),
        ])
        .unwrap();
        let third: Arc<str> = "third".into();
        for _ in 0..2 {
            assert_eq!(l.check(&third, hourly, 1, now).0, Outcome::Admitted);
        }
        assert_eq!(l.check(&third, hourly, 1, now).0, Outcome::Limited);
    }

    #[test]
    fn the_local_limiter_holds_a_concurrency_on_this_node_and_frees_what_is_given_back() {
        let l = LocalLimiter::default();
        let key: Arc<str> = "k".into();
        let now = crate::base::clock::unix_now();
        let limits = Limits::minute_day(100, 100).unwrap().with_concurrency(2);
        let (a, _, first) = l.check(&key, limits, 1, now);
        let (b, _, _) = l.check(&key, limits, 1, now);
        let (c, view, _) = l.check(&key, limits, 1, now);
        assert_eq!(
            (a, b, c, view.retry_after),
            (
                Outcome::Admitted,
                Outcome::Admitted,
                Outcome::ConcurrencyLimited,
                Some(1)
            )
        );
        l.release(&key, first);
        assert_eq!(l.check(&key, limits, 1, now).0, Outcome::Admitted);
        // The concurrency alone (`open`): the same places.
        assert_eq!(l.slot(&key, limits, now).0, Outcome::ConcurrencyLimited);
        let other: Arc<str> = "other".into();
        let (outcome, lease) = l.slot(&other, limits, now);
        assert!(outcome == Outcome::Admitted && lease.taken());
        assert_eq!(
            l.slot(&other, Limits::minute_day(1, 1).unwrap(), now),
            (Outcome::Admitted, Lease::default()),
            "no concurrency, no lease"
        );
    }

    #[test]
    fn cached_bans_end_on_time_and_are_rechecked_when_stale() {
        let c = BanCache::default();
        let key: Arc<str> = "k".into();
        c.remember(&key, 100);
        assert_eq!(c.banned_until("k", 50, true), Some(100));
        assert_eq!(c.banned_until("other", 50, false), None);
        assert_eq!(c.banned_until("k", 100, false), None, "ended");
        c.remember(&key, 100);
        c.forget("k");
        assert_eq!(c.banned_until("k", 50, false), None);
    }
}
