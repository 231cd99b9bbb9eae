//! The embedded store: every key's [`KeyState`] in a sharded map in this process, packed
//! ([`super::packed`]: 40 bytes a key and 8 per window of its own), and the [`Leases`] of the
//! quotas with a concurrency beside them. Shards keep two worker threads from contending on one
//! lock; idle entries (every window over, no ban pending, no lease held) are swept out once a
//! minute per shard, so memory follows the keys in use in their windows, not every key ever
//! seen.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::packed::PackedStates;
use super::ranking::Ranking;
use super::{Ban, QuotaStore, StoreError, TopWindow, Usage};
use crate::base::clock::Clock;
use crate::keys::limits::Limits;
use crate::quota::rules::{BanPolicy, Lease, Leases, Verdict, MINUTE_SECS};

const SHARDS: usize = 64;

#[derive(Default)]
struct Shard {
    keys: PackedStates,
    swept_minute: u64,
    /// The shard's bans, key id to end, kept beside the states so that listing them (the
    /// console's overview asks every few seconds) walks the bans, not every key: a walk of a
    /// million states held each shard's lock against requests for milliseconds. An entry goes
    /// with its ban (lifted, or another one started) or its state (swept once idle), not with
    /// the time: a clock stepped back would bring back a ban the time had ended. Readers skip
    /// the ended ones.
    bans: HashMap<Arc<str>, u64>,
    /// The requests in flight of the quotas with a concurrency, by quota id.
    leases: HashMap<Arc<str>, Leases>,
}

impl Shard {
    /// Forgets whatever can no longer matter at `now`.
    fn sweep(&mut self, now: u64) {
        self.keys.retain(|s| !s.is_idle(now));
        self.prune_bans();
        self.leases.retain(|_, l| !l.is_empty(now));
    }

    /// Keeps the entries whose state still holds that very ban.
    fn prune_bans(&mut self) {
        let keys = &self.keys;
        self.bans.retain(|id, until| {
            keys.get(id)
                .is_some_and(|s| u64::from(s.ban_until) == *until)
        });
    }
}

pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    clock: Clock,
    /// The top consumers' index: written once a second by the flush, so one lock suffices.
    ranking: Mutex<Ranking>,
    /// [`QuotaStore::claim_once`]'s names, their claimants and until when they hold.
    claimed: Mutex<HashMap<String, (String, u64)>>,
    /// How long a lease lasts unless given back or renewed, in seconds.
    lease_secs: u64,
}

/// How long a lease lasts by default: the bound on how long a node that died holding places
/// keeps them from its keys (`concurrency_lease_secs`).
pub const DEFAULT_LEASE_SECS: u64 = 15;
/// The longest a lease may last. The Redis scripts drop a lease ending further off than this
/// (a clock that went back, a primary's replaced by a replica's behind it), so none outlives it.
pub const MAX_LEASE_SECS: u64 = 600;

impl Default for MemoryStore {
    fn default() -> Self {
        Self::with_clock(Clock::system())
    }
}

impl MemoryStore {
    pub fn new() -> MemoryStore {
        Self::default()
    }

    /// Reads the time from `clock`: tests pass a manual one to step over windows and bans.
    pub fn with_clock(clock: Clock) -> MemoryStore {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            clock,
            ranking: Mutex::new(Ranking::default()),
            claimed: Mutex::new(HashMap::new()),
            lease_secs: DEFAULT_LEASE_SECS,
        }
    }

    /// Leases last `secs` seconds unless given back or renewed.
    pub fn with_lease_secs(mut self, secs: u64) -> MemoryStore {
        self.lease_secs = secs.max(1);
        self
    }

    /// Number of keys currently held (for tests and memory figures).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).keys.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key_id: &str) -> &Mutex<Shard> {
        // FNV-1a: cheap, and key ids are random already.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in key_id.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        &self.shards[(h % SHARDS as u64) as usize]
    }
}

