//! The gateway's Prometheus metrics. They live in the prometheus crate's default registry, the
//! one pingora registers its own metrics in and its Prometheus service serves; the admin
//! listener's `/metrics` renders that registry. Labels are bounded by construction: the route
//! is the operation name, the plan a plan file's name, the status an HTTP status; no label ever
//! carries a key, a key hash or a raw path.

use std::sync::LazyLock;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

pub struct Metrics {
    pub requests: IntCounterVec,
    pub request_duration: HistogramVec,
    pub upstream_duration: HistogramVec,
    pub rate_limited: IntCounterVec,
    pub bans: IntCounterVec,
    pub auth_failures: IntCounterVec,
    pub store_duration: Histogram,
    pub store_batch_size: Histogram,
    pub store_errors: IntCounterVec,
    pub store_fallback: IntGauge,
    pub config_reloads: IntCounterVec,
    pub responses_aborted: IntCounter,
    pub slow_request_heads: IntCounter,
    pub catalog_reload_failing: IntGaugeVec,
    pub catalog_keys_skipped: IntGauge,
    pub keys: IntGaugeVec,
    pub catalog_last_reload: IntGaugeVec,
}

/// Latency buckets from 100 µs (a local decision) to 10 s (the upstream read timeout).
const LATENCY: &[f64] = &[
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

pub static METRICS: LazyLock<Metrics> =
    LazyLock::new(|| Metrics::new(prometheus::default_registry()));

/// Registers `metric`; a clash (a programming error, never input) is logged and the metric
/// still counts, unexported, rather than taking the gateway down.
fn register<M: prometheus::core::Collector + Clone + 'static>(registry: &Registry, metric: M) -> M {
    if let Err(e) = registry.register(Box::new(metric.clone())) {
        tracing::error!(error = %e, "metric not registered");
    }
    metric
}

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let vec = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric definition");
    register(registry, vec)
}

fn gauge(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let vec = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric definition");
    register(registry, vec)
}

fn histogram(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(LATENCY.to_vec());
    register(
        registry,
        HistogramVec::new(opts, labels).expect("valid metric definition"),
    )
}

