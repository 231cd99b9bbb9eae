//! OpenTelemetry traces to an OTLP collector (HTTP/protobuf), off unless an endpoint is given:
//! `tracing_otlp_endpoint`, or the SDK's own `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (and its other `OTEL_EXPORTER_OTLP_*` variables: headers,
//! timeout), as every OpenTelemetry user expects; `OTEL_SDK_DISABLED=true` keeps it off.
//!
//! The request path decides at its start whether a request is sampled ([`Tracing::sampled`]:
//! the SDK's parent-based sampler over a trace-id ratio) and, for one that is, hands its spans
//! over whole when it ends ([`Tracing::submit`]). They wait in a bounded queue for a thread of
//! their own, which batches them to the collector: a collector that is slow or down fills the
//! queue and the spans past it are dropped and counted, never waited for.

use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Context, InstrumentationScope, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{Sampler, SamplingDecision, ShouldSample, SpanData, SpanExporter};
use opentelemetry_sdk::Resource;

use crate::base::metrics::METRICS;

/// Requests whose spans may wait for the exporter; past it they are dropped (`queue_full`).
const QUEUE_REQUESTS: usize = 4096;
/// The most spans in one export.
const BATCH_SPANS: usize = 512;
/// How long a batch waits for more spans after its first: the OpenTelemetry SDKs' default
/// schedule delay (`OTEL_BSP_SCHEDULE_DELAY`). Each export costs the exporter's thread about as
/// much as a thousand requests' spans; waiting keeps its share of a request small at low ratios.
const BATCH_WAIT: Duration = Duration::from_secs(5);
/// How long a stop waits for the last spans to go out.
const STOP_WAIT: Duration = Duration::from_secs(2);

/// What the gateway's traces are configured with.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    /// The collector's traces URL; `None`: the SDK's variables, or no traces.
    pub endpoint: Option<String>,
    /// The share of requests sampled where no trusted caller decided.
    pub sample_ratio: f64,
    pub environment: String,
    pub node_id: String,
}

/// Why traces cannot start; the message names the setting or variable.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{var} = {value:?}: only http/protobuf is built in")]
    Protocol { var: &'static str, value: String },
    #[error("tracing_otlp_endpoint (or OTEL_EXPORTER_OTLP_*): {0}")]
    Exporter(String),
}

/// Who chose a request's trace: see [`Tracing::sampled`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    Trusted { span_id: [u8; 8], sampled: bool },
    New,
    Untrusted,
}

/// The request path's handle: the sampler and the queue to the exporter.
pub struct Tracing {
    sampler: Sampler,
    queue: SyncSender<Vec<SpanData>>,
    scope: InstrumentationScope,
}

/// Stops the exporter when dropped, after the spans already queued had a moment to go out.
pub struct TraceExport {
    stop: Option<SyncSender<Vec<SpanData>>>,
    done: Receiver<()>,
}

impl Drop for TraceExport {
    fn drop(&mut self) {
        // The request path's senders may live on; this empty batch is the stop.
        if let Some(stop) = self.stop.take() {
            let _ = stop.try_send(Vec::new());
        }
        let _ = self.done.recv_timeout(STOP_WAIT);
    }
}

/// Starts the exporter when an endpoint is configured; `None` when traces are off. A fault in
/// the gateway's own setting stops the start; one in the SDK's variables alone (set for the
/// whole pod by an operator or an injector, perhaps for another program) turns traces off with
/// a warning instead of taking the gateway down.
pub fn start(settings: &TraceSettings) -> Result<Option<(Arc<Tracing>, TraceExport)>, TraceError> {
    if !enabled(settings) {
        return Ok(None);
    }
    let exporter = match exporter(settings) {
        Ok(exporter) => exporter,
        Err(e) if settings.endpoint.is_none() => {
            tracing::warn!(error = %e, "traces are off: the OTEL_EXPORTER_OTLP_* variables ask for what is not built in");
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let (queue, spans) = std::sync::mpsc::sync_channel(QUEUE_REQUESTS);
    let (finished, done) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("trace-export".into())
        .spawn(move || {
            export_until_stopped(&exporter, &spans);
            let _ = finished.send(());
        })
        .map_err(|e| TraceError::Exporter(format!("cannot start its thread: {e}")))?;
    let tracing = Tracing {
        sampler: Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(settings.sample_ratio))),
        queue: queue.clone(),
        scope: InstrumentationScope::builder("pet-gateway")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build(),
    };
    Ok(Some((
        Arc::new(tracing),
        TraceExport {
            stop: Some(queue),
            done,
        },
    )))
}

