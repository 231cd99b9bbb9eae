//! What keeps a quota-store outage from becoming a gateway outage:
//!
//! - [`Breaker`]: after a few failed store calls in a row the gateway stops waiting on the store
//!   for each request; a background probe, the one trial while it is open, closes it once the
//!   store runs a script again (not merely answers `PING`), and exact shared counting resumes.
//! - [`LocalLimiter`]: while the store is out (`on_store_error = "local"`), each node limits a key
//!   to the plan's per-minute rate on its own (governor, GCRA); the day quota pauses.
//! - [`BanCache`]: bans this node has seen stay enforced without asking the store, through an
//!   outage and on the hot path (a banned key costs no round trip; it is re-checked at most once
//!   a second). The store probe compares it with the store's list of bans every second, and a
//!   store answer that the key is not banned drops it, so a ban lifted on another node ends
//!   here within a second too and does not come back during a later outage.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use governor::clock::{Clock, DefaultClock};
use governor::middleware::StateInformationMiddleware;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};

use crate::keys::plans::Limits;
use crate::quota::rules::{
    gcra_refill_secs, retry_after_secs, Outcome, RateView, Window, DAY_SECS,
};

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

type KeyedLimiter = RateLimiter<
    Arc<str>,
    DefaultKeyedStateStore<Arc<str>>,
    DefaultClock,
    StateInformationMiddleware,
>;

/// Per-node limits for when the shared store is out: one governor limiter per distinct
/// per-minute rate (plans share them), keyed by API key id.
#[derive(Default)]
pub struct LocalLimiter {
    by_rate: Mutex<HashMap<u64, Arc<KeyedLimiter>>>,
    clock: DefaultClock,
}

impl LocalLimiter {
    fn limiter(&self, per_minute: u64) -> Arc<KeyedLimiter> {
        let mut map = self.by_rate.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(map.entry(per_minute).or_insert_with(|| {
            let rate = u32::try_from(per_minute).unwrap_or(u32::MAX);
            let quota = Quota::per_minute(NonZeroU32::new(rate).unwrap_or(NonZeroU32::MIN));
            Arc::new(RateLimiter::keyed(quota).with_middleware::<StateInformationMiddleware>())
        }))
    }

    /// Decides one request on this node alone, at `now` (Unix seconds).
    pub fn check(&self, key_id: &Arc<str>, limits: Limits, now: u64) -> (Outcome, RateView) {
        let limit = limits.per_minute.max(1);
        let day_reset = (now / DAY_SECS + 1) * DAY_SECS;
        let view = |remaining: u64, reset: u64, retry_after: Option<u64>| RateView {
            limits,
            now,
            minute_remaining: remaining,
            minute_reset: reset.max(now + 1),
            // The day quota pauses during an outage: nothing is known about it here.
            day_remaining: limits.per_day,
            day_reset,
            limit,
            remaining,
            reset: reset.max(now + 1),
            retry_after,
            binding: Window::Minute,
        };
        match self.limiter(limit).check_key(key_id) {
            Ok(snapshot) => {
                let remaining = u64::from(snapshot.remaining_burst_capacity()).min(limit);
                (
                    Outcome::Admitted,
                    view(
                        remaining,
                        now + gcra_refill_secs(limit - remaining, limit),
                        None,
                    ),
                )
            }
            Err(not_until) => {
                let retry = retry_after_secs(not_until.wait_time_from(self.clock.now()));
                (Outcome::Limited, view(0, now + retry, Some(retry)))
            }
        }
    }

    /// Forgets keys whose allowance is full again.
    pub fn sweep(&self) {
        let map = self.by_rate.lock().unwrap_or_else(|p| p.into_inner());
        for limiter in map.values() {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
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
    fn the_local_limiter_holds_a_key_to_its_per_minute_rate() {
        let l = LocalLimiter::default();
        let key: Arc<str> = "k".into();
        let other: Arc<str> = "other".into();
        let limits = Limits {
            per_minute: 3,
            per_day: 1000,
        };
        for remaining in [2, 1, 0] {
            let (outcome, view) = l.check(&key, limits, 1_000);
            assert_eq!((outcome, view.remaining), (Outcome::Admitted, remaining));
        }
        let (outcome, view) = l.check(&key, limits, 1_000);
        assert_eq!(outcome, Outcome::Limited);
        assert!(view.retry_after.is_some_and(|r| (1..=20).contains(&r)));
        assert_eq!(l.check(&other, limits, 1_000).0, Outcome::Admitted);
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
