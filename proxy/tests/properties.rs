//! Property tests for the gateway's parser and quota arithmetic: the bearer-token parser never
//! panics and only accepts what RFC 6750 allows; the quota rules never admit more than a
//! window's limit, never report a reset in the past, and always ask for at least one second.

use std::collections::HashMap;

use proptest::prelude::*;
use proxy::http::auth::{bearer_token, MAX_TOKEN_LEN};
use proxy::keys::limits::{Every, Limits, WindowLimit};
use proxy::quota::rules::{BanPolicy, KeyState, Outcome, RateView};

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
        // Any windows of a menu of lengths (0: the calendar month), each with a limit.
        lengths in proptest::sample::subsequence(vec![1u32, 10, 60, 3_600, 86_400, 0], 1..=4),
        limits in proptest::collection::vec(1u64..40, 6),
        // Any instant the state's 32-bit seconds hold (until 2106; `quota::KeyState`).
        start in 0u64..(u64::from(u32::MAX) - 60_000),
        steps in proptest::collection::vec((0u64..200, 1u64..4), 1..300),
    ) {
        let windows: Vec<WindowLimit> = lengths
            .iter()
            .zip(&limits)
            .map(|(&code, &limit)| WindowLimit::new(Every::from_code(code), limit).unwrap())
            .collect();
        let limits = Limits::new(&windows).unwrap();
        let ban = BanPolicy { strikes: 3, durations: vec![30, 300], decay_secs: 600 };
        let mut state = KeyState::default();
        let mut spent: HashMap<(u32, u64), u64> = HashMap::new();
        let mut now = start;
        for (gap, cost) in steps {
            now += gap;
            let v = state.acquire(now, &limits, cost, &ban);
            let view = RateView::new(&v, limits, cost);
            prop_assert!(view.reset > now, "reset {} not after now {}", view.reset, now);
            prop_assert!(view.remaining <= view.limit);
            match v.outcome {
                Outcome::Admitted => {
                    prop_assert!(view.retry_after.is_none());
                    for w in limits.windows() {
                        let s = spent.entry((w.every.code(), w.every.index(now))).or_default();
                        *s += cost;
                        prop_assert!(*s <= w.limit(), "{} over {}", w.every, w.limit);
                    }
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