/// The OTLP/HTTP exporter, from the setting and the SDK's variables.
fn exporter(settings: &TraceSettings) -> Result<opentelemetry_otlp::SpanExporter, TraceError> {
    if settings.endpoint.is_none() {
        check_protocol()?;
    }
    // The exporter's HTTPS client takes the process's crypto provider: the one the gateway's
    // other TLS clients use.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary);
    if let Some(endpoint) = &settings.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    let mut exporter = builder
        .build()
        .map_err(|e| TraceError::Exporter(e.to_string()))?;
    exporter.set_resource(&resource(settings));
    Ok(exporter)
}

fn enabled(settings: &TraceSettings) -> bool {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return false;
    }
    settings.endpoint.is_some()
        || var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
        || var("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
}

/// gRPC and JSON are not built in: refused at start rather than sent in another protocol.
fn check_protocol() -> Result<(), TraceError> {
    for var in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Ok(value) = std::env::var(var) {
            if !value.trim().is_empty() && value.trim() != "http/protobuf" {
                return Err(TraceError::Protocol { var, value });
            }
        }
    }
    Ok(())
}

/// `service.name` (`pet-gateway` unless `OTEL_SERVICE_NAME` says otherwise), the environment
/// and the node, and what `OTEL_RESOURCE_ATTRIBUTES` adds.
fn resource(settings: &TraceSettings) -> Resource {
    let mut builder = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        builder = builder.with_service_name("pet-gateway");
    }
    builder
        .with_attributes([
            KeyValue::new("deployment.environment.name", settings.environment.clone()),
            KeyValue::new("service.instance.id", settings.node_id.clone()),
            KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        ])
        .build()
}

impl Tracing {
    /// Whether a request is sampled:
    /// - `Caller::Trusted`: a caller in `trusted_proxies` decided, by its sampled flag;
    /// - `Caller::New`: the gateway started the trace: the ratio, by the trace id, as the
    ///   OpenTelemetry SDKs' `TraceIdRatioBased` decides;
    /// - `Caller::Untrusted`: a public client chose the trace id: the ratio, by a draw of the
    ///   gateway's own. By the id, a client could pick ids the ratio always takes and have
    ///   every request of its own exported (and crowd the others' spans out of the queue).
    pub fn sampled(&self, trace_id: [u8; 16], caller: Caller) -> bool {
        let (trace_id, parent) = match caller {
            Caller::Trusted { span_id, sampled } => (trace_id, Some((span_id, sampled))),
            Caller::New => (trace_id, None),
            Caller::Untrusted => (rand::random(), None),
        };
        let trace_id = TraceId::from_bytes(trace_id);
        let context = parent.map(|(span_id, sampled)| {
            let flags = if sampled {
                TraceFlags::SAMPLED
            } else {
                TraceFlags::default()
            };
            Context::new().with_remote_span_context(SpanContext::new(
                trace_id,
                SpanId::from_bytes(span_id),
                flags,
                true,
                TraceState::default(),
            ))
        });
        let result =
            self.sampler
                .should_sample(context.as_ref(), trace_id, "", &SpanKind::Server, &[], &[]);
        result.decision == SamplingDecision::RecordAndSample
    }

    /// Hands a finished request's spans to the exporter; dropped and counted when its queue is
    /// full (never waited for).
    pub fn submit(&self, spans: Vec<SpanData>) {
        let n = spans.len() as u64;
        match self.queue.try_send(spans) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => METRICS
                .trace_spans_dropped
                .with_label_values(&["queue_full"])
                .inc_by(n),
        }
    }

    /// The scope every span of the gateway is reported under.
    pub fn scope(&self) -> InstrumentationScope {
        self.scope.clone()
    }
}

