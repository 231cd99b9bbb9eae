//! What the gateway's headers say about the caller's quota, and the client-side limiter that
//! uses it: a request the client knows will be refused (no room left until a reset it was told
//! of, or a ban it was told of) is not sent; the client waits for the reset instead, so a
//! well-behaved client never collects the strikes that earn a ban.
//!
//! A plan has any windows (`second`, `minute`, `6h`, `day`, `month`, …), none of them known to
//! the client in advance: `X-RateLimit-*` describe the binding one, and `RateLimit` lists every
//! enforced window by name, which this module reads whatever the names are.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::header::HeaderMap;

/// The rate-limit headers of one response (`X-RateLimit-*`, `Retry-After`, and what `RateLimit`
/// says of the windows with nothing left).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateState {
    /// Units the binding window allows (a request spends its operation's cost, 1 by default).
    pub limit: Option<u64>,
    /// Units left in it.
    pub remaining: Option<u64>,
    /// When it resets, Unix seconds.
    pub reset: Option<u64>,
    /// Seconds to wait, on a refusal.
    pub retry_after: Option<u64>,
    /// Seconds until every window that `RateLimit` lists with nothing left (`r=0`) has reset:
    /// the binding window is only the first of them to reset when several are spent at once.
    /// `None` when no window is spent.
    pub spent_for: Option<u64>,
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
            spent_for: header_windows(headers)
                .iter()
                .filter(|w| w.remaining == Some(0))
                .filter_map(|w| w.reset_in)
                .max(),
        }
    }
}

/// One window of a response's `RateLimit-Policy` and `RateLimit` headers
/// (draft-ietf-httpapi-ratelimit-headers): `"<name>";q=<limit>;w=<seconds>` and
/// `"<name>";r=<remaining>;t=<seconds to reset>`. The gateway lists every enforced window of the
/// key's limits, shortest first, under any name (`second`, `minute`, `hour`, `day`, `month`, or
/// a length such as `10s`, `90m`, `6h`, `7d`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderWindow {
    pub name: String,
    /// `q`: units the window allows.
    pub limit: Option<u64>,
    /// `w`: its length in seconds (for `month`, the current month's).
    pub every: Option<u64>,
    /// `r`: units left in it.
    pub remaining: Option<u64>,
    /// `t`: seconds until it resets.
    pub reset_in: Option<u64>,
}

/// Every window of `RateLimit` and `RateLimit-Policy`, in the order `RateLimit` lists them (then
/// any only the policy names). Unreadable entries are skipped; no header, no windows.
pub fn header_windows(headers: &HeaderMap) -> Vec<HeaderWindow> {
    let mut windows: Vec<HeaderWindow> = Vec::new();
    for header in ["ratelimit", "ratelimit-policy"] {
        for (name, params) in sf_list(headers, header) {
            let k = match windows.iter().position(|w| w.name == name) {
                Some(k) => k,
                None => {
                    windows.push(HeaderWindow {
                        name,
                        limit: None,
                        every: None,
                        remaining: None,
                        reset_in: None,
                    });
                    windows.len() - 1
                }
            };
            let w = &mut windows[k];
            for (key, value) in params {
                match (header, key.as_str()) {
                    ("ratelimit", "r") => w.remaining = Some(value),
                    ("ratelimit", "t") => w.reset_in = Some(value),
                    ("ratelimit-policy", "q") => w.limit = Some(value),
                    ("ratelimit-policy", "w") => w.every = Some(value),
                    _ => {}
                }
            }
        }
    }
    windows
}

/// The items of a Structured Field list header (every line of it): each item's name (a string
/// or a token) and its integer parameters. Items without a name are skipped, and so are
/// parameters that are not whole numbers.
fn sf_list(headers: &HeaderMap, name: &str) -> Vec<(String, Vec<(String, u64)>)> {
    let mut items = Vec::new();
    for value in headers.get_all(name) {
        let Ok(text) = value.to_str() else { continue };
        for item in text.split(',') {
            let mut parts = item.split(';');
            let label = parts.next().unwrap_or("").trim();
            let label = label
                .strip_prefix('"')
                .and_then(|l| l.strip_suffix('"'))
                .unwrap_or(label);
            if label.is_empty() || label.contains(['"', ' ']) {
                continue;
            }
            let params = parts
                .filter_map(|p| {
                    let (key, value) = p.split_once('=')?;
                    Some((key.trim().to_owned(), value.trim().parse::<u64>().ok()?))
                })
                .collect();
            items.push((label.to_owned(), params));
        }
    }
    items
}

