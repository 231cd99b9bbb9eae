//! How the client retries, as the interface asks of clients: after a 429 it waits `Retry-After`
//! (never less; for a ban, until the ban ends); after a gateway 5xx (`bad_gateway`, 503,
//! `gateway_timeout`) or a lost connection it retries only idempotent requests, with
//! exponential backoff and full jitter up to a cap, except a 503 `overloaded`, which the
//! gateway sheds before the backend sees it: any request is sent again after its
//! `Retry-After`; and no wait ever runs past the total deadline the caller set.

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Off: every answer is returned as it comes, nothing is waited for (for comparison, and for
    /// callers that schedule themselves).
    pub enabled: bool,
    /// The first backoff's upper bound; each further attempt doubles it.
    pub base: Duration,
    /// The largest backoff bound.
    pub cap: Duration,
    /// How long one call may take in all, waits included.
    pub deadline: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy {
            enabled: true,
            base: Duration::from_millis(200),
            cap: Duration::from_secs(20),
            deadline: Duration::from_secs(120),
        }
    }
}

impl RetryPolicy {
    /// No retries, no waits.
    pub fn none() -> RetryPolicy {
        RetryPolicy {
            enabled: false,
            ..RetryPolicy::default()
        }
    }

    /// The wait before retry number `attempt` (0 for the first retry): uniformly random between
    /// zero and `min(cap, base * 2^attempt)` ("full jitter"), so that many clients failing at
    /// once do not come back at once.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let bound = self
            .base
            .saturating_mul(2u32.saturating_pow(attempt.min(30)))
            .min(self.cap);
        let nanos = u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rand::random_range(0..=nanos))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_full_jitter_up_to_the_cap() {
        let p = RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
            ..RetryPolicy::default()
        };
        for attempt in 0..12 {
            let bound = Duration::from_millis(100 * 2u64.pow(attempt)).min(Duration::from_secs(1));
            let waits: Vec<Duration> = (0..200).map(|_| p.backoff(attempt)).collect();
            assert!(waits.iter().all(|w| *w <= bound), "attempt {attempt}");
            // Full jitter: spread over the whole range, not bunched at its top.
            assert!(waits.iter().any(|w| *w < bound / 2), "attempt {attempt}");
        }
        assert!(p.backoff(u32::MAX) <= Duration::from_secs(1));
    }
}
