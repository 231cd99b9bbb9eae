//! The pingora phases, following pingora's own examples: every decision in `request_filter`,
//! headers on the way in (`upstream_request_filter`) and out (`response_filter`), error bodies
//! in `fail_to_proxy`, the access log in `logging`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorSource, ErrorType, Result};
use rand::RngCore;

use crate::auth::{bearer_token, AuthFailure};
use crate::catalog::Catalog;
use crate::config::{Config, OnStoreError};
use crate::keys::KeyInfo;
use crate::metrics::METRICS;
use crate::quota::{BanPolicy, Limits, Outcome, RateView, Verdict};
use crate::resilience::{BanCache, Breaker, LocalLimiter};
use crate::responses::{error_body, error_head, insert_rate_headers, ErrorCode, RateHeaders};
use crate::store::QuotaStore;
use crate::unauth::{UnauthDecision, UnauthLimiter};
use crate::upstreams::Upstreams;

/// The operation a request is for: the only route label metrics and logs ever carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Route {
    ListPets,
    CreatePet,
    GetPet,
    ListOrders,
    #[default]
    Other,
}

impl Route {
    pub fn of(method: &http::Method, path: &str) -> Route {
        let get = method == http::Method::GET;
        match path.strip_prefix("/v1") {
            Some("/pets") if get => Route::ListPets,
            Some("/pets") if method == http::Method::POST => Route::CreatePet,
            Some("/store/orders") if get => Route::ListOrders,
            Some(rest) if get => match rest.strip_prefix("/pets/") {
                Some(id) if !id.is_empty() && !id.contains('/') => Route::GetPet,
                _ => Route::Other,
            },
            _ => Route::Other,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Route::ListPets => "listPets",
            Route::CreatePet => "createPet",
            Route::GetPet => "getPet",
            Route::ListOrders => "listOrders",
            Route::Other => "other",
        }
    }
}

/// The shared parts of the gateway's fault handling (the admin listener and the store probe
/// hold them too).
#[derive(Clone, Default)]
pub struct Resilience {
    pub breaker: Arc<Breaker>,
    pub bans: Arc<BanCache>,
    pub local: Arc<LocalLimiter>,
}

/// What to do with a request, and the numbers for its rate-limit headers.
struct Decision {
    outcome: Outcome,
    view: RateView,
    ban_started: bool,
}

impl Decision {
    fn of(v: &Verdict, limits: Limits) -> Decision {
        Decision {
            outcome: v.outcome,
            view: RateView::new(v, limits),
            ban_started: v.ban_started,
        }
    }
}

