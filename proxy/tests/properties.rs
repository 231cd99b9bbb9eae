//! Property tests for the gateway's parsers and quota arithmetic: the bearer-token parser never
//! panics and only accepts what RFC 6750 allows; the request-path scanner passes no path a
//! normaliser would change, and every path made of plain segments; the quota rules never admit more than a
//! window's limit, never report a reset in the past, and always ask for at least one second;
//! a concurrency is never exceeded, its refusals spend nothing, and leases nobody gives back
//! end by themselves.

use std::collections::HashMap;

use proptest::prelude::*;
use proxy::http::auth::{bearer_token, MAX_TOKEN_LEN};
use proxy::http::request::path_fault;
use proxy::keys::limits::{Every, Limits, WindowLimit};
use proxy::quota::rules::{BanPolicy, KeyState, Lease, Leases, Outcome, RateView};

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
    fn a_path_passed_has_nothing_a_normaliser_would_change(
        path in proptest::collection::vec(proptest::sample::select(b"/.%2eEfF5cC0\\;a\x00\xc3 3b8".to_vec()), 0..24),
    ) {
        if path_fault(&path).is_none() {
            prop_assert!(path.first() == Some(&b'/'));
            prop_assert!(path.len() == 1 || !path.ends_with(b"/"));
            prop_assert!(path.iter().all(|b| b.is_ascii_graphic() && *b != b'\\' && *b != b';'));
            if path.len() > 1 {
                for segment in path[1..].split(|b| *b == b'/') {
                    prop_assert!(!segment.is_empty() && segment != b"." && segment != b"..");
                }
            }
            let lower = path.to_ascii_lowercase();
            for encoded in [b"%2f", b"%5c", b"%2e", b"%00", b"%25", b"%3b"] {
                prop_assert!(!lower.windows(3).any(|w| w == encoded));
            }
            prop_assert!(std::str::from_utf8(&percent_decoded(&path)).is_ok());
        }
    }

    #[test]
    fn a_path_of_plain_segments_passes(path in "(/[A-Za-z0-9_~!$&'()*+,=:@-]{1,8}(\\.[a-z]{1,3})?(%20|%C3%A9)?){1,6}") {
        prop_assert_eq!(path_fault(path.as_bytes()), None);
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
                Outcome::ConcurrencyLimited => prop_assert!(false, "no concurrency here"),
                Outcome::Unleased => prop_assert!(false, "no regions here"),
            }
        }
    }

    #[test]
    fn a_concurrency_is_never_exceeded_and_its_refusals_spend_nothing(
        most in 1u32..6,
        lease_secs in 3u64..20,
        start in 0u64..(u64::from(u32::MAX) - 100_000),
        // (seconds later, 0: ask for a place; 1: give the oldest place back; 2: forget one,
        // as a node that died would)
        steps in proptest::collection::vec((0u64..5, 0u8..3), 1..300),
    ) {
        let limits = Limits::minute_day(1_000_000, 1_000_000).unwrap().with_concurrency(most);
        let ban = BanPolicy { strikes: 0, ..BanPolicy::default() };
        let (mut state, mut leases) = (KeyState::default(), Leases::default());
        // The leases whose requests are still running, and those nobody will give back.
        let mut held: Vec<Lease> = Vec::new();
        let mut forgotten: Vec<Lease> = Vec::new();
        let mut now = start;
        for (gap, action) in steps {
            now += gap;
            forgotten.retain(|l| l.end > now);
            held.retain(|l| l.end > now);
            match action {
                0 => {
                    let before = state;
                    let v = state.acquire_leased(now, &limits, 1, &ban, Some((&mut leases, lease_secs)));
                    let running = (held.len() + forgotten.len()) as u64;
                    match v.outcome {
                        Outcome::Admitted => {
                            prop_assert!(running < u64::from(most));
                            prop_assert_eq!(v.lease.end, now + lease_secs);
                            held.push(v.lease);
                        }
                        Outcome::ConcurrencyLimited => {
                            prop_assert!(running >= u64::from(most));
                            prop_assert_eq!(state, before, "a concurrency refusal changes nothing");
                            prop_assert_eq!(RateView::new(&v, limits, 1).retry_after, Some(1));
                        }
                        other => prop_assert!(false, "{:?}", other),
                    }
                    prop_assert_eq!(leases.in_flight(now), (held.len() + forgotten.len()) as u64);
                }
                1 if !held.is_empty() => {
                    let lease = held.remove(0);
                    prop_assert!(leases.give_back(now, lease.end));
                }
                2 if !held.is_empty() => forgotten.push(held.remove(0)),
                _ => {}
            }
            prop_assert!(leases.in_flight(now) <= u64::from(most));
        }
        // Nobody gives anything back any more: every place ends by itself.
        prop_assert!(leases.is_empty(now + lease_secs));
    }
}

/// `path` with every `%XY` decoded (the scanner has checked each is two hex digits).
fn percent_decoded(path: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        let hex = path
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
            Some(byte) if path[i] == b'%' => {
                out.push(byte);
                i += 3;
            }
            _ => {
                out.push(path[i]);
                i += 1;
            }
        }
    }
    out
}
