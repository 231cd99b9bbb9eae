//! The per-client-IP limit on requests with a missing or invalid key. It lives in this process
//! (governor, GCRA): floods of bad keys are stopped before they cost a Redis round trip, and
//! guessing keys from one address is slowed to this rate.

use std::net::IpAddr;
use std::num::NonZeroU32;

use governor::clock::{Clock, DefaultClock};
use governor::middleware::StateInformationMiddleware;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};

use crate::quota::{gcra_refill_secs, retry_after_secs};
use crate::responses::SimpleLimit;

type Limiter =
    RateLimiter<IpAddr, DefaultKeyedStateStore<IpAddr>, DefaultClock, StateInformationMiddleware>;

pub struct UnauthLimiter {
    limiter: Limiter,
    per_minute: u32,
    clock: DefaultClock,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnauthDecision {
    /// Answer 401, reporting this limit.
    Allowed(SimpleLimit),
    /// Answer 429: this address has used up its unauthenticated requests.
    Refused {
        limit: SimpleLimit,
        retry_after: u64,
    },
}

impl UnauthLimiter {
    pub fn new(per_minute: u32) -> UnauthLimiter {
        let per_minute = per_minute.max(1);
        let quota = Quota::per_minute(NonZeroU32::new(per_minute).unwrap_or(NonZeroU32::MIN));
        UnauthLimiter {
            limiter: RateLimiter::keyed(quota).with_middleware::<StateInformationMiddleware>(),
            per_minute,
            clock: DefaultClock::default(),
        }
    }

    pub fn check(&self, ip: IpAddr, now_unix: u64) -> UnauthDecision {
        let limit = u64::from(self.per_minute);
        match self.limiter.check_key(&ip) {
            Ok(snapshot) => {
                let remaining = u64::from(snapshot.remaining_burst_capacity());
                UnauthDecision::Allowed(SimpleLimit {
                    limit,
                    remaining,
                    reset: now_unix + gcra_refill_secs(limit - remaining.min(limit), limit),
                })
            }
            Err(not_until) => {
                let retry_after = retry_after_secs(not_until.wait_time_from(self.clock.now()));
                UnauthDecision::Refused {
                    limit: SimpleLimit {
                        limit,
                        remaining: 0,
                        reset: now_unix + gcra_refill_secs(limit, limit),
                    },
                    retry_after,
                }
            }
        }
    }

    /// Forgets addresses whose allowance is full again, to keep memory bounded.
    pub fn sweep(&self) {
        self.limiter.retain_recent();
        self.limiter.shrink_to_fit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allows_the_per_minute_budget_per_address_then_refuses() {
        let l = UnauthLimiter::new(3);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        for expected in [2, 1, 0] {
            match l.check(a, 1_000) {
                UnauthDecision::Allowed(s) => assert_eq!((s.limit, s.remaining), (3, expected)),
                other => panic!("{other:?}"),
            }
        }
        match l.check(a, 1_000) {
            UnauthDecision::Refused { retry_after, .. } => assert!((1..=20).contains(&retry_after)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(l.check(b, 1_000), UnauthDecision::Allowed(_)));
    }
}
