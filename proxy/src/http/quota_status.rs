//! `GET /v1/rate_limit`: a client asks where its quota stands without spending any of it, the
//! way GitHub's `GET /rate_limit` lets clients schedule their work. The gateway answers it
//! itself: never forwarded, never counted in the minute or day windows, one read of the store.
//! So that it cannot become a free way to load the store, it has a small limit of its own per
//! key (its quota id: a rotated key and its successor share it), kept on each node.

use std::borrow::Cow;
use std::num::NonZeroU32;
use std::sync::Arc;

use bytes::Bytes;
use governor::clock::{Clock, DefaultClock};
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};
use pingora::proxy::Session;
use serde::Serialize;

use crate::base::metrics::METRICS;
use crate::http::responses::{json_head, refuse, RateHeaders, Refusal};
use crate::keys::index::KeyInfo;
use crate::keys::limits::{Every, Limits, MAX_WINDOWS};
use crate::quota::resilience::Resilience;
use crate::quota::rules::SimpleLimit;
use crate::quota::rules::{self, RateView, Verdict};
use crate::quota::store::{QuotaStore, Usage};

/// Requests a key may make to this endpoint: one a second on average, ten at once.
const PER_SECOND: u32 = 1;
const BURST: u32 = 10;

type KeyedLimiter = RateLimiter<Arc<str>, DefaultKeyedStateStore<Arc<str>>, DefaultClock>;

pub struct QuotaStatus {
    store: Arc<dyn QuotaStore>,
    resilience: Resilience,
    limiter: KeyedLimiter,
}

#[derive(Serialize)]
struct Window {
    limit: u64,
    remaining: u64,
    reset: u64,
}

/// One enforced window, in `windows`.
#[derive(Serialize)]
struct Named {
    name: Cow<'static, str>,
    /// Seconds (for `month`, the current month's length).
    every: u64,
    limit: u64,
    remaining: u64,
    reset: u64,
}

#[derive(Serialize)]
struct Ban {
    until: u64,
}

/// The key's concurrency: its limit and its requests (or its customer's) in flight now.
#[derive(Serialize)]
struct Concurrency {
    limit: u32,
    in_flight: u64,
}

#[derive(Serialize)]
struct Body<'a> {
    plan: &'a str,
    /// The minute and day windows where the key's limits have them (the first form of the
    /// body; `windows` has them too).
    #[serde(skip_serializing_if = "Option::is_none")]
    minute: Option<Window>,
    #[serde(skip_serializing_if = "Option::is_none")]
    day: Option<Window>,
    /// Every enforced window, shortest first (shadow windows are the operator's experiment
    /// and never shown to clients).
    windows: Vec<Named>,
    ban: Option<Ban>,
    /// `null` when the key has no concurrency.
    concurrency: Option<Concurrency>,
    /// In a region only: the global store's grants of the current windows, as last read.
    #[serde(skip_serializing_if = "Option::is_none")]
    global: Option<Global>,
}

/// The global store's figures (`quota::regions::granted`): the other fields are the region's.
#[derive(Serialize)]
struct Global {
    /// When they were read, Unix seconds: earlier than now when the global store did not answer.
    as_of: u64,
    windows: Vec<GlobalWindow>,
}

#[derive(Serialize)]
struct GlobalWindow {
    name: Cow<'static, str>,
    limit: u64,
    /// Granted to every region together (at least what all of them admitted, at most `limit`).
    granted: u64,
    /// Granted to this region.
    granted_here: u64,
}

/// The global figures of `limits`' shown windows whose instance read is still the current one.
fn global_of(limits: Limits, usage: &Usage) -> Option<Global> {
    let read = usage.global.as_ref()?;
    let windows = limits
        .windows()
        .iter()
        .filter(|w| !w.shadow)
        .filter_map(|w| {
            let &(_, _, granted, granted_here) =
                read.windows.iter().find(|(every, index, _, _)| {
                    *every == w.every && *index == w.every.index(usage.now)
                })?;
            Some(GlobalWindow {
                name: w.every.name(),
                limit: w.limit(),
                granted,
                granted_here,
            })
        })
        .collect();
    Some(Global {
        as_of: read.as_of,
        windows,
    })
}

