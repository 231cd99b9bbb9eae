//! The places this node holds among its quotas' requests in flight (a plan's `concurrency`, a
//! key's own): every admitted request of such a quota holds a lease from the store (or, while
//! the store is away, from this node's [`LocalLimiter`]) until it ends. What gives it back is a
//! [`Slot`] the request carries to its end: its `Drop` releases the lease however the request
//! ends (answered, the client gone, the backend failed or timed out, refused later on the path,
//! its task dropped at a stop). A request that outlives its lease (a slow upload, a long answer,
//! a wait for the backend) has it renewed before it ends, by [`Slots::renew_due`], run by a task
//! of the node's own. A lease nobody gives back (the node killed) ends by itself in the store:
//! no place is ever held for good.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::base::metrics::METRICS;
use crate::quota::crowded::Crowded;
use crate::quota::resilience::{LocalLimiter, Resilience};
use crate::quota::rules::Lease;
use crate::quota::store::{QuotaStore, StoreError};

/// How often the renewal task looks for leases near their end.
pub const RENEW_TICK: Duration = Duration::from_millis(500);

pub struct Slots {
    store: Arc<dyn QuotaStore>,
    local: Arc<LocalLimiter>,
    /// Told of every place given back, so a holder refused here a moment ago is asked of the
    /// store again at once.
    crowded: Arc<Crowded>,
    table: Mutex<Table>,
    /// How long before its end a lease is renewed: a third of its length, at least 2 s, so a
    /// renewal that waits out a store deadline or a tick still comes in time.
    renew_before: Duration,
    /// A lease's length: a renewed lease runs this long from the renewal (by the store's clock,
    /// which this node does not share: its own is never compared with a lease's end).
    lease: Duration,
}

#[derive(Default)]
struct Table {
    entries: Vec<Option<Held>>,
    free: Vec<usize>,
    len: usize,
}

struct Held {
    quota: Arc<str>,
    lease: Lease,
    /// Taken from this node's own limiter (the store was away), not from the store.
    local: bool,
    renew_at: Instant,
    /// A renewal is out: an end meanwhile leaves the release to it, so the lease it brings
    /// back is the one given back.
    renewing: bool,
    /// The request ended while its lease was being renewed.
    ended: bool,
}

/// A request's place among its quota's requests in flight: given back when dropped.
pub struct Slot {
    slots: Arc<Slots>,
    at: usize,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.end(self.at);
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot").field("at", &self.at).finish()
    }
}