impl Metrics {
    /// Creates the zero-valued series of every plan, so dashboards and alerts see 0 rather
    /// than nothing before the first event (a missing series makes `rate()` and `increase()`
    /// silently empty).
    pub fn init_plans<'a>(&self, plans: impl IntoIterator<Item = &'a str>) {
        for plan in plans {
            self.bans.with_label_values(&[plan]);
            for window in ["minute", "day", "ban"] {
                self.rate_limited.with_label_values(&[plan, window]);
            }
        }
    }

    fn new(r: &Registry) -> Metrics {
        let m = Self::register_all(r);
        for kind in ["timeout", "unavailable", "protocol", "config"] {
            m.store_errors.with_label_values(&[kind]);
        }
        for result in ["applied", "refused"] {
            m.config_reloads.with_label_values(&[result]);
        }
        for status in ["active", "expired", "revoked", "skipped"] {
            m.keys.with_label_values(&[status]);
        }
        for part in ["keys", "plans"] {
            m.catalog_reload_failing.with_label_values(&[part]);
            m.catalog_last_reload.with_label_values(&[part]);
        }
        for reason in ["missing", "malformed", "unknown", "expired"] {
            m.auth_failures.with_label_values(&[reason]);
        }
        m
    }

    fn register_all(r: &Registry) -> Metrics {
        let (requests, request_duration, upstream_duration, rate_limited, bans, auth_failures) =
            Self::request_metrics(r);
        let (store_duration, store_batch_size, store_errors, store_fallback) =
            Self::store_metrics(r);
        let (
            config_reloads,
            responses_aborted,
            slow_request_heads,
            catalog_reload_failing,
            catalog_keys_skipped,
            keys,
            catalog_last_reload,
        ) = Self::ops_metrics(r);
        Metrics {
            requests,
            request_duration,
            upstream_duration,
            rate_limited,
            bans,
            auth_failures,
            store_duration,
            store_batch_size,
            store_errors,
            store_fallback,
            config_reloads,
            responses_aborted,
            slow_request_heads,
            catalog_reload_failing,
            catalog_keys_skipped,
            keys,
            catalog_last_reload,
        }
    }

    /// The request path: requests, latency, refusals, bans, authentication failures.
    fn request_metrics(
        r: &Registry,
    ) -> (
        IntCounterVec,
        HistogramVec,
        HistogramVec,
        IntCounterVec,
        IntCounterVec,
        IntCounterVec,
    ) {
        (
            counter(
                r,
                "pet_gateway_requests_total",
                "Requests answered, by environment, operation, plan and HTTP status.",
                &["env", "route", "plan", "status"],
            ),
            histogram(
                r,
                "pet_gateway_request_duration_seconds",
                "Time from request head to the end of the response, by operation.",
                &["route"],
            ),
            histogram(
                r,
                "pet_gateway_upstream_duration_seconds",
                "Time from choosing a backend to its response head, by operation.",
                &["route"],
            ),
            counter(
                r,
                "pet_gateway_rate_limited_total",
                "Requests refused with 429, by plan and the window that refused them (minute, day, ban).",
                &["plan", "window"],
            ),
            counter(
                r,
                "pet_gateway_bans_total",
                "Bans started, by plan.",
                &["plan"],
            ),
            counter(
                r,
                "pet_gateway_auth_failures_total",
                "Requests refused with 401, by reason (missing, malformed, unknown, expired).",
                &["reason"],
            ),
        )
    }

    /// The quota store: latency, batch size, errors, fallback.
    fn store_metrics(r: &Registry) -> (Histogram, Histogram, IntCounterVec, IntGauge) {
        (
            register(
                r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "pet_gateway_store_duration_seconds",
                        "Time of one quota-store decision.",
                    )
                    .buckets(LATENCY.to_vec()),
                )
                .expect("valid metric definition"),
            ),
            register(
                r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "pet_gateway_store_batch_size",
                        "Decisions carried by one Redis script run (group commit; 1 at low load).",
                    )
                    .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]),
                )
                .expect("valid metric definition"),
            ),
            counter(
                r,
                "pet_gateway_store_errors_total",
                "Quota-store calls that failed, by kind (timeout, unavailable, protocol).",
                &["kind"],
            ),
            register(
                r,
                IntGauge::new(
                    "pet_gateway_store_fallback",
                    "1 while the quota store fails and on_store_error decides instead, else 0.",
                )
                .expect("valid metric definition"),
            ),
        )
    }

    /// Reloads, aborted responses, slow heads, the catalog and its keys.
    fn ops_metrics(
        r: &Registry,
    ) -> (
        IntCounterVec,
        IntCounter,
        IntCounter,
        IntGaugeVec,
        IntGauge,
        IntGaugeVec,
        IntGaugeVec,
    ) {
        (
            counter(
                r,
                "pet_gateway_config_reloads_total",
                "Reloads of keys, plans or the TLS certificate, by result (applied, refused).",
                &["result"],
            ),
            register(
                r,
                IntCounter::new(
                    "pet_gateway_responses_aborted_total",
                    "Responses cut off after their head had gone out (the backend failed mid-body): \
                     the client saw an incomplete response, never an error spliced into it.",
                )
                .expect("valid metric definition"),
            ),
            register(
                r,
                IntCounter::new(
                    "pet_gateway_slow_request_heads_total",
                    "Connections closed because a request head did not arrive within \
                     request_header_timeout_ms (a slow or trickling client).",
                )
                .expect("valid metric definition"),
            ),
            gauge(
                r,
                "pet_gateway_catalog_reload_failing",
                "1 while the newest version of the keys file or the plans directory (part) is \
                 refused and the previous one stays in force, else 0.",
                &["part"],
            ),
            register(
                r,
                IntGauge::new(
                    "pet_gateway_catalog_keys_skipped",
                    "Active keys in the keys file left out because their plan is not in force \
                     (they get 401; check and a restart refuse such a file).",
                )
                .expect("valid metric definition"),
            ),
            gauge(
                r,
                "pet_gateway_keys",
                "Records of the keys file (or the registry's replica) in force, by status (active, expired, revoked; skipped: active but naming a plan not in force).",
                &["status"],
            ),
            gauge(
                r,
                "pet_gateway_catalog_last_reload_timestamp_seconds",
                "When the keys or the plans (part) in force were loaded, Unix seconds.",
                &["part"],
            ),
        )
    }
}

/// The default registry in the Prometheus text format.
pub fn render() -> Vec<u8> {
    use prometheus::Encoder;
    let mut out = Vec::new();
    if let Err(e) = prometheus::TextEncoder::new().encode(&prometheus::gather(), &mut out) {
        tracing::error!(error = %e, "cannot encode metrics");
    }
    out
}
