//! The request path as an ordered list of steps: shape, key, versioned API, plan, the quota
//! status endpoint, admission (the windows and a place among the key's requests in flight),
//! body, a place at the backend. Each step returns `Ok(())` to go on, or stops the request
//! with a [`Refusal`] (written by the one exit, [`Pipeline::run`]'s caller), an answer the step
//! wrote itself ([`Stop::Answered`], `GET /v1/rate_limit`), or pingora's error. A new refusal
//! reason is one step (or one line in a step) and one constructor in `responses`.
//!
//! The steps are plain methods called in order, not boxed trait objects: the list costs
//! nothing per request.

// See `Step`: its large `Err` is moved, never boxed, on purpose.
#![allow(clippy::result_large_err)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use pingora::proxy::Session;
use pingora::Error;

use crate::base::clock::unix_now;
use crate::base::metrics::METRICS;
use crate::base::traces::Caller;
use crate::events::usage::Meter;
use crate::events::{lifecycle, threshold};
use crate::http::auth::{bearer_token, AuthFailure};
use crate::http::context::Ctx;
use crate::http::quota_status::QuotaStatus;
use crate::http::request::{path_fault, read_body, refuse_shape, request_id, target_fault};
use crate::http::responses::{RateHeaders, Refusal};
use crate::http::routes::Route;
use crate::http::spans::{self, Phase, Recording};
use crate::http::trace::TraceContext;
use crate::keys::catalog::Catalog;
use crate::keys::format;
use crate::keys::plans::NotifyAt;
use crate::quota::admission::{Admission, Outcome};
use crate::quota::concurrency::Slots;
use crate::quota::rules::{Binding, RateView};
use crate::quota::unauth::{UnauthDecision, UnauthLimiter};
use crate::upstream::places::Places;
use crate::upstream::priority::Priorities;

/// Why the request path stopped before forwarding.
pub enum Stop {
    /// Answer with this Error response; nothing is forwarded. Boxed: a refusal carries the
    /// request's whole rate view, and the path that goes on should not move it around.
    Refuse(Box<Refusal>),
    /// The gateway has written the whole answer itself.
    Answered,
    /// pingora failed (the client went away mid-body, say).
    Failed(Box<Error>),
}

impl Stop {
    pub fn refuse(refusal: Refusal) -> Stop {
        Stop::Refuse(Box::new(refusal))
    }
}

/// What one step decides: `Ok(())` goes on to the next step.
pub type Step = Result<(), Stop>;

/// What the steps need: the keys and plans in force, the quota decision, the limit on
/// unauthenticated clients and the quota status endpoint.
pub struct Pipeline {
    pub catalog: Arc<Catalog>,
    pub admission: Admission,
    pub unauth: Arc<UnauthLimiter>,
    pub quota_status: Arc<QuotaStatus>,
    pub api_key_prefix: String,
    pub client_read_timeout: Duration,
    /// Usage for the metering file, when there is one.
    pub meter: Option<Arc<Meter>>,
    /// Units admitted per quota holder, for the top consumers' index.
    pub top: Option<Arc<crate::quota::top::TopTally>>,
    /// The leases this node holds for requests in flight of quotas with a concurrency.
    pub slots: Arc<Slots>,
    /// Places at the backends, and the queue for them.
    pub places: Arc<Places>,
    /// Each operation's level when waiting for a place.
    pub priorities: Priorities,
    /// Traces, when they are on: which requests are sampled.
    pub tracing: Option<Arc<crate::base::traces::Tracing>>,
}

impl Pipeline {
    /// The steps, in order.
    pub async fn run(&self, session: &mut Session, ctx: &mut Ctx) -> Step {
        self.begin(session, ctx);
        shape(session, ctx)?;
        let t = spans::start(&ctx.spans);
        let authenticated = self.authenticate(session, ctx);
        spans::mark(&mut ctx.spans, Phase::Authenticate, t);
        authenticated?;
        versioned_only(session)?;
        plan_in_force(ctx)?;
        self.quota_status(session, ctx).await?;
        let t = spans::start(&ctx.spans);
        let admitted = self.admit(ctx).await;
        spans::mark(&mut ctx.spans, Phase::Decision, t);
        admitted?;
        self.body(session, ctx).await?;
        let t = spans::start(&ctx.spans);
        let placed = self.place(ctx).await;
        if ctx.queue_time.is_some() || ctx.shed.is_some() {
            spans::mark(&mut ctx.spans, Phase::Queue, t);
        }
        placed
    }

    /// Names the request (id, trace); never stops it.
    fn begin(&self, session: &mut Session, ctx: &mut Ctx) {
        // A client that stalls while sending its body is cut off, not waited on.
        session.set_read_timeout(Some(self.client_read_timeout));
        let req = session.req_header();
        ctx.request_id = request_id(req);
        let mut trace =
            TraceContext::from_header(req.headers.get("traceparent").map(|v| v.as_bytes()));
        if let Some(tracing) = &self.tracing {
            // A caller's sampled flag counts only from a trusted proxy; the ratio decides the rest.
            let caller = match trace.parent_id {
                None => Caller::New,
                Some(span_id) if client_ip(session).is_some_and(|ip| self.unauth.trusts(ip)) => {
                    Caller::Trusted {
                        span_id,
                        sampled: trace.flags & 1 == 1,
                    }
                }
                Some(_) => Caller::Untrusted,
            };
            let sampled = tracing.sampled(trace.trace_id, caller);
            trace.flags = u8::from(sampled);
            if sampled {
                ctx.spans = Some(Box::new(Recording::new(ctx.started)));
            }
        }
        ctx.trace = Some(trace);
    }

