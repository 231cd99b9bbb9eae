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
    pub shadow_refusals: IntCounterVec,
    pub log_lines_dropped: IntCounter,
    pub bans: IntCounterVec,
    pub auth_failures: IntCounterVec,
    pub store_duration: Histogram,
    pub store_batch_size: Histogram,
    pub store_errors: IntCounterVec,
    pub region_grants: IntCounterVec,
    pub store_fallback: IntGauge,
    pub store_local_decisions: IntCounter,
    pub config_reloads: IntCounterVec,
    pub responses_aborted: IntCounter,
    pub slow_request_heads: IntCounter,
    pub admin_auth_refusals: IntCounterVec,
    pub catalog_reload_failing: IntGaugeVec,
    pub catalog_keys_skipped: IntGauge,
    pub keys: IntGaugeVec,
    pub catalog_last_reload: IntGaugeVec,
    pub registry_repairs: IntCounter,
    pub registry_rejected_records: IntCounterVec,
    pub registry_in_step: IntGauge,
    pub registry_snapshot_unsaved: IntGauge,
    pub events_pending: IntGaugeVec,
    pub events_delivered: IntCounterVec,
    pub events_delivery_failures: IntCounterVec,
    pub events_dropped: IntCounterVec,
    pub events_dead_lettered: IntCounterVec,
    pub trace_spans_exported: IntCounter,
    pub trace_spans_dropped: IntCounterVec,
    pub top_flush_failures: IntCounter,
    pub concurrency_slots_held: IntGauge,
    pub upstream_in_flight: IntGaugeVec,
    pub upstream_queue: IntGaugeVec,
    pub upstream_limit: IntGaugeVec,
    pub upstream_queue_wait: Histogram,
    pub overload_refusals: IntCounterVec,
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

/// A metric as data: its name, its help and its labels (none for a plain counter or gauge).
struct Def {
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
}

fn opts(def: &Def) -> Opts {
    Opts::new(def.name, def.help)
}

fn counter(r: &Registry, def: &Def) -> IntCounterVec {
    register(
        r,
        IntCounterVec::new(opts(def), def.labels).expect("valid metric definition"),
    )
}

fn gauge(r: &Registry, def: &Def) -> IntGaugeVec {
    register(
        r,
        IntGaugeVec::new(opts(def), def.labels).expect("valid metric definition"),
    )
}

fn histogram(r: &Registry, def: &Def) -> HistogramVec {
    let opts = HistogramOpts::new(def.name, def.help).buckets(LATENCY.to_vec());
    register(
        r,
        HistogramVec::new(opts, def.labels).expect("valid metric definition"),
    )
}

fn plain_counter(r: &Registry, def: &Def) -> IntCounter {
    register(
        r,
        IntCounter::with_opts(opts(def)).expect("valid metric definition"),
    )
}

fn plain_gauge(r: &Registry, def: &Def) -> IntGauge {
    register(
        r,
        IntGauge::with_opts(opts(def)).expect("valid metric definition"),
    )
}

fn plain_histogram(r: &Registry, def: &Def, buckets: &[f64]) -> Histogram {
    let opts = HistogramOpts::new(def.name, def.help).buckets(buckets.to_vec());
    register(
        r,
        Histogram::with_opts(opts).expect("valid metric definition"),
    )
}

// The request path: requests, latency, refusals, bans, authentication failures.
const REQUESTS: Def = Def {
    name: "pet_gateway_requests_total",
    help: "Requests answered, by environment, operation, plan and HTTP status.",
    labels: &["env", "route", "plan", "status"],
};
const REQUEST_DURATION: Def = Def {
    name: "pet_gateway_request_duration_seconds",
    help: "Time from request head to the end of the response, by operation.",
    labels: &["route"],
};
const UPSTREAM_DURATION: Def = Def {
    name: "pet_gateway_upstream_duration_seconds",
    help: "Time from choosing a backend to its response head, by operation.",
    labels: &["route"],
};
const RATE_LIMITED: Def = Def {
    name: "pet_gateway_rate_limited_total",
    help: "Requests refused with 429, by plan and the window that refused them (minute, day, ban).",
    labels: &["plan", "window"],
};
const BANS: Def = Def {
    name: "pet_gateway_bans_total",
    help: "Bans started, by plan.",
    labels: &["plan"],
};
const AUTH_FAILURES: Def = Def {
    name: "pet_gateway_auth_failures_total",
    help: "Requests refused with 401, by reason (missing, malformed, unknown, expired).",
    labels: &["reason"],
};

