//! The request path's part of the top consumers' index (`GET /usage/top`): units the store
//! admitted, summed in memory per quota holder and UTC day and month of the store's clock, and
//! written to the store by [`run_flush`] once a second. So the index costs the store a few
//! commands per holder and second, never a call per request, and a request pays one shard lock
//! and a hash lookup: no allocation once its holder is in the tally.
//!
//! The store's figures lag the exact counts by up to a flush (about a second). A flush that
//! fails puts what it took back, up to [`MAX_HOLDERS`] holders (the rest is lost, counted in
//! `pet_gateway_top_flush_failures_total`); the next flush sends it.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::base::metrics::METRICS;
use crate::keys::limits::Every;
use crate::quota::store::{QuotaStore, StoreError};

/// The holders' maps' hasher: holders are key and customer ids the fleet issued, not a
/// client's bytes, so a fast hash (foldhash, seeded per process, not from the OS's randomness)
/// in place of SipHash, which cost two hashes of some 400 instructions each on every admitted
/// request. Never key these maps by anything a client sends.
type Fast = foldhash::fast::RandomState;

const SHARDS: usize = 16;
/// The most holders a tally keeps for a store that refuses its flushes: a bound on memory
/// through a long outage (a million holders are some 100 MB).
pub const MAX_HOLDERS: usize = 1_000_000;
const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// Units of one holder in one day (and the month holding it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Units {
    day: u64,
    month: u64,
    units: u64,
}

#[derive(Default)]
struct Shard {
    current: HashMap<Arc<str>, Units, Fast>,
    /// Sums a holder's later request moved on from (a day ended), kept for the next flush.
    spilled: Vec<(Arc<str>, Units)>,
}

/// What holders spent in one day, as one store call sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopBatch {
    pub day: u64,
    pub month: u64,
    pub entries: Vec<(Arc<str>, u64)>,
}

/// Units admitted per holder since the last flush.
pub struct TopTally {
    hasher: Fast,
    shards: Box<[Mutex<Shard>]>,
    /// The latest day seen and its month, `day << 32 | month`: the month is worked out once a
    /// day, not on every request.
    calendar: AtomicU64,
}

impl Default for TopTally {
    fn default() -> TopTally {
        TopTally {
            hasher: Fast::default(),
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            calendar: AtomicU64::new(0),
        }
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

impl TopTally {
    /// Counts `cost` units admitted for `holder` (a quota id) at `now`, the store's clock.
    pub fn add(&self, holder: &Arc<str>, now: u64, cost: u64) {
        let day = now / 86_400;
        let packed = self.calendar.load(Ordering::Relaxed);
        let month = if packed >> 32 == day {
            packed & u64::from(u32::MAX)
        } else {
            let month = Every::Month.index(now);
            self.calendar.store(day << 32 | month, Ordering::Relaxed);
            month
        };
        self.put(
            holder,
            Units {
                day,
                month,
                units: cost,
            },
        );
    }

    fn put(&self, holder: &Arc<str>, add: Units) {
        let shard = &self.shards[self.hasher.hash_one(&**holder) as usize % SHARDS];
        let mut guard = lock(shard);
        let shard = &mut *guard;
        match shard.current.get_mut(&**holder) {
            Some(u) if (u.day, u.month) == (add.day, add.month) => {
                u.units = u.units.saturating_add(add.units)
            }
            Some(u) => {
                let ended = std::mem::replace(u, add);
                shard.spilled.push((Arc::clone(holder), ended));
            }
            None => {
                shard.current.insert(Arc::clone(holder), add);
            }
        }
    }

    /// Holders held now.
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = lock(s);
                s.current.len() + s.spilled.len()
            })
            .sum()
    }

    /// Takes everything counted, one batch per day, oldest first. The maps keep their memory,
    /// so holders coming back allocate nothing.
    pub fn take(&self) -> Vec<TopBatch> {
        let mut periods: HashMap<(u64, u64), HashMap<Arc<str>, u64>> = HashMap::new();
        for shard in self.shards.iter() {
            let mut guard = lock(shard);
            let shard = &mut *guard;
            for (holder, u) in shard.current.drain().chain(shard.spilled.drain(..)) {
                let sum = periods
                    .entry((u.day, u.month))
                    .or_default()
                    .entry(holder)
                    .or_default();
                *sum = sum.saturating_add(u.units);
            }
        }
        let mut batches: Vec<TopBatch> = periods
            .into_iter()
            .map(|((day, month), holders)| TopBatch {
                day,
                month,
                entries: holders.into_iter().collect(),
            })
            .collect();
        batches.sort_by_key(|b| b.day);
        batches
    }

    /// Puts back a batch the store did not take; returns how many holders were dropped for
    /// the bound.
    pub fn restore(&self, batch: TopBatch) -> usize {
        let room = MAX_HOLDERS.saturating_sub(self.len());
        let dropped = batch.entries.len().saturating_sub(room);
        for (holder, units) in batch.entries.into_iter().take(room) {
            let (day, month) = (batch.day, batch.month);
            self.put(&holder, Units { day, month, units });
        }
        dropped
    }
}

