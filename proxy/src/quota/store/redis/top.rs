//! The top consumers' index in Redis: one sorted set per environment and period,
//! `{<prefix>:top:day:<index>}` and `{<prefix>:top:month:<index>}` (`Every::index`), member
//! the quota holder, score the units it spent. Written by each node's flush once a second (a
//! `ZINCRBY` per holder, all in one pipeline), read with one `ZREVRANGE`; no request touches
//! it, so it costs Redis a few commands per holder and second, not one per decision.
//!
//! Each set is one key, its own hash tag: on a Redis Cluster one shard holds each period's
//! set, and a flush sends one pipeline per set there (a pipeline may not span slots).

use std::sync::Arc;

use crate::quota::store::TopWindow;

/// How long a period's set outlives its period: long enough to read yesterday's or last
/// month's ranking by hand, short enough that sets do not pile up.
const DAY_KEPT_SECS: u64 = 2 * 86_400;
const MONTH_KEPT_SECS: u64 = 35 * 86_400;

/// The sorted set of period `index` of `window`.
pub(super) fn top_key(prefix: &str, window: TopWindow, index: u64) -> String {
    // The prefix inside the tag: environments sharing a Redis Cluster put their sets on
    // different slots.
    format!("{{{prefix}:top:{}:{index}}}", window.name())
}

/// When the set of period `index` of `window` expires (Unix seconds).
fn expires_at(window: TopWindow, index: u64) -> u64 {
    let end = window.every().start_of(index + 1);
    end + match window {
        TopWindow::Day => DAY_KEPT_SECS,
        TopWindow::Month => MONTH_KEPT_SECS,
    }
}

/// One flush's writes to the sets of `day` and `month`: one pipeline, or one per set when
/// `per_set` (a cluster).
pub(super) fn add_pipelines(
    prefix: &str,
    day: u64,
    month: u64,
    entries: &[(Arc<str>, u64)],
    per_set: bool,
) -> Vec<redis::Pipeline> {
    let mut pipelines = Vec::new();
    let mut pipe = redis::pipe();
    for (window, index) in [(TopWindow::Day, day), (TopWindow::Month, month)] {
        let key = top_key(prefix, window, index);
        for (holder, units) in entries.iter().filter(|(_, u)| *u > 0) {
            pipe.cmd("ZINCRBY")
                .arg(&key)
                .arg(*units)
                .arg(&**holder)
                .ignore();
        }
        pipe.cmd("EXPIREAT")
            .arg(&key)
            .arg(expires_at(window, index))
            .ignore();
        if per_set {
            pipelines.push(std::mem::replace(&mut pipe, redis::pipe()));
        }
    }
    if !per_set {
        pipelines.push(pipe);
    }
    pipelines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_day_set_expires_two_days_after_its_day_and_a_month_35_after_its_month() {
        assert_eq!(
            top_key("pet:prod", TopWindow::Day, 20_000),
            "{pet:prod:top:day:20000}"
        );
        assert_eq!(expires_at(TopWindow::Day, 20_000), 20_003 * 86_400);
        // Month 671 is December 2025; it ends on 1 January 2026 (day 20,454).
        assert_eq!(expires_at(TopWindow::Month, 671), (20_454 + 35) * 86_400);
    }

    #[test]
    fn a_cluster_gets_a_pipeline_per_set() {
        let entries = [(Arc::from("k1"), 2), (Arc::from("k2"), 0)];
        let one = add_pipelines("p", 1, 2, &entries, false);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].cmd_iter().count(), 4, "k2 spent nothing");
        assert_eq!(add_pipelines("p", 1, 2, &entries, true).len(), 2);
    }
}
