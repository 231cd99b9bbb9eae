//! The pingora phases and nothing else, following pingora's own examples: every decision in
//! `request_filter` (the work itself in `request`, `auth`, `admission`), headers on the way in
//! (`upstream_request_filter`) and out (`response_filter`), error bodies in `fail_to_proxy`
//! (`responses`), metrics and the access log in `logging`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, Result};

use crate::base::clock::unix_now;
use crate::base::metrics::METRICS;
use crate::config::Config;
use crate::http::auth::{bearer_token, AuthFailure};
use crate::http::metric_handles;
use crate::http::quota_status::QuotaStatus;
use crate::http::request::{read_h2_body, refuse_shape, request_id};
use crate::http::responses::{insert_rate_headers, refuse, RateHeaders, Refusal};
use crate::http::routes::Route;
use crate::http::trace::TraceContext;
use crate::http::upstreams::Upstreams;
use crate::keys::catalog::Catalog;
use crate::keys::format;
use crate::keys::index::KeyInfo;
use crate::quota::admission::{Admission, Outcome};
use crate::quota::resilience::Resilience;
use crate::quota::rules::RateView;
use crate::quota::store::QuotaStore;
use crate::quota::unauth::{UnauthDecision, UnauthLimiter};

/// Per-request state, carried from phase to phase.
pub struct Ctx {
    started: Instant,
    request_id: String,
    /// This request's place in its W3C trace (joined or started in `request_filter`).
    trace: Option<TraceContext>,
    route: Route,
    key: Option<KeyInfo>,
    rate: Option<RateView>,
    auth_failure: Option<AuthFailure>,
    store_time: Option<Duration>,
    store_degraded: bool,
    upstream: Option<SocketAddr>,
    upstream_tries: usize,
    upstream_started: Option<Instant>,
    upstream_time: Option<Duration>,
}

pub struct Gateway {
    env: String,
    catalog: Arc<Catalog>,
    admission: Admission,
    unauth: Arc<UnauthLimiter>,
    upstreams: Upstreams,
    connect_timeout: Duration,
    read_timeout: Duration,
    client_read_timeout: Duration,
    api_key_prefix: String,
    /// `GET /v1/rate_limit`, answered here.
    quota_status: Arc<QuotaStatus>,
}

impl Gateway {
    pub fn new(
        config: &Config,
        catalog: Arc<Catalog>,
        store: Arc<dyn QuotaStore>,
        unauth: Arc<UnauthLimiter>,
        resilience: Resilience,
    ) -> Gateway {
        Gateway {
            env: config.environment.clone(),
            catalog,
            quota_status: Arc::new(QuotaStatus::new(Arc::clone(&store), resilience.clone())),
            admission: Admission::new(store, resilience, config.on_store_error, config.ban.clone()),
            unauth,
            upstreams: Upstreams::new(config.upstreams.clone()),
            connect_timeout: config.upstream_connect_timeout,
            read_timeout: config.upstream_read_timeout,
            client_read_timeout: config.client_read_timeout,
            api_key_prefix: config.api_key_prefix.clone(),
        }
    }

    /// The `GET /v1/rate_limit` answerer, for the reloader to sweep.
    pub fn quota_status(&self) -> Arc<QuotaStatus> {
        Arc::clone(&self.quota_status)
    }

