//! The backend's Prometheus metrics, served at `GET /metrics` on its listener (the gateway never
//! forwards that path). Labels are bounded: the route is the operation name, the status an HTTP
//! status.

use std::sync::LazyLock;

use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry};

pub struct Metrics {
    pub requests: IntCounterVec,
    pub duration: HistogramVec,
    pub sqlite_errors: IntCounter,
}

const LATENCY: &[f64] = &[
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0,
];

pub static METRICS: LazyLock<Metrics> =
    LazyLock::new(|| Metrics::new(prometheus::default_registry()));

fn register<M: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: M) -> M {
    if let Err(e) = r.register(Box::new(m.clone())) {
        tracing::error!(error = %e, "metric not registered");
    }
    m
}

impl Metrics {
    fn new(r: &Registry) -> Metrics {
        Metrics {
            requests: register(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "pet_backend_requests_total",
                        "Requests answered, by operation and HTTP status.",
                    ),
                    &["route", "status"],
                )
                .expect("valid metric definition"),
            ),
            duration: register(
                r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "pet_backend_request_duration_seconds",
                        "Time to answer a request, by operation.",
                    )
                    .buckets(LATENCY.to_vec()),
                    &["route"],
                )
                .expect("valid metric definition"),
            ),
            sqlite_errors: register(
                r,
                IntCounter::new(
                    "pet_backend_sqlite_errors_total",
                    "Store operations that failed in SQLite.",
                )
                .expect("valid metric definition"),
            ),
        }
    }
}

pub fn render() -> Vec<u8> {
    use prometheus::Encoder;
    let mut out = Vec::new();
    if let Err(e) = prometheus::TextEncoder::new().encode(&prometheus::gather(), &mut out) {
        tracing::error!(error = %e, "cannot encode metrics");
    }
    out
}
