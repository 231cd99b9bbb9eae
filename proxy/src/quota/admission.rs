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
use crate::quota::store::QuotaStore;

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
}

impl From<rules::Outcome> for Outcome {
    fn from(o: rules::Outcome) -> Outcome {
        match o {
            rules::Outcome::Admitted => Outcome::Admitted,
            rules::Outcome::Limited => Outcome::Limited,
            rules::Outcome::Banned => Outcome::Banned,
            rules::Outcome::ConcurrencyLimited => Outcome::ConcurrencyLimited,
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
            let result = self
                .store
                .acquire(quota, limits, cost, &self.ban_policy)
                .await;
            let elapsed = started.elapsed();
            store_time = Some(elapsed);
            METRICS.store_duration.observe(elapsed.as_secs_f64());
            match result {
                Ok(v) => {
                    r.breaker.success();
                    METRICS.store_fallback.set(0);
                    if v.outcome == rules::Outcome::Banned {
                        r.ban_cache.remember(quota, v.ban_until);
                    } else if !r.ban_cache.is_empty() {
                        // The store says no ban (lifted, perhaps on another node): a stale
                        // entry must not come back during an outage.
                        r.ban_cache.forget(quota);
                    }
                    return Decision {
                        ban_started: v.ban_started,
                        store_time,
                        lease: v.lease,
                        ..Decision::of(v.outcome.into(), RateView::new(&v, limits, cost))
                    };
                }
                Err(error) => {
                    METRICS
                        .store_errors
                        .with_label_values(&[error.kind()])
                        .inc();
                    if r.breaker.failure() {
                        tracing::error!(error = %error, mode = ?self.on_store_error,
                            "quota store failing: deciding without it until it answers again");
                    } else {
                        tracing::warn!(error = %error, key_id = %key.id, "quota store call failed");
                    }
                }
            }
        }
        METRICS.store_fallback.set(1);
        let fallback = match self.on_store_error {
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
        };
        Decision {
            store_time,
            degraded: true,
            ..fallback
        }
    }
}