/// What the endpoint answers for a key with `limits` whose store state is `usage`: the body, and
/// the view behind the usual rate-limit headers.
fn status(plan: &str, limits: Limits, usage: &Usage) -> (Bytes, RateView) {
    let banned = usage.ban_until > usage.now;
    let now = usage.now;
    let mut counts = [0u64; MAX_WINDOWS];
    for (count, w) in counts.iter_mut().zip(limits.windows()) {
        *count = usage.count(w.every);
    }
    let verdict = Verdict {
        outcome: if banned {
            rules::Outcome::Banned
        } else {
            rules::Outcome::Admitted
        },
        now,
        counts,
        ban_until: usage.ban_until,
        ban_started: false,
        lease: rules::Lease::default(),
    };
    let view = RateView::new(&verdict, limits, 0);
    let windows: Vec<Named> = limits
        .windows()
        .iter()
        .zip(view.remaining_by_window)
        .filter(|(w, _)| !w.shadow)
        .map(|(w, remaining)| Named {
            name: w.every.name(),
            every: w.every.secs_at(now),
            limit: w.limit(),
            remaining: remaining.into(),
            reset: w.every.reset(now),
        })
        .collect();
    let first_form = |every: Every| {
        let n = windows.iter().find(|n| n.name == every.name())?;
        Some(Window {
            limit: n.limit,
            remaining: n.remaining,
            reset: n.reset,
        })
    };
    let body = Body {
        plan,
        minute: first_form(Every::MINUTE),
        day: first_form(Every::DAY),
        windows,
        ban: banned.then_some(Ban {
            until: usage.ban_until,
        }),
        concurrency: limits.concurrency().map(|limit| Concurrency {
            limit,
            in_flight: usage.in_flight,
        }),
        global: global_of(limits, usage),
    };
    let json = serde_json::to_vec(&body).unwrap_or_else(|_| b"{}".to_vec());
    (Bytes::from(json), view)
}

impl QuotaStatus {
    pub fn new(store: Arc<dyn QuotaStore>, resilience: Resilience) -> QuotaStatus {
        let quota = Quota::per_second(NonZeroU32::new(PER_SECOND).unwrap_or(NonZeroU32::MIN))
            .allow_burst(NonZeroU32::new(BURST).unwrap_or(NonZeroU32::MIN));
        QuotaStatus {
            store,
            resilience,
            limiter: RateLimiter::keyed(quota),
        }
    }

    /// Answers the request of `key` (authenticated, its plan in force, at `limits`) and returns
    /// the view its headers were written from, when there was one.
    pub async fn answer(
        &self,
        session: &mut Session,
        request_id: &str,
        key: &KeyInfo,
        limits: Limits,
    ) -> Option<RateView> {
        let quota_id = key.quota_id();
        if let Err(not_until) = self.limiter.check_key(quota_id) {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            let retry_after = rules::retry_after_secs(wait);
            let now = crate::base::clock::unix_now();
            let refusal = Refusal::quota_status_limited(
                SimpleLimit {
                    limit: u64::from(BURST),
                    remaining: 0,
                    reset: now + retry_after,
                },
                retry_after,
            );
            refuse(session, request_id, refusal).await;
            return None;
        }
        // A ban this node knows of is answered from its cache, like a request would be; a store
        // the breaker has given up on is not asked (the answer would be a deadline).
        let now = crate::base::clock::unix_now();
        let store_up = self.resilience.breaker.allows();
        let usage = if let Some(until) = self
            .resilience
            .ban_cache
            .banned_until(quota_id, now, store_up)
        {
            Some(Usage {
                now,
                windows: Vec::new(),
                refused_today: 0,
                last_admitted: 0,
                ban_until: until,
                in_flight: 0,
                global: None,
            })
        } else if store_up {
            let started = std::time::Instant::now();
            let result = self.store.usage(quota_id).await;
            METRICS
                .store_duration
                .observe(started.elapsed().as_secs_f64());
            match result {
                Ok(usage) => Some(usage),
                Err(e) => {
                    // Counted like any store failure, so an outage shows however it is met.
                    METRICS.store_errors.with_label_values(&[e.kind()]).inc();
                    tracing::warn!(error = %e, "quota store call for GET /v1/rate_limit failed");
                    None
                }
            }
        } else {
            None
        };
        let Some(usage) = usage else {
            refuse(session, request_id, Refusal::store_unavailable()).await;
            return None;
        };
        let (body, view) = status(&key.plan, limits, &usage);
        let head = json_head(200, body.len(), request_id, RateHeaders::Plan(view));
        if let Err(e) = session.write_response_header(Box::new(head), false).await {
            tracing::debug!(error = %e, "client went away before the response head");
        } else if let Err(e) = session.write_response_body(Some(body), true).await {
            tracing::debug!(error = %e, "client went away before the response body");
        }
        Some(view)
    }

