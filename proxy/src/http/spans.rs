//! A sampled request's spans: when each part of its path began and ended, noted as it goes
//! ([`Recording`], kept in the request's state only when it is sampled), and made into spans
//! once it ends ([`Recording::finish`]), so that an unsampled request, or a gateway without
//! traces, pays for nothing but a branch.
//!
//! The spans, under the request's server span (the gateway's span of the W3C trace, whose id
//! the access log carries): `authenticate`, `quota decision` with its `quota store` call inside,
//! `backend queue` when the request waited for a place, and one `upstream attempt` a try at a
//! backend (each with its own span id: the `traceparent` the backend gets names it). Their
//! attributes are the HTTP semantic conventions' and the gateway's own (`pet.*`: the key id,
//! the plan, the decision); never the bearer token.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::SpanData;

use crate::http::trace::TraceContext;

/// A part of the request's path that gets a span of its own.
#[derive(Debug, Clone, Copy)]
pub enum Phase {
    Authenticate,
    Decision,
    Queue,
}

/// One try at a backend.
#[derive(Debug)]
struct Attempt {
    span_id: [u8; 8],
    peer: SocketAddr,
    start: Instant,
    end: Option<Instant>,
    status: Option<u16>,
    error: Option<String>,
}

/// What a sampled request noted of its path.
#[derive(Debug)]
pub struct Recording {
    started: Instant,
    wall_started: SystemTime,
    authenticate: Option<(Instant, Instant)>,
    decision: Option<(Instant, Instant)>,
    queue: Option<(Instant, Instant)>,
    attempts: Vec<Attempt>,
}

/// The starting instant of a phase, read only when the request is sampled.
pub fn start(recording: &Option<Box<Recording>>) -> Option<Instant> {
    recording.as_ref().map(|_| Instant::now())
}

/// Notes that `phase` ran from `started` until now.
pub fn mark(recording: &mut Option<Box<Recording>>, phase: Phase, started: Option<Instant>) {
    if let (Some(r), Some(started)) = (recording, started) {
        let span = Some((started, Instant::now()));
        match phase {
            Phase::Authenticate => r.authenticate = span,
            Phase::Decision => r.decision = span,
            Phase::Queue => r.queue = span,
        }
    }
}

/// What the server span says of the request as it ended.
pub struct Ended<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub route: &'static str,
    pub operation: &'static str,
    pub status: u16,
    pub http2: bool,
    pub tls: bool,
    pub client: Option<String>,
    pub request_id: &'a str,
    pub key_id: Option<&'a str>,
    pub plan: Option<&'a str>,
    /// `admitted`, `rate_limited`, `banned`, …, or why no decision was made.
    pub decision: &'static str,
    /// The store's share of the decision, and whether this node decided alone (the store
    /// away) or in one of the store's batches.
    pub store_time: Option<Duration>,
    pub decided_locally: bool,
    pub store: &'static str,
    pub batched: bool,
    pub priority: Option<&'static str>,
    pub shed: Option<&'static str>,
}

impl Recording {
    pub fn new(started: Instant) -> Recording {
        Recording {
            started,
            wall_started: SystemTime::now() - started.elapsed(),
            authenticate: None,
            decision: None,
            queue: None,
            attempts: Vec::new(),
        }
    }

    /// A new try at `peer` begins: its span id, which the backend's `traceparent` names.
    pub fn attempt(&mut self, peer: SocketAddr) -> [u8; 8] {
        let span_id = crate::http::trace::new_span_id();
        self.attempts.push(Attempt {
            span_id,
            peer,
            start: Instant::now(),
            end: None,
            status: None,
            error: None,
        });
        span_id
    }

    /// The span id of the try under way.
    pub fn attempt_span(&self) -> Option<[u8; 8]> {
        self.attempts.last().map(|a| a.span_id)
    }

    /// The try under way was answered with `status`.
    pub fn answered(&mut self, status: u16) {
        if let Some(a) = self.attempts.last_mut() {
            a.end.get_or_insert_with(Instant::now);
            a.status = Some(status);
        }
    }

    /// The try under way failed.
    pub fn failed(&mut self, error: &pingora::Error) {
        if let Some(a) = self.attempts.last_mut() {
            a.end.get_or_insert_with(Instant::now);
            a.error = Some(error.etype().as_str().to_owned());
        }
    }

    /// The request's spans, the server span first.
    pub fn finish(
        &self,
        trace: &TraceContext,
        ended: &Ended,
        scope: &InstrumentationScope,
    ) -> Vec<SpanData> {
        let now = Instant::now();
        let maker = Maker {
            trace_id: TraceId::from_bytes(trace.trace_id),
            server: SpanId::from_bytes(trace.span_id),
            started: self.started,
            wall_started: self.wall_started,
            scope,
        };
        let mut spans = vec![maker.server(trace, ended, now)];
        if let Some((from, to)) = self.authenticate {
            let result = if ended.key_id.is_some() {
                "ok"
            } else {
                ended.decision
            };
            spans.push(maker.child(
                "authenticate",
                SpanKind::Internal,
                (from, to),
                vec![KeyValue::new("pet.auth.result", result)],
            ));
        }
        if let Some(span) = self.decision {
            spans.extend(maker.decision(span, ended));
        }
        if let Some(span) = self.queue {
            let mut attributes = vec![KeyValue::new(
                "pet.queue.outcome",
                ended.shed.unwrap_or("placed"),
            )];
            attributes.extend(ended.priority.map(|p| KeyValue::new("pet.priority", p)));
            spans.push(maker.child("backend queue", SpanKind::Internal, span, attributes));
        }
        for (i, attempt) in self.attempts.iter().enumerate() {
            spans.push(maker.attempt(attempt, i, now));
        }
        spans
    }
}