    /// 401, or 429 once the client's address has sent too many requests without a valid key.
    async fn refuse_unauthenticated(&self, session: &mut Session, ctx: &mut Ctx, why: AuthFailure) {
        ctx.auth_failure = Some(why);
        METRICS
            .auth_failures
            .with_label_values(&[why.as_str()])
            .inc();
        let peer = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(SocketAddr::ip)
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        let forwarded: Vec<&[u8]> = session
            .req_header()
            .headers
            .get_all("x-forwarded-for")
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        let client = self.unauth.client(peer, &forwarded);
        let refusal = match self.unauth.check(client, unix_now()) {
            UnauthDecision::Allowed(limit) => Refusal::unauthorized(why.message(), limit),
            UnauthDecision::Refused { limit, retry_after } => {
                Refusal::unauthenticated_flood(limit, retry_after)
            }
        };
        refuse(session, &ctx.request_id, refusal).await;
    }
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx {
            started: Instant::now(),
            request_id: String::new(),
            trace: None,
            route: Route::Other,
            key: None,
            rate: None,
            auth_failure: None,
            store_time: None,
            store_degraded: false,
            upstream: None,
            upstream_tries: 0,
            upstream_started: None,
            upstream_time: None,
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        // A client that stalls while sending its body is cut off, not waited on.
        session.set_read_timeout(Some(self.client_read_timeout));
        let req = session.req_header();
        ctx.request_id = request_id(req);
        ctx.trace = Some(TraceContext::from_header(
            req.headers.get("traceparent").map(|v| v.as_bytes()),
        ));
        ctx.route = Route::of(&req.method, req.uri.path());
        if let Some((status, message)) = refuse_shape(req) {
            refuse(
                session,
                &ctx.request_id,
                Refusal::bad_shape(status, message),
            )
            .await;
            return Ok(true);
        }
        // A token shaped like one of our keys must carry a valid checksum: a typo or a made-up
        // key is refused as malformed before it is hashed or looked up.
        let token = bearer_token(
            req.headers
                .get_all("authorization")
                .iter()
                .map(|v| v.as_bytes()),
        )
        .and_then(|t| {
            if format::plausible(t, &self.api_key_prefix) {
                Ok(t)
            } else {
                Err(AuthFailure::Checksum)
            }
        });

        // Read what this request needs from the current keys and plans, then let go of the
        // snapshot before awaiting anything.
        let found = {
            let snapshot = self.catalog.snapshot();
            token.and_then(|t| {
                let key = snapshot.keys.lookup(t).ok_or(AuthFailure::Unknown)?;
                if key.expired(unix_now()) {
                    return Err(AuthFailure::Expired);
                }
                let limits = snapshot.plans.get(&key.plan).map(|p| key.limits(p.limits));
                Ok((key.clone(), limits))
            })
        };
        let (key, limits) = match found {
            Ok(found) => found,
            Err(why) => {
                self.refuse_unauthenticated(session, ctx, why).await;
                return Ok(true);
            }
        };
        ctx.key = Some(key.clone());
        // Only the versioned API is forwarded: the backend's operational endpoints (such as its
        // /metrics) are not for API clients.
        if !session.req_header().uri.path().starts_with("/v1/") {
            refuse(session, &ctx.request_id, Refusal::not_found()).await;
            return Ok(true);
        }
        let Some(limits) = limits else {
            tracing::error!(key_id = %key.id, plan = %key.plan, "key's plan is missing");
            refuse(session, &ctx.request_id, Refusal::plan_missing()).await;
            return Ok(true);
        };
        // Where the quota stands, without spending any of it.
        if ctx.route == Route::RateLimit {
            ctx.rate = self
                .quota_status
                .answer(session, &ctx.request_id, &key, limits)
                .await;
            return Ok(true);
        }
        if session.req_header().uri.path() == "/v1/rate_limit" {
            refuse(session, &ctx.request_id, Refusal::get_only()).await;
            return Ok(true);
        }

        let decision = self.admission.decide(&key, limits).await;
        ctx.store_time = decision.store_time;
        ctx.store_degraded = decision.degraded;
        ctx.rate = decision.view;
        let plan = &*key.plan;
        if decision.ban_started {
            METRICS.bans.with_label_values(&[plan]).inc();
        }
        let refusal = match (decision.outcome, ctx.rate.as_ref()) {
            (Outcome::Admitted, _) => {
                return match read_h2_body(session, self.client_read_timeout).await? {
                    Ok(()) => Ok(false),
                    Err(why) => {
                        let refusal = Refusal::unread_body(why, ctx.rate.as_ref());
                        refuse(session, &ctx.request_id, refusal).await;
                        Ok(true)
                    }
                };
            }
            (Outcome::Limited, Some(view)) => Refusal::rate_limited(view),
            (Outcome::Banned, Some(view)) => Refusal::banned(view),
            (Outcome::StoreUnavailable, _) | (_, None) => Refusal::store_unavailable(),
        };
        if let RateHeaders::Plan(view) = refusal.rate {
            METRICS
                .rate_limited
                .with_label_values(&[plan, view.binding.as_str()])
                .inc();
        }
        refuse(session, &ctx.request_id, refusal).await;
        Ok(true)
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        // A retry goes to another backend than the one that just failed, when there is one.
        let addr = self.upstreams.pick(ctx.upstream);
        ctx.upstream = Some(addr);
        ctx.upstream_tries += 1;
        ctx.upstream_started = Some(Instant::now());
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
        // Nothing reached the backend, so any request may go to another one.
        if let Some(addr) = ctx.upstream {
            self.upstreams.mark_down(addr);
            tracing::warn!(upstream = %addr, error = %e, "backend connection failed; skipping it for a while");
        }
        if ctx.upstream_tries < self.upstreams.len() {
            e.set_retry(true);
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
        upstream.remove_header("authorization");
        if let Some(key) = &ctx.key {
            upstream.insert_header("x-api-key-id", &*key.id)?;
            upstream.insert_header("x-plan", &*key.plan)?;
        }
        upstream.insert_header("x-request-id", &ctx.request_id)?;
        if let Some(trace) = &ctx.trace {
            // The backend's parent is this gateway's span; an invalid `traceparent` from the
            // client is replaced, never passed on.
            upstream.insert_header("traceparent", trace.traceparent())?;
            if trace.parent_id.is_none() {
                // A new trace: the client's `tracestate` belonged to no valid trace.
                upstream.remove_header("tracestate");
            }
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        ctx.upstream_time = ctx.upstream_started.map(|t| t.elapsed());
        if let Some(view) = &ctx.rate {
            insert_rate_headers(upstream_response, RateHeaders::Plan(view));
        }
        upstream_response.insert_header("x-request-id", &ctx.request_id)?;
        Ok(())
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        // Once the head is out, the status and length are promised: an error body written now
        // would be spliced into the live body and delivered as a success. Abort instead (the
        // connection or stream is dropped unfinished), so the client sees it incomplete.
        if session.response_written().is_some() {
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
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        let plan = ctx.key.as_ref().map_or("none", |k| &*k.plan);
        metric_handles::count_request(&self.env, ctx.route, plan, status);
        metric_handles::observe_request(ctx.route, ctx.started.elapsed().as_secs_f64());
        if let Some(t) = ctx.upstream_time {
            metric_handles::observe_upstream(ctx.route, t.as_secs_f64());
        }
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
            duration_us = ctx.started.elapsed().as_micros() as u64,
            store_degraded = ctx.store_degraded,
            error = e.map(|e| e.etype().as_str()),
        );
    }
}
