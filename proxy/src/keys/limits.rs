//! A quota as data: a plan's (or a key's) windows, each a length and a limit, counted in fixed
//! windows aligned to the Unix epoch (a day to UTC midnight) or to the UTC calendar month, and
//! how many of the quota's requests may be in flight at once. The rules (`quota::rules`), the
//! stores and every header read windows from here, so a new length is a plan-file edit, not a
//! code change.

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;

use crate::base::clock::{civil_from_days, days_from_civil};

/// At most this many windows per plan (and per key, with its own limits): each one is a count
/// the store reads and writes on every decision.
pub const MAX_WINDOWS: usize = 6;
/// Counts are kept in 32 bits (the Redis state and the embedded store).
pub const MAX_LIMIT: u64 = u32::MAX as u64;
/// How a key's own concurrency is named among its limits (`--limit concurrency=8`, the admin
/// API's `"limits": {"concurrency": 8}`), beside the window lengths.
pub const CONCURRENCY: &str = "concurrency";
/// The most requests of one quota in flight at once a plan or key may allow: far above any
/// backend's capacity, and small enough that the stores' counts of leases never overflow.
pub const MAX_CONCURRENCY: u64 = 1_000_000;
/// The longest fixed window: past a year a window is a budget, not a rate.
const MAX_SECS: u64 = 400 * 86_400;
/// A month's nominal length, for ordering windows only (`40d` is longer than a month).
const MONTH_NOMINAL_SECS: u64 = 2_629_746;

/// A window's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Every {
    /// Fixed windows of this many seconds, aligned to the Unix epoch.
    Secs(u32),
    /// The UTC calendar month.
    Month,
}

impl Every {
    pub const MINUTE: Every = Every::Secs(60);
    pub const DAY: Every = Every::Secs(86_400);

    /// `Ns`, `Nm`, `Nh`, `Nd` (N from 1; at most 400 days) or `month`.
    pub fn parse(text: &str) -> Result<Every, String> {
        if text == "month" {
            return Ok(Every::Month);
        }
        let bad = || {
            format!(
                "`{text}` is not a window length: write Ns, Nm, Nh or Nd (N a whole number from \
                 1, at most 400 days in all) or month"
            )
        };
        // ASCII only: a length ending in a character of several bytes must not split it.
        if !text.is_ascii() {
            return Err(bad());
        }
        let split = text.len().checked_sub(1).ok_or_else(bad)?;
        let (digits, unit) = text.split_at(split);
        let unit_secs = match unit {
            "s" => 1,
            "m" => 60,
            "h" => 3_600,
            "d" => 86_400,
            _ => return Err(bad()),
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let n: u64 = digits.parse().map_err(|_| bad())?;
        let secs = n.checked_mul(unit_secs).ok_or_else(bad)?;
        if n == 0 || secs > MAX_SECS {
            return Err(bad());
        }
        Ok(Every::Secs(secs as u32))
    }

    /// The window's name in headers, metrics and JSON: `second`, `minute`, `hour`, `day`,
    /// `month`, else the length in its largest whole unit (`10s`, `90m`, `6h`, `7d`).
    pub fn name(self) -> Cow<'static, str> {
        match self {
            Every::Month => Cow::Borrowed("month"),
            Every::Secs(1) => Cow::Borrowed("second"),
            Every::Secs(60) => Cow::Borrowed("minute"),
            Every::Secs(3_600) => Cow::Borrowed("hour"),
            Every::Secs(86_400) => Cow::Borrowed("day"),
            Every::Secs(n) => Cow::Owned(Self::written(n)),
        }
    }

    /// The length as a plan file writes it (`1m`, `6h`, `month`).
    pub fn spec(self) -> String {
        match self {
            Every::Month => "month".to_owned(),
            Every::Secs(n) => Self::written(n),
        }
    }

    fn written(n: u32) -> String {
        for (unit, secs) in [("d", 86_400), ("h", 3_600), ("m", 60)] {
            if n.is_multiple_of(secs) {
                return format!("{}{unit}", n / secs);
            }
        }
        format!("{n}s")
    }

