//! One quota across regions (issue 48): each region decides inside itself, in its own Redis,
//! exact among its nodes as a fleet without regions is, and admits only out of units the global
//! store granted it (`quota::store::redis::ledger`), so the regions together never pass a limit.
//!
//! [`RegionalStore`] is the quota store of a region's node: the region's [`RedisStore`] built
//! [`RedisStore::regional`], whose decisions refuse with [`Outcome::Unleased`] (nothing counted,
//! no strike) when the region holds too few units, and the ledger. Around each decision:
//!
//! - **Ahead of use.** After an admission the node looks at what the region counted and holds
//!   (`sizing`) and, when the spare units would run out soon or an instance is about to end, asks
//!   the global store in the background: a key below its limit never waits on it. One ask at a
//!   time per quota on a node, and one a second per quota in a region (`claim_once`).
//! - **Short.** A decision refused for too few units asks at once (the request waits one
//!   cross-region call) and decides again. The global store granting nothing marks the instance
//!   as having none left for two seconds: a refusal then is a full window's (`rate_limited`, with a
//!   strike, as in one region). A global store that does not answer leaves the refusal as it is:
//!   429 `region_unleased`.
//! - **Back.** Units a region holds of a quota nobody in the region was admitted for a while
//!   are given back (`sweep`), so the budget follows traffic that moved.
//!
//! A grant is held (`RedisStore::hold`) only once the global store's replicas acknowledged it
//! (`Grant::durable`); a grant whose answer is lost stays counted there and is never spent
//! (under-admission, never over). What the region holds lives in its Redis under that server's
//! run id: a restart or a failover forfeits it (`scripts::regional_lua`).

pub mod bans;
pub mod granted;
pub mod sizing;
pub mod sweep;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;

use self::sizing::Seen;
use crate::base::clock::unix_now_ms;
use crate::base::metrics::METRICS;
use crate::keys::limits::{Limits, MAX_WINDOWS};
use crate::quota::rules::{BanPolicy, Lease, Outcome, Verdict};
use crate::quota::store::redis::ban_feed::BanFeed;
use crate::quota::store::redis::ledger::{Ask, Instance, Ledger};
use crate::quota::store::redis::{Held, RedisStore};
use crate::quota::store::{Ban, QuotaStore, StoreError, TopWindow, Usage};

/// How long a region's Redis remembers that the global store had none left of an instance: a
/// short refusal meanwhile is a full window's, and asks nothing. A key past its limit costs the
/// global store a call every this long from each node, and units another region gives back
/// are found within it.
const NONE_LEFT_SECS: u64 = 2;

/// How long requests short of units answer at once (`region_unleased`), without asking, after
/// the global store did not answer one: a region cut off from it does not make every such
/// request wait out a deadline.
const AWAY_FOR: Duration = Duration::from_secs(1);

/// The longest a request short of units waits for another one's ask on this node.
const GLOBAL_WAIT: Duration = Duration::from_secs(1);

/// A region's node's quota store.
pub struct RegionalStore {
    store: Arc<RedisStore>,
    ledger: Arc<Ledger>,
    feed: Arc<BanFeed>,
    region: Arc<str>,
    /// This node's name in request ids and claims: random at start.
    node: String,
    seq: AtomicU64,
    /// Quotas with an ask of this node in flight.
    asking: Mutex<HashSet<Arc<str>>>,
    /// Per quota, the turn of this node's requests refused for too few units: one asks at a
    /// time.
    shorts: Mutex<HashMap<Arc<str>, Arc<tokio::sync::Mutex<()>>>>,
    /// Until when (Unix milliseconds) requests short of units do not ask: the global store did
    /// not answer the last one.
    away_until: AtomicU64,
    /// Next instances (quota, length code, instance) this node looked at, with their end.
    looked: Mutex<HashMap<NextInstance, u64>>,
    /// Quotas this node got units for, and when it last decided one of their requests: what
    /// the sweep gives back once idle.
    pub(crate) tracked: RwLock<HashMap<Arc<str>, Arc<sweep::Tracked>>>,
    /// What this node read of the bans of every region (`bans`).
    following: Mutex<bans::Following>,
    /// The global store's figures this node last read, by quota (`granted`).
    last_granted: Mutex<granted::LastRead>,
    /// Whether usage is read with the global store's figures (`GET /v1/rate_limit`), not only
    /// the region's (the admin API: a search shows the usage of a page of keys, one global read
    /// each would cost it a round trip between regions a key).
    reads_granted: bool,
}

