//! The pingora phases and nothing else, following pingora's own examples: every decision in
//! `request_filter` (the steps of `pipeline`, the work in `request`, `auth`, `admission`,
//! `upstream::places`), the backend in `upstream_peer` (the one its place is at), headers on the
//! way in (`upstream_request_filter`) and out (`response_filter`), the place given back once the
//! backend's answer is whole (`upstream_response_body_filter`), error bodies in `fail_to_proxy`
//! (`responses`), metrics and the access log in `logging`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::http::{RequestHeader, ResponseHeader, StaticHeaderName};
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, Result, RetryType};

use crate::base::metrics::METRICS;
use crate::http::access_log;
use crate::http::auth::AuthFailure;
use crate::http::context::Ctx;
use crate::http::draining::Draining;
use crate::http::header_names as names;
use crate::http::metric_handles;
use crate::http::pipeline::{self, Pipeline, Stop};
use crate::http::quota_status::QuotaStatus;
use crate::http::responses::{add_rate_headers, clear_added_headers, refuse, RateHeaders, Refusal};
use crate::http::spans;
use crate::keys::catalog::Catalog;
use crate::quota::admission::{Admission, OnStoreError};
use crate::quota::concurrency::Slots;
use crate::quota::resilience::Resilience;
use crate::quota::rules::{BanPolicy, RateView};
use crate::quota::store::QuotaStore;
use crate::quota::unauth::UnauthLimiter;
use crate::upstream::places::{PlaceSettings, Places};
use crate::upstream::priority::Priorities;
use crate::upstream::rotation::Rotation;

/// What the request path takes from the config; the assembly (`ops::server`) fills it in.
pub struct Settings {
    pub environment: String,
    pub upstreams: Vec<crate::upstream::names::UpstreamAddr>,
    pub upstream_connect_timeout: Duration,
    pub upstream_read_timeout: Duration,
    pub client_read_timeout: Duration,
    pub api_key_prefix: String,
    pub on_store_error: OnStoreError,
    pub ban: BanPolicy,
    /// Usage for the metering file, when there is one.
    pub meter: Option<Arc<crate::events::usage::Meter>>,
    /// Units admitted per quota holder, for the top consumers' index.
    pub top: Option<Arc<crate::quota::top::TopTally>>,
    /// Places at the backends and the queue for them.
    pub places: PlaceSettings,
    pub priorities: Priorities,
    /// How long a concurrency lease lasts unless given back or renewed.
    pub lease_secs: u64,
    /// Traces, when they are on.
    pub tracing: Option<Arc<crate::base::traces::Tracing>>,
    /// What the quota decisions are made in, for their spans: `redis` or `memory`, and
    /// whether Redis takes them in batches.
    pub store_kind: &'static str,
    pub store_batched: bool,
    /// Set once a stop or an upgrade begins: every answer then closes its connection.
    pub draining: Draining,
}

pub struct Gateway {
    env: String,
    pipeline: Pipeline,
    store_kind: &'static str,
    store_batched: bool,
    rotation: Arc<Rotation>,
    connect_timeout: Duration,
    read_timeout: Duration,
    draining: Draining,
}

impl Gateway {
    pub fn new(
        settings: Settings,
        catalog: Arc<Catalog>,
        store: Arc<dyn QuotaStore>,
        unauth: Arc<UnauthLimiter>,
        resilience: Resilience,
    ) -> Gateway {
        let quota_status = Arc::new(QuotaStatus::new(Arc::clone(&store), resilience.clone()));
        let slots = Arc::new(Slots::new(
            Arc::clone(&store),
            &resilience,
            settings.lease_secs,
        ));
        let admission = Admission::new(store, resilience, settings.on_store_error, settings.ban);
        let rotation = Arc::new(Rotation::new(settings.upstreams));
        let places = Places::new(Arc::clone(&rotation), settings.places);
        Gateway {
            env: settings.environment,
            pipeline: Pipeline {
                catalog,
                admission,
                unauth,
                quota_status,
                api_key_prefix: settings.api_key_prefix,
                client_read_timeout: settings.client_read_timeout,
                meter: settings.meter,
                top: settings.top,
                slots,
                places,
                priorities: settings.priorities,
                tracing: settings.tracing,
            },
            store_kind: settings.store_kind,
            store_batched: settings.store_batched,
            rotation,
            connect_timeout: settings.upstream_connect_timeout,
            read_timeout: settings.upstream_read_timeout,
            draining: settings.draining,
        }
    }