/// Batches the queue's spans to the collector until an empty batch (the stop) comes: a batch
/// goes out when it is full or [`BATCH_WAIT`] after its first span, whichever comes first.
fn export_until_stopped(
    exporter: &opentelemetry_otlp::SpanExporter,
    queue: &Receiver<Vec<SpanData>>,
) {
    let mut batch: Vec<SpanData> = Vec::new();
    let mut due = Instant::now() + BATCH_WAIT;
    loop {
        let wait = if batch.is_empty() {
            BATCH_WAIT
        } else {
            due.saturating_duration_since(Instant::now())
        };
        let stop = match queue.recv_timeout(wait) {
            Ok(spans) if spans.is_empty() => true,
            Ok(spans) => {
                if batch.is_empty() {
                    due = Instant::now() + BATCH_WAIT;
                }
                batch.extend(spans);
                if batch.len() < BATCH_SPANS && Instant::now() < due {
                    continue;
                }
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        if !batch.is_empty() {
            export(exporter, std::mem::take(&mut batch));
        }
        if stop {
            return;
        }
    }
}

fn export(exporter: &opentelemetry_otlp::SpanExporter, batch: Vec<SpanData>) {
    let n = batch.len() as u64;
    match futures_executor::block_on(exporter.export(batch)) {
        Ok(()) => METRICS.trace_spans_exported.inc_by(n),
        Err(e) => {
            METRICS
                .trace_spans_dropped
                .with_label_values(&["export_failed"])
                .inc_by(n);
            tracing::warn!(error = %e, spans = n, "the OTLP collector did not take a batch of spans");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracing(ratio: f64) -> Tracing {
        let (queue, _spans) = std::sync::mpsc::sync_channel(1);
        Tracing {
            sampler: Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio))),
            queue,
            scope: InstrumentationScope::builder("test").build(),
        }
    }

    /// The ratio's decision for a trace id is the SDK's: its low 64 bits, halved, against the
    /// ratio of 2^63.
    #[test]
    fn the_ratio_decides_by_the_trace_ids_low_bits_and_a_trusted_parent_decides_alone() {
        let t = tracing(0.25);
        let id = |low: u64| {
            let mut id = [0u8; 16];
            id[0] = 1;
            id[8..].copy_from_slice(&low.to_be_bytes());
            id
        };
        // 0.25 of 2^63 is 2^61; the low bits halved are under it below 2^62.
        let bound = 1u64 << 62;
        assert!(t.sampled(id(bound - 2), Caller::New));
        assert!(!t.sampled(id(bound), Caller::New));
        assert!(!t.sampled(id(u64::MAX), Caller::New));
        let trusted = |sampled| Caller::Trusted {
            span_id: [1; 8],
            sampled,
        };
        assert!(t.sampled(id(u64::MAX), trusted(true)));
        assert!(!t.sampled(id(0), trusted(false)));
    }

    /// An id the ratio always takes, chosen by a public client, is sampled at the ratio, not
    /// always: 4,000 draws at 0.25, within 6 standard deviations (27) of 1,000.
    #[test]
    fn a_public_client_cannot_choose_ids_the_ratio_always_takes() {
        let t = tracing(0.25);
        let always = [0u8; 16];
        assert!(t.sampled(always, Caller::New));
        let n = (0..4_000)
            .filter(|_| t.sampled(always, Caller::Untrusted))
            .count();
        assert!((1_000 - 6 * 27..=1_000 + 6 * 27).contains(&n), "{n}");
    }

    #[test]
    fn a_full_queue_drops_and_counts_and_never_waits() {
        let t = tracing(1.0);
        let before = METRICS
            .trace_spans_dropped
            .with_label_values(&["queue_full"])
            .get();
        let span = || SpanData {
            span_context: SpanContext::empty_context(),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: "test".into(),
            start_time: std::time::SystemTime::now(),
            end_time: std::time::SystemTime::now(),
            attributes: Vec::new(),
            dropped_attributes_count: 0,
            events: Default::default(),
            links: Default::default(),
            status: opentelemetry::trace::Status::Unset,
            instrumentation_scope: InstrumentationScope::builder("test").build(),
        };
        t.submit(vec![span()]);
        t.submit(vec![span(), span()]);
        let after = METRICS
            .trace_spans_dropped
            .with_label_values(&["queue_full"])
            .get();
        assert!(after >= before + 2, "{before} -> {after}");
    }
}
