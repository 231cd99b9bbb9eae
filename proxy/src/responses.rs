//! Responses the gateway writes itself (401, 429, 502, 504, ...): always the interface's Error
//! object as JSON, with the rate-limit headers the design puts on every response.

use bytes::Bytes;
use pingora::http::ResponseHeader;
use serde::Serialize;

use crate::quota::RateView;

/// The Error `code` values the gateway emits (the backend emits the rest of the design's list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    InvalidRequest,
    Unauthorized,
    NotFound,
    MethodNotAllowed,
    RateLimited,
    ApiKeyBanned,
    BadGateway,
    GatewayTimeout,
    Internal,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::ApiKeyBanned => "api_key_banned",
            ErrorCode::BadGateway => "bad_gateway",
            ErrorCode::GatewayTimeout => "gateway_timeout",
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

/// The `X-RateLimit-*` triple as numbers, for responses that are not about a key's plan (the
/// per-IP limit on unauthenticated requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleLimit {
    pub limit: u64,
    pub remaining: u64,
    pub reset: u64,
}

/// Which rate-limit headers a response carries.
#[derive(Debug, Clone, Copy)]
pub enum RateHeaders<'a> {
    Plan(&'a RateView),
    Simple(SimpleLimit),
    None,
}

pub fn insert_rate_headers(resp: &mut ResponseHeader, rate: RateHeaders<'_>) {
    let (limit, remaining, reset) = match rate {
        RateHeaders::Plan(v) => {
            let _ = resp.insert_header("ratelimit-policy", v.policy_header());
            let _ = resp.insert_header("ratelimit", v.ratelimit_header());
            (v.limit, v.remaining, v.reset)
        }
        RateHeaders::Simple(s) => (s.limit, s.remaining, s.reset),
        RateHeaders::None => return,
    };
    let _ = resp.insert_header("x-ratelimit-limit", limit);
    let _ = resp.insert_header("x-ratelimit-remaining", remaining);
    let _ = resp.insert_header("x-ratelimit-reset", reset);
}

/// A complete error response head; the caller writes [`error_body`] after it.
pub fn error_head(
    status: u16,
    body_len: usize,
    request_id: &str,
    rate: RateHeaders<'_>,
) -> ResponseHeader {
    let mut resp = match ResponseHeader::build(status, Some(10)) {
        Ok(r) => r,
        Err(_) => ResponseHeader::build(500, Some(10)).expect("500 is a valid status"),
    };
    let _ = resp.insert_header("content-type", "application/json");
    let _ = resp.insert_header("content-length", body_len);
    let _ = resp.insert_header("cache-control", "no-store");
    if !request_id.is_empty() {
        let _ = resp.insert_header("x-request-id", request_id);
    }
    insert_rate_headers(&mut resp, rate);
    resp
}
