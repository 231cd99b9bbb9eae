//! The quota rules, as plain arithmetic: fixed windows aligned to UTC (the minute and the UTC
//! day), admission only when both windows have room, strikes for requests sent after a refusal,
//! and escalating bans. The in-memory store runs exactly this code; the Redis script
//! (`store/scripts.rs`) is its transcription to Lua, and the store behaviour suite holds the two
//! to the same results.

pub const MINUTE_SECS: u64 = 60;
pub const DAY_SECS: u64 = 86_400;

use crate::keys::plans::Limits;

/// When a key that keeps sending after its 429s is banned, and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BanPolicy {
    /// Refused requests allowed inside one minute window; the next one starts a ban.
    pub strikes: u64,
    /// Ban lengths in seconds by level: the first ban is `durations[0]`, the next one longer, and
    /// the last entry repeats.
    pub durations: Vec<u64>,
    /// A key whose last ban ended this many seconds ago starts again at the first level.
    pub decay_secs: u64,
}

impl Default for BanPolicy {
    fn default() -> Self {
        BanPolicy {
            strikes: 10,
            durations: vec![60, 600, 3_600, 86_400],
            decay_secs: DAY_SECS,
        }
    }
}

impl BanPolicy {
    pub fn duration_for_level(&self, level: u64) -> u64 {
        let last = self.durations.len().saturating_sub(1);
        let index = usize::try_from(level).unwrap_or(usize::MAX).min(last);
        self.durations.get(index).copied().unwrap_or(60)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Counted in both windows; forward the request.
    Admitted,
    /// A window is full; nothing was counted.
    Limited,
    /// The key is banned (possibly by this very request); nothing was counted.
    Banned,
}

/// What a store answers for one request: enough to write every rate-limit header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub outcome: Outcome,
    /// The store's clock, Unix seconds (Redis `TIME` in Redis mode).
    pub now: u64,
    /// Requests counted in the current minute and day windows, this one included if admitted.
    pub minute_count: u64,
    pub day_count: u64,
    /// Unix second at which the ban ends; 0 when not banned.
    pub ban_until: u64,
    /// This very request started the ban (for counting bans, not refusals).
    pub ban_started: bool,
}

/// One API key's counters. Window numbers say which window a count belongs to, so a count from
/// an older window reads as zero without anything having to reset it.
///
/// Every field is 32 bits (48 bytes a key, against 96 in `u64`s: the embedded store holds one
/// per key seen today, a million of them on a large node): windows and Unix seconds fit until
/// 2106, counts fit because plan and key limits are capped at `u32::MAX`, and whatever could pass
/// the cap (a ban configured to end after 2106) is held at it. The arithmetic is done in `u64`
/// on a [`Wide`] copy, so nothing can wrap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyState {
    pub minute_window: u32,
    pub minute_count: u32,
    pub day_window: u32,
    pub day_count: u32,
    pub strike_window: u32,
    pub strikes: u32,
    pub ban_until: u32,
    pub ban_level: u32,
    /// After this Unix second the ban level decays back to zero.
    pub level_until: u32,
    /// When a request was last admitted (Unix seconds; 0: never), for `keys show`.
    pub last_admitted: u32,
    /// Requests refused in day window `refused_day` (rate-limited, or starting a ban; those
    /// refused during a ban are answered from ban caches and not counted here).
    pub refused_day: u32,
    pub refused: u32,
}

/// [`KeyState`] widened for arithmetic.
#[derive(Debug, Clone, Copy)]
struct Wide {
    minute_window: u64,
    minute_count: u64,
    day_window: u64,
    day_count: u64,
    strike_window: u64,
    strikes: u64,
    ban_until: u64,
    ban_level: u64,
    level_until: u64,
    last_admitted: u64,
    refused_day: u64,
    refused: u64,
}