    /// The number of the window holding `now` (Unix seconds): `now / length`, or months since
    /// January 1970.
    pub fn index(self, now: u64) -> u64 {
        match self {
            Every::Secs(n) => now / u64::from(n),
            Every::Month => {
                let (y, m, _) = civil_from_days(now / 86_400);
                month_index(y, m)
            }
        }
    }

    /// The first second of window `index`.
    pub fn start_of(self, index: u64) -> u64 {
        match self {
            Every::Secs(n) => index * u64::from(n),
            Every::Month => {
                let (y, m) = ((index / 12) as i64 + 1970, (index % 12) as u32 + 1);
                days_from_civil(y, m, 1) * 86_400
            }
        }
    }

    /// When the window holding `now` ends (the next one's first second).
    pub fn reset(self, now: u64) -> u64 {
        match self {
            Every::Secs(n) => (now / u64::from(n) + 1) * u64::from(n),
            Every::Month => self.start_of(self.index(now) + 1),
        }
    }

    /// The length in seconds of the window holding `now` (a month's varies).
    pub fn secs_at(self, now: u64) -> u64 {
        match self {
            Every::Secs(n) => u64::from(n),
            Every::Month => {
                let index = self.index(now);
                self.start_of(index + 1) - self.start_of(index)
            }
        }
    }

    /// For ordering windows by length (a month as its average length).
    pub fn nominal_secs(self) -> u64 {
        match self {
            Every::Secs(n) => u64::from(n),
            Every::Month => MONTH_NOMINAL_SECS,
        }
    }

    /// The compact form stores keep beside a window's count: the length in seconds, 0 for the
    /// month.
    pub fn code(self) -> u32 {
        match self {
            Every::Secs(n) => n,
            Every::Month => 0,
        }
    }

    pub fn from_code(code: u32) -> Every {
        match code {
            0 => Every::Month,
            n => Every::Secs(n),
        }
    }
}

impl Ord for Every {
    fn cmp(&self, other: &Self) -> Ordering {
        self.nominal_secs().cmp(&other.nominal_secs())
    }
}

impl PartialOrd for Every {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Every {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.spec())
    }
}

/// Months since January 1970 of month `m` (1-12) of year `y`.
fn month_index(y: i64, m: u32) -> u64 {
    ((y - 1970) * 12 + i64::from(m) - 1).max(0) as u64
}

/// One window of a quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowLimit {
    pub every: Every,
    /// Units (requests times their cost) allowed in one window, 1 to [`MAX_LIMIT`].
    pub limit: u32,
    /// Counted and reported to the operator, never refusing: a limit being tried out.
    pub shadow: bool,
}

impl WindowLimit {
    pub fn new(every: Every, limit: u64) -> Result<WindowLimit, String> {
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(format!(
                "the limit of the {} window must be a whole number from 1 to {MAX_LIMIT} (got {limit})",
                every.spec()
            ));
        }
        Ok(WindowLimit {
            every,
            limit: limit as u32,
            shadow: false,
        })
    }

    pub fn limit(&self) -> u64 {
        u64::from(self.limit)
    }
}

const UNUSED: WindowLimit = WindowLimit {
    every: Every::Secs(1),
    limit: 0,
    shadow: false,
};

/// A quota's windows, shortest first; at most [`MAX_WINDOWS`], each length once; and its
/// concurrency, the most of its requests in flight at once (0: no such limit). A value, not a
/// reference: a request carries its limits without touching a shared count.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    windows: [WindowLimit; MAX_WINDOWS],
    len: u8,
    concurrency: u32,
}