    /// A sampled request's spans, to the exporter's queue.
    fn export_spans(&self, session: &Session, ctx: &mut Ctx, status: u16) {
        let (Some(tracing), Some(recording), Some(trace)) =
            (&self.pipeline.tracing, ctx.spans.take(), ctx.trace.as_ref())
        else {
            return;
        };
        let req = session.req_header();
        let ended = spans::Ended {
            method: req.method.as_str(),
            path: req.uri.path(),
            route: ctx.route.template(),
            operation: ctx.route.as_str(),
            status,
            http2: session.as_http2().is_some(),
            tls: session.digest().is_some_and(|d| d.ssl_digest.is_some()),
            client: pipeline::client_ip(session).map(|ip| ip.to_string()),
            request_id: &ctx.request_id,
            key_id: ctx.key.as_ref().map(|k| &*k.id),
            plan: ctx.key.as_ref().map(|k| &*k.plan),
            decision: decision_name(ctx),
            store_time: ctx.store_time,
            decided_locally: ctx.store_degraded,
            store: self.store_kind,
            batched: self.store_batched,
            priority: ctx.key.as_ref().map(|_| ctx.level.name()),
            shed: ctx.shed.map(|s| s.reason()),
        };
        tracing.submit(recording.finish(trace, &ended, &tracing.scope()));
    }

    /// The `GET /v1/rate_limit` answerer, for the reloader to sweep.
    pub fn quota_status(&self) -> Arc<QuotaStatus> {
        Arc::clone(&self.pipeline.quota_status)
    }

    /// The concurrency leases this node holds, for their renewal task.
    pub fn slots(&self) -> Arc<Slots> {
        Arc::clone(&self.pipeline.slots)
    }

    /// The places at the backends, for the console's figures.
    pub fn places(&self) -> Arc<Places> {
        Arc::clone(&self.pipeline.places)
    }
}