    /// Forgets keys that have not asked for a while (called by the reloader).
    pub fn sweep(&self) {
        self.limiter.retain_recent();
        self.limiter.shrink_to_fit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::store::GlobalUsage;

    fn usage(now: u64, minute: u64, day: u64, ban_until: u64) -> Usage {
        Usage {
            now,
            windows: vec![(Every::MINUTE, minute), (Every::DAY, day)],
            refused_today: 0,
            last_admitted: 0,
            ban_until,
            in_flight: 0,
            global: None,
        }
    }

    fn free() -> Limits {
        Limits::minute_day(60, 1_000).unwrap()
    }

    #[test]
    fn the_body_has_both_windows_and_no_ban() {
        let now = 20_000 * 86_400 + 3_600 + 30;
        let (body, view) = status("free", free(), &usage(now, 10, 400, 0));
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "plan": "free",
                "minute": {"limit": 60, "remaining": 50, "reset": now - 30 + 60},
                "day": {"limit": 1000, "remaining": 600, "reset": 20_001 * 86_400},
                "windows": [
                    {"name": "minute", "every": 60, "limit": 60, "remaining": 50, "reset": now - 30 + 60},
                    {"name": "day", "every": 86_400, "limit": 1000, "remaining": 600, "reset": 20_001 * 86_400},
                ],
                "ban": null,
                "concurrency": null,
            })
        );
        assert_eq!((view.limit, view.remaining), (60, 50));
        let with = Usage {
            in_flight: 3,
            ..usage(now, 10, 400, 0)
        };
        let (body, _) = status("free", free().with_concurrency(8), &with);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v["concurrency"],
            serde_json::json!({"limit": 8, "in_flight": 3})
        );
    }

    #[test]
    fn a_regions_body_shows_the_global_figures_of_current_windows_only() {
        let now = 20_000 * 86_400 + 3_600 + 30;
        let read = GlobalUsage {
            as_of: now - 5,
            windows: vec![
                // The minute read is the one before: ended, not shown.
                (Every::MINUTE, Every::MINUTE.index(now) - 1, 60, 20),
                (Every::DAY, Every::DAY.index(now), 700, 300),
            ],
        };
        let used = Usage {
            global: Some(read),
            ..usage(now, 10, 400, 0)
        };
        let (body, _) = status("free", free(), &used);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v["global"],
            serde_json::json!({"as_of": now - 5, "windows": [
                {"name": "day", "limit": 1000, "granted": 700, "granted_here": 300},
            ]})
        );
        let (body, _) = status("free", free(), &usage(now, 10, 400, 0));
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert!(v.get("global").is_none(), "{v}");
    }

    #[test]
    fn any_windows_are_listed_shadow_ones_never_and_minute_and_day_only_when_there() {
        let now = 20_000 * 86_400 + 3_600 + 30;
        let w = |every: &str, limit: u64, shadow: bool| {
            let mut w =
                crate::keys::limits::WindowLimit::new(Every::parse(every).unwrap(), limit).unwrap();
            w.shadow = shadow;
            w
        };
        let limits =
            Limits::new(&[w("1s", 5, false), w("6h", 100, false), w("month", 9, true)]).unwrap();
        let used = Usage {
            now,
            windows: vec![
                (Every::Secs(1), 2),
                (Every::Secs(21_600), 40),
                (Every::Month, 12),
            ],
            refused_today: 0,
            last_admitted: 0,
            ban_until: 0,
            in_flight: 0,
            global: None,
        };
        let (body, view) = status("pro", limits, &used);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert!(v.get("minute").is_none() && v.get("day").is_none(), "{v}");
        let names: Vec<&str> = v["windows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["second", "6h"]);
        assert_eq!(v["windows"][1]["remaining"], 60);
        assert_eq!((view.limit, view.remaining), (5, 3), "the least room binds");
        assert!(!view.policy_header().contains("month"));
    }

    #[test]
    fn a_banned_key_is_told_when_its_ban_ends_and_has_nothing_left() {
        let now = 20_000 * 86_400;
        let (body, view) = status("free", free(), &usage(now, 60, 70, now + 600));
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["ban"], serde_json::json!({"until": now + 600}));
        assert_eq!(v["minute"]["remaining"], 0);
        assert_eq!(v["day"]["remaining"], 0);
        assert_eq!((view.remaining, view.reset), (0, now + 600));
    }
}