    /// The bearer token, its checksum, the key it names and the key's expiry; the key and its
    /// limits go into `ctx`. 401 (or 429 for a flood from one client) otherwise.
    fn authenticate(&self, session: &Session, ctx: &mut Ctx) -> Step {
        let req = session.req_header();
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
                let plan = snapshot.plans.get(&key.plan);
                let limits = plan.map(|p| key.limits(&p.limits));
                let cost = plan.map_or(1, |p| p.costs.of(ctx.route.cost_index()));
                let notify_at = plan.map_or_else(NotifyAt::default, |p| p.notify_at);
                let steps = plan.map_or(0, |p| p.priority);
                Ok((key.clone(), limits, cost, notify_at, steps))
            })
        };
        match found {
            Ok((key, limits, cost, notify_at, steps)) => {
                ctx.key = Some(key);
                ctx.limits = limits;
                ctx.cost = cost;
                ctx.notify_at = notify_at;
                ctx.level = self.priorities.level(ctx.route.cost_index(), steps);
                Ok(())
            }
            Err(why) => Err(Stop::refuse(self.unauthenticated(session, ctx, why))),
        }
    }

    /// 401, or 429 once the client's address has sent too many requests without a valid key.
    fn unauthenticated(&self, session: &Session, ctx: &mut Ctx, why: AuthFailure) -> Refusal {
        ctx.auth_failure = Some(why);
        METRICS
            .auth_failures
            .with_label_values(&[why.as_str()])
            .inc();
        let peer = client_ip(session).unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        let forwarded: Vec<&[u8]> = session
            .req_header()
            .headers
            .get_all("x-forwarded-for")
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        let client = self.unauth.client(peer, &forwarded);
        match self.unauth.check(client, unix_now()) {
            UnauthDecision::Allowed(limit) => Refusal::unauthorized(why.message(), limit),
            UnauthDecision::Refused { limit, retry_after } => {
                Refusal::unauthenticated_flood(limit, retry_after)
            }
        }
    }

    /// `GET /v1/rate_limit`: where the key's quota stands, answered here without spending any
    /// of it; any other method there is 405.
    async fn quota_status(&self, session: &mut Session, ctx: &mut Ctx) -> Step {
        let (Some(key), Some(limits)) = (&ctx.key, ctx.limits) else {
            return Ok(());
        };
        if ctx.route == Route::RateLimit {
            ctx.rate = self
                .quota_status
                .answer(session, &ctx.request_id, key, limits)
                .await;
            return Err(Stop::Answered);
        }
        if session.req_header().uri.path() == "/v1/rate_limit" {
            return Err(Stop::refuse(Refusal::get_only()));
        }
        Ok(())
    }

    /// The quota decision: admitted, or 429 (`rate_limited`, `api_key_banned`), or 503 when the
    /// store failed and `on_store_error = "closed"`.
    async fn admit(&self, ctx: &mut Ctx) -> Step {
        let (Some(key), Some(limits)) = (&ctx.key, ctx.limits) else {
            return Ok(());
        };
        let decision = self.admission.decide(key, limits, ctx.cost).await;
        ctx.outcome = Some(decision.outcome);
        ctx.store_time = decision.store_time;
        ctx.store_degraded = decision.degraded;
        ctx.rate = decision.view;
        if let (Some(top), Some(view), false, Outcome::Admitted) =
            (&self.top, &ctx.rate, decision.degraded, decision.outcome)
        {
            top.add(key.quota_id(), view.now, ctx.cost);
        }
        if let (Some(meter), Some(view), false) = (&self.meter, &ctx.rate, decision.degraded) {
            // What the store decided, at its clock: a node's guess while it is away is not.
            let admitted = match decision.outcome {
                Outcome::Admitted => Some(true),
                Outcome::Limited
                | Outcome::Banned
                | Outcome::ConcurrencyLimited
                | Outcome::Unleased => Some(false),
                Outcome::StoreUnavailable => None,
            };
            if let Some(admitted) = admitted {
                meter.record(key, ctx.route.as_str(), view.now, admitted, ctx.cost);
            }
            if admitted == Some(true) && !ctx.notify_at.is_empty() {
                for notice in threshold::crossed(key, view, ctx.cost, ctx.notify_at) {
                    meter.notify(notice);
                }
            }
            if decision.ban_started && view.binding == Binding::Ban {
                meter.notify(lifecycle::banned(key, view.now, view.reset));
            }
        }
        let plan = &*key.plan;
        if decision.ban_started {
            METRICS.bans.with_label_values(&[plan]).inc();
        }
        let refusal = match (decision.outcome, ctx.rate.as_ref()) {
            (Outcome::Admitted, view) => {
                if let Some(view) = view {
                    count_shadow_refusals(plan, view);
                }
                if decision.lease.taken() {
                    let now = view.map_or_else(unix_now, |v| v.now);
                    let quota = key.quota_id();
                    let held = (decision.lease, decision.local_lease);
                    ctx.slot = Some(self.slots.hold(quota, held.0, held.1, now));
                }
                return Ok(());
            }
            (Outcome::ConcurrencyLimited, Some(view)) => {
                ctx.concurrency_limited = true;
                METRICS
                    .overload_refusals
                    .with_label_values(&["concurrency", ctx.level.name()])
                    .inc();
                return Err(Stop::refuse(Refusal::concurrency_limited(view)));
            }
            (Outcome::Limited, Some(view)) => Refusal::rate_limited(view),
            (Outcome::Unleased, Some(view)) => Refusal::region_unleased(view),
            (Outcome::Banned, Some(view)) => Refusal::banned(view),
            (Outcome::StoreUnavailable, _) | (_, None) => Refusal::store_unavailable(),
        };
        if let RateHeaders::Plan(view) = refusal.rate {
            METRICS
                .rate_limited
                .with_label_values(&[plan, &view.binding.name()])
                .inc();
        }
        Err(Stop::refuse(refusal))
    }

    /// An admitted request's body, read whole under the client read timeout before it waits for
    /// a place at the backend (a slow upload holds none): 408 when it stalls, 413 when it is too
    /// large.
    async fn body(&self, session: &mut Session, ctx: &mut Ctx) -> Step {
        match read_body(session, self.client_read_timeout).await {
            Err(e) => Err(Stop::Failed(e)),
            Ok(Ok(continued)) => {
                ctx.continued = continued;
                Ok(())
            }
            Ok(Err(why)) => Err(Stop::refuse(Refusal::unread_body(why, ctx.rate.as_ref()))),
        }
    }

    /// A place at a backend: at once, or after waiting its turn, or 503 `overloaded` (shed
    /// before anything reaches the backend; the request keeps the units it spent, as a 502
    /// does, and gives its concurrency place back).
    async fn place(&self, ctx: &mut Ctx) -> Step {
        let Some(key) = &ctx.key else {
            return Ok(());
        };
        match self.places.acquire(key.quota_id(), ctx.level).await {
            Ok(place) => {
                ctx.queue_time = (!place.waited.is_zero()).then_some(place.waited);
                ctx.place = Some(place);
                Ok(())
            }
            Err(shed) => {
                METRICS
                    .overload_refusals
                    .with_label_values(&[shed.reason(), ctx.level.name()])
                    .inc();
                ctx.shed = Some(shed);
                Err(Stop::refuse(Refusal::overloaded(ctx.rate.as_ref())))
            }
        }
    }
}