// The quota store: latency, batch size, errors, fallback.
const STORE_DURATION: Def = Def {
    name: "pet_gateway_store_duration_seconds",
    help: "Time of one quota-store decision.",
    labels: &[],
};
const STORE_BATCH_SIZE: Def = Def {
    name: "pet_gateway_store_batch_size",
    help: "Decisions carried by one Redis script run (group commit; 1 at low load).",
    labels: &[],
};
const BATCH_SIZES: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
const STORE_ERRORS: Def = Def {
    name: "pet_gateway_store_errors_total",
    help: "Quota-store calls that failed, by kind (timeout, unavailable, protocol).",
    labels: &["kind"],
};
const REGION_GRANTS: Def = Def {
    name: "pet_gateway_region_grants_total",
    help: "A region's calls to the global store, by result: granted, not_durable (its replicas \
           did not acknowledge in time: never spent), failed (a request short of units could \
           not reach it), given_back, give_back_lost.",
    labels: &["result"],
};
const STORE_FALLBACK: Def = Def {
    name: "pet_gateway_store_fallback",
    help: "1 while the quota store fails and on_store_error decides instead, else 0.",
    labels: &[],
};
const STORE_LOCAL_DECISIONS: Def = Def {
    name: "pet_gateway_store_local_decisions_total",
    help: "Decisions on_store_error made without the quota store (after a call that failed, or \
           while the breaker is open), each one.",
    labels: &[],
};

// Reloads, aborted responses, slow heads, the catalog and its keys.
const CONFIG_RELOADS: Def = Def {
    name: "pet_gateway_config_reloads_total",
    help: "Reloads of keys, plans or the TLS certificate, by result (applied, refused).",
    labels: &["result"],
};
const RESPONSES_ABORTED: Def = Def {
    name: "pet_gateway_responses_aborted_total",
    help: "Responses cut off after their head had gone out (the backend failed mid-body): \
           the client saw an incomplete response, never an error spliced into it.",
    labels: &[],
};
const SLOW_REQUEST_HEADS: Def = Def {
    name: "pet_gateway_slow_request_heads_total",
    help: "Connections closed because a request head did not arrive within \
           request_header_timeout_ms (a slow or trickling client), on the public listener or \
           the admin one.",
    labels: &[],
};
const ADMIN_AUTH_REFUSALS: Def = Def {
    name: "pet_gateway_admin_auth_refusals_total",
    help: "Admin requests refused for their token, by reason: wrong_token (401, a wrong \
           token counted against its peer) or limited (429, its peer sent too many wrong ones \
           within a minute).",
    labels: &["reason"],
};
const CATALOG_RELOAD_FAILING: Def = Def {
    name: "pet_gateway_catalog_reload_failing",
    help: "1 while the newest version of the keys file or the plans directory (part) is \
           refused and the previous one stays in force, else 0.",
    labels: &["part"],
};
const CATALOG_KEYS_SKIPPED: Def = Def {
    name: "pet_gateway_catalog_keys_skipped",
    help: "Active keys in the keys file left out because their plan is not in force \
           (they get 401; check and a restart refuse such a file).",
    labels: &[],
};
const KEYS: Def = Def {
    name: "pet_gateway_keys",
    help: "Records of the keys file (or the registry's replica) in force, by status (active, expired, revoked; skipped: active but naming a plan not in force).",
    labels: &["status"],
};
const CATALOG_LAST_RELOAD: Def = Def {
    name: "pet_gateway_catalog_last_reload_timestamp_seconds",
    help: "When the keys or the plans (part) in force were loaded, Unix seconds.",
    labels: &["part"],
};

// The key registry (`keys_source = "store"`): healing and refused records.
const REGISTRY_REPAIRS: Def = Def {
    name: "pet_gateway_registry_repairs_total",
    help: "Key records this node wrote back into the registry because the registry had lost them \
           or held an older version (a Redis restart without persistence, a flush, a failover to a \
           lagging replica).",
    labels: &[],
};
const REGISTRY_REJECTED_RECORDS: Def = Def {
    name: "pet_gateway_registry_rejected_records_total",
    help: "Key records read from the registry and refused, by reason (unsigned, bad_signature, \
           unbound: not bound to this environment where binding is required, older: not newer \
           than the version this node holds, replayed: older than the change feed or the \
           writers' floors say the registry held, future: a version more than a day ahead of \
           its clock, unparsable); the version held stays in force.",
    labels: &["reason"],
};
const REGISTRY_IN_STEP: Def = Def {
    name: "pet_gateway_registry_in_step",
    help: "1 while this node's replica and the registry agree (or keys_source is file), 0 while they \
           do not: the registry lost records this node could not write back, or is another registry.",
    labels: &[],
};