/// Makes the spans of one request.
struct Maker<'a> {
    trace_id: TraceId,
    server: SpanId,
    started: Instant,
    wall_started: SystemTime,
    scope: &'a InstrumentationScope,
}

impl Maker<'_> {
    fn at(&self, t: Instant) -> SystemTime {
        self.wall_started + t.saturating_duration_since(self.started)
    }

    fn span(
        &self,
        id: SpanId,
        parent: SpanId,
        name: &'static str,
        kind: SpanKind,
        (from, to): (Instant, Instant),
        attributes: Vec<KeyValue>,
    ) -> SpanData {
        SpanData {
            span_context: SpanContext::new(
                self.trace_id,
                id,
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: parent,
            parent_span_is_remote: false,
            span_kind: kind,
            name: Cow::Borrowed(name),
            start_time: self.at(from),
            end_time: self.at(to),
            attributes,
            dropped_attributes_count: 0,
            events: Default::default(),
            links: Default::default(),
            status: Status::Unset,
            instrumentation_scope: self.scope.clone(),
        }
    }

    fn child(
        &self,
        name: &'static str,
        kind: SpanKind,
        span: (Instant, Instant),
        attributes: Vec<KeyValue>,
    ) -> SpanData {
        let id = SpanId::from_bytes(crate::http::trace::new_span_id());
        self.span(id, self.server, name, kind, span, attributes)
    }

    fn server(&self, trace: &TraceContext, e: &Ended, now: Instant) -> SpanData {
        let mut a = vec![
            KeyValue::new("http.request.method", e.method.to_owned()),
            KeyValue::new("url.path", e.path.to_owned()),
            KeyValue::new("url.scheme", if e.tls { "https" } else { "http" }),
            KeyValue::new(
                "network.protocol.version",
                if e.http2 { "2" } else { "1.1" },
            ),
            KeyValue::new("http.response.status_code", i64::from(e.status)),
            KeyValue::new("pet.request_id", e.request_id.to_owned()),
            KeyValue::new("pet.operation", e.operation),
            KeyValue::new("pet.decision", e.decision),
        ];
        if !e.route.is_empty() {
            a.push(KeyValue::new("http.route", e.route));
        }
        a.extend(e.client.clone().map(|c| KeyValue::new("client.address", c)));
        a.extend(e.key_id.map(|k| KeyValue::new("pet.key_id", k.to_owned())));
        a.extend(e.plan.map(|p| KeyValue::new("pet.plan", p.to_owned())));
        let mut span = self.span(
            self.server,
            trace.parent_id.map_or(SpanId::INVALID, SpanId::from_bytes),
            "",
            SpanKind::Server,
            (self.started, now),
            a,
        );
        span.parent_span_is_remote = trace.parent_id.is_some();
        span.name = Cow::Owned(if e.route.is_empty() {
            e.method.to_owned()
        } else {
            format!("{} {}", e.method, e.route)
        });
        if e.status >= 500 {
            span.attributes
                .push(KeyValue::new("error.type", e.status.to_string()));
            span.status = Status::error("");
        }
        span
    }

    /// The decision's span, and the store call's inside it (measured from the decision's start).
    fn decision(&self, (from, to): (Instant, Instant), e: &Ended) -> Vec<SpanData> {
        let id = SpanId::from_bytes(crate::http::trace::new_span_id());
        let attributes = vec![
            KeyValue::new("pet.decision", e.decision),
            KeyValue::new("pet.quota.decided_locally", e.decided_locally),
            KeyValue::new("pet.quota.batched", e.batched && !e.decided_locally),
        ];
        let mut spans = vec![self.span(
            id,
            self.server,
            "quota decision",
            SpanKind::Internal,
            (from, to),
            attributes,
        )];
        if let Some(store_time) = e.store_time {
            let store = SpanId::from_bytes(crate::http::trace::new_span_id());
            let mut span = self.span(
                store,
                id,
                "quota store",
                SpanKind::Client,
                (from, (from + store_time).min(to)),
                vec![KeyValue::new("db.system.name", e.store)],
            );
            if e.decided_locally {
                span.status = Status::error("the store did not answer in time");
            }
            spans.push(span);
        }
        spans
    }

    fn attempt(&self, a: &Attempt, i: usize, now: Instant) -> SpanData {
        let mut attributes = vec![
            KeyValue::new("server.address", a.peer.ip().to_string()),
            KeyValue::new("server.port", i64::from(a.peer.port())),
        ];
        if i > 0 {
            attributes.push(KeyValue::new("http.request.resend_count", i as i64));
        }
        attributes.extend(
            a.status
                .map(|s| KeyValue::new("http.response.status_code", i64::from(s))),
        );
        let mut span = self.span(
            SpanId::from_bytes(a.span_id),
            self.server,
            "upstream attempt",
            SpanKind::Client,
            (a.start, a.end.unwrap_or(now)),
            attributes,
        );
        if let Some(error) = &a.error {
            span.attributes
                .push(KeyValue::new("error.type", error.clone()));
            span.status = Status::error(error.clone());
        }
        span
    }
}