impl Limits {
    /// The limits of `windows` (any order): refused when there are none, more than
    /// [`MAX_WINDOWS`], or two of one length.
    pub fn new(windows: &[WindowLimit]) -> Result<Limits, String> {
        if windows.is_empty() {
            return Err("a plan needs at least one window".to_owned());
        }
        if windows.len() > MAX_WINDOWS {
            return Err(format!(
                "{} windows: at most {MAX_WINDOWS} are allowed",
                windows.len()
            ));
        }
        let mut sorted = [UNUSED; MAX_WINDOWS];
        sorted[..windows.len()].copy_from_slice(windows);
        sorted[..windows.len()].sort_by_key(|w| w.every);
        if let Some(pair) = sorted[..windows.len()]
            .windows(2)
            .find(|p| p[0].every == p[1].every)
        {
            return Err(format!(
                "two windows of one length ({}): merge them into one",
                pair[0].every.spec()
            ));
        }
        Ok(Limits {
            windows: sorted,
            len: windows.len() as u8,
            concurrency: 0,
        })
    }

    /// These limits with at most `n` requests in flight at once (0: no such limit).
    pub fn with_concurrency(mut self, n: u32) -> Limits {
        self.concurrency = n;
        self
    }

    /// The most requests of the quota in flight at once; `None`: no such limit.
    pub fn concurrency(&self) -> Option<u32> {
        (self.concurrency > 0).then_some(self.concurrency)
    }

    /// The two windows of the first plan form (and of `--per-minute`/`--per-day`).
    pub fn minute_day(per_minute: u64, per_day: u64) -> Result<Limits, String> {
        Limits::new(&[
            WindowLimit::new(Every::MINUTE, per_minute)?,
            WindowLimit::new(Every::DAY, per_day)?,
        ])
    }

    pub fn windows(&self) -> &[WindowLimit] {
        &self.windows[..usize::from(self.len)]
    }

    /// The windows that refuse (not shadow).
    pub fn enforced(&self) -> impl Iterator<Item = &WindowLimit> {
        self.windows().iter().filter(|w| !w.shadow)
    }

    pub fn get(&self, every: Every) -> Option<&WindowLimit> {
        self.windows().iter().find(|w| w.every == every)
    }

    /// The limit of the enforced window of this length.
    pub fn enforced_limit(&self, every: Every) -> Option<u64> {
        self.get(every)
            .filter(|w| !w.shadow)
            .map(WindowLimit::limit)
    }

    /// The smallest enforced limit: no operation may cost more, or it could never pass.
    pub fn smallest_enforced(&self) -> Option<u64> {
        self.enforced().map(WindowLimit::limit).min()
    }

    /// These limits with a key's own: a length these have takes the key's limit (a shadow
    /// window stays shadow); a length they lack is added as an enforced window. Additions past
    /// [`MAX_WINDOWS`] (a plan that grew since the key was issued) are left out, longest first.
    pub fn with_overrides(&self, own: &[(Every, u32)]) -> Limits {
        let mut out = *self;
        for &(every, limit) in own {
            let limit = limit.max(1);
            if let Some(w) = out.windows[..usize::from(out.len)]
                .iter_mut()
                .find(|w| w.every == every)
            {
                w.limit = limit;
            } else if usize::from(out.len) < MAX_WINDOWS {
                out.windows[usize::from(out.len)] = WindowLimit {
                    every,
                    limit,
                    shadow: false,
                };
                out.len += 1;
                out.windows[..usize::from(out.len)].sort_by_key(|w| w.every);
            }
        }
        out
    }
}

impl fmt::Debug for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        list.entries(self.windows());
        if let Some(n) = self.concurrency() {
            list.entry(&format_args!("concurrency {n}"));
        }
        list.finish()
    }
}