const REGISTRY_SNAPSHOT_UNSAVED: Def = Def {
    name: "pet_gateway_registry_snapshot_unsaved",
    help: "1 while this node cannot write its registry snapshot (keys_file; a full disk): it serves \
           the registry's keys from memory, and a restart would start from the last snapshot written.",
    labels: &[],
};

const SHADOW_REFUSALS: Def = Def {
    name: "pet_gateway_shadow_refusals_total",
    help:
        "Admitted requests that a shadow window (a limit being tried out) would have refused, by \
           plan and window.",
    labels: &["plan", "window"],
};

const EVENTS_PENDING: Def = Def {
    name: "pet_gateway_events_pending",
    help: "Events made and not yet taken by a sink: `file` the metering file and `spool` the \
           webhook's spool (both growing while their disk fails), `webhook` the batches in the \
           spool the receiver has not yet taken (growing while it is down).",
    labels: &["sink"],
};

const EVENTS_DELIVERED: Def = Def {
    name: "pet_gateway_events_delivered_total",
    help: "Events taken by a sink (`file`: written to the metering file; `webhook`: a 2xx from \
           the receiver), by type.",
    labels: &["sink", "type"],
};

const EVENTS_DELIVERY_FAILURES: Def = Def {
    name: "pet_gateway_events_delivery_failures_total",
    help: "Failed writes or posts of events (a full disk, no permission, a receiver down or \
           answering 5xx/408/429); the events are kept and tried again.",
    labels: &["sink"],
};

const EVENTS_DROPPED: Def = Def {
    name: "pet_gateway_events_dropped_total",
    help: "Events lost: made while the events waiting for a failing sink (a full disk, a full \
           spool) already filled their bound in memory. Billing data is missing; page.",
    labels: &["sink"],
};

const EVENTS_DEAD_LETTERED: Def = Def {
    name: "pet_gateway_events_dead_lettered_total",
    help: "Events the webhook gave up on: moved to the spool's dead-letter file, `rejected` (a \
           4xx other than 408/429) or `expired` (retried for 24 hours), or a batch set aside as \
           `<segment>.unreadable` (`unreadable`: another user's file, or not a file).",
    labels: &["reason"],
};

const TRACE_SPANS_EXPORTED: Def = Def {
    name: "pet_gateway_trace_spans_exported_total",
    help: "Spans of sampled requests the OTLP collector accepted.",
    labels: &[],
};

const TRACE_SPANS_DROPPED: Def = Def {
    name: "pet_gateway_trace_spans_dropped_total",
    help: "Spans of sampled requests never exported: `queue_full` (the collector slow or down \
           and the bounded queue full: requests are never held for it) or `export_failed` (the \
           collector refused them or did not answer in time).",
    labels: &["reason"],
};

const TOP_FLUSH_FAILURES: Def = Def {
    name: "pet_gateway_top_flush_failures_total",
    help: "Flushes of the top consumers' tally the quota store refused; the tally is kept for \
           the next flush (up to a million holders).",
    labels: &[],
};

const CONCURRENCY_SLOTS_HELD: Def = Def {
    name: "pet_gateway_concurrency_slots_held",
    help: "Places this node holds among its keys' requests in flight (plans or keys with a \
           concurrency): one per such request until it ends. 0 when idle: a place never leaks.",
    labels: &[],
};

// Overload protection: places at the backends, the queue, refusals.
const UPSTREAM_IN_FLIGHT: Def = Def {
    name: "pet_gateway_upstream_in_flight",
    help: "Requests this node has at the backends now (holding a place), by priority level.",
    labels: &["priority"],
};
const UPSTREAM_QUEUE: Def = Def {
    name: "pet_gateway_upstream_queue",
    help: "Requests waiting for a place at a backend now, by priority level.",
    labels: &["priority"],
};
const UPSTREAM_LIMIT: Def = Def {
    name: "pet_gateway_upstream_limit",
    help: "Places this node gives each backend (upstream_max_in_flight, or the adaptive limit \
           now); absent with no limit.",
    labels: &["upstream"],
};
const UPSTREAM_QUEUE_WAIT: Def = Def {
    name: "pet_gateway_upstream_queue_wait_seconds",
    help: "How long requests that found every place taken waited (for a place, or until shed).",
    labels: &[],
};
const OVERLOAD_REFUSALS: Def = Def {
    name: "pet_gateway_overload_refusals_total",
    help: "Requests refused to protect the backend, by reason (concurrency: 429 \
           concurrency_limited, the key's requests in flight at its limit; queue_timeout and \
           queue_full: 503 overloaded, shed before reaching the backend) and priority level.",
    labels: &["reason", "priority"],
};

