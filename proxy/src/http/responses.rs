//! Responses the gateway writes itself (401, 429, 502, 504, ...): always the interface's Error
//! object as JSON, with the rate-limit headers the design puts on every response.
//!
//! Every refusal is a [`Refusal`] and leaves through one function, [`refuse`]; the table that
//! turns a failed proxy attempt into a status ([`Refusal::for_proxy_error`]) lives here too, so
//! what a client can be told is all in one file.

use bytes::Bytes;
use http::HeaderValue;
use pingora::http::{ResponseHeader, StaticHeaderName};
use pingora::proxy::Session;
use pingora::{Error, ErrorSource, ErrorType};
use serde::Serialize;

use crate::http::header_names as names;
use crate::quota::rules::{RateView, SimpleLimit};

/// The Error `code` values the gateway emits (the backend emits the rest of the design's list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    InvalidRequest,
    Unauthorized,
    /// The admin API's: a request from another site, or by a name it does not answer to.
    Forbidden,
    NotFound,
    MethodNotAllowed,
    PayloadTooLarge,
    /// 415: the admin API's, for a change whose body is not declared JSON.
    UnsupportedMediaType,
    RateLimited,
    /// 429: the key's (or its customer's) requests in flight are at its concurrency.
    ConcurrencyLimited,
    /// 429: a region's: the region holds none of the key's quota left and could not get more
    /// from the global store in time.
    RegionUnleased,
    ApiKeyBanned,
    BadGateway,
    /// 503: the backend is at its limit and the request was shed before reaching it.
    Overloaded,
    GatewayTimeout,
    /// The admin API's: a change this node cannot make as configured.
    Conflict,
    Internal,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::ConcurrencyLimited => "concurrency_limited",
            ErrorCode::RegionUnleased => "region_unleased",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::ApiKeyBanned => "api_key_banned",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::BadGateway => "bad_gateway",
            ErrorCode::GatewayTimeout => "gateway_timeout",
            ErrorCode::Conflict => "conflict",
            ErrorCode::Internal => "internal",
        }
    }
}

pub fn error_body(status: u16, code: ErrorCode, message: &str) -> Bytes {
    #[derive(Serialize)]
    struct Body<'a> {
        code: &'a str,
        message: &'a str,
        status: u16,
    }
    serde_json::to_vec(&Body {
        code: code.as_str(),
        message,
        status,
    })
    .map(Bytes::from)
    .unwrap_or_else(|_| {
        Bytes::from_static(br#"{"code":"internal","message":"error","status":500}"#)
    })
}

/// Which rate-limit headers a response carries.
#[derive(Debug, Clone, Copy)]
pub enum RateHeaders {
    /// By value: a refusal carries it out of the request's context (it is `Copy`, and small).
    Plan(RateView),
    Simple(SimpleLimit),
    None,
}

/// The rate-limit headers, added beside the head's maps (`add_unmapped_header`,
/// vendor/README.md's patch 6): nothing reads them back, and an insert hashes and probes two
/// maps for each. Their values are written into one buffer and each header's is a slice of it:
/// one allocation instead of five. Beside the maps, a later `insert_header` of one of these
/// names would add a second field, not replace it: the gateway inserts none of them.
pub fn add_rate_headers(resp: &mut ResponseHeader, rate: RateHeaders) {
    let mut buf = String::with_capacity(160);
    let mut ends = [0usize; 5];
    let (limit, remaining, reset) = match rate {
        RateHeaders::Plan(v) => {
            v.push_policy(&mut buf);
            ends[0] = buf.len();
            v.push_ratelimit(&mut buf);
            ends[1] = buf.len();
            (v.limit, v.remaining, v.reset)
        }
        RateHeaders::Simple(s) => (s.limit, s.remaining, s.reset),
        RateHeaders::None => return,
    };
    for (at, n) in [(2, limit), (3, remaining), (4, reset)] {
        buf.push_str(itoa::Buffer::new().format(n));
        ends[at] = buf.len();
    }
    let buf = Bytes::from(buf);
    let plan = matches!(rate, RateHeaders::Plan(_));
    let mut start = 0;
    for (i, (name, end)) in RATE_HEADERS.iter().copied().zip(ends).enumerate() {
        if i >= 2 || plan {
            if let Ok(value) = HeaderValue::from_maybe_shared(buf.slice(start..end)) {
                let _ = resp.add_unmapped_header(name, value);
            }
        }
        start = end;
    }
}

/// Removes the backend's own fields of the names the gateway adds to its answer (the request
/// id always, the rate-limit headers when `rate`): added beside the maps, they replace nothing
/// by themselves, and a client must not see two of them.
pub fn clear_added_headers(resp: &mut ResponseHeader, rate: bool) {
    let added = if rate {
        &ANSWER_HEADERS[..]
    } else {
        &ANSWER_HEADERS[..1]
    };
    for name in names::held(&resp.headers, added) {
        resp.remove_header(&name);
    }
}