/// Held at `u32::MAX` rather than wrapped.
fn narrow(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

impl KeyState {
    fn wide(&self) -> Wide {
        Wide {
            minute_window: self.minute_window.into(),
            minute_count: self.minute_count.into(),
            day_window: self.day_window.into(),
            day_count: self.day_count.into(),
            strike_window: self.strike_window.into(),
            strikes: self.strikes.into(),
            ban_until: self.ban_until.into(),
            ban_level: self.ban_level.into(),
            level_until: self.level_until.into(),
            last_admitted: self.last_admitted.into(),
            refused_day: self.refused_day.into(),
            refused: self.refused.into(),
        }
    }

    fn set(&mut self, w: &Wide) {
        *self = KeyState {
            minute_window: narrow(w.minute_window),
            minute_count: narrow(w.minute_count),
            day_window: narrow(w.day_window),
            day_count: narrow(w.day_count),
            strike_window: narrow(w.strike_window),
            strikes: narrow(w.strikes),
            ban_until: narrow(w.ban_until),
            ban_level: narrow(w.ban_level),
            level_until: narrow(w.level_until),
            last_admitted: narrow(w.last_admitted),
            refused_day: narrow(w.refused_day),
            refused: narrow(w.refused),
        };
    }

    /// Decides one request at `now` and updates the counters.
    pub fn acquire(&mut self, now: u64, limits: Limits, ban: &BanPolicy) -> Verdict {
        let mut w = self.wide();
        let verdict = w.acquire(now, limits, ban);
        self.set(&w);
        // The answer says what was stored: a ban end past 2106 is the one held at the cap.
        Verdict {
            ban_until: verdict.ban_until.min(u64::from(u32::MAX)),
            ..verdict
        }
    }

    /// The counts of the windows current at `now` (as [`KeyState::acquire`] would see them):
    /// admitted this minute, admitted today, refused today.
    pub fn usage(&self, now: u64) -> (u64, u64, u64) {
        self.wide().usage(now)
    }

    /// True when nothing in this state can matter any more: its day is over and no ban or ban
    /// level is pending. Such entries are evicted to keep memory bounded.
    pub fn is_idle(&self, now: u64) -> bool {
        let w = self.wide();
        w.day_window < now / DAY_SECS && w.ban_until <= now && w.level_until <= now
    }
}

impl Wide {
    fn acquire(&mut self, now: u64, limits: Limits, ban: &BanPolicy) -> Verdict {
        // Only a newer window starts from zero. A clock that steps back by up to one window
        // (NTP, a failover to a node whose clock lags) keeps counting in the stored window:
        // resetting to the older one would zero today's count at a backwards step over midnight
        // and admit it all again. A stored window further ahead came from a clock that had
        // jumped forward; it is not kept, or the key would stay pinned to it.
        let minute = ahead_by_one(self.minute_window, now / MINUTE_SECS);
        let day = ahead_by_one(self.day_window, now / DAY_SECS);
        let minute_count = if self.minute_window == minute {
            self.minute_count
        } else {
            0
        };
        let day_count = if self.day_window == day {
            self.day_count
        } else {
            0
        };
        // A banned request changes nothing, as in the Lua script (which writes nothing then).
        if self.ban_until > now {
            return Verdict {
                outcome: Outcome::Banned,
                now,
                minute_count,
                day_count,
                ban_until: self.ban_until,
                ban_started: false,
            };
        }
        self.minute_window = minute;
        self.minute_count = minute_count;
        self.day_window = day;
        self.day_count = day_count;
        let verdict = |outcome, s: &Wide| Verdict {
            outcome,
            now,
            minute_count: s.minute_count,
            day_count: s.day_count,
            ban_until: if s.ban_until > now { s.ban_until } else { 0 },
            ban_started: false,
        };
        if self.minute_count < limits.per_minute && self.day_count < limits.per_day {
            self.minute_count += 1;
            self.day_count += 1;
            self.last_admitted = now;
            return verdict(Outcome::Admitted, self);
        }
        if self.refused_day != day {
            self.refused_day = day;
            self.refused = 0;
        }
        self.refused += 1;
        if self.strike_window != minute {
            self.strike_window = minute;
            self.strikes = 0;
        }
        self.strikes += 1;
        if self.strikes <= ban.strikes {
            return verdict(Outcome::Limited, self);
        }
        if self.level_until <= now {
            self.ban_level = 0;
        }
        self.ban_until = now + ban.duration_for_level(self.ban_level);
        self.ban_level += 1;
        self.level_until = self.ban_until + ban.decay_secs;
        self.strikes = 0;
        Verdict {
            ban_started: true,
            ..verdict(Outcome::Banned, self)
        }
    }

    fn usage(&self, now: u64) -> (u64, u64, u64) {
        let minute = ahead_by_one(self.minute_window, now / MINUTE_SECS);
        let day = ahead_by_one(self.day_window, now / DAY_SECS);
        (
            if self.minute_window == minute {
                self.minute_count
            } else {
                0
            },
            if self.day_window == day {
                self.day_count
            } else {
                0
            },
            if self.refused_day == day {
                self.refused
            } else {
                0
            },
        )
    }
}

/// The window to count in: the stored one when it is exactly one ahead of the clock's (the
/// clock stepped back a little), else the clock's.
fn ahead_by_one(stored: u64, current: u64) -> u64 {
    if stored == current + 1 {
        stored
    } else {
        current
    }
}

/// The window a response reports in `X-RateLimit-*` (and a refusal is counted under, as the
/// `window` label of `pet_gateway_rate_limited_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    Minute,
    Day,
    /// A ban binds: its end is the reset, whatever the windows hold.
    Ban,
}