impl RegionalStore {
    /// `store` must be built [`RedisStore::regional`].
    pub fn new(
        store: Arc<RedisStore>,
        ledger: Arc<Ledger>,
        feed: Arc<BanFeed>,
        region: &str,
    ) -> Arc<RegionalStore> {
        RegionalStore::build(store, ledger, feed, region, true)
    }

    /// The admin API's store: as [`RegionalStore::new`], its usage the region's alone.
    pub fn for_admin(
        store: Arc<RedisStore>,
        ledger: Arc<Ledger>,
        feed: Arc<BanFeed>,
        region: &str,
    ) -> Arc<RegionalStore> {
        RegionalStore::build(store, ledger, feed, region, false)
    }

    fn build(
        store: Arc<RedisStore>,
        ledger: Arc<Ledger>,
        feed: Arc<BanFeed>,
        region: &str,
        reads_granted: bool,
    ) -> Arc<RegionalStore> {
        Arc::new(RegionalStore {
            store,
            ledger,
            feed,
            region: Arc::from(region),
            node: format!("{:016x}", rand::random::<u64>()),
            seq: AtomicU64::new(0),
            asking: Mutex::default(),
            shorts: Mutex::default(),
            away_until: AtomicU64::new(0),
            looked: Mutex::default(),
            tracked: RwLock::default(),
            following: Mutex::default(),
            last_granted: Mutex::default(),
            reads_granted,
        })
    }

    fn request_id(&self) -> String {
        format!("{}-{}", self.node, self.seq.fetch_add(1, Ordering::Relaxed))
    }

    /// Asks the global store for `asks` and holds what it grants, by the region's clock `now`
    /// (`Verdict::now`). A call that timed out is sent again with the same id (`patient`: in
    /// the background; a waiting request does not wait twice), and a grant its replicas did not
    /// acknowledge in time is asked again with the same id (answered again, counted once, and
    /// waited for again); one still not acknowledged stays counted and is never held.
    /// Instances granted nothing are marked as having none left (see the module's doc).
    async fn ask(
        &self,
        quota: &Arc<str>,
        limits: Limits,
        asks: &[Ask],
        now: u64,
        patient: bool,
    ) -> Result<(), AskError> {
        if asks.is_empty() {
            return Ok(());
        }
        let id = self.request_id();
        let region = &*self.region;
        let mut grant = match self.ledger.grant(quota, region, &id, asks).await {
            Err(StoreError::Timeout(_) | StoreError::Unavailable(_)) if patient => {
                self.ledger.grant(quota, region, &id, asks).await
            }
            other => other,
        }
        .map_err(AskError::Global)?;
        if !grant.durable {
            grant =
                (self.ledger.grant(quota, region, &id, asks).await).map_err(AskError::Global)?;
        }
        self.track(quota, limits);
        let result = if grant.durable {
            "granted"
        } else {
            "not_durable"
        };
        METRICS.region_grants.with_label_values(&[result]).inc();
        if !grant.durable {
            return Ok(());
        }
        let held: Vec<Held> = asks
            .iter()
            .zip(&grant.units)
            .map(|(ask, &units)| Held {
                code: ask.at.every.code(),
                index: ask.at.index,
                units,
                none_left_until: if units == 0 { now + NONE_LEFT_SECS } else { 0 },
            })
            .collect();
        self.store
            .hold(quota, &held)
            .await
            .map(|_| ())
            .map_err(AskError::Region)
    }

    /// A request refused for too few units: asks at once, one ask a quota at a time on this
    /// node (the others wait for it, then decide again before asking themselves), none while
    /// the global store was just found away ([`AWAY_FOR`]); then decides again.
    async fn short(&self, r: &Request<'_>, first: Decided) -> Result<Decided, StoreError> {
        if self.away() {
            return Ok(first);
        }
        let turn = Arc::clone(lock(&self.shorts).entry(Arc::clone(r.key_id)).or_default());
        let result = self.short_turn(&turn, r, first).await;
        let mut shorts = lock(&self.shorts);
        // The map's own and this one's: nobody else waits, so the entry goes.
        if Arc::strong_count(&turn) <= 2 {
            shorts.remove(r.key_id);
        }
        result
    }

