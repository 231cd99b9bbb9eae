//! `GET /overview/history`: the last 15 minutes of the gateway's traffic and its protection, a
//! sample every 5 seconds, for the console's overview chart: requests answered by the backend,
//! refused (429: a window, a ban, the concurrency) and shed (503 `overloaded`) per second, the
//! requests at the backends and their limit. The gateway keeps them itself (a few kilobytes),
//! so the chart needs no Prometheus.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use http::Response;
use prometheus::core::Collector;

use super::overview::total;
use super::reply::json_response;
use super::Admin;
use crate::base::clock::unix_now;
use crate::base::metrics::METRICS;

/// How often a sample is taken.
pub const EVERY: Duration = Duration::from_secs(5);
/// Samples kept: 15 minutes.
pub const KEPT: usize = 180;

/// One sample: rates over the 5 seconds before `t`, and the gauges at `t`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Sample {
    pub t: u64,
    pub admitted: f64,
    pub refused: f64,
    pub shed: f64,
    pub in_flight: f64,
    /// The backends' limits together; `None` without one (`upstream_max_in_flight = "off"`).
    pub limit: Option<f64>,
}

/// The counters a sample's rates are worked out from.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    at: u64,
    admitted: f64,
    refused: f64,
    shed: f64,
}

#[derive(Default)]
pub struct History {
    state: Mutex<(Option<Totals>, VecDeque<Sample>)>,
}

/// The answers backends gave: every series of the upstream latency histogram's count.
fn answered() -> f64 {
    METRICS
        .upstream_duration
        .collect()
        .iter()
        .flat_map(|f| f.get_metric().iter())
        .map(|m| m.get_histogram().get_sample_count() as f64)
        .sum()
}

/// The overload refusals of `reasons`.
fn refusals(reasons: &[&str]) -> f64 {
    METRICS
        .overload_refusals
        .collect()
        .iter()
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| {
            m.get_label()
                .iter()
                .any(|l| l.name() == "reason" && reasons.contains(&l.value()))
        })
        .map(|m| m.get_counter().value())
        .sum()
}

impl History {
    /// Takes a sample at `now` (Unix seconds) from the gateway's own metrics.
    pub fn sample(&self, now: u64) {
        let totals = Totals {
            at: now,
            admitted: answered(),
            refused: total(&METRICS.rate_limited) + refusals(&["concurrency"]),
            shed: refusals(&["queue_timeout", "queue_full"]),
        };
        let limits = total(&METRICS.upstream_limit);
        let in_flight = total(&METRICS.upstream_in_flight);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (last, samples) = &mut *state;
        if let Some(before) = last.filter(|b| b.at < now) {
            let secs = (now - before.at) as f64;
            let rate = |a: f64, b: f64| ((a - b) / secs).max(0.0);
            if samples.len() == KEPT {
                samples.pop_front();
            }
            samples.push_back(Sample {
                t: now,
                admitted: rate(totals.admitted, before.admitted),
                refused: rate(totals.refused, before.refused),
                shed: rate(totals.shed, before.shed),
                in_flight,
                // A backend without a limit shows none (its gauge is not set).
                limit: (limits > 0.0).then_some(limits),
            });
        }
        *last = Some(totals);
    }

    pub fn samples(&self) -> Vec<Sample> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.1.iter().copied().collect()
    }

    /// Samples every [`EVERY`] until `shutdown` says stop.
    pub async fn run(&self, mut shutdown: pingora::server::ShutdownWatch) {
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.sample(unix_now()),
                _ = shutdown.changed() => return,
            }
        }
    }
}

impl Admin {
    pub(super) fn history(&self) -> Response<Vec<u8>> {
        let body = serde_json::json!({
            "every": EVERY.as_secs(),
            "samples": self.history.samples(),
        });
        json_response(200, body.to_string().into_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_rates_of_five_seconds_and_fifteen_minutes_are_kept() {
        let h = History::default();
        h.sample(1_000);
        assert!(h.samples().is_empty(), "a rate needs two readings");
        METRICS
            .overload_refusals
            .with_label_values(&["queue_timeout", "low"])
            .inc_by(10);
        h.sample(1_005);
        let s = h.samples();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].t, 1_005);
        assert!(s[0].shed >= 2.0, "10 shed in 5 s: {s:?}");
        for t in 0..(KEPT as u64 + 20) {
            h.sample(1_010 + 5 * t);
        }
        assert_eq!(h.samples().len(), KEPT);
        assert_eq!(h.samples()[KEPT - 1].t, 1_010 + 5 * (KEPT as u64 + 19));
    }
}