impl Window {
    pub fn as_str(self) -> &'static str {
        match self {
            Window::Minute => "minute",
            Window::Day => "day",
            Window::Ban => "ban",
        }
    }
}

/// The numbers behind the rate-limit headers of one response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateView {
    pub limits: Limits,
    pub now: u64,
    pub minute_remaining: u64,
    pub minute_reset: u64,
    pub day_remaining: u64,
    pub day_reset: u64,
    /// The binding window, reported in `X-RateLimit-*`.
    pub limit: u64,
    pub remaining: u64,
    pub reset: u64,
    /// Whole seconds, at least 1; only on refusals.
    pub retry_after: Option<u64>,
    /// Which window `limit`, `remaining` and `reset` are of.
    pub binding: Window,
}

impl RateView {
    /// A key banned until `until`, as this node knows without asking the store: nothing is
    /// known of its windows here, so they read as untouched.
    pub fn banned(limits: Limits, now: u64, until: u64) -> RateView {
        Self::untouched(Outcome::Banned, limits, now, until)
    }

    /// A request admitted without counting (`on_store_error = "open"`): its windows read as
    /// untouched.
    pub fn unmetered(limits: Limits, now: u64) -> RateView {
        Self::untouched(Outcome::Admitted, limits, now, 0)
    }

    fn untouched(outcome: Outcome, limits: Limits, now: u64, ban_until: u64) -> RateView {
        Self::new(
            &Verdict {
                outcome,
                now,
                minute_count: 0,
                day_count: 0,
                ban_until,
                ban_started: false,
            },
            limits,
        )
    }

    pub fn new(v: &Verdict, limits: Limits) -> RateView {
        let minute_reset = (v.now / MINUTE_SECS + 1) * MINUTE_SECS;
        let day_reset = (v.now / DAY_SECS + 1) * DAY_SECS;
        let mut minute_remaining = limits.per_minute.saturating_sub(v.minute_count);
        let mut day_remaining = limits.per_day.saturating_sub(v.day_count);
        let minute = (limits.per_minute, minute_remaining, minute_reset);
        let day = (limits.per_day, day_remaining, day_reset);
        // The binding window has the fewest requests remaining, the minute on a tie; when a
        // request is refused because both are full, the day binds: waiting for the minute would
        // not help.
        let day_binds = day_remaining < minute_remaining
            || (v.outcome != Outcome::Admitted && day_remaining == 0);
        let (limit, mut remaining, mut reset) = if day_binds { day } else { minute };
        let mut binding = if day_binds {
            Window::Day
        } else {
            Window::Minute
        };
        let retry_after = match v.outcome {
            Outcome::Admitted => None,
            Outcome::Limited => Some(reset.saturating_sub(v.now).max(1)),
            Outcome::Banned => {
                // A banned key can send nothing, whatever its windows hold: every header
                // (`X-RateLimit-Remaining` and both windows of `RateLimit`) says 0.
                remaining = 0;
                minute_remaining = 0;
                day_remaining = 0;
                reset = v.ban_until.max(v.now + 1);
                binding = Window::Ban;
                Some(reset - v.now)
            }
        };
        RateView {
            limits,
            now: v.now,
            minute_remaining,
            minute_reset,
            day_remaining,
            day_reset,
            limit,
            remaining,
            reset,
            retry_after,
            binding,
        }
    }

    /// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers).
    pub fn policy_header(&self) -> String {
        format!(
            "\"minute\";q={};w={MINUTE_SECS}, \"day\";q={};w={DAY_SECS}",
            self.limits.per_minute, self.limits.per_day
        )
    }

