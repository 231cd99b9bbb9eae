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
//!   as having none left for a second: a refusal then is a full window's (`rate_limited`, with a
//!   strike, as in one region). A global store that does not answer leaves the refusal as it is:
//!   429 `region_unleased`.
//! - **Back.** Units a region holds of a quota nobody in the region was admitted for a while
//!   are given back (`sweep`), so the budget follows traffic that moved.
//!
//! A grant is held (`RedisStore::hold`) only once the global store's replicas acknowledged it
//! (`Grant::durable`); a grant whose answer is lost stays counted there and is never spent
//! (under-admission, never over). What the region holds lives in its Redis under that server's
//! run id: a restart or a failover forfeits it (`scripts::regional_lua`).

pub mod sizing;
pub mod sweep;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;

use self::sizing::{Ask, Seen};
use crate::base::metrics::METRICS;
use crate::keys::limits::Limits;
use crate::quota::rules::{BanPolicy, Lease, Outcome, Verdict};
use crate::quota::store::redis::ledger::Ledger;
use crate::quota::store::redis::{Held, RedisStore};
use crate::quota::store::{Ban, QuotaStore, StoreError, TopWindow, Usage};

/// How long a region's Redis remembers that the global store had none left of an instance: a
/// short refusal meanwhile is a full window's.
const NONE_LEFT_SECS: u64 = 1;

/// A region's node's quota store.
pub struct RegionalStore {
    store: Arc<RedisStore>,
    ledger: Arc<Ledger>,
    region: Arc<str>,
    /// This node's name in request ids and claims: random at start.
    node: String,
    seq: AtomicU64,
    /// Quotas with an ask of this node in flight.
    asking: Mutex<HashMap<Arc<str>, ()>>,
    /// Quotas this node got units for, and when it last decided one of their requests: what
    /// the sweep gives back once idle.
    pub(crate) tracked: RwLock<HashMap<Arc<str>, Arc<sweep::Tracked>>>,
}

impl RegionalStore {
    /// `store` must be built [`RedisStore::regional`].
    pub fn new(store: Arc<RedisStore>, ledger: Arc<Ledger>, region: &str) -> Arc<RegionalStore> {
        Arc::new(RegionalStore {
            store,
            ledger,
            region: Arc::from(region),
            node: format!("{:016x}", rand::random::<u64>()),
            seq: AtomicU64::new(0),
            asking: Mutex::default(),
            tracked: RwLock::default(),
        })
    }

    fn request_id(&self) -> String {
        format!("{}-{}", self.node, self.seq.fetch_add(1, Ordering::Relaxed))
    }

    /// Asks the global store for `asks` and holds what it grants; `short`: a request waits.
    /// Instances granted nothing are marked as having none left (see the module's doc).
    async fn ask(&self, quota: &Arc<str>, limits: Limits, asks: &[Ask]) -> Result<(), StoreError> {
        if asks.is_empty() {
            return Ok(());
        }
        let id = self.request_id();
        let grant = match self.ledger.grant(quota, &self.region, &id, asks).await {
            // Once more with the same id: a grant whose answer was lost is answered again,
            // counted once.
            Err(StoreError::Timeout(_) | StoreError::Unavailable(_)) => {
                self.ledger.grant(quota, &self.region, &id, asks).await?
            }
            other => other?,
        };
        self.track(quota, limits);
        if !grant.durable {
            METRICS
                .region_grants
                .with_label_values(&["not_durable"])
                .inc();
            return Ok(());
        }
        METRICS.region_grants.with_label_values(&["granted"]).inc();
        let now = crate::base::clock::unix_now();
        let held: Vec<Held> = asks
            .iter()
            .zip(&grant.units)
            .map(|(&(at, _, _), &units)| Held {
                code: at.every.code(),
                index: at.index,
                units,
                none_left_until: if units == 0 { now + NONE_LEFT_SECS } else { 0 },
            })
            .collect();
        self.store.hold(quota, &held).await.map(|_| ())
    }

    /// Asks ahead of use, in the background, when the decision `seen` says the region will
    /// run short soon: one ask a quota at a time on this node, one a second in the region.
    fn ahead(self: &Arc<Self>, quota: &Arc<str>, limits: Limits, seen: &Seen, cost: u64) {
        let asks = sizing::asks(&limits, seen, cost, false);
        if asks.is_empty() {
            return;
        }
        {
            let mut asking = self.asking.lock().unwrap_or_else(|p| p.into_inner());
            if asking.insert(Arc::clone(quota), ()).is_some() {
                return;
            }
        }
        let (me, quota, now) = (Arc::clone(self), Arc::clone(quota), seen.now);
        tokio::spawn(async move {
            let claim = format!("lease:{}:{quota}", me.region);
            if let Ok(true) = me.store.claim_once(&claim, &me.node, now + 1).await {
                if let Err(e) = me.ask(&quota, limits, &asks).await {
                    tracing::warn!(error = %e, "could not ask the global store ahead of use");
                }
            }
            me.asking
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&quota);
        });
    }
}

fn seen_of(verdict: &Verdict, held: [u64; crate::keys::limits::MAX_WINDOWS]) -> Seen {
    Seen {
        now: verdict.now,
        counts: verdict.counts,
        held,
    }
}

/// Decisions go to the region's Redis, every other call too: bans, usage and the top
/// consumers' index are the region's (issue 48 lists what crosses regions).
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
        me.touch(key_id);
        let (verdict, held) = me.store.decide(key_id, limits, cost, ban).await?;
        if verdict.outcome != Outcome::Unleased {
            if verdict.outcome == Outcome::Admitted {
                me.ahead(key_id, limits, &seen_of(&verdict, held), cost);
            }
            return Ok(verdict);
        }
        let asks = sizing::asks(&limits, &seen_of(&verdict, held), cost, true);
        if let Err(e) = me.ask(key_id, limits, &asks).await {
            METRICS.region_grants.with_label_values(&["failed"]).inc();
            tracing::debug!(error = %e, "a region short of units could not reach the global store");
            return Ok(verdict);
        }
        let (verdict, held) = me.store.decide(key_id, limits, cost, ban).await?;
        if verdict.outcome == Outcome::Admitted {
            me.ahead(key_id, limits, &seen_of(&verdict, held), cost);
        }
        Ok(verdict)
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

    async fn lift_ban(&self, key_id: &str) -> Result<bool, StoreError> {
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
        self.0.store.usage(quota_id).await
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