/// `concurrency = N` of a plan file, a key's `--limit concurrency=N` or its record's field:
/// from 1 to [`MAX_CONCURRENCY`].
pub fn check_concurrency(n: u64) -> Result<u32, String> {
    if (1..=MAX_CONCURRENCY).contains(&n) {
        Ok(n as u32)
    } else {
        Err(format!(
            "concurrency must be a whole number from 1 to {MAX_CONCURRENCY} (got {n}): the most \
             requests of a key, or of a customer's keys together, in flight at once"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_parse_and_are_named() {
        let cases = [
            ("1s", Every::Secs(1), "second"),
            ("10s", Every::Secs(10), "10s"),
            ("1m", Every::Secs(60), "minute"),
            ("90m", Every::Secs(5_400), "90m"),
            ("1h", Every::Secs(3_600), "hour"),
            ("6h", Every::Secs(21_600), "6h"),
            ("1d", Every::Secs(86_400), "day"),
            ("7d", Every::Secs(604_800), "7d"),
            ("month", Every::Month, "month"),
        ];
        for (text, every, name) in cases {
            assert_eq!(Every::parse(text), Ok(every), "{text}");
            assert_eq!(every.name(), name);
            assert_eq!(Every::parse(&every.spec()), Ok(every));
            assert_eq!(Every::from_code(every.code()), every);
        }
        for bad in [
            "",
            "s",
            "0s",
            "1",
            "1w",
            "-1s",
            "1.5h",
            "401d",
            "+1s",
            "Month",
            "99999999999999999999d",
        ] {
            assert!(Every::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn months_follow_the_utc_calendar() {
        // 2024-02-29T12:00:00Z: a leap February.
        let now = 1_709_208_000;
        let month = Every::Month;
        assert_eq!(month.start_of(month.index(now)), 1_706_745_600); // 2024-02-01
        assert_eq!(month.reset(now), 1_709_251_200); // 2024-03-01
        assert_eq!(month.secs_at(now), 29 * 86_400);
        // The last second of December, and the first of January.
        let new_year = 1_735_689_600; // 2025-01-01
        assert_eq!(month.reset(new_year - 1), new_year);
        assert_eq!(month.index(new_year), month.index(new_year - 1) + 1);
        assert_eq!(month.secs_at(new_year - 1), 31 * 86_400);
        assert_eq!(month.index(0), 0);
        // Every day of four centuries maps back to itself.
        for days in (0..146_097 * 4).step_by(17) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn fixed_windows_align_to_the_epoch() {
        let day = Every::DAY;
        let now = 1_764_028_800 + 3_723; // 2025-11-25T01:02:03Z
        assert_eq!(day.reset(now), 1_764_028_800 + 86_400);
        assert_eq!(Every::MINUTE.reset(now), now - 3 + 60);
        assert_eq!(Every::Secs(1).reset(now), now + 1);
        assert_eq!(Every::Secs(10).secs_at(now), 10);
    }

    #[test]
    fn limits_are_sorted_checked_and_overridden() {
        let w = |e: &str, n: u64| WindowLimit::new(Every::parse(e).unwrap(), n).unwrap();
        let limits = Limits::new(&[w("month", 200_000), w("1s", 20), w("1d", 10_000)]).unwrap();
        let order: Vec<String> = limits.windows().iter().map(|w| w.every.spec()).collect();
        assert_eq!(order, ["1s", "1d", "month"]);
        assert_eq!(limits.smallest_enforced(), Some(20));
        assert!(Limits::new(&[]).is_err());
        assert!(Limits::new(&[w("1m", 1), w("60s", 2)])
            .unwrap_err()
            .contains("1m"));
        let seven: Vec<WindowLimit> = (1..=7).map(|n| w(&format!("{n}s"), 5)).collect();
        assert!(Limits::new(&seven).unwrap_err().contains("at most 6"));
        assert!(WindowLimit::new(Every::MINUTE, 0).is_err());
        assert!(WindowLimit::new(Every::MINUTE, MAX_LIMIT + 1).is_err());

        let mut shadowed = limits;
        shadowed.windows[2].shadow = true;
        let own = shadowed.with_overrides(&[(Every::Month, 5), (Every::MINUTE, 50)]);
        assert_eq!(
            own.get(Every::Month).map(|w| (w.limit, w.shadow)),
            Some((5, true))
        );
        assert_eq!(own.enforced_limit(Every::MINUTE), Some(50));
        assert_eq!(own.windows().len(), 4);
        assert!(own.windows().windows(2).all(|p| p[0].every < p[1].every));
        assert_eq!(
            Limits::minute_day(60, 1000)
                .unwrap()
                .enforced_limit(Every::DAY),
            Some(1000)
        );
    }
}