/// Unix seconds now.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The longest wait the client believes: a window is at most 400 days long (a month at most 31),
/// so a reset further away than that is a broken answer, not a reason to stop for good.
pub const MAX_BLOCK_SECS: u64 = 400 * 86_400;

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
        match (state.retry_after, state.spent_for) {
            (Some(secs), _) => self.block_until(now.saturating_add(secs.max(1)), now),
            // Every spent window, not only the binding one (the first of them to reset): a
            // request sent when the binding window turns would be refused by the others. (On a
            // refusal, `Retry-After` already covers every refusing window.)
            (None, Some(secs)) if secs > 0 => self.block_until(now.saturating_add(secs), now),
            _ => {}
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
                retry_after: None,
                spent_for: None,
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
    fn absurd_figures_block_for_400_days_at_most() {
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

    #[test]
    fn any_window_names_are_read_from_ratelimit_and_its_policy() {
        let mut h = HeaderMap::new();
        h.insert(
            "ratelimit-policy",
            HeaderValue::from_static(
                "\"second\";q=5;w=1, \"90m\";q=400;w=5400, \"month\";q=9000;w=2592000",
            ),
        );
        h.insert(
            "ratelimit",
            HeaderValue::from_static(
                "\"second\";r=4;t=1, \"90m\";r=0;t=600, \"month\";r=0;t=86400",
            ),
        );
        h.insert("x-ratelimit-remaining", HeaderValue::from_static("0"));
        h.insert("x-ratelimit-reset", HeaderValue::from_static("1600"));
        let windows = header_windows(&h);
        let names: Vec<&str> = windows.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, ["second", "90m", "month"]);
        assert_eq!(
            windows[2],
            HeaderWindow {
                name: "month".into(),
                limit: Some(9000),
                every: Some(2_592_000),
                remaining: Some(0),
                reset_in: Some(86_400),
            }
        );
        let state = RateState::from_headers(&h);
        assert_eq!(
            state.spent_for,
            Some(86_400),
            "the last spent window to reset"
        );
        // The binding window (the 90m one, the first spent window to reset) says 600 s, but a
        // request then would be refused by the month: the client waits for both.
        let mut limiter = Limiter::default();
        limiter.observe(&state, 1000);
        assert_eq!(limiter.wait(1000), Duration::from_secs(86_400));
    }

    #[test]
    fn unreadable_ratelimit_entries_are_skipped_and_tokens_are_names_too() {
        let mut h = HeaderMap::new();
        h.append(
            "ratelimit",
            HeaderValue::from_static("\"minute\";r=x;t=5, ;r=0;t=9"),
        );
        h.append("ratelimit", HeaderValue::from_static("7d;r=0;t=99"));
        let windows = header_windows(&h);
        assert_eq!(windows.len(), 2, "{windows:?}");
        assert_eq!((windows[0].remaining, windows[0].reset_in), (None, Some(5)));
        assert_eq!(windows[1].name, "7d");
        assert_eq!(RateState::from_headers(&h).spent_for, Some(99));
        assert!(header_windows(&HeaderMap::new()).is_empty());
    }

    #[test]
    fn on_a_refusal_retry_after_rules_not_the_spent_windows() {
        // A ban: every window reads 0 whatever it holds, and Retry-After is the ban's end.
        let banned = RateState {
            remaining: Some(0),
            reset: Some(1600),
            retry_after: Some(600),
            spent_for: Some(80_000),
            ..RateState::default()
        };
        let mut limiter = Limiter::default();
        limiter.observe(&banned, 1000);
        assert_eq!(limiter.wait(1000), Duration::from_secs(600));
    }
}