fn lock(m: &Mutex<Table>) -> MutexGuard<'_, Table> {
    // Plain bookkeeping: a panic elsewhere leaves it usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Slots {
    /// Leases taken from `store` (or `resilience`'s local limiter, while the store is away)
    /// last `lease_secs`.
    pub fn new(store: Arc<dyn QuotaStore>, resilience: &Resilience, lease_secs: u64) -> Slots {
        Slots {
            store,
            local: Arc::clone(&resilience.local),
            crowded: Arc::clone(&resilience.crowded),
            table: Mutex::new(Table::default()),
            renew_before: Duration::from_secs((lease_secs / 3).max(2)),
            lease: Duration::from_secs(lease_secs),
        }
    }

    /// Holds `lease`, taken for `quota` at `now` by the store's clock, until the returned slot
    /// is dropped. `local`: the lease is this node's own.
    pub fn hold(self: &Arc<Self>, quota: &Arc<str>, lease: Lease, local: bool, now: u64) -> Slot {
        let left = Duration::from_secs(lease.end.saturating_sub(now));
        let held = Held {
            quota: Arc::clone(quota),
            lease,
            local,
            renew_at: Instant::now() + left.saturating_sub(self.renew_before),
            renewing: false,
            ended: false,
        };
        let mut table = lock(&self.table);
        let at = match table.free.pop() {
            Some(at) => {
                table.entries[at] = Some(held);
                at
            }
            None => {
                table.entries.push(Some(held));
                table.entries.len() - 1
            }
        };
        table.len += 1;
        METRICS.concurrency_slots_held.set(table.len as i64);
        Slot {
            slots: Arc::clone(self),
            at,
        }
    }

    /// The slots held now, by this node.
    pub fn held(&self) -> usize {
        lock(&self.table).len
    }

    /// The request holding slot `at` ended: its lease goes back, unless a renewal is out (then
    /// the renewal gives back what it brings).
    fn end(&self, at: usize) {
        let gone = {
            let mut table = lock(&self.table);
            let Some(Some(held)) = table.entries.get_mut(at) else {
                return;
            };
            if held.renewing {
                held.ended = true;
                return;
            }
            table.take(at)
        };
        if let Some(held) = gone {
            self.give_back(&held);
        }
    }

    fn give_back(&self, held: &Held) {
        self.crowded.forget(&held.quota);
        if !held.lease.taken() {
            // Forgotten after a renewal in doubt: nothing of it to give back.
            return;
        }
        if held.local {
            self.local.release(&held.quota, held.lease);
        } else {
            self.store.release(&held.quota, held.lease);
        }
    }

    /// Renews every lease whose renewal is due, all at once (the store batches them); a lease
    /// whose renewal surely did not run keeps its end and is tried again at the next pass, one
    /// whose renewal may have run is forgotten and a fresh one taken at the next pass.
    pub async fn renew_due(self: &Arc<Self>) {
        let now = Instant::now();
        let due: Vec<(usize, Arc<str>, Lease, bool)> = {
            let mut table = lock(&self.table);
            table
                .entries
                .iter_mut()
                .enumerate()
                .filter_map(|(at, e)| Some((at, e.as_mut()?)))
                .filter(|(_, h)| !h.renewing && h.renew_at <= now)
                .map(|(at, h)| {
                    h.renewing = true;
                    (at, Arc::clone(&h.quota), h.lease, h.local)
                })
                .collect()
        };
        if due.is_empty() {
            return;
        }
        let mut renewals = tokio::task::JoinSet::new();
        for (at, quota, lease, local) in due {
            let slots = Arc::clone(self);
            renewals.spawn(async move {
                let renewed = if local {
                    slots.local.renew(&quota, lease).await
                } else {
                    slots.store.renew(&quota, lease).await
                };
                (at, renewed)
            });
        }
        while let Some(done) = renewals.join_next().await {
            let Ok((at, renewed)) = done else {
                continue;
            };
            self.renewed(at, renewed);
        }
    }

    /// A renewal of slot `at` came back: its lease moves on, or, when its request ended
    /// meanwhile, the lease it holds now goes back.
    fn renewed(&self, at: usize, renewed: Result<Lease, StoreError>) {
        let gone = {
            let mut table = lock(&self.table);
            let Some(Some(held)) = table.entries.get_mut(at) else {
                return;
            };
            held.renewing = false;
            match renewed {
                Ok(lease) => {
                    held.lease = lease;
                    held.renew_at = Instant::now() + self.lease.saturating_sub(self.renew_before);
                }
                Err(e) => {
                    // A renewal that may have run (a timeout, a connection lost mid-call) may
                    // have moved the lease to an end this node never learnt, and a lease gives
                    // no id of its own: giving back or renewing the old end then would take
                    // another request's place. So the node forgets it (it ends by itself) and
                    // the next pass takes a fresh one: the quota counts one too many for a
                    // while, never one too few.
                    if !held.local && !matches!(e, StoreError::Refused(_)) {
                        held.lease.end = 0;
                    }
                    tracing::warn!(error = %e, quota = %held.quota,
                        "could not renew a concurrency lease; trying again");
                }
            }
            if held.ended {
                table.take(at)
            } else {
                None
            }
        };
        if let Some(held) = gone {
            self.give_back(&held);
        }
    }

    /// Renews leases as they near their end, and sends releases a failed store call left
    /// behind, every [`RENEW_TICK`], for as long as the task runs (a stop ends it with its
    /// runtime, after the grace period's requests have ended).
    pub async fn run_renewals(self: Arc<Self>) {
        let mut tick = tokio::time::interval(RENEW_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.store.flush();
            self.renew_due().await;
        }
    }
}

