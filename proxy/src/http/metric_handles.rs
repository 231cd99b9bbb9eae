//! The per-request metrics without a label lookup per request: the prometheus crate's
//! `with_label_values` hashes every label value and takes a lock on each call, so the handles
//! are resolved once, per route for the latency histograms (a fixed set) and per
//! (environment, route, plan, status) for the request counter, in a per-thread cache that needs
//! no lock and allocates only when it meets a new label set.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::LazyLock;

use prometheus::{Histogram, IntCounter};

use crate::base::metrics::METRICS;
use crate::http::routes::Route;

const ROUTES: [Route; 6] = [
    Route::ListPets,
    Route::CreatePet,
    Route::GetPet,
    Route::ListOrders,
    Route::RateLimit,
    Route::Other,
];

struct RouteHandles {
    request_duration: Histogram,
    upstream_duration: Histogram,
}

static BY_ROUTE: LazyLock<Vec<RouteHandles>> = LazyLock::new(|| {
    ROUTES
        .iter()
        .map(|r| RouteHandles {
            request_duration: METRICS.request_duration.with_label_values(&[r.as_str()]),
            upstream_duration: METRICS.upstream_duration.with_label_values(&[r.as_str()]),
        })
        .collect()
});

fn route_handles(route: Route) -> &'static RouteHandles {
    // Exhaustive: a new route must be given its place here (and in ROUTES).
    let i = match route {
        Route::ListPets => 0,
        Route::CreatePet => 1,
        Route::GetPet => 2,
        Route::ListOrders => 3,
        Route::RateLimit => 4,
        Route::Other => 5,
    };
    &BY_ROUTE[i]
}

/// Past this many plans for one (route, status) a thread stops caching new ones and looks them
/// up each time: the cache cannot grow without bound however plans are renamed.
const MAX_PLANS_CACHED: usize = 64;

type Counters = HashMap<(Route, u16), Vec<(Box<str>, Box<str>, IntCounter)>>;

thread_local! {
    static REQUESTS: RefCell<Counters> = RefCell::new(HashMap::new());
}

/// Counts one finished request in `pet_gateway_requests_total`.
pub fn count_request(env: &str, route: Route, plan: &str, status: u16) {
    REQUESTS.with(|cache| {
        let mut cache = cache.borrow_mut();
        let entries = cache.entry((route, status)).or_default();
        if let Some((_, _, c)) = entries.iter().find(|(e, p, _)| &**e == env && &**p == plan) {
            c.inc();
            return;
        }
        let mut buf = itoa::Buffer::new();
        let counter =
            METRICS
                .requests
                .with_label_values(&[env, route.as_str(), plan, buf.format(status)]);
        counter.inc();
        if entries.len() < MAX_PLANS_CACHED {
            entries.push((env.into(), plan.into(), counter));
        }
    })
}

/// Observes a request's total time for its route.
pub fn observe_request(route: Route, seconds: f64) {
    route_handles(route).request_duration.observe(seconds);
}

/// Observes the backend's time to a response head for a route.
pub fn observe_upstream(route: Route, seconds: f64) {
    route_handles(route).upstream_duration.observe(seconds);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_handles_count_in_the_labelled_series() {
        let series = || {
            METRICS
                .requests
                .with_label_values(&["handles-test", "getPet", "pro", "429"])
                .get()
        };
        let before = series();
        for _ in 0..3 {
            count_request("handles-test", Route::GetPet, "pro", 429);
        }
        count_request("handles-test", Route::GetPet, "free", 429);
        assert_eq!(series(), before + 3);
        let h = METRICS.request_duration.with_label_values(&["listOrders"]);
        let n = h.get_sample_count();
        observe_request(Route::ListOrders, 0.01);
        assert_eq!(h.get_sample_count(), n + 1);
    }
}