/// The request id, then the rate-limit headers ([`RATE_HEADERS`]).
static ANSWER_HEADERS: [&StaticHeaderName; 6] = [
    &names::X_REQUEST_ID,
    &names::RATELIMIT_POLICY,
    &names::RATELIMIT,
    &names::X_RATELIMIT_LIMIT,
    &names::X_RATELIMIT_REMAINING,
    &names::X_RATELIMIT_RESET,
];

/// The headers [`add_rate_headers`] adds, in its order.
static RATE_HEADERS: &[&StaticHeaderName] = ANSWER_HEADERS.split_at(1).1;

/// A complete JSON response head (an Error, or an answer the gateway gives itself); the caller
/// writes the body after it.
pub fn json_head(
    status: u16,
    body_len: usize,
    request_id: &str,
    rate: RateHeaders,
) -> ResponseHeader {
    let mut resp = match ResponseHeader::build(status, Some(10)) {
        Ok(r) => r,
        Err(_) => ResponseHeader::build(500, Some(10)).expect("500 is a valid status"),
    };
    let _ = resp.insert_header(&names::CONTENT_TYPE, "application/json");
    let _ = resp.insert_header(&names::CONTENT_LENGTH, body_len);
    let _ = resp.insert_header(&names::CACHE_CONTROL, "no-store");
    if !request_id.is_empty() {
        let _ = resp.add_unmapped_header(&names::X_REQUEST_ID, request_id);
    }
    add_rate_headers(&mut resp, rate);
    resp
}

/// A response the gateway answers itself instead of forwarding.
#[derive(Debug, Clone, Copy)]
pub struct Refusal {
    pub status: u16,
    pub code: ErrorCode,
    pub message: &'static str,
    pub rate: RateHeaders,
    /// Whole seconds for `Retry-After`.
    pub retry_after: Option<u64>,
    pub extra_headers: &'static [(&'static str, &'static str)],
    /// Close the client connection after this response (framing that cannot be trusted, or a
    /// failed proxy attempt, after which pingora closes it anyway).
    pub close: bool,
}

impl Refusal {
    fn new(status: u16, code: ErrorCode, message: &'static str) -> Refusal {
        Refusal {
            status,
            code,
            message,
            rate: RateHeaders::None,
            retry_after: None,
            extra_headers: &[],
            close: false,
        }
    }

    /// A request refused for its shape (oversized headers, smuggling-prone framing).
    pub fn bad_shape(status: u16, message: &'static str) -> Refusal {
        Refusal {
            close: true,
            ..Refusal::new(status, ErrorCode::InvalidRequest, message)
        }
    }

    /// 400 for a path not in canonical form (`request::PathFault`): the connection stays open,
    /// its framing was sound.
    pub fn non_canonical_path(message: &'static str) -> Refusal {
        Refusal::new(400, ErrorCode::InvalidRequest, message)
    }

    /// A request body that stalled (408) or was too large (413); the request was admitted, so
    /// its rate-limit headers go with it. An HTTP/1 connection closes (its unread body would
    /// otherwise be drained, however slowly it comes); an HTTP/2 one's other streams go on.
    pub fn unread_body(why: crate::http::request::BodyRefusal, rate: Option<&RateView>) -> Refusal {
        let (status, code, message) = match why {
            crate::http::request::BodyRefusal::Stalled => (
                408,
                ErrorCode::InvalidRequest,
                "the request body did not arrive in time",
            ),
            crate::http::request::BodyRefusal::TooLarge => (
                413,
                ErrorCode::PayloadTooLarge,
                "request body exceeds 65536 bytes",
            ),
        };
        Refusal {
            rate: rate.map_or(RateHeaders::None, |v| RateHeaders::Plan(*v)),
            close: true,
            ..Refusal::new(status, code, message)
        }
    }

    /// 401 for a missing, malformed, unknown or revoked key; reports the per-IP limit.
    pub fn unauthorized(message: &'static str, limit: SimpleLimit) -> Refusal {
        Refusal {
            rate: RateHeaders::Simple(limit),
            extra_headers: &[("www-authenticate", "Bearer")],
            ..Refusal::new(401, ErrorCode::Unauthorized, message)
        }
    }

    /// 429 for a key asking `GET /v1/rate_limit` more often than that endpoint allows; its
    /// headers are that endpoint's own limit, not the plan's.
    pub fn quota_status_limited(limit: SimpleLimit, retry_after: u64) -> Refusal {
        Refusal::limited_apart(
            limit,
            retry_after,
            "GET /v1/rate_limit answers a key once a second on average (10 at once); it never \
             counts against the plan",
        )
    }

    /// 429 for an address that sent too many requests without a valid key.
    pub fn unauthenticated_flood(limit: SimpleLimit, retry_after: u64) -> Refusal {
        Refusal::limited_apart(
            limit,
            retry_after,
            "too many requests without a valid API key from this address",
        )
    }

    /// 429 `rate_limited` under a limit of its own, not a plan's: its headers are that limit.
    fn limited_apart(limit: SimpleLimit, retry_after: u64, message: &'static str) -> Refusal {
        Refusal {
            rate: RateHeaders::Simple(limit),
            retry_after: Some(retry_after),
            ..Refusal::new(429, ErrorCode::RateLimited, message)
        }
    }

