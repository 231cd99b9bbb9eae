//! `pet.quota.threshold.v1`: a quota holder (a key, or a customer's shared quota) crossed one of
//! its plan's `notify_at` percentages of a window of a day or longer.
//!
//! Once across the fleet without any coordination of its own: the store decides every request
//! of a quota one at a time (its script, or the embedded store's lock) and answers each with the
//! window's count including that request, so exactly one admitted decision takes the count from
//! below a threshold to at or past it, and only the node that made that decision reports it.
//! Its id is derived from the holder, the window instance and the percentage, so a receiver
//! also keeps one if the count were ever zeroed (`keys reset-usage`) and crossed again.

use super::cloud::THRESHOLD;
use super::usage::Notice;
use crate::base::clock::rfc3339;
use crate::keys::index::KeyInfo;
use crate::keys::plans::NotifyAt;
use crate::quota::rules::RateView;

/// Thresholds are for the windows a business bills or warns by, not the per-second ones.
const SHORTEST: u64 = 86_400;

/// The thresholds an admitted request costing `cost` crossed, by the store's answer `view`.
pub fn crossed(key: &KeyInfo, view: &RateView, cost: u64, notify_at: NotifyAt) -> Vec<Notice> {
    let mut out = Vec::new();
    for (k, w) in view.limits.windows().iter().enumerate() {
        if w.shadow || w.every.nominal_secs() < SHORTEST {
            continue;
        }
        let limit = w.limit();
        let used = limit.saturating_sub(u64::from(view.remaining_by_window[k]));
        for percent in notify_at.crossed(limit, used.saturating_sub(cost), used) {
            out.push(notice(key, view.now, w.every, percent, used, limit));
        }
    }
    out
}

fn notice(
    key: &KeyInfo,
    now: u64,
    every: crate::keys::limits::Every,
    percent: u32,
    used: u64,
    limit: u64,
) -> Notice {
    let mut data = serde_json::json!({
        "key_id": &*key.id,
        "customer": key.customer(),
        "plan": &*key.plan,
        "window": every.spec(),
        "threshold": percent,
        "used": used,
        "limit": limit,
        "reset": rfc3339(every.reset(now)),
    });
    if key.customer().is_none() {
        data["customer"] = serde_json::Value::Null;
    }
    Notice {
        kind: THRESHOLD,
        id: format!(
            "{THRESHOLD}:{}:{}:{}:{percent}",
            key.quota_id(),
            every.spec(),
            every.index(now)
        ),
        time: now,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::limits::{Every, Limits, WindowLimit};
    use crate::keys::plans::parse_plan;
    use crate::quota::rules::{Outcome, Verdict};
    use std::sync::Arc;

    fn view(limits: Limits, counts: [u64; 2], now: u64) -> RateView {
        let mut c = [0; crate::keys::limits::MAX_WINDOWS];
        c[..2].copy_from_slice(&counts);
        RateView::new(
            &Verdict {
                outcome: Outcome::Admitted,
                now,
                counts: c,
                ban_until: 0,
                ban_started: false,
                lease: Default::default(),
            },
            limits,
            1,
        )
    }

    #[test]
    fn the_request_that_reaches_a_threshold_of_the_day_reports_it_with_a_derived_id() {
        let limits = Limits::new(&[
            WindowLimit::new(Every::MINUTE, 100).unwrap(),
            WindowLimit::new(Every::DAY, 10).unwrap(),
        ])
        .unwrap();
        let notify =
            parse_plan("requests_per_minute = 1\nrequests_per_day = 2\nnotify_at = [80, 100]\n")
                .unwrap()
                .notify_at;
        let key = KeyInfo {
            id: Arc::from("k1"),
            plan: Arc::from("pro"),
            overrides: Default::default(),
            quota: Some(Arc::from("customer:acme")),
        };
        let now = 1_795_000_000;
        assert!(crossed(&key, &view(limits, [8, 7], now), 1, notify).is_empty());
        let got = crossed(&key, &view(limits, [80, 8], now), 1, notify);
        assert_eq!(
            got.len(),
            1,
            "the minute's 80 % is not reported: too short a window"
        );
        let n = &got[0];
        assert_eq!(n.kind, THRESHOLD);
        assert_eq!(
            n.id,
            format!("{THRESHOLD}:customer:acme:1d:{}:80", now / 86_400)
        );
        assert_eq!(n.data["threshold"], 80);
        assert_eq!(n.data["used"], 8);
        assert_eq!(n.data["limit"], 10);
        assert_eq!(n.data["window"], "1d");
        assert_eq!(n.data["customer"], "acme");
        assert_eq!(n.data["reset"], "2026-11-19T00:00:00Z");
        let both = crossed(&key, &view(limits, [1, 10], now), 3, notify);
        assert_eq!(
            both.iter()
                .map(|n| n.data["threshold"].clone())
                .collect::<Vec<_>>(),
            [80, 100]
        );
    }
}