/// Per-request state, carried from phase to phase.
pub struct Ctx {
    started: Instant,
    request_id: String,
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
    store: Arc<dyn QuotaStore>,
    /// Stops sending requests to a failing store; closed again by the probe.
    breaker: Arc<Breaker>,
    /// Bans this node knows of.
    bans: Arc<BanCache>,
    /// Counts on this node alone while the shared store fails (`on_store_error = "local"`).
    local: Arc<LocalLimiter>,
    on_store_error: OnStoreError,
    ban: BanPolicy,
    unauth: Arc<UnauthLimiter>,
    upstreams: Upstreams,
    connect_timeout: Duration,
    read_timeout: Duration,
    client_read_timeout: Duration,
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
            store,
            breaker: resilience.breaker,
            bans: resilience.bans,
            local: resilience.local,
            on_store_error: config.on_store_error,
            ban: config.ban.clone(),
            unauth,
            upstreams: Upstreams::new(config.upstreams.clone()),
            connect_timeout: config.upstream_connect_timeout,
            read_timeout: config.upstream_read_timeout,
            client_read_timeout: config.client_read_timeout,
        }
    }

    /// Decides a request of `key`: a ban this node knows of answers at once; otherwise the store
    /// decides, unless it is failing, in which case `on_store_error` does. `Err(())`: refuse
    /// with 503 (`closed`).
    async fn decide(
        &self,
        key: &KeyInfo,
        limits: Limits,
        ctx: &mut Ctx,
    ) -> std::result::Result<Decision, ()> {
        let now = crate::store::memory_now();
        let store_up = self.breaker.allows();
        if let Some(until) = self.bans.banned_until(&key.id, now, store_up) {
            return Ok(Decision::of(
                &Verdict {
                    outcome: Outcome::Banned,
                    now,
                    minute_count: 0,
                    day_count: 0,
                    ban_until: until,
                    ban_started: false,
                },
                limits,
            ));
        }
        if store_up {
            let started = Instant::now();
            let result = self.store.acquire(&key.id, limits, &self.ban).await;
            let elapsed = started.elapsed();
            ctx.store_time = Some(elapsed);
            METRICS.store_duration.observe(elapsed.as_secs_f64());
            match result {
                Ok(v) => {
                    self.breaker.success();
                    METRICS.store_fallback.set(0);
                    if v.outcome == Outcome::Banned {
                        self.bans.remember(&key.id, v.ban_until);
                    }
                    return Ok(Decision::of(&v, limits));
                }
                Err(error) => {
                    METRICS
                        .store_errors
                        .with_label_values(&[error.kind()])
                        .inc();
                    if self.breaker.failure() {
                        tracing::error!(error = %error, mode = ?self.on_store_error,
                            "quota store failing: deciding without it until it answers again");
                    } else {
                        tracing::warn!(error = %error, key_id = %key.id, "quota store call failed");
                    }
                }
            }
        }
        ctx.store_degraded = true;
        METRICS.store_fallback.set(1);
        match self.on_store_error {
            OnStoreError::Closed => Err(()),
            OnStoreError::Open => Ok(Decision::of(
                &Verdict {
                    outcome: Outcome::Admitted,
                    now,
                    minute_count: 0,
                    day_count: 0,
                    ban_until: 0,
                    ban_started: false,
                },
                limits,
            )),
            OnStoreError::Local => {
                let (outcome, view) = self.local.check(&key.id, limits, now);
                Ok(Decision {
                    outcome,
                    view,
                    ban_started: false,
                })
            }
        }
    }

    async fn refuse_unauthenticated(&self, session: &mut Session, ctx: &mut Ctx, why: AuthFailure) {
        ctx.auth_failure = Some(why);
        METRICS
            .auth_failures
            .with_label_values(&[why.as_str()])
            .inc();
        let ip = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(SocketAddr::ip)
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        match self.unauth.check(ip, crate::store::memory_now()) {
            UnauthDecision::Allowed(limit) => {
                let body = error_body(401, ErrorCode::Unauthorized, why.message());
                let mut head =
                    error_head(401, body.len(), &ctx.request_id, RateHeaders::Simple(limit));
                let _ = head.insert_header("www-authenticate", "Bearer");
                write(session, head, body).await;
            }
            UnauthDecision::Refused { limit, retry_after } => {
                let body = error_body(
                    429,
                    ErrorCode::RateLimited,
                    "too many requests without a valid API key from this address",
                );
                let mut head =
                    error_head(429, body.len(), &ctx.request_id, RateHeaders::Simple(limit));
                let _ = head.insert_header("retry-after", retry_after);
                write(session, head, body).await;
            }
        }
    }
}

async fn write(session: &mut Session, head: ResponseHeader, body: bytes::Bytes) {
    if let Err(e) = session.write_response_header(Box::new(head), false).await {
        tracing::debug!(error = %e, "client went away before the response head");
        return;
    }
    if let Err(e) = session.write_response_body(Some(body), true).await {
        tracing::debug!(error = %e, "client went away before the response body");
    }
}

/// Largest total of request header names and values accepted, and most headers.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
pub const MAX_HEADERS: usize = 100;