/// Oversized or smuggling-prone requests, and paths not in canonical form, refused before
/// anything else is read: before the key, so a refusal costs no quota and needs no key. Only a
/// canonical path is given a route (the label, and later the cost): a path is sent on as it
/// came, so a route read off another spelling could be another operation at the backend.
fn shape(session: &Session, ctx: &mut Ctx) -> Step {
    let req = session.req_header();
    let fault = target_fault(req.raw_path()).or_else(|| path_fault(req.uri.path().as_bytes()));
    if fault.is_none() {
        ctx.route = Route::of(&req.method, req.uri.path());
    }
    if let Some((status, message)) = refuse_shape(req) {
        return Err(Stop::refuse(Refusal::bad_shape(status, message)));
    }
    match fault {
        Some(fault) => Err(Stop::refuse(Refusal::non_canonical_path(fault.message()))),
        None => Ok(()),
    }
}

/// Only the versioned API is forwarded: the backend's operational endpoints (such as its
/// /metrics) are not for API clients.
fn versioned_only(session: &Session) -> Step {
    if session.req_header().uri.path().starts_with("/v1/") {
        Ok(())
    } else {
        Err(Stop::refuse(Refusal::not_found()))
    }
}

/// A key whose plan is missing: reloads refuse such keys, so this is a bug, logged as one.
fn plan_in_force(ctx: &Ctx) -> Step {
    match (&ctx.key, ctx.limits) {
        (Some(key), None) => {
            tracing::error!(key_id = %key.id, plan = %key.plan, "key's plan is missing");
            Err(Stop::refuse(Refusal::plan_missing()))
        }
        _ => Ok(()),
    }
}

/// A shadow window this admitted request went past: what it would have refused.
fn count_shadow_refusals(plan: &str, view: &RateView) {
    for w in view.shadow_windows() {
        METRICS
            .shadow_refusals
            .with_label_values(&[plan, &w.every.name()])
            .inc();
    }
}

/// The peer's address (a proxy's, when there is one in front).
pub fn client_ip(session: &Session) -> Option<IpAddr> {
    session
        .client_addr()
        .and_then(|a| a.as_inet())
        .map(SocketAddr::ip)
}
