//! Property tests for the gateway's parser and quota arithmetic: the bearer-token parser never
//! panics and only accepts what RFC 6750 allows; the quota rules never admit more than a
//! window's limit, never report a reset in the past, and always ask for at least one second.

use std::collections::HashMap;

use proptest::prelude::*;
use proxy::http::auth::{bearer_token, MAX_TOKEN_LEN};
use proxy::keys::plans::Limits;
use proxy::quota::rules::{BanPolicy, KeyState, Outcome, RateView, DAY_SECS, MINUTE_SECS};

proptest! {
    #[test]
    fn the_bearer_parser_never_panics_and_accepts_only_token68(value in proptest::collection::vec(any::<u8>(), 0..400)) {
        if let Ok(token) = bearer_token(std::iter::once(value.as_slice())) {
            prop_assert!(!token.is_empty() && token.len() <= MAX_TOKEN_LEN);
            prop_assert!(token.trim_end_matches('=').bytes().all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b)));
        }
    }

    #[test]
    fn every_token68_is_read_back(token in "[A-Za-z0-9._~+/-]{1,200}=*", scheme in "(?i)bearer", spaces in " {1,3}") {
        let header = format!("{scheme}{spaces}{token}");
        prop_assert_eq!(bearer_token(std::iter::once(header.as_bytes())), Ok(token.as_str()));
    }

    #[test]
    fn quotas_never_admit_more_than_a_window_allows(
        per_minute in 1u64..20,
        per_day in 1u64..60,
        // Any instant the state's 32-bit seconds hold (until 2106; `quota::KeyState`).
        start in 0u64..(u64::from(u32::MAX) - 60_000),
        gaps in proptest::collection::vec(0u64..200, 1..300),
    ) {
        let limits = Limits { per_minute, per_day };
        let ban = BanPolicy { strikes: 3, durations: vec![30, 300], decay_secs: 600 };
        let mut state = KeyState::default();
        let mut per_minute_seen: HashMap<u64, u64> = HashMap::new();
        let mut per_day_seen: HashMap<u64, u64> = HashMap::new();
        let mut now = start;
        for gap in gaps {
            now += gap;
            let v = state.acquire(now, limits, &ban);
            let view = RateView::new(&v, limits);
            prop_assert!(view.reset > now, "reset {} not after now {}", view.reset, now);
            prop_assert!(view.remaining <= view.limit);
            match v.outcome {
                Outcome::Admitted => {
                    prop_assert!(view.retry_after.is_none());
                    let m = per_minute_seen.entry(now / MINUTE_SECS).or_default();
                    *m += 1;
                    prop_assert!(*m <= per_minute);
                    let d = per_day_seen.entry(now / DAY_SECS).or_default();
                    *d += 1;
                    prop_assert!(*d <= per_day);
                }
                Outcome::Limited | Outcome::Banned => {
                    let retry = view.retry_after.unwrap();
                    prop_assert!(retry >= 1);
                    prop_assert_eq!(now + retry, view.reset.max(now + 1));
                }
            }
        }
    }
}