/// Requests refused for their shape before anything else looks at them: oversized headers, and
/// a body framed two ways (`Content-Length` with `Transfer-Encoding`), the classic request
/// smuggling vector, which is refused outright rather than resolved.
fn refuse_shape(req: &RequestHeader) -> Option<(u16, &'static str)> {
    let headers = &req.headers;
    if headers.len() > MAX_HEADERS {
        return Some((431, "too many request headers"));
    }
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if bytes > MAX_HEADER_BYTES {
        return Some((431, "request headers exceed 64 KiB"));
    }
    if headers.contains_key("content-length") && headers.contains_key("transfer-encoding") {
        return Some((
            400,
            "Content-Length and Transfer-Encoding together are not accepted",
        ));
    }
    None
}

/// Keeps a client's `X-Request-Id` when it is sane (short, visible ASCII), else makes one.
fn request_id(req: &RequestHeader) -> String {
    if let Some(v) = req.headers.get("x-request-id") {
        let b = v.as_bytes();
        if !b.is_empty() && b.len() <= 128 && b.iter().all(|c| c.is_ascii_graphic()) {
            if let Ok(s) = v.to_str() {
                return s.to_owned();
            }
        }
    }
    let mut raw = [0u8; 16];
    rand::rng().fill_bytes(&mut raw);
    hex::encode(raw)
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx {
            started: Instant::now(),
            request_id: String::new(),
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
        ctx.route = Route::of(&req.method, req.uri.path());
        if let Some((status, message)) = refuse_shape(req) {
            session.set_keepalive(None);
            let body = error_body(status, ErrorCode::InvalidRequest, message);
            write(
                session,
                error_head(status, body.len(), &ctx.request_id, RateHeaders::None),
                body,
            )
            .await;
            return Ok(true);
        }
        let token = bearer_token(
            req.headers
                .get_all("authorization")
                .iter()
                .map(|v| v.as_bytes()),
        );

        // Read what this request needs from the current keys and plans, then let go of the
        // snapshot before awaiting anything.
        let found = {
            let snapshot = self.catalog.snapshot();
            token.and_then(|t| {
                let key = snapshot.keys.lookup(t).ok_or(AuthFailure::Unknown)?;
                Ok((key.clone(), snapshot.plans.get(&key.plan).map(|p| p.limits)))
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
            let body = error_body(404, ErrorCode::NotFound, "no such resource");
            write(
                session,
                error_head(404, body.len(), &ctx.request_id, RateHeaders::None),
                body,
            )
            .await;
            return Ok(true);
        }
        let Some(limits) = limits else {
            // Reloads refuse keys whose plan is missing, so this is a bug, not an input error.
            tracing::error!(key_id = %key.id, plan = %key.plan, "key's plan is missing");
            let body = error_body(500, ErrorCode::Internal, "the key's plan is not configured");
            write(
                session,
                error_head(500, body.len(), &ctx.request_id, RateHeaders::None),
                body,
            )
            .await;
            return Ok(true);
        };

        let decision = match self.decide(&key, limits, ctx).await {
            Ok(d) => d,
            Err(()) => {
                let body = error_body(
                    503,
                    ErrorCode::Internal,
                    "the rate-limit store is unavailable; try again shortly",
                );
                let mut head = error_head(503, body.len(), &ctx.request_id, RateHeaders::None);
                let _ = head.insert_header("retry-after", 1);
                write(session, head, body).await;
                return Ok(true);
            }
        };
        let view = decision.view;
        ctx.rate = Some(view);
        let plan = &*key.plan;
        let window = if decision.outcome == Outcome::Banned {
            "ban"
        } else if view.limit == limits.per_day && view.reset == view.day_reset {
            "day"
        } else {
            "minute"
        };
        if decision.ban_started {
            METRICS.bans.with_label_values(&[plan]).inc();
        }
        let (code, message) = match decision.outcome {
            Outcome::Admitted => return Ok(false),
            Outcome::Limited => (
                ErrorCode::RateLimited,
                "rate limit exceeded; retry after the number of seconds in Retry-After",
            ),
            Outcome::Banned => (
                ErrorCode::ApiKeyBanned,
                "this API key is temporarily banned for sending requests after being rate limited",
            ),
        };
        METRICS
            .rate_limited
            .with_label_values(&[plan, window])
            .inc();
        let body = error_body(429, code, message);
        let mut head = error_head(429, body.len(), &ctx.request_id, RateHeaders::Plan(&view));
        let _ = head.insert_header("retry-after", view.retry_after.unwrap_or(1));
        write(session, head, body).await;
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
        peer: &HttpPeer,
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
        let _ = peer;
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
        use ErrorType::*;
        let (status, code, message) = match (e.esource(), e.etype()) {
            (_, HTTPStatus(status)) if *status >= 400 && *status < 500 => (
                *status,
                ErrorCode::InvalidRequest,
                "the request could not be processed",
            ),
            (ErrorSource::Upstream, ConnectTimedout | ReadTimedout | WriteTimedout) => (
                504,
                ErrorCode::GatewayTimeout,
                "the backend did not answer in time",
            ),
            (ErrorSource::Upstream, _) | (_, ConnectRefused | ConnectNoRoute | ConnectError) => (
                502,
                ErrorCode::BadGateway,
                "the backend could not be reached",
            ),
            (ErrorSource::Downstream, ReadError | WriteError | ConnectionClosed) => {
                return FailToProxy {
                    error_code: 0,
                    can_reuse_downstream: false,
                }
            }
            (ErrorSource::Downstream, ReadTimedout) => (
                408,
                ErrorCode::InvalidRequest,
                "the request body did not arrive in time",
            ),
            (ErrorSource::Downstream, _) => (
                400,
                ErrorCode::InvalidRequest,
                "the request could not be read",
            ),
            _ => (
                500,
                ErrorCode::Internal,
                "the gateway failed to handle the request",
            ),
        };
        // Pingora closes the client connection after a failed proxy attempt; say so in the
        // response, or a client would reuse the connection and lose its next request.
        session.set_keepalive(None);
        let body = error_body(status, code, message);
        let rate = ctx
            .rate
            .as_ref()
            .map_or(RateHeaders::None, RateHeaders::Plan);
        let head = error_head(status, body.len(), &ctx.request_id, rate);
        write(session, head, body).await;
        FailToProxy {
            error_code: status,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        let route = ctx.route.as_str();
        let plan = ctx.key.as_ref().map_or("none", |k| &*k.plan);
        let mut status_buf = itoa::Buffer::new();
        METRICS
            .requests
            .with_label_values(&[&self.env, route, plan, status_buf.format(status)])
            .inc();
        METRICS
            .request_duration
            .with_label_values(&[route])
            .observe(ctx.started.elapsed().as_secs_f64());
        if let Some(t) = ctx.upstream_time {
            METRICS
                .upstream_duration
                .with_label_values(&[route])
                .observe(t.as_secs_f64());
        }
        tracing::info!(
            target: "access",
            request_id = %ctx.request_id,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_the_operation_names() {
        let get = http::Method::GET;
        assert_eq!(Route::of(&get, "/v1/pets"), Route::ListPets);
        assert_eq!(Route::of(&http::Method::POST, "/v1/pets"), Route::CreatePet);
        assert_eq!(Route::of(&get, "/v1/pets/42"), Route::GetPet);
        assert_eq!(Route::of(&get, "/v1/store/orders"), Route::ListOrders);
        for (m, p) in [
            (&get, "/v1/pets/"),
            (&get, "/v1/pets/1/x"),
            (&get, "/admin"),
            (&http::Method::DELETE, "/v1/pets"),
        ] {
            assert_eq!(Route::of(m, p), Route::Other, "{m} {p}");
        }
    }
}
