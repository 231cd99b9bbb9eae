//! What the gateway's headers say about the caller's quota, and the client-side limiter that
//! uses it: a request the client knows will be refused (no requests left until a reset it was
//! told of, or a ban it was told of) is not sent; the client waits for the reset instead, so a
//! well-behaved client never collects the strikes that earn a ban.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::header::HeaderMap;

/// The rate-limit headers of one response (`X-RateLimit-*`, `Retry-After`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateState {
    /// Requests the binding window allows.
    pub limit: Option<u64>,
    /// Requests left in it.
    pub remaining: Option<u64>,
    /// When it resets, Unix seconds.
    pub reset: Option<u64>,
    /// Seconds to wait, on a refusal.
    pub retry_after: Option<u64>,
}

impl RateState {
    pub fn from_headers(headers: &HeaderMap) -> RateState {
        let num = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        RateState {
            limit: num("x-ratelimit-limit"),
            remaining: num("x-ratelimit-remaining"),
            reset: num("x-ratelimit-reset"),
            retry_after: num("retry-after"),
        }
    }
}

/// Unix seconds now.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Until when the client must not send: the latest instant it knows a request would be refused
/// until (a window with nothing left, or a ban), as Unix seconds.
#[derive(Debug, Default)]
pub struct Limiter {
    blocked_until: Option<u64>,
}

impl Limiter {
    /// Learns from a response's headers (any response: 2xx ones tell what is left).
    pub fn observe(&mut self, state: &RateState, now: u64) {
        if let (Some(0), Some(reset)) = (state.remaining, state.reset) {
            if reset > now {
                self.block_until(reset);
            }
        }
        if let Some(secs) = state.retry_after {
            self.block_until(now + secs.max(1));
        }
    }

    /// Learns of a ban or a reset from elsewhere (`GET /v1/rate_limit`).
    pub fn block_until(&mut self, until: u64) {
        self.blocked_until = Some(self.blocked_until.map_or(until, |b| b.max(until)));
    }

    /// How long to wait before the next request may be sent (zero when it may go now).
    pub fn wait(&self, now: u64) -> Duration {
        match self.blocked_until {
            Some(until) if until > now => Duration::from_secs(until - now),
            _ => Duration::ZERO,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn headers_are_read_and_an_empty_window_blocks_until_its_reset() {
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-limit", HeaderValue::from_static("60"));
        h.insert("x-ratelimit-remaining", HeaderValue::from_static("0"));
        h.insert("x-ratelimit-reset", HeaderValue::from_static("1060"));
        let state = RateState::from_headers(&h);
        assert_eq!(
            state,
            RateState {
                limit: Some(60),
                remaining: Some(0),
                reset: Some(1060),
                retry_after: None
            }
        );
        let mut limiter = Limiter::default();
        limiter.observe(&state, 1000);
        assert_eq!(limiter.wait(1000), Duration::from_secs(60));
        assert_eq!(limiter.wait(1060), Duration::ZERO);
    }

    #[test]
    fn requests_left_do_not_block_and_retry_after_does() {
        let mut limiter = Limiter::default();
        let left = RateState {
            remaining: Some(3),
            reset: Some(1060),
            ..RateState::default()
        };
        limiter.observe(&left, 1000);
        assert_eq!(limiter.wait(1000), Duration::ZERO);
        let refused = RateState {
            retry_after: Some(600),
            ..RateState::default()
        };
        limiter.observe(&refused, 1000);
        assert_eq!(limiter.wait(1000), Duration::from_secs(600));
        // A shorter block learned later does not shorten a longer one.
        limiter.block_until(1010);
        assert_eq!(limiter.wait(1000), Duration::from_secs(600));
    }
}
