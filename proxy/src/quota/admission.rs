//! The admission decision for one authenticated request, in the order that keeps a store outage
//! from becoming a gateway outage: a ban this node already knows of answers at once (no round
//! trip); otherwise the quota store decides (the windows and, in the same call, a place among
//! the quota's requests in flight), unless the breaker says it is failing, in which case
//! `on_store_error` does (count locally, admit, or refuse with 503) and the node holds the
//! quota's concurrency on its own.
//!
//! The answer is one [`Decision`]: what to do, the numbers for the headers, and what the access
//! log and metrics need to know about how it was reached. Nothing is written into the request's
//! context from here.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::base::clock::unix_now;
use crate::base::metrics::METRICS;
use crate::keys::index::KeyInfo;
use crate::keys::plans::Limits;
use crate::quota::resilience::Resilience;
use crate::quota::rules::{self, BanPolicy, Lease, RateView};
use crate::quota::store::{QuotaStore, StoreError};

/// What to do when the quota store cannot answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    /// Count on this node alone at the plan's per-minute rate; the day quota pauses.
    Local,
    /// Admit every authenticated request.
    Open,
    /// Refuse with 503.
    Closed,
}

/// What happens to the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Forward it.
    Admitted,
    /// 429 `rate_limited`: a window is full.
    Limited,
    /// 429 `api_key_banned`.
    Banned,
    /// 503: the store failed and `on_store_error = "closed"`.
    StoreUnavailable,
    /// 429 `concurrency_limited`: the quota's requests in flight are at its concurrency.
    ConcurrencyLimited,
    /// 429 `region_unleased`: the region holds too few units and got none in time.
    Unleased,
}

