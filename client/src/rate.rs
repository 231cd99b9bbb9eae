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

/// A ban or a day window ends within a day and a half.
pub const MAX_BLOCK_SECS: u64 = 36 * 3_600;

/// Until when the client must not send: the latest instant it knows a request would be refused
/// until (a window with nothing left, or a ban), as Unix seconds.
#[derive(Debug, Default)]
pub struct Limiter {
    blocked_until: Option<u64>,
}

impl Limiter {
    /// Learns from a response's headers (any response: 2xx ones tell what is left).
    pub fn observe(&mut self, state: &RateState, now: u64) {
        match (state.remaining, state.reset) {
            (Some(0), Some(reset)) if reset > now => self.block_until(reset, now),
            // The gateway says requests are left: whatever blocked before is over (a ban lifted,
            // usage reset, a larger plan).
            (Some(left), _) if left > 0 && state.retry_after.is_none() => self.blocked_until = None,
            _ => {}
        }
        if let Some(secs) = state.retry_after {
            self.block_until(now.saturating_add(secs.max(1)), now);
        }
    }

    /// Learns of a ban or a reset from elsewhere (`GET /v1/rate_limit`). Never believed further
    /// than [`MAX_BLOCK_SECS`] ahead: a larger figure is a broken answer, not a reason to stop
    /// for good.
    pub fn block_until(&mut self, until: u64, now: u64) {
        let until = until.min(now.saturating_add(MAX_BLOCK_SECS));
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
        limiter.block_until(1010, 1000);
        assert_eq!(limiter.wait(1000), Duration::from_secs(600));
        // Requests left, by the gateway's word, end it.
        limiter.observe(&left, 1001);
        assert_eq!(limiter.wait(1001), Duration::ZERO);
    }

    #[test]
    fn absurd_figures_block_for_a_day_and_a_half_at_most() {
        let mut limiter = Limiter::default();
        limiter.observe(
            &RateState {
                retry_after: Some(u64::MAX),
                ..RateState::default()
            },
            1000,
        );
        assert_eq!(limiter.wait(1000), Duration::from_secs(MAX_BLOCK_SECS));
        let mut limiter = Limiter::default();
        limiter.observe(
            &RateState {
                remaining: Some(0),
                reset: Some(u64::MAX),
                ..RateState::default()
            },
            1000,
        );
        assert_eq!(limiter.wait(1000), Duration::from_secs(MAX_BLOCK_SECS));
    }
}
