//! A request's state, carried from phase to phase and from step to step: what the request path
//! learned (its id, trace, route, key, limits) and what the access log and metrics report.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::http::auth::AuthFailure;
use crate::http::routes::Route;
use crate::http::trace::TraceContext;
use crate::keys::index::KeyInfo;
use crate::keys::plans::{Limits, NotifyAt};
use crate::quota::concurrency::Slot;
use crate::quota::rules::RateView;
use crate::upstream::places::{Place, Shed};
use crate::upstream::priority::Level;

pub struct Ctx {
    pub started: Instant,
    pub request_id: String,
    /// This request's place in its W3C trace (joined or started by the first step).
    pub trace: Option<TraceContext>,
    /// What it noted of its path for its spans: only when it is sampled.
    pub spans: Option<Box<crate::http::spans::Recording>>,
    /// The quota decision's outcome, when one was made.
    pub outcome: Option<crate::quota::admission::Outcome>,
    pub route: Route,
    pub key: Option<KeyInfo>,
    /// The key's limits in force: its own, else its plan's; `None` while its plan is missing.
    pub limits: Option<Limits>,
    /// What this request's operation costs under the key's plan, in units of its windows.
    pub cost: u64,
    /// The plan's `notify_at`: the thresholds whose crossing this request reports.
    pub notify_at: NotifyAt,
    pub rate: Option<RateView>,
    pub auth_failure: Option<AuthFailure>,
    pub store_time: Option<Duration>,
    pub store_degraded: bool,
    /// Its level when waiting for a place at the backend (its operation's and its plan's).
    pub level: Level,
    /// Its place among its quota's requests in flight (plans and keys with a concurrency):
    /// given back when the request's state is dropped, however the request ends.
    pub slot: Option<Slot>,
    /// Its place at the backend: given back when the backend's answer has come whole, or
    /// with the request's state.
    pub place: Option<Place>,
    /// How long it waited for that place, when it had to.
    pub queue_time: Option<Duration>,
    /// Why it got no place (503 `overloaded`).
    pub shed: Option<Shed>,
    /// It was refused for its quota's requests in flight (429 `concurrency_limited`).
    pub concurrency_limited: bool,
    /// The gateway answered its `Expect: 100-continue` itself (its body was read before it
    /// went on): the backend is not asked for another.
    pub continued: bool,
    pub upstream: Option<SocketAddr>,
    /// The backend's index in the rotation (`upstream` is its address).
    pub backend: Option<usize>,
    pub upstream_tries: usize,
    /// This request was already sent again after a new connection closed unanswered: once is
    /// enough to ride out a backend's restart, and a request that makes backends drop it (a
    /// query of death) reaches two of them at most.
    pub retried_unanswered: bool,
    /// The backend (given by host name) whose connection failed: its name is looked up again
    /// before the retry, once a request (it may have moved: a restarted container).
    pub look_up: Option<(usize, SocketAddr, pingora::ErrorType)>,
    pub looked_up: bool,
    pub upstream_started: Option<Instant>,
    pub upstream_time: Option<Duration>,
}

impl Ctx {
    pub fn new() -> Ctx {
        Ctx {
            started: Instant::now(),
            request_id: String::new(),
            trace: None,
            spans: None,
            outcome: None,
            route: Route::Other,
            key: None,
            limits: None,
            cost: 1,
            notify_at: NotifyAt::default(),
            rate: None,
            auth_failure: None,
            store_time: None,
            store_degraded: false,
            level: Level::Normal,
            slot: None,
            place: None,
            queue_time: None,
            shed: None,
            concurrency_limited: false,
            continued: false,
            upstream: None,
            backend: None,
            upstream_tries: 0,
            retried_unanswered: false,
            look_up: None,
            looked_up: false,
            upstream_started: None,
            upstream_time: None,
        }
    }
}

impl Default for Ctx {
    fn default() -> Ctx {
        Ctx::new()
    }
}
