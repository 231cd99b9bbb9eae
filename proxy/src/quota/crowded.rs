//! Quota holders the store has just found at their concurrency, refused on this node for a
//! moment ([`CROWDED_FOR`]) without asking the store again. A concurrency 429 strikes nothing
//! (parallel clients are not abusive), so no ban ever comes to stop a script that keeps
//! sending past its concurrency; without this, each of its requests would cost the store a
//! decision, at whatever rate it sends. With it, a node asks the store about such a holder at
//! most ten times a second.
//!
//! What it costs: a place freed on another node is seen here up to [`CROWDED_FOR`] late (a
//! refusal the store would not have given; the client is told to come back in a second
//! anyway). A place this node gives back ends the moment at once, so a single node stays exact
//! (but for a place given back while the refusing call was on its way: the refusal is then
//! remembered after it, for its 100 ms).
//! Only a refusal with the same limits is repeated (a plan reload that raised the concurrency
//! asks the store), and only while the store answers: during an outage the node's own limiter
//! decides.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::keys::limits::Limits;
use crate::quota::rules::RateView;

/// How long a concurrency refusal from the store is repeated here.
pub const CROWDED_FOR: Duration = Duration::from_millis(100);

/// Entries past which remembering one first drops those whose moment has passed.
const SWEEP_AT: usize = 4_096;

#[derive(Debug, Default)]
pub struct Crowded {
    refused: Mutex<HashMap<Arc<str>, (Instant, RateView)>>,
    /// Entries in `refused`, readable without the lock: almost always 0, and then every request
    /// skips the lock. Written only under the lock.
    len: AtomicUsize,
}

impl Crowded {
    fn lock(&self) -> MutexGuard<'_, HashMap<Arc<str>, (Instant, RateView)>> {
        self.refused.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The store's refusal of `quota` under `limits`, when it came less than [`CROWDED_FOR`]
    /// before `now`.
    pub fn refused(&self, quota: &str, limits: Limits, now: Instant) -> Option<RateView> {
        if self.len.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut refused = self.lock();
        let (at, view) = *refused.get(quota)?;
        if now.duration_since(at) >= CROWDED_FOR {
            // Passed: dropped here, so that once none is left every request skips the lock.
            refused.remove(quota);
            self.len.store(refused.len(), Ordering::Relaxed);
            return None;
        }
        (view.limits == limits).then_some(view)
    }

    /// The store refused `quota` at `now` for its concurrency, with `view`.
    pub fn remember(&self, quota: &Arc<str>, view: RateView, now: Instant) {
        let mut refused = self.lock();
        if refused.len() >= SWEEP_AT {
            refused.retain(|_, (at, _)| now.duration_since(*at) < CROWDED_FOR);
        }
        refused.insert(Arc::clone(quota), (now, view));
        self.len.store(refused.len(), Ordering::Relaxed);
    }

    /// A place of `quota` was given back here (or the store admitted it): ask the store again.
    pub fn forget(&self, quota: &str) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut refused = self.lock();
        refused.remove(quota);
        self.len.store(refused.len(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(limits: Limits) -> RateView {
        RateView::unmetered(limits, 1_800_000_000)
    }

    #[test]
    fn a_refusal_is_repeated_for_a_moment_until_a_place_comes_back() {
        let c = Crowded::default();
        let limits = Limits::minute_day(10, 100).unwrap().with_concurrency(2);
        let quota: Arc<str> = "q".into();
        let t0 = Instant::now();
        assert_eq!(c.refused("q", limits, t0), None);
        c.remember(&quota, view(limits), t0);
        assert_eq!(
            c.refused("q", limits, t0 + CROWDED_FOR / 2),
            Some(view(limits))
        );
        assert_eq!(
            c.refused("q", limits, t0 + CROWDED_FOR),
            None,
            "its moment passed"
        );
        assert_eq!(c.len.load(Ordering::Relaxed), 0, "and it is gone");
        c.remember(&quota, view(limits), t0);
        assert_eq!(c.refused("other", limits, t0), None);
        let raised = limits.with_concurrency(3);
        assert_eq!(
            c.refused("q", raised, t0),
            None,
            "other limits ask the store"
        );
        c.forget("q");
        assert_eq!(c.refused("q", limits, t0), None, "a place given back here");
    }

    #[test]
    fn passed_moments_are_dropped_before_it_grows_past_its_bound() {
        let c = Crowded::default();
        let limits = Limits::minute_day(10, 100).unwrap().with_concurrency(1);
        let t0 = Instant::now();
        for i in 0..SWEEP_AT {
            c.remember(&Arc::from(format!("q{i}")), view(limits), t0);
        }
        c.remember(&Arc::from("late"), view(limits), t0 + CROWDED_FOR);
        assert_eq!(c.len.load(Ordering::Relaxed), 1);
    }
}