    async fn short_turn(
        &self,
        turn: &tokio::sync::Mutex<()>,
        r: &Request<'_>,
        first: Decided,
    ) -> Result<Decided, StoreError> {
        let mut seen = first;
        let _turn = match turn.try_lock() {
            Ok(guard) => guard,
            Err(_) => {
                let Ok(guard) = tokio::time::timeout(GLOBAL_WAIT, turn.lock()).await else {
                    return Ok(seen);
                };
                // Another request's ask ran meanwhile: what it got may be enough.
                seen = r.decide(&self.store).await?;
                if seen.0.outcome != Outcome::Unleased {
                    return Ok(seen);
                }
                guard
            }
        };
        let asks = sizing::asks(&r.limits, &seen_of(&seen), r.cost, true, |_| false);
        match self.ask(r.key_id, r.limits, &asks, seen.0.now, false).await {
            Ok(()) => {}
            Err(AskError::Global(e)) => {
                METRICS.region_grants.with_label_values(&["failed"]).inc();
                let away = unix_now_ms() + AWAY_FOR.as_millis() as u64;
                self.away_until.store(away, Ordering::Relaxed);
                tracing::debug!(error = %e, "a region short of units could not reach the global store");
                return Ok(seen);
            }
            // The region's Redis failed: the decision again meets the same failure, or not.
            Err(AskError::Region(e)) => {
                tracing::debug!(error = %e, "units granted could not be held in the region");
            }
        }
        r.decide(&self.store).await
    }

    /// Whether the global store did not answer this node's last ask for a request short of
    /// units, less than [`AWAY_FOR`] ago.
    fn away(&self) -> bool {
        unix_now_ms() < self.away_until.load(Ordering::Relaxed)
    }

    /// Asks ahead of use, in the background, when the decision `seen` says the region will
    /// run short soon: one ask a quota at a time on this node, a top-up of the current
    /// instances once a second in the region, each next instance once in the region
    /// (`claim_once`; this node looks at each next instance once).
    fn ahead(self: &Arc<Self>, quota: &Arc<str>, limits: Limits, seen: &Seen, cost: u64) {
        if lock(&self.asking).contains(quota) {
            return;
        }
        let asks = sizing::asks(&limits, seen, cost, false, |at| self.first_look(quota, at));
        if asks.is_empty() {
            return;
        }
        if !lock(&self.asking).insert(Arc::clone(quota)) {
            // Another decision's ask started meanwhile: the next instances are its to ask.
            self.unlook(quota, &asks);
            return;
        }
        let (me, quota, now) = (Arc::clone(self), Arc::clone(quota), seen.now);
        tokio::spawn(async move {
            let mut claimed = Vec::with_capacity(asks.len());
            for ask in asks {
                let at = ask.at;
                let (name, until) = if is_current(&at, now) {
                    (format!("lease:{}:{quota}", me.region), now + 1)
                } else {
                    let (code, index) = (at.every.code(), at.index);
                    (format!("next:{}:{quota}:{code}:{index}", me.region), at.end)
                };
                if let Ok(true) = me.store.claim_once(&name, &me.node, until).await {
                    claimed.push(ask);
                }
            }
            if let Err(e) = me.ask(&quota, limits, &claimed, now, true).await {
                tracing::warn!(error = %e, "could not ask the global store ahead of use");
                // Looked at again by the next decision.
                me.unlook(&quota, &claimed);
            }
            lock(&me.asking).remove(&quota);
        });
    }

    /// Forgets that this node looked at the next instances of `asks`.
    fn unlook(&self, quota: &Arc<str>, asks: &[Ask]) {
        let mut looked = lock(&self.looked);
        for ask in asks {
            looked.remove(&(Arc::clone(quota), ask.at.every.code(), ask.at.index));
        }
    }

    /// Whether this node looks at `quota`'s next instance `at` for the first time.
    fn first_look(&self, quota: &Arc<str>, at: &Instance) -> bool {
        let mut looked = lock(&self.looked);
        if looked.len() >= 4_096 {
            let now = crate::base::clock::unix_now();
            looked.retain(|_, end| *end > now);
            if looked.len() >= 2_048 {
                // Many keys end an instance at once (every minute's end): forgetting costs at
                // most a next instance asked again, which its region's claim refuses.
                looked.clear();
            }
        }
        looked
            .insert((Arc::clone(quota), at.every.code(), at.index), at.end)
            .is_none()
    }
}

/// Why an ask came to nothing: the global store did not grant (nothing was held), or the
/// region's Redis did not take what it granted (the units stay counted as granted, unspent).
#[derive(Debug, thiserror::Error)]
enum AskError {
    #[error("global store: {0}")]
    Global(StoreError),
    #[error("the region's store: {0}")]
    Region(StoreError),
}