impl MemoryStore {
    /// [`QuotaStore::acquire`] at `now`, without waiting for anything.
    pub fn decide(
        &self,
        key_id: &Arc<str>,
        limits: &Limits,
        cost: u64,
        ban: &BanPolicy,
        now: u64,
    ) -> Verdict {
        let mut shard = lock(self.shard(key_id));
        let minute = now / MINUTE_SECS;
        if shard.swept_minute != minute {
            shard.swept_minute = minute;
            shard.sweep(now);
        }
        let Shard { keys, leases, .. } = &mut *shard;
        let verdict = match limits.concurrency() {
            None => keys.update(key_id, |state| state.acquire(now, limits, cost, ban)),
            Some(_) => {
                let held = leases.entry(Arc::clone(key_id)).or_default();
                let lease = Some((held, self.lease_secs));
                keys.update(key_id, |state| {
                    state.acquire_leased(now, limits, cost, ban, lease)
                })
            }
        };
        if verdict.ban_started {
            shard.bans.insert(Arc::clone(key_id), verdict.ban_until);
        }
        verdict
    }

    /// A lease of `key_id`'s, when fewer than `most` are held at `now`; otherwise a lease not
    /// taken (`end` 0) with the count held. The concurrency alone, no window: what a node holds
    /// on its own while the shared store is away.
    pub fn take_lease(&self, key_id: &Arc<str>, most: u32, now: u64) -> Lease {
        let mut shard = lock(self.shard(key_id));
        let held = shard.leases.entry(Arc::clone(key_id)).or_default();
        held.take_within(now, most, self.lease_secs)
    }

    /// Drops every state with nothing left that can matter at `now`.
    pub fn sweep(&self, now: u64) {
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            shard.sweep(now);
            shard.keys.shrink_to_fit();
            shard.bans.shrink_to_fit();
            shard.leases.shrink_to_fit();
        }
    }
}

/// A poisoned shard only means another thread panicked mid-update of plain counters; the
/// counters are still usable, so carry on rather than fail every later request.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[async_trait]
impl QuotaStore for MemoryStore {
    async fn acquire(
        &self,
        key_id: &Arc<str>,
        limits: Limits,
        cost: u64,
        ban: &BanPolicy,
    ) -> Result<Verdict, StoreError> {
        Ok(self.decide(key_id, &limits, cost, ban, self.clock.now()))
    }

    fn release(&self, quota_id: &Arc<str>, lease: Lease) {
        let now = self.clock.now();
        let mut shard = lock(self.shard(quota_id));
        if let Some(held) = shard.leases.get_mut(&**quota_id) {
            held.give_back(now, lease.end);
            if held.is_empty(now) {
                shard.leases.remove(&**quota_id);
            }
        }
    }

    async fn renew(&self, quota_id: &Arc<str>, lease: Lease) -> Result<Lease, StoreError> {
        let now = self.clock.now();
        let mut shard = lock(self.shard(quota_id));
        let held = shard.leases.entry(Arc::clone(quota_id)).or_default();
        let end = held.renew(now, lease.end, self.lease_secs);
        Ok(Lease {
            end,
            in_flight: held.in_flight(now),
        })
    }

    async fn lift_ban(&self, key_id: &str) -> Result<bool, StoreError> {
        let now = self.clock.now();
        let mut shard = lock(self.shard(key_id));
        shard.bans.remove(key_id);
        Ok(shard.keys.update_existing(key_id, |state| {
            if u64::from(state.ban_until) <= now {
                return false;
            }
            state.ban_until = 0;
            state.strikes = 0;
            true
        }))
    }

    async fn ban_of(&self, key_id: &str) -> Result<Option<Ban>, StoreError> {
        let now = self.clock.now();
        let shard = lock(self.shard(key_id));
        Ok(shard
            .keys
            .get(key_id)
            .filter(|s| u64::from(s.ban_until) > now)
            .map(|s| Ban {
                key_id: key_id.to_owned(),
                until: s.ban_until.into(),
            }))
    }