/// Flushes `tally` to `store` once a second until `stop` changes, then once more.
pub async fn run_flush(
    tally: Arc<TopTally>,
    store: Arc<dyn QuotaStore>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut failing = false;
    loop {
        let stopping = tokio::select! {
            _ = tokio::time::sleep(FLUSH_EVERY) => false,
            _ = stop.changed() => true,
        };
        failing = flush(&tally, &*store, failing).await;
        if stopping {
            return;
        }
    }
}

/// The most holders in one store call: a call small enough to finish well within its deadline
/// on a busy store, so a timeout (after which the store may or may not have added the units)
/// stays rare.
const CHUNK: usize = 2_000;

/// One flush, in calls of at most [`CHUNK`] holders. A call that failed is kept for the next
/// flush, except one that timed out: the store may have added it, and adding it again would
/// count it twice, so it is dropped (the ranking is off by it, low rather than high). Whether
/// it failed; the first failure of a run of them is logged, and so is the recovery.
pub async fn flush(tally: &TopTally, store: &dyn QuotaStore, was_failing: bool) -> bool {
    let mut failure = None;
    let mut dropped = 0;
    for batch in tally.take() {
        for chunk in batch.entries.chunks(CHUNK) {
            let rest = || TopBatch {
                day: batch.day,
                month: batch.month,
                entries: chunk.to_vec(),
            };
            if failure.is_some() {
                dropped += tally.restore(rest());
                continue;
            }
            match store.add_top(batch.day, batch.month, chunk).await {
                Ok(()) => {}
                Err(e @ StoreError::Timeout(_)) => {
                    dropped += chunk.len();
                    failure = Some(e);
                }
                Err(e) => {
                    dropped += tally.restore(rest());
                    failure = Some(e);
                }
            }
        }
    }
    let Some(e) = failure else {
        if was_failing {
            tracing::info!("top consumers: the store takes the tally again");
        }
        return false;
    };
    METRICS.top_flush_failures.inc();
    if !was_failing || dropped > 0 {
        tracing::warn!(error = %e, dropped,
            "top consumers: cannot write the tally to the store; kept for the next flush (a \
             call that timed out is not sent again: it may have been applied)");
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = 86_400;
    /// 2025-11-30T12:00:00Z: day 20,422, in month 670; a day later it is December.
    const NOW: u64 = 20_422 * DAY + DAY / 2;

    fn sorted(mut b: TopBatch) -> TopBatch {
        b.entries.sort();
        b
    }

    #[test]
    fn units_add_up_per_holder_and_day_and_a_new_day_is_a_batch_of_its_own() {
        let t = TopTally::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("k1"), Arc::from("customer:acme"));
        t.add(&a, NOW, 1);
        t.add(&a, NOW + 1, 3);
        t.add(&b, NOW, 2);
        t.add(&a, NOW + DAY, 5);
        let batches: Vec<TopBatch> = t.take().into_iter().map(sorted).collect();
        assert_eq!(batches.len(), 2);
        assert_eq!((batches[0].day, batches[0].month), (20_422, 670));
        assert_eq!(
            batches[0].entries,
            vec![(Arc::clone(&b), 2), (Arc::clone(&a), 4)]
        );
        assert_eq!((batches[1].day, batches[1].month), (20_423, 671));
        assert_eq!(batches[1].entries, vec![(a, 5)]);
        assert!(t.take().is_empty(), "taken once");
    }

    #[test]
    fn a_batch_put_back_joins_what_came_since() {
        let t = TopTally::default();
        let a: Arc<str> = Arc::from("k1");
        t.add(&a, NOW, 2);
        let taken = t.take().pop().unwrap();
        t.add(&a, NOW, 1);
        assert_eq!(t.restore(taken), 0);
        assert_eq!(t.take().pop().unwrap().entries, vec![(a, 3)]);
    }
}
