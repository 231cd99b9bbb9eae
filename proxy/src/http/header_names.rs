//! The header names the gateway writes, each made once. An insert by a `&'static str` parses
//! the name, and allocates one that is not a standard header, on every request; one of these
//! is cloned (a static name's clone allocates nothing) and inserted as it is
//! (`vendor/pingora-http`, vendor/README.md's patch 4). Their wire form is as written here, lower case.

use http::{HeaderMap, HeaderName};
use pingora::http::StaticHeaderName;

pub static RATELIMIT_POLICY: StaticHeaderName = StaticHeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: StaticHeaderName = StaticHeaderName::from_static("ratelimit");
pub static X_RATELIMIT_LIMIT: StaticHeaderName = StaticHeaderName::from_static("x-ratelimit-limit");
pub static X_RATELIMIT_REMAINING: StaticHeaderName =
    StaticHeaderName::from_static("x-ratelimit-remaining");
pub static X_RATELIMIT_RESET: StaticHeaderName = StaticHeaderName::from_static("x-ratelimit-reset");
pub static X_REQUEST_ID: StaticHeaderName = StaticHeaderName::from_static("x-request-id");
pub static X_API_KEY_ID: StaticHeaderName = StaticHeaderName::from_static("x-api-key-id");
pub static X_PLAN: StaticHeaderName = StaticHeaderName::from_static("x-plan");
pub static TRACEPARENT: StaticHeaderName = StaticHeaderName::from_static("traceparent");
/// Removed by name: a `HeaderName` rather than a string parsed at each removal.
pub static TRACESTATE: http::HeaderName = http::HeaderName::from_static("tracestate");
pub static CONTENT_TYPE: StaticHeaderName = StaticHeaderName::from_static("content-type");
pub static CONTENT_LENGTH: StaticHeaderName = StaticHeaderName::from_static("content-length");
pub static CACHE_CONTROL: StaticHeaderName = StaticHeaderName::from_static("cache-control");
pub static RETRY_AFTER: StaticHeaderName = StaticHeaderName::from_static("retry-after");

/// Which of `names` a message's map holds, in one pass over its names. The gateway adds some
/// fields beside the maps (`add_unmapped_header`, vendor/README.md's patch 6), where they
/// replace nothing: a field of the same name that came with the message is found here and
/// removed first. A message seldom has one, and this costs less than a removal by each name.
/// (`keys` gives each name once, however many fields have it.)
pub fn held(headers: &HeaderMap, names: &[&StaticHeaderName]) -> Vec<HeaderName> {
    headers
        .keys()
        .filter(|name| {
            let first = name.as_str().as_bytes().first();
            names
                .iter()
                .any(|n| n.name().as_str().as_bytes().first() == first && n.name() == *name)
        })
        .cloned()
        .collect()
}