    async fn bans(&self) -> Result<Vec<Ban>, StoreError> {
        let now = self.clock.now();
        let mut bans = Vec::new();
        for shard in self.shards.iter() {
            let shard = lock(shard);
            bans.extend(
                shard
                    .bans
                    .iter()
                    .filter(|(_, &until)| until > now)
                    .map(|(id, &until)| Ban {
                        key_id: id.to_string(),
                        until,
                    }),
            );
        }
        Ok(bans)
    }

    async fn usage(&self, quota_id: &str) -> Result<Usage, StoreError> {
        let now = self.clock.now();
        let (state, in_flight) = {
            let shard = lock(self.shard(quota_id));
            let held = shard.leases.get(quota_id);
            (
                shard.keys.get(quota_id),
                held.map_or(0, |l| l.in_flight(now)),
            )
        };
        let state = state.as_ref();
        Ok(Usage {
            now,
            windows: state.map_or_else(Vec::new, |s| s.windows_now(now)),
            refused_today: state.map_or(0, |s| s.refused_today(now)),
            last_admitted: state.map_or(0, |s| s.last_admitted.into()),
            ban_until: state
                .map(|s| u64::from(s.ban_until))
                .filter(|&until| until > now)
                .unwrap_or(0),
            in_flight,
            global: None,
        })
    }

    async fn reset_usage(&self, quota_id: &str) -> Result<(), StoreError> {
        lock(self.shard(quota_id))
            .keys
            .update_existing(quota_id, |state| {
                state.reset_counts();
                true
            });
        Ok(())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn probe(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn claim_once(&self, name: &str, claimant: &str, until: u64) -> Result<bool, StoreError> {
        let now = self.clock.now();
        let mut claimed = lock(&self.claimed);
        claimed.retain(|_, (_, u)| *u > now);
        if let Some((first, _)) = claimed.get(name) {
            return Ok(first == claimant);
        }
        claimed.insert(name.to_owned(), (claimant.to_owned(), until));
        Ok(true)
    }

    async fn add_top(
        &self,
        day: u64,
        month: u64,
        entries: &[(Arc<str>, u64)],
    ) -> Result<(), StoreError> {
        lock(&self.ranking).add(day, month, entries);
        Ok(())
    }

    async fn top(
        &self,
        window: TopWindow,
        limit: usize,
    ) -> Result<(u64, Vec<(String, u64)>), StoreError> {
        let index = window.every().index(self.clock.now());
        Ok((index, lock(&self.ranking).top(window, index, limit)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ban list follows the states, not the time: a clock stepped forward past a ban's end,
    /// swept there, then stepped back still lists the ban the state holds (and `ban_of` shows).
    #[tokio::test]
    async fn a_ban_swept_past_its_end_is_listed_again_when_the_clock_steps_back() {
        let start = 1_800_000_000;
        let clock = Clock::manual(start);
        let store = MemoryStore::with_clock(clock.clone());
        let limits = Limits::minute_day(1, 100).unwrap();
        let ban = BanPolicy {
            strikes: 0,
            durations: vec![600],
            decay_secs: 3_600,
        };
        let id: Arc<str> = Arc::from("k");
        store.acquire(&id, limits, 1, &ban).await.unwrap();
        let banned = store.acquire(&id, limits, 1, &ban).await.unwrap();
        assert!(banned.ban_started);
        clock.set(start + 700);
        store.sweep(start + 700);
        assert!(
            store.bans().await.unwrap().is_empty(),
            "ended at start + 700"
        );
        clock.set(start + 10);
        let listed: Vec<(String, u64)> = store
            .bans()
            .await
            .unwrap()
            .into_iter()
            .map(|b| (b.key_id, b.until))
            .collect();
        assert_eq!(listed, [("k".to_owned(), banned.ban_until)]);
        assert!(store.ban_of("k").await.unwrap().is_some());
        // Lifted, it leaves the list at once.
        assert!(store.lift_ban("k").await.unwrap());
        assert!(store.bans().await.unwrap().is_empty());
    }
}