/// What the backend is told about the caller, by the gateway only.
static IDENTITY_HEADERS: [&StaticHeaderName; 3] =
    [&names::X_API_KEY_ID, &names::X_PLAN, &names::X_REQUEST_ID];

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx::new()
    }

    /// Every decision, as the pipeline's steps; a refusal is written here, the one exit.
    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        if self.draining.is_on() {
            session.set_keepalive(None);
        }
        match self.pipeline.run(session, ctx).await {
            Ok(()) => Ok(false),
            Err(Stop::Answered) => Ok(true),
            Err(Stop::Refuse(refusal)) => {
                refuse(session, &ctx.request_id, *refusal).await;
                Ok(true)
            }
            Err(Stop::Failed(e)) => Err(e),
        }
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        // The first try goes where the request's place is; a retry to another backend than the
        // one that just failed, when there is one, and its place moves there.
        let backend = match (&mut ctx.place, ctx.upstream_tries) {
            (Some(place), 0) => place.backend(),
            (place, _) => {
                if let Some((named, failed, failure)) = ctx.look_up.take() {
                    let moved = self.rotation.look_up_again(named, Some(failed)).await;
                    if !moved && ctx.upstream_tries >= self.rotation.len() {
                        // Nowhere new to go: the failure stands, as it was (502 or 504).
                        return Err(Error::create(
                            failure,
                            pingora::ErrorSource::Upstream,
                            Some("the backend failed and its name still resolves to it".into()),
                            None,
                        ));
                    }
                }
                let backend = self.rotation.pick(ctx.backend);
                if let Some(place) = place {
                    place.move_to(backend);
                }
                backend
            }
        };
        let addr = self.rotation.addr(backend);
        ctx.backend = Some(backend);
        ctx.upstream = Some(addr);
        ctx.upstream_tries += 1;
        ctx.upstream_started = Some(Instant::now());
        if let Some(spans) = &mut ctx.spans {
            spans.attempt(addr);
        }
        let mut peer = HttpPeer::new(addr, false, String::new());
        peer.options.connection_timeout = Some(self.connect_timeout);
        peer.options.total_connection_timeout = Some(self.connect_timeout);
        peer.options.read_timeout = Some(self.read_timeout);
        peer.options.write_timeout = Some(self.read_timeout);
        peer.options.idle_timeout = Some(Duration::from_secs(60));
        Ok(Box::new(peer))
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if let Some(spans) = &mut ctx.spans {
            spans.failed(&e);
        }
        // Nothing reached the backend, so any request may go to another one.
        if let (Some(backend), Some(addr)) = (ctx.backend, ctx.upstream) {
            self.rotation.mark_down(backend);
            tracing::warn!(upstream = %addr, error = %e, "backend connection failed; skipping it for a while");
            // A backend given by name may have moved: its name is looked up before one more
            // try, which goes to its new address when it is the only backend.
            if self.rotation.is_named(backend) && !ctx.looked_up {
                ctx.looked_up = true;
                ctx.look_up = Some((backend, addr, e.etype().clone()));
                e.set_retry(true);
                return e;
            }
        }
        if ctx.upstream_tries < self.rotation.len() {
            e.set_retry(true);
        }
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        reused: bool,
    ) -> Box<Error> {
        if let Some(spans) = &mut ctx.spans {
            spans.failed(&e);
        }
        let mut e = e.more_context(format!("Peer: {peer}"));
        let replayable = session.req_header().method.is_idempotent()
            && !session.as_ref().retry_buffer_truncated();
        if !replayable {
            e.set_retry(false);
        } else if !reused
            && matches!(e.retry, RetryType::ReusedOnly)
            && !ctx.retried_unanswered
            && ctx.upstream_tries < self.rotation.len()
        {
            // A new connection closed before any answer (a backend shutting down had accepted
            // it): pingora retries that only on a reused connection, but an idempotent request
            // may go to another backend either way. Once, and without marking this backend
            // down: a request that crashes backends would otherwise take healthy ones out of
            // the rotation. One that is really going away refuses the next connection, and
            // `fail_to_connect` marks it then.
            ctx.retried_unanswered = true;
            tracing::warn!(upstream = ?ctx.upstream, error = %e, "backend closed a new connection unanswered; trying the next one");
            e.set_retry(true);
        } else {
            e.retry.decide_reuse(reused);
        }
        e
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // The backend learns who is calling from the gateway, never from the client: the key
        // stays here and client-sent identity headers are replaced.
        upstream.remove_header(&http::header::AUTHORIZATION);
        if ctx.continued {
            upstream.remove_header(&http::header::EXPECT);
        }
        // Added beside the maps, where they replace nothing: a client's own are removed first.
        for name in names::held(&upstream.headers, &IDENTITY_HEADERS) {
            upstream.remove_header(&name);
        }
        if let Some(key) = &ctx.key {
            upstream.add_unmapped_header(&names::X_API_KEY_ID, &*key.id)?;
            upstream.add_unmapped_header(&names::X_PLAN, &*key.plan)?;
        }
        upstream.add_unmapped_header(&names::X_REQUEST_ID, &ctx.request_id)?;
        if let Some(trace) = &ctx.trace {
            // The backend's parent is this gateway's span; an invalid `traceparent` from the
            // client is replaced, never passed on.
            // Sampled: the attempt's span is the parent, so the backend's spans sit under it.
            let parent = match ctx.spans.as_ref().and_then(|s| s.attempt_span()) {
                Some(attempt) => trace.traceparent_under(attempt),
                None => trace.traceparent(),
            };
            upstream.insert_header(&names::TRACEPARENT, parent)?;
            if trace.parent_id.is_none() {
                // A new trace: the client's `tracestate` belonged to no valid trace.
                upstream.remove_header(&names::TRACESTATE);
            }
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // A request in flight when the drain began closes its connection too.
        if self.draining.is_on() {
            session.set_keepalive(None);
        }
        ctx.upstream_time = ctx.upstream_started.map(|t| t.elapsed());
        if let Some(spans) = &mut ctx.spans {
            spans.answered(upstream_response.status.as_u16());
        }
        if let (Some(place), Some(latency)) = (&mut ctx.place, ctx.upstream_time) {
            place.answered(latency);
        }
        clear_added_headers(upstream_response, ctx.rate.is_some());
        if let Some(view) = &ctx.rate {
            add_rate_headers(upstream_response, RateHeaders::Plan(*view));
        }
        upstream_response.add_unmapped_header(&names::X_REQUEST_ID, &ctx.request_id)?;
        Ok(())
    }

    /// The backend's answer is whole: its place goes to the next request, even while this one's
    /// body is still on its way to a slow client.
    fn upstream_response_body_filter(
        &self,
        _session: &mut Session,
        _body: &mut Option<bytes::Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        if end_of_stream {
            ctx.place = None;
        }
        Ok(None)
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        // A backend that did not answer in time: the adaptive limit learns of it as an answer
        // that took that long.
        if let (Some(place), pingora::ErrorType::ReadTimedout, pingora::ErrorSource::Upstream) =
            (&mut ctx.place, e.etype(), e.esource())
        {
            if let Some(started) = ctx.upstream_started {
                place.answered(started.elapsed());
            }
        }
        // Once the head is out, the status and length are promised: an error body written now
        // would be spliced into the live body and delivered as a success. Abort instead (the
        // connection or stream is dropped unfinished), so the client sees it incomplete. (A
        // `100 Continue` promises nothing.)
        if session
            .response_written()
            .is_some_and(|r| !r.status.is_informational())
        {
            // Only a backend failure is news; a client that left mid-body is not.
            if *e.esource() == pingora::ErrorSource::Upstream {
                METRICS.responses_aborted.inc();
                tracing::warn!(request_id = %ctx.request_id, error = %e,
                    "response aborted mid-body: the backend failed after the head was sent");
            }
            session.set_keepalive(None);
            return FailToProxy {
                error_code: 0,
                can_reuse_downstream: false,
            };
        }
        let Some(refusal) = Refusal::for_proxy_error(e, ctx.rate.as_ref()) else {
            return FailToProxy {
                error_code: 0,
                can_reuse_downstream: false,
            };
        };
        let status = refusal.status;
        refuse(session, &ctx.request_id, refusal).await;
        FailToProxy {
            error_code: status,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        let status = session
            .response_written()
            .filter(|r| !r.status.is_informational())
            .map_or(0, |r| r.status.as_u16());
        let plan = ctx.key.as_ref().map_or("none", |k| &*k.plan);
        metric_handles::count_request(&self.env, ctx.route, plan, status);
        metric_handles::observe_request(ctx.route, ctx.started.elapsed().as_secs_f64());
        if let Some(t) = ctx.upstream_time {
            metric_handles::observe_upstream(ctx.route, t.as_secs_f64());
        }
        if ctx.spans.is_some() {
            self.export_spans(session, ctx, status);
        }
        if !tracing::enabled!(target: "access", tracing::Level::INFO) {
            return;
        }
        let shadow_refused = ctx.rate.as_ref().and_then(RateView::shadow_refused);
        let priority = ctx.key.as_ref().map(|_| ctx.level.name());
        let overload = match (ctx.shed, status) {
            (Some(shed), _) => Some(shed.reason()),
            (None, 429) if ctx.concurrency_limited => Some("concurrency"),
            _ => None,
        };
        let line = access_log::Line {
            request_id: &ctx.request_id,
            trace: ctx.trace,
            route: ctx.route.as_str(),
            key_id: ctx.key.as_ref().map(|k| &*k.id),
            plan: ctx.key.as_ref().map(|k| &*k.plan),
            auth_failure: ctx.auth_failure.map(AuthFailure::as_str),
            status,
            upstream: ctx.upstream,
            upstream_us: ctx.upstream_time.map(|d| d.as_micros() as u64),
            store_us: ctx.store_time.map(|d| d.as_micros() as u64),
            queue_us: ctx.queue_time.map(|d| d.as_micros() as u64),
            duration_us: ctx.started.elapsed().as_micros() as u64,
            store_degraded: ctx.store_degraded,
            shadow_refused: shadow_refused.as_deref(),
            priority,
            overload,
            error: e.map(|e| e.etype().as_str()),
        };
        if access_log::write(&line) {
            return;
        }
        // No sink (the gateway run in a test without `serve`): the same line through tracing.
        tracing::info!(
            target: "access",
            request_id = %ctx.request_id,
            trace_id = ctx.trace.map(|t| t.trace_id_hex()),
            span_id = ctx.trace.map(|t| t.span_id_hex()),
            parent_span_id = ctx.trace.and_then(|t| t.parent_id_hex()),
            route = ctx.route.as_str(),
            key_id = ctx.key.as_ref().map(|k| &*k.id),
            plan = ctx.key.as_ref().map(|k| &*k.plan),
            auth_failure = ctx.auth_failure.map(AuthFailure::as_str),
            status,
            upstream = ctx.upstream.map(|a| a.to_string()),
            upstream_us = ctx.upstream_time.map(|d| d.as_micros() as u64),
            store_us = ctx.store_time.map(|d| d.as_micros() as u64),
            queue_us = line.queue_us,
            duration_us = ctx.started.elapsed().as_micros() as u64,
            store_degraded = ctx.store_degraded,
            shadow_refused = line.shadow_refused,
            priority = line.priority,
            overload = line.overload,
            error = e.map(|e| e.etype().as_str()),
        );
    }
}

/// What became of the request at the gateway, for its span: the quota decision, or why none
/// was made.
fn decision_name(ctx: &Ctx) -> &'static str {
    use crate::quota::admission::Outcome;
    if ctx.auth_failure.is_some() {
        return "unauthenticated";
    }
    match ctx.outcome {
        Some(Outcome::Admitted) if ctx.shed.is_some() => "shed",
        Some(Outcome::Admitted) => "admitted",
        Some(Outcome::Limited) => "rate_limited",
        Some(Outcome::Banned) => "banned",
        Some(Outcome::ConcurrencyLimited) => "concurrency_limited",
        Some(Outcome::Unleased) => "region_unleased",
        Some(Outcome::StoreUnavailable) => "store_unavailable",
        None => "none",
    }
}