impl Table {
    fn take(&mut self, at: usize) -> Option<Held> {
        let held = self.entries.get_mut(at)?.take()?;
        self.free.push(at);
        self.len -= 1;
        METRICS.concurrency_slots_held.set(self.len as i64);
        Some(held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::clock::Clock;
    use crate::keys::limits::Limits;
    use crate::quota::rules::{BanPolicy, Outcome};
    use crate::quota::store::memory::MemoryStore;

    fn setup(lease_secs: u64) -> (Arc<Slots>, Arc<MemoryStore>, Clock) {
        let clock = Clock::manual(1_800_000_000);
        let store = Arc::new(MemoryStore::with_clock(clock.clone()).with_lease_secs(lease_secs));
        let slots = Arc::new(Slots::new(
            Arc::clone(&store) as Arc<dyn QuotaStore>,
            &Resilience::default(),
            lease_secs,
        ));
        (slots, store, clock)
    }

    async fn admit(store: &MemoryStore, quota: &Arc<str>, most: u32) -> (Outcome, Lease) {
        let limits = Limits::minute_day(1_000, 1_000)
            .unwrap()
            .with_concurrency(most);
        let v = store
            .acquire(quota, limits, 1, &BanPolicy::default())
            .await
            .unwrap();
        (v.outcome, v.lease)
    }

    #[tokio::test]
    async fn a_dropped_slot_gives_its_lease_back_and_its_place_is_reused() {
        let (slots, store, clock) = setup(15);
        let quota: Arc<str> = Arc::from("q");
        let (_, lease) = admit(&store, &quota, 1).await;
        let slot = slots.hold(&quota, lease, false, clock.now());
        assert_eq!(
            admit(&store, &quota, 1).await.0,
            Outcome::ConcurrencyLimited
        );
        assert_eq!(slots.held(), 1);
        drop(slot);
        assert_eq!(slots.held(), 0);
        let (outcome, lease) = admit(&store, &quota, 1).await;
        assert_eq!(outcome, Outcome::Admitted);
        let again = slots.hold(&quota, lease, false, clock.now());
        assert_eq!(again.at, 0, "the table's place is reused");
    }

    #[tokio::test]
    async fn a_lease_near_its_end_is_renewed_and_one_ended_meanwhile_is_given_back() {
        let (slots, store, clock) = setup(3);
        let quota: Arc<str> = Arc::from("q");
        let (_, lease) = admit(&store, &quota, 1).await;
        let slot = slots.hold(&quota, lease, false, clock.now());
        // Due (its store's clock is a hand-moved one, the renewal's time a real one).
        lock(&slots.table).entries[slot.at]
            .as_mut()
            .unwrap()
            .renew_at = Instant::now();
        clock.advance(2);
        slots.renew_due().await;
        clock.advance(2);
        assert_eq!(
            admit(&store, &quota, 1).await.0,
            Outcome::ConcurrencyLimited,
            "renewed past its first end"
        );
        // The request ends during a renewal: the renewed lease is the one given back.
        {
            let mut table = lock(&slots.table);
            table.entries[slot.at].as_mut().unwrap().renewing = true;
        }
        drop(slot);
        assert_eq!(slots.held(), 1, "kept until the renewal comes back");
        let (at, current) = (0, lock(&slots.table).entries[0].as_ref().unwrap().lease);
        let renewed = store.renew(&quota, current).await;
        slots.renewed(at, renewed);
        assert_eq!(slots.held(), 0);
        assert_eq!(admit(&store, &quota, 1).await.0, Outcome::Admitted);
    }
}