    /// `RateLimit` (draft-ietf-httpapi-ratelimit-headers): remaining and seconds to reset.
    pub fn ratelimit_header(&self) -> String {
        format!(
            "\"minute\";r={};t={}, \"day\";r={};t={}",
            self.minute_remaining,
            self.minute_reset - self.now,
            self.day_remaining,
            self.day_reset - self.now
        )
    }
}

/// The `X-RateLimit-*` triple as numbers, for responses that are not about a key's plan (the
/// per-IP limit on unauthenticated requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleLimit {
    pub limit: u64,
    pub remaining: u64,
    pub reset: u64,
}

/// Seconds until a per-minute GCRA allowance (governor) that lacks `missing` of its `per_minute`
/// cells is full again: one cell comes back every 60/`per_minute` seconds.
pub fn gcra_refill_secs(missing: u64, per_minute: u64) -> u64 {
    (missing * MINUTE_SECS).div_ceil(per_minute.max(1))
}

/// A wait as the whole seconds of `Retry-After`: rounded up, and at least 1.
pub fn retry_after_secs(wait: std::time::Duration) -> u64 {
    (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FREE: Limits = Limits {
        per_minute: 60,
        per_day: 1000,
    };

    #[test]
    fn a_clock_stepping_back_over_midnight_keeps_the_day_count() {
        let ban = BanPolicy::default();
        let tight = Limits {
            per_minute: 100,
            per_day: 5,
        };
        let mut s = KeyState::default();
        let midnight = 20_000 * DAY_SECS;
        for _ in 0..5 {
            assert_eq!(
                s.acquire(midnight + 3, tight, &ban).outcome,
                Outcome::Admitted
            );
        }
        // The clock steps back 5 s, into yesterday, then forward again.
        for t in [midnight - 2, midnight + 4] {
            let v = s.acquire(t, tight, &ban);
            assert_eq!(v.outcome, Outcome::Limited, "at {t}");
            assert_eq!(v.day_count, 5);
        }
        // A stored window far ahead (the clock had jumped forward, then back) is not kept: the
        // key is not pinned to it.
        let mut s = KeyState::default();
        s.acquire(midnight + 10 * DAY_SECS, tight, &ban);
        let v = s.acquire(midnight + 3, tight, &ban);
        assert_eq!((v.outcome, v.day_count), (Outcome::Admitted, 1));
    }

    #[test]
    fn admits_up_to_the_minute_limit_then_refuses_without_counting() {
        let ban = BanPolicy::default();
        let mut s = KeyState::default();
        let minute_start = 60 * 16_667;
        let t0 = minute_start + 20;
        for i in 1..=60 {
            let v = s.acquire(t0, FREE, &ban);
            assert_eq!(v.outcome, Outcome::Admitted);
            let view = RateView::new(&v, FREE);
            assert_eq!((view.limit, view.remaining), (60, 60 - i));
        }
        let v = s.acquire(t0 + 5, FREE, &ban);
        assert_eq!(v.outcome, Outcome::Limited);
        assert_eq!(v.day_count, 60, "refused requests do not count");
        let view = RateView::new(&v, FREE);
        assert_eq!(view.reset, minute_start + 60);
        assert_eq!(view.retry_after, Some(35));
        assert_eq!(view.binding, Window::Minute);
        // The next minute has room again.
        assert_eq!(s.acquire(t0 + 40, FREE, &ban).outcome, Outcome::Admitted);
    }

    #[test]
    fn the_day_binds_when_it_has_fewer_remaining() {
        let limits = Limits {
            per_minute: 100,
            per_day: 5,
        };
        let mut s = KeyState::default();
        let now = 10 * DAY_SECS + 3_600;
        for _ in 0..5 {
            assert_eq!(
                s.acquire(now, limits, &BanPolicy::default()).outcome,
                Outcome::Admitted
            );
        }
        let v = s.acquire(now, limits, &BanPolicy::default());
        assert_eq!(v.outcome, Outcome::Limited);
        let view = RateView::new(&v, limits);
        assert_eq!(
            (view.limit, view.remaining, view.reset),
            (5, 0, 11 * DAY_SECS)
        );
        assert_eq!(view.retry_after, Some(DAY_SECS - 3_600));
        assert_eq!(view.binding, Window::Day);
    }

    #[test]
    fn strikes_past_the_threshold_ban_with_escalating_then_decaying_levels() {
        let limits = Limits {
            per_minute: 1,
            per_day: 1000,
        };
        let ban = BanPolicy {
            strikes: 2,
            durations: vec![10, 100],
            decay_secs: 1_000,
        };
        let mut s = KeyState::default();
        let t = 600;
        assert_eq!(s.acquire(t, limits, &ban).outcome, Outcome::Admitted);
        assert_eq!(s.acquire(t, limits, &ban).outcome, Outcome::Limited);
        assert_eq!(s.acquire(t, limits, &ban).outcome, Outcome::Limited);
        let v = s.acquire(t, limits, &ban);
        assert_eq!(
            (v.outcome, v.ban_until, v.ban_started),
            (Outcome::Banned, t + 10, true)
        );
        let view = RateView::new(&v, limits);
        assert_eq!(
            (view.remaining, view.reset, view.retry_after, view.binding),
            (0, t + 10, Some(10), Window::Ban)
        );
        let during = s.acquire(t + 9, limits, &ban);
        assert_eq!(
            (during.outcome, during.ban_started),
            (Outcome::Banned, false)
        );
        // Ban over; a new minute has room.
        assert_eq!(s.acquire(t + 60, limits, &ban).outcome, Outcome::Admitted);
        // Second ban inside the decay period is longer.
        for _ in 0..2 {
            assert_eq!(s.acquire(t + 60, limits, &ban).outcome, Outcome::Limited);
        }
        assert_eq!(s.acquire(t + 60, limits, &ban).ban_until, t + 160);
        // Third, still escalated: the last duration repeats.
        let t2 = t + 240;
        assert_eq!(s.acquire(t2, limits, &ban).outcome, Outcome::Admitted);
        for _ in 0..2 {
            s.acquire(t2, limits, &ban);
        }
        assert_eq!(s.acquire(t2, limits, &ban).ban_until, t2 + 100);
        // After a quiet period longer than the decay the level starts over.
        let t3 = t2 + 100 + 1_000 + 60;
        assert_eq!(s.acquire(t3, limits, &ban).outcome, Outcome::Admitted);
        for _ in 0..2 {
            s.acquire(t3, limits, &ban);
        }
        assert_eq!(s.acquire(t3, limits, &ban).ban_until, t3 + 10);
    }

    #[test]
    fn headers_are_formatted_per_the_draft() {
        let v = Verdict {
            outcome: Outcome::Admitted,
            now: 120 + 18,
            minute_count: 1,
            day_count: 1,
            ban_until: 0,
            ban_started: false,
        };
        let view = RateView::new(&v, FREE);
        assert_eq!(
            view.policy_header(),
            "\"minute\";q=60;w=60, \"day\";q=1000;w=86400"
        );
        assert_eq!(
            view.ratelimit_header(),
            "\"minute\";r=59;t=42, \"day\";r=999;t=86262"
        );
    }

    #[test]
    fn a_ban_known_locally_and_an_unmetered_admission_read_as_untouched_windows() {
        let now = 120 + 18;
        let banned = RateView::banned(FREE, now, now + 30);
        assert_eq!(
            (
                banned.binding,
                banned.remaining,
                banned.reset,
                banned.retry_after
            ),
            (Window::Ban, 0, now + 30, Some(30))
        );
        assert_eq!(
            (banned.minute_remaining, banned.day_remaining),
            (0, 0),
            "every header of a banned key says 0 remaining"
        );
        assert!(banned.ratelimit_header().contains("\"minute\";r=0;"));
        let open = RateView::unmetered(FREE, now);
        assert_eq!(
            (open.binding, open.limit, open.remaining, open.retry_after),
            (Window::Minute, 60, 60, None)
        );
    }

    #[test]
    fn gcra_and_retry_after_round_up() {
        assert_eq!(gcra_refill_secs(0, 60), 0);
        assert_eq!(gcra_refill_secs(1, 60), 1);
        assert_eq!(gcra_refill_secs(1, 7), 9);
        assert_eq!(gcra_refill_secs(7, 7), 60);
        assert_eq!(retry_after_secs(std::time::Duration::ZERO), 1);
        assert_eq!(retry_after_secs(std::time::Duration::from_millis(1_001)), 2);
        assert_eq!(retry_after_secs(std::time::Duration::from_secs(3)), 3);
    }

    #[test]
    fn idle_states_are_those_of_past_days_without_bans() {
        let mut s = KeyState::default();
        s.acquire(DAY_SECS + 5, FREE, &BanPolicy::default());
        assert!(!s.is_idle(DAY_SECS + 100));
        assert!(s.is_idle(2 * DAY_SECS));
    }
}