impl From<rules::Outcome> for Outcome {
    fn from(o: rules::Outcome) -> Outcome {
        match o {
            rules::Outcome::Admitted => Outcome::Admitted,
            rules::Outcome::Limited => Outcome::Limited,
            rules::Outcome::Banned => Outcome::Banned,
            rules::Outcome::ConcurrencyLimited => Outcome::ConcurrencyLimited,
            rules::Outcome::Unleased => Outcome::Unleased,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub outcome: Outcome,
    /// The rate-limit headers' numbers; `None` only when the store was unavailable and nothing
    /// is known of the key's windows.
    pub view: Option<RateView>,
    /// This very request started a ban (counted once, in `pet_gateway_bans_total`).
    pub ban_started: bool,
    /// How long the store call took, when one was made.
    pub store_time: Option<Duration>,
    /// Decided without the shared store (breaker open or the call failed).
    pub degraded: bool,
    /// The place this admitted request took among its quota's requests in flight (none
    /// without a concurrency): to be given back when the request ends.
    pub lease: Lease,
    /// The lease is this node's own (taken while the store was away), not the store's.
    pub local_lease: bool,
}

impl Decision {
    fn of(outcome: Outcome, view: RateView) -> Decision {
        Decision {
            outcome,
            view: Some(view),
            ban_started: false,
            store_time: None,
            degraded: false,
            lease: Lease::default(),
            local_lease: false,
        }
    }
}

pub struct Admission {
    store: Arc<dyn QuotaStore>,
    resilience: Resilience,
    on_store_error: OnStoreError,
    ban_policy: BanPolicy,
}

impl Admission {
    pub fn new(
        store: Arc<dyn QuotaStore>,
        resilience: Resilience,
        on_store_error: OnStoreError,
        ban_policy: BanPolicy,
    ) -> Admission {
        Admission {
            store,
            resilience,
            on_store_error,
            ban_policy,
        }
    }

    /// Decides one request of `key` costing `cost` units under `limits`.
    pub async fn decide(&self, key: &KeyInfo, limits: Limits, cost: u64) -> Decision {
        let now = unix_now();
        // Counts and bans belong to the quota: a rotated key and its successor share one.
        let quota = key.quota_id();
        let r = &self.resilience;
        let store_up = r.breaker.allows();
        if let Some(until) = r.ban_cache.banned_until(quota, now, store_up) {
            return Decision::of(Outcome::Banned, RateView::banned(limits, now, until));
        }
        let mut store_time = None;
        if store_up {
            let started = Instant::now();
            if let Some(view) = r.crowded.refused(quota, limits, started) {
                return Decision::of(Outcome::ConcurrencyLimited, view);
            }
            let result = self
                .store
                .acquire(quota, limits, cost, &self.ban_policy)
                .await;
            let elapsed = started.elapsed();
            store_time = Some(elapsed);
            METRICS.store_duration.observe(elapsed.as_secs_f64());
            match result {
                Ok(v) => {
                    return Decision {
                        store_time,
                        ..self.stored(quota, limits, cost, v)
                    }
                }
                Err(error) => self.store_failed(key, &error),
            }
        }
        Decision {
            store_time,
            degraded: true,
            ..self.fallback(quota, limits, cost, now)
        }
    }

    /// The store's answer, with what this node keeps of it: a ban to apply during an outage,
    /// a refusal for want of places to answer at once for a moment.
    fn stored(&self, quota: &Arc<str>, limits: Limits, cost: u64, v: rules::Verdict) -> Decision {
        let r = &self.resilience;
        r.breaker.success();
        METRICS.store_fallback.set(0);
        if v.outcome == rules::Outcome::Banned {
            r.ban_cache.remember(quota, v.ban_until);
        } else if !r.ban_cache.is_empty() {
            // The store says no ban (lifted, perhaps on another node): a stale entry must
            // not come back during an outage.
            r.ban_cache.forget(quota);
        }
        let view = RateView::new(&v, limits, cost);
        if v.outcome == rules::Outcome::ConcurrencyLimited {
            r.crowded.remember(quota, view, Instant::now());
        }
        Decision {
            ban_started: v.ban_started,
            lease: v.lease,
            ..Decision::of(v.outcome.into(), view)
        }
    }

    fn store_failed(&self, key: &KeyInfo, error: &StoreError) {
        METRICS
            .store_errors
            .with_label_values(&[error.kind()])
            .inc();
        if self.resilience.breaker.failure() {
            tracing::error!(error = %error, mode = ?self.on_store_error,
                "quota store failing: deciding without it until it answers again");
        } else {
            tracing::warn!(error = %error, key_id = %key.id, "quota store call failed");
        }
    }

    /// The decision without the store, as `on_store_error` says.
    fn fallback(&self, quota: &Arc<str>, limits: Limits, cost: u64, now: u64) -> Decision {
        METRICS.store_fallback.set(1);
        // Counted one by one (the gauge above is sampled, and a short outage can fall between
        // two samples): the soak's checker caps a node's own decisions by it.
        METRICS.store_local_decisions.inc();
        let r = &self.resilience;
        match self.on_store_error {
            OnStoreError::Closed => Decision {
                outcome: Outcome::StoreUnavailable,
                view: None,
                ..Decision::of(Outcome::StoreUnavailable, RateView::unmetered(limits, now))
            },
            OnStoreError::Open => {
                let (outcome, lease) = r.local.slot(quota, limits, now);
                let mut view = RateView::unmetered(limits, now);
                if outcome == rules::Outcome::ConcurrencyLimited {
                    view.retry_after = Some(rules::CONCURRENCY_RETRY_AFTER);
                }
                Decision {
                    lease,
                    local_lease: true,
                    ..Decision::of(outcome.into(), view)
                }
            }
            OnStoreError::Local => {
                let (outcome, view, lease) = r.local.check(quota, limits, cost, now);
                Decision {
                    lease,
                    local_lease: true,
                    ..Decision::of(outcome.into(), view)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::concurrency::Slots;
    use crate::quota::crowded::CROWDED_FOR;
    use crate::quota::store::memory::MemoryStore;

    fn key() -> KeyInfo {
        KeyInfo {
            id: Arc::from("k"),
            plan: Arc::from("pro"),
            overrides: Default::default(),
            quota: None,
        }
    }

    /// A holder at its concurrency is refused on this node for a moment without the store:
    /// a place freed elsewhere (here: in the store directly, as another node would) is seen
    /// once the moment has passed, one freed here at once.
    #[tokio::test]
    async fn a_holder_at_its_concurrency_is_refused_here_a_moment_without_the_store() {
        let store = Arc::new(MemoryStore::new());
        let resilience = Resilience::default();
        let admission = Admission::new(
            Arc::clone(&store) as Arc<dyn QuotaStore>,
            resilience.clone(),
            OnStoreError::Local,
            BanPolicy::default(),
        );
        let slots = Arc::new(Slots::new(
            Arc::clone(&store) as Arc<dyn QuotaStore>,
            &resilience,
            15,
        ));
        let limits = Limits::minute_day(1_000, 1_000)
            .unwrap()
            .with_concurrency(1);
        let (key, now) = (key(), unix_now());
        let first = admission.decide(&key, limits, 1).await;
        assert_eq!(first.outcome, Outcome::Admitted);
        let refused = admission.decide(&key, limits, 1).await;
        assert_eq!(refused.outcome, Outcome::ConcurrencyLimited);
        assert!(refused.store_time.is_some(), "the store said so");
        // Freed as another node frees it: this node keeps refusing for the moment.
        store.release(key.quota_id(), first.lease);
        let again = admission.decide(&key, limits, 1).await;
        assert_eq!(again.outcome, Outcome::ConcurrencyLimited);
        assert_eq!(again.store_time, None, "answered here");
        assert_eq!(again.view, refused.view, "with the store's numbers");
        tokio::time::sleep(CROWDED_FOR).await;
        let second = admission.decide(&key, limits, 1).await;
        assert_eq!(second.outcome, Outcome::Admitted, "the store asked again");
        // Refused again, then freed here: the next request goes to the store at once.
        let slot = slots.hold(key.quota_id(), second.lease, false, now);
        assert_eq!(
            admission.decide(&key, limits, 1).await.outcome,
            Outcome::ConcurrencyLimited
        );
        drop(slot);
        let third = admission.decide(&key, limits, 1).await;
        assert_eq!(third.outcome, Outcome::Admitted);
        assert!(third.store_time.is_some());
    }
}