/// One request to decide, as the region's store is asked it (again, after a grant).
struct Request<'a> {
    key_id: &'a Arc<str>,
    limits: Limits,
    cost: u64,
    ban: &'a BanPolicy,
}

/// A decision, and the units the region holds of each window's instance.
type Decided = (Verdict, [u64; MAX_WINDOWS]);

impl Request<'_> {
    async fn decide(&self, store: &RedisStore) -> Result<Decided, StoreError> {
        store
            .decide(self.key_id, self.limits, self.cost, self.ban)
            .await
    }
}

/// A quota's next instance: its id, the window's length code, which instance.
type NextInstance = (Arc<str>, u32, u64);

/// A lock whose holder panicked leaves plain maps behind, still usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `at` is the instance holding `now` (not one asked ahead of its start).
fn is_current(at: &Instance, now: u64) -> bool {
    at.index == at.every.index(now)
}

fn seen_of((verdict, held): &Decided) -> Seen {
    Seen {
        now: verdict.now,
        counts: verdict.counts,
        held: *held,
    }
}

/// Decisions go to the region's Redis, every other call too: the top consumers' index is the
/// region's, usage too (with the global store's grants beside it, `granted`); bans are the region's, fed by the others' (`bans`) and lifted in
/// every region.
#[async_trait]
impl QuotaStore for RegionalStoreHandle {
    async fn acquire(
        &self,
        key_id: &Arc<str>,
        limits: Limits,
        cost: u64,
        ban: &BanPolicy,
    ) -> Result<Verdict, StoreError> {
        let me = &self.0;
        let tracked = me.touch(key_id);
        let request = Request {
            key_id,
            limits,
            cost,
            ban,
        };
        let mut seen = request.decide(&me.store).await?;
        if seen.0.outcome == Outcome::Unleased {
            seen = me.short(&request, seen).await?;
        }
        if seen.0.outcome == Outcome::Admitted {
            let spare = seen.0.counts.iter().zip(&seen.1).any(|(c, h)| h > c);
            if !tracked && spare {
                // Units granted before this node started (or to another node): given back by
                // this one too once the key is quiet.
                me.track(key_id, limits);
            }
            me.ahead(key_id, limits, &seen_of(&seen), cost);
        } else if seen.0.ban_started {
            me.publish_ban(key_id, seen.0.now, seen.0.ban_until);
        }
        Ok(seen.0)
    }

    fn release(&self, quota_id: &Arc<str>, lease: Lease) {
        self.0.store.release(quota_id, lease)
    }

    fn flush(&self) {
        self.0.store.flush()
    }

    async fn renew(&self, quota_id: &Arc<str>, lease: Lease) -> Result<Lease, StoreError> {
        self.0.store.renew(quota_id, lease).await
    }

    /// Into the feed first: a lift the other regions cannot learn of is not done here either.
    async fn lift_ban(&self, key_id: &str) -> Result<bool, StoreError> {
        self.0.lift_everywhere(key_id).await?;
        self.0.store.lift_ban(key_id).await
    }

    async fn ban_of(&self, key_id: &str) -> Result<Option<Ban>, StoreError> {
        self.0.store.ban_of(key_id).await
    }

    async fn bans(&self) -> Result<Vec<Ban>, StoreError> {
        self.0.store.bans().await
    }

    async fn probe(&self) -> Result<(), StoreError> {
        self.0.store.probe().await
    }

    async fn usage(&self, quota_id: &str) -> Result<Usage, StoreError> {
        let usage = self.0.store.usage(quota_id).await?;
        if !self.0.reads_granted {
            return Ok(usage);
        }
        Ok(self.0.with_granted(quota_id, usage).await)
    }

    async fn reset_usage(&self, quota_id: &str) -> Result<(), StoreError> {
        self.0.store.reset_usage(quota_id).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.0.store.ping().await
    }

    async fn add_top(
        &self,
        day: u64,
        month: u64,
        entries: &[(Arc<str>, u64)],
    ) -> Result<(), StoreError> {
        self.0.store.add_top(day, month, entries).await
    }

    async fn top(
        &self,
        window: TopWindow,
        limit: usize,
    ) -> Result<(u64, Vec<(String, u64)>), StoreError> {
        self.0.store.top(window, limit).await
    }

    async fn claim_once(&self, name: &str, claimant: &str, until: u64) -> Result<bool, StoreError> {
        self.0.store.claim_once(name, claimant, until).await
    }
}

/// The [`QuotaStore`] of a region's node (its asks ahead of use run as tasks holding the store).
pub struct RegionalStoreHandle(pub Arc<RegionalStore>);