    /// 404 for anything outside the versioned API (the backend's own endpoints included).
    /// 405 for a method other than GET on an endpoint the gateway answers itself.
    pub fn get_only() -> Refusal {
        Refusal {
            extra_headers: &[("allow", "GET")],
            ..Refusal::new(
                405,
                ErrorCode::MethodNotAllowed,
                "only GET is allowed on this path",
            )
        }
    }

    pub fn not_found() -> Refusal {
        Refusal::new(404, ErrorCode::NotFound, "no such resource")
    }

    /// 500 for a key whose plan is missing: reloads refuse such keys, so this is a bug.
    pub fn plan_missing() -> Refusal {
        Refusal::new(500, ErrorCode::Internal, "the key's plan is not configured")
    }

    /// 503 when the store fails and `on_store_error = "closed"`.
    pub fn store_unavailable() -> Refusal {
        Refusal {
            retry_after: Some(1),
            ..Refusal::new(
                503,
                ErrorCode::Internal,
                "the rate-limit store is unavailable; try again shortly",
            )
        }
    }

    /// 429 `rate_limited`: a window of the key's plan is full.
    pub fn rate_limited(view: &RateView) -> Refusal {
        Refusal {
            rate: RateHeaders::Plan(*view),
            retry_after: Some(view.retry_after.unwrap_or(1)),
            ..Refusal::new(
                429,
                ErrorCode::RateLimited,
                "rate limit exceeded; retry after the number of seconds in Retry-After",
            )
        }
    }

    /// 429 `concurrency_limited`: every window had room, but the key's requests in flight are
    /// at its concurrency. Nothing was spent; the headers are the windows', untouched.
    pub fn concurrency_limited(view: &RateView) -> Refusal {
        Refusal {
            rate: RateHeaders::Plan(*view),
            retry_after: Some(view.retry_after.unwrap_or(1)),
            ..Refusal::new(
                429,
                ErrorCode::ConcurrencyLimited,
                "too many requests of this API key in flight at once; retry after the number of \
                 seconds in Retry-After, or when one of them has ended",
            )
        }
    }

    /// 429 `region_unleased`: every window had room, but this region holds too few of the key's
    /// units and could get none from the global store in time (cut off from it, or another
    /// region holds the last ones). Nothing was spent.
    pub fn region_unleased(view: &RateView) -> Refusal {
        Refusal {
            rate: RateHeaders::Plan(*view),
            retry_after: Some(view.retry_after.unwrap_or(1)),
            ..Refusal::new(
                429,
                ErrorCode::RegionUnleased,
                "this region could not get more of the key's quota from the global store in \
                 time; retry after the number of seconds in Retry-After",
            )
        }
    }

    /// 503 `overloaded`: the backend has no place free and the request waited its longest (or
    /// the queue was full); nothing was sent to the backend.
    pub fn overloaded(rate: Option<&RateView>) -> Refusal {
        Refusal {
            rate: rate.map_or(RateHeaders::None, |v| RateHeaders::Plan(*v)),
            retry_after: Some(1),
            ..Refusal::new(
                503,
                ErrorCode::Overloaded,
                "the service is at capacity; retry after the number of seconds in Retry-After",
            )
        }
    }

    /// 429 `api_key_banned`.
    pub fn banned(view: &RateView) -> Refusal {
        Refusal {
            rate: RateHeaders::Plan(*view),
            retry_after: Some(view.retry_after.unwrap_or(1)),
            ..Refusal::new(
                429,
                ErrorCode::ApiKeyBanned,
                "this API key is temporarily banned for sending requests after being rate limited",
            )
        }
    }

    /// What a failed proxy attempt tells the client; `None` when the client itself went away
    /// and there is nobody to tell.
    pub fn for_proxy_error(e: &Error, rate: Option<&RateView>) -> Option<Refusal> {
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
            (ErrorSource::Downstream, ReadError | WriteError | ConnectionClosed) => return None,
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
        Some(Refusal {
            rate: rate.map_or(RateHeaders::None, |v| RateHeaders::Plan(*v)),
            // Pingora closes the client connection after a failed proxy attempt; say so in
            // the response, or a client would reuse the connection and lose its next request.
            close: true,
            ..Refusal::new(status, code, message)
        })
    }
}

/// Writes `refusal` as the whole response. A client that went away meanwhile is not an error
/// worth more than a debug line.
pub async fn refuse(session: &mut Session, request_id: &str, refusal: Refusal) {
    if refusal.close {
        session.set_keepalive(None);
    }
    let body = error_body(refusal.status, refusal.code, refusal.message);
    let mut head = json_head(refusal.status, body.len(), request_id, refusal.rate);
    if let Some(secs) = refusal.retry_after {
        let _ = head.insert_header(&names::RETRY_AFTER, secs);
    }
    for (name, value) in refusal.extra_headers {
        let _ = head.insert_header(*name, *value);
    }
    if let Err(e) = session.write_response_header(Box::new(head), false).await {
        tracing::debug!(error = %e, "client went away before the response head");
        return;
    }
    if let Err(e) = session.write_response_body(Some(body), true).await {
        tracing::debug!(error = %e, "client went away before the response body");
    }
}