const LOG_LINES_DROPPED: Def = Def {
    name: "pet_gateway_log_lines_dropped_total",
    help: "Log lines (access log and others) dropped because standard error did not take them \
           fast enough and the buffer in front of it was full; a request never waits for the log.",
    labels: &[],
};

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
        for reason in [
            "unsigned",
            "bad_signature",
            "unbound",
            "older",
            "replayed",
            "future",
            "unparsable",
        ] {
            m.registry_rejected_records.with_label_values(&[reason]);
        }
        m.registry_in_step.set(1);
        for sink in ["file", "spool", "webhook"] {
            m.events_pending.with_label_values(&[sink]);
            m.events_delivery_failures.with_label_values(&[sink]);
            m.events_dropped.with_label_values(&[sink]);
        }
        for sink in ["file", "webhook"] {
            m.events_delivered
                .with_label_values(&[sink, "pet.usage.v1"]);
        }
        for reason in ["rejected", "expired", "unreadable"] {
            m.events_dead_lettered.with_label_values(&[reason]);
        }
        for reason in ["wrong_token", "limited"] {
            m.admin_auth_refusals.with_label_values(&[reason]);
        }
        for reason in ["queue_full", "export_failed"] {
            m.trace_spans_dropped.with_label_values(&[reason]);
        }
        for priority in ["low", "normal", "high", "critical"] {
            m.upstream_in_flight.with_label_values(&[priority]);
            m.upstream_queue.with_label_values(&[priority]);
            for reason in ["concurrency", "queue_timeout", "queue_full"] {
                m.overload_refusals.with_label_values(&[reason, priority]);
            }
        }
        m
    }

    fn register_all(r: &Registry) -> Metrics {
        Metrics {
            requests: counter(r, &REQUESTS),
            request_duration: histogram(r, &REQUEST_DURATION),
            upstream_duration: histogram(r, &UPSTREAM_DURATION),
            rate_limited: counter(r, &RATE_LIMITED),
            shadow_refusals: counter(r, &SHADOW_REFUSALS),
            log_lines_dropped: plain_counter(r, &LOG_LINES_DROPPED),
            events_pending: gauge(r, &EVENTS_PENDING),
            events_delivered: counter(r, &EVENTS_DELIVERED),
            events_delivery_failures: counter(r, &EVENTS_DELIVERY_FAILURES),
            events_dropped: counter(r, &EVENTS_DROPPED),
            events_dead_lettered: counter(r, &EVENTS_DEAD_LETTERED),
            trace_spans_exported: plain_counter(r, &TRACE_SPANS_EXPORTED),
            trace_spans_dropped: counter(r, &TRACE_SPANS_DROPPED),
            top_flush_failures: plain_counter(r, &TOP_FLUSH_FAILURES),
            bans: counter(r, &BANS),
            auth_failures: counter(r, &AUTH_FAILURES),
            store_duration: plain_histogram(r, &STORE_DURATION, LATENCY),
            store_batch_size: plain_histogram(r, &STORE_BATCH_SIZE, BATCH_SIZES),
            store_errors: counter(r, &STORE_ERRORS),
            region_grants: counter(r, &REGION_GRANTS),
            store_fallback: plain_gauge(r, &STORE_FALLBACK),
            store_local_decisions: plain_counter(r, &STORE_LOCAL_DECISIONS),
            config_reloads: counter(r, &CONFIG_RELOADS),
            responses_aborted: plain_counter(r, &RESPONSES_ABORTED),
            slow_request_heads: plain_counter(r, &SLOW_REQUEST_HEADS),
            admin_auth_refusals: counter(r, &ADMIN_AUTH_REFUSALS),
            catalog_reload_failing: gauge(r, &CATALOG_RELOAD_FAILING),
            catalog_keys_skipped: plain_gauge(r, &CATALOG_KEYS_SKIPPED),
            keys: gauge(r, &KEYS),
            catalog_last_reload: gauge(r, &CATALOG_LAST_RELOAD),
            registry_repairs: plain_counter(r, &REGISTRY_REPAIRS),
            registry_rejected_records: counter(r, &REGISTRY_REJECTED_RECORDS),
            registry_in_step: plain_gauge(r, &REGISTRY_IN_STEP),
            registry_snapshot_unsaved: plain_gauge(r, &REGISTRY_SNAPSHOT_UNSAVED),
            concurrency_slots_held: plain_gauge(r, &CONCURRENCY_SLOTS_HELD),
            upstream_in_flight: gauge(r, &UPSTREAM_IN_FLIGHT),
            upstream_queue: gauge(r, &UPSTREAM_QUEUE),
            upstream_limit: gauge(r, &UPSTREAM_LIMIT),
            upstream_queue_wait: plain_histogram(r, &UPSTREAM_QUEUE_WAIT, LATENCY),
            overload_refusals: counter(r, &OVERLOAD_REFUSALS),
        }
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
