//! The harness the end-to-end tests share, one module per subject:
//!
//! | module | what |
//! |---|---|
//! | `process` | binaries and tools, free ports, child processes killed on drop, `pet-backend` |
//! | `redis` | a private `redis-server` or Redis Cluster |
//! | `redis_ha` | Redis as production runs it: a CA made with `openssl`, `redis-sentinel` |
//! | `gateway` | `pet-gateway` processes, its CLI, plans and keys, `Fixture`, response helpers |
//! | `upstreams` | fake backends (echo, silent, closing, truncating, chaotic) and the bench's backend of fixed capacity |
//! | `tls` | test certificates and a client that trusts them |
//! | `disk` | a small disk of a test's own (tmpfs), to fill: the full-disk seam |
//! | `python` | receivers in Python on the ecosystem's own packages (Standard Webhooks, OTLP) |
//!
//! Everything is re-exported here, so a test writes `e2e::Fixture`.

pub mod browser;
pub mod disk;
pub mod gateway;
pub mod process;
pub mod python;
pub mod redis;
pub mod redis_ha;
pub mod tls;
pub mod upstreams;
pub mod webhook;

use std::time::Duration;

pub use crate::browser::*;
pub use crate::disk::*;
pub use crate::gateway::*;
pub use crate::process::*;
pub use crate::python::*;
pub use crate::redis::*;
pub use crate::redis_ha::*;
pub use crate::tls::*;
pub use crate::upstreams::*;
pub use crate::webhook::*;

/// A minute, as the gateway's minute windows count it.
pub const MINUTE: Duration = Duration::from_secs(60);
/// A day, as the gateway's day windows count it (UTC midnight to UTC midnight).
pub const DAY: Duration = Duration::from_secs(86_400);

/// What is left of the fixed window of length `every` (aligned to the Unix epoch, as the
/// gateway's windows are: a minute to the minute, a day to UTC midnight) holding `now`.
fn left_in(every: Duration, now: Duration) -> Duration {
    let every_ms = every.as_millis().max(1);
    every.saturating_sub(Duration::from_millis((now.as_millis() % every_ms) as u64))
}

/// Sleeps, if needed, until every `(every, margin)` holds at once: at least `margin` remains in
/// the current window of length `every`. Call it after the slow setup (processes started, keys
/// issued), right before the first request that counts, with a margin that covers everything the
/// test counts after it on a loaded machine.
///
/// Windows nest: a minute ends no later than the day (or the UTC month) holding it, so a test
/// done within `margin` of `fresh_minute(margin)` crosses no day either. A test whose counts
/// run longer than its minute margin, or that counts in the day alone, asks for the day itself
/// ([`fresh_day`]: it waits only near midnight UTC, which also ends every month).
pub fn fresh_windows(needs: &[(Duration, Duration)]) {
    for &(every, margin) in needs {
        assert!(
            margin < every,
            "a margin of {margin:?} never fits a window of {every:?}"
        );
    }
    loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock after 1970");
        // To the latest end among the windows short of their margin: a window nested in that
        // one starts again there too.
        let wait = needs
            .iter()
            .map(|&(every, margin)| (left_in(every, now), margin))
            .filter(|&(left, margin)| left < margin)
            .map(|(left, _)| left)
            .max();
        match wait {
            None => return,
            Some(left) => std::thread::sleep(left + Duration::from_millis(50)),
        }
    }
}

/// At least `margin` left in the current window of length `every` (`Duration::from_secs(10)`
/// for a plan's `10s` window).
pub fn fresh_window(every: Duration, margin: Duration) {
    fresh_windows(&[(every, margin)]);
}

/// Sleeps, if needed, so that at least `margin` remains in the current UTC minute: tests
/// that count within one minute window must not straddle two.
pub fn fresh_minute(margin: Duration) {
    fresh_window(MINUTE, margin);
}

/// At least `margin` left of the current UTC day (and so of the month): for tests that count in
/// the day window for longer than any minute margin would cover, or in the day alone. Waits only
/// within `margin` of midnight UTC.
pub fn fresh_day(margin: Duration) {
    fresh_window(DAY, margin);
}
