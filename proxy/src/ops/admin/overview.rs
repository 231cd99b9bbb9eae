//! Read-only views for the console: `GET /overview`, the gateway's own counters and states in
//! one answer (a page polls it every few seconds and works out rates from two answers), and
//! `GET /plans`, the plans in force. (`GET /overview/history`, the chart's: `history.rs`.)

use http::Response;
use prometheus::core::Collector;
use prometheus::proto::MetricType;

use super::reply::json_response;
use super::Admin;
use crate::base::clock::unix_now;
use crate::base::metrics::METRICS;

/// A series' value, whether its family counts or gauges.
fn value(kind: MetricType, m: &prometheus::proto::Metric) -> f64 {
    if kind == MetricType::COUNTER {
        m.get_counter().value()
    } else {
        m.get_gauge().value()
    }
}

/// The sum of every series of a counter or gauge family.
pub(super) fn total<C: Collector>(family: &C) -> f64 {
    family
        .collect()
        .iter()
        .flat_map(|f| f.get_metric().iter().map(|m| value(f.get_field_type(), m)))
        .sum()
}

/// Each series of a family by one label's value.
fn by_label<C: Collector>(family: &C, label: &str) -> serde_json::Map<String, serde_json::Value> {
    let mut out = serde_json::Map::new();
    for f in family.collect() {
        for m in f.get_metric() {
            let Some(name) = m.get_label().iter().find(|l| l.name() == label) else {
                continue;
            };
            let v = value(f.get_field_type(), m);
            let entry = out.entry(name.value().to_owned()).or_insert(0.into());
            *entry = (entry.as_f64().unwrap_or(0.0) + v).into();
        }
    }
    out
}

impl Admin {
    pub(super) async fn overview(&self) -> Response<Vec<u8>> {
        // The console opens here: have the key records ready for its keys page.
        self.warm_records();
        let bans = self.store.bans().await;
        let store = if METRICS.store_fallback.get() > 0 {
            "fallback"
        } else {
            "ok"
        };
        let registry = self.registry.as_ref().map(|r| {
            let (ok, says) = match r.readiness() {
                Ok(m) => (true, m),
                Err(m) => (false, m),
            };
            serde_json::json!({
                "ok": ok,
                "says": says,
                "in_step": METRICS.registry_in_step.get() == 1,
                "snapshot_unsaved": METRICS.registry_snapshot_unsaved.get() == 1,
            })
        });
        let body = serde_json::json!({
            "now": unix_now(),
            "requests_total": total(&METRICS.requests),
            "rate_limited_total": total(&METRICS.rate_limited),
            "bans_active": bans.as_ref().map(Vec::len).ok(),
            "store": {
                "state": store,
                "breaker": if self.breaker.is_open() { "open" } else { "closed" },
                "errors_total": by_label(&METRICS.store_errors, "kind"),
                "reachable": bans.is_ok(),
            },
            "registry": registry,
            "keys": by_label(&METRICS.keys, "status"),
            "overload": self.overload(),
            "events": {
                "pending": by_label(&METRICS.events_pending, "sink"),
                "delivered_total": by_label(&METRICS.events_delivered, "sink"),
                "failures_total": by_label(&METRICS.events_delivery_failures, "sink"),
                "dropped_total": total(&METRICS.events_dropped),
                "dead_lettered_total": total(&METRICS.events_dead_lettered),
            },
        });
        json_response(200, body.to_string().into_bytes())
    }

    /// The backend's protection now: requests at the backends and their limits (`null`: none),
    /// waiting, the places this node holds for keys' concurrencies, and refusals so far by
    /// reason.
    fn overload(&self) -> serde_json::Value {
        let limits: Vec<Option<usize>> = self
            .places
            .limits()
            .into_iter()
            .map(|l| (l != usize::MAX).then_some(l))
            .collect();
        serde_json::json!({
            "in_flight": total(&METRICS.upstream_in_flight),
            "queued": self.places.queued(),
            "limits": limits,
            "slots_held": METRICS.concurrency_slots_held.get(),
            "refusals_total": by_label(&METRICS.overload_refusals, "reason"),
        })
    }

    pub(super) fn plans(&self) -> Response<Vec<u8>> {
        let snapshot = self.catalog.snapshot();
        let plans: Vec<serde_json::Value> = snapshot
            .plans
            .names()
            .into_iter()
            .filter_map(|name| snapshot.plans.get(name))
            .map(|p| {
                let windows: Vec<serde_json::Value> = p
                    .limits
                    .windows()
                    .iter()
                    .map(|w| {
                        serde_json::json!({
                            "name": w.every.name(),
                            "every": w.every.spec(),
                            "limit": w.limit,
                            "shadow": w.shadow,
                        })
                    })
                    .collect();
                let costs: serde_json::Map<String, serde_json::Value> = p
                    .costs
                    .listed()
                    .map(|(op, c)| (op.to_owned(), c.into()))
                    .collect();
                serde_json::json!({
                    "name": &*p.name,
                    "windows": windows,
                    "costs": costs,
                    "notify_at": p.notify_at.percents().collect::<Vec<_>>(),
                    "concurrency": p.limits.concurrency(),
                    "priority": p.priority,
                })
            })
            .collect();
        json_response(
            200,
            serde_json::Value::Array(plans).to_string().into_bytes(),
        )
    }
}
