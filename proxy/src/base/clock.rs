//! Time has one home: the wall clock every part of the gateway reads (Unix seconds, as the quota
//! windows and the rate-limit headers count them), a [`Clock`] that tests can hold still and move
//! by hand, and the RFC 3339 form that files and admin answers show people.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// Unix seconds now. A clock set before 1970 reads 0 rather than failing a request.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Unix milliseconds: the floor of a key record's version (writers) and its horizon (nodes).
pub fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Where a component reads the time: the system clock, or (in tests) a hand-moved one, so that
/// window and ban tests step over minutes without sleeping through them.
#[derive(Debug, Clone, Default)]
pub struct Clock {
    manual: Option<Arc<AtomicU64>>,
}

impl Clock {
    /// The system clock.
    pub fn system() -> Clock {
        Clock::default()
    }

    /// A clock that reads `start` until [`Clock::advance`] or [`Clock::set`] moves it; clones
    /// share it.
    pub fn manual(start: u64) -> Clock {
        Clock {
            manual: Some(Arc::new(AtomicU64::new(start))),
        }
    }

    pub fn now(&self) -> u64 {
        match &self.manual {
            Some(t) => t.load(Ordering::Relaxed),
            None => unix_now(),
        }
    }

    /// Moves a manual clock forward; the system clock cannot be moved, and is left alone.
    pub fn advance(&self, secs: u64) {
        if let Some(t) = &self.manual {
            t.fetch_add(secs, Ordering::Relaxed);
        }
    }

    /// Sets a manual clock; the system clock is left alone.
    pub fn set(&self, secs: u64) {
        if let Some(t) = &self.manual {
            t.store(secs, Ordering::Relaxed);
        }
    }

    pub fn is_manual(&self) -> bool {
        self.manual.is_some()
    }
}

/// Now, as RFC 3339 UTC.
pub fn rfc3339_now() -> String {
    rfc3339(unix_now())
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> u64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe - 719_468).max(0) as u64
}

/// The date (year, month 1-12, day 1-31) of a day number since 1970-01-01.
pub fn civil_from_days(days: u64) -> (i64, u32, u32) {
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// UTC date-time for Unix seconds.
pub fn rfc3339(secs: u64) -> String {
    let rem = secs % 86_400;
    let (year, month, day) = civil_from_days(secs / 86_400);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

/// Unix seconds of an RFC 3339 date-time (`2027-01-31T12:00:00Z`, `…T12:00:00.5+02:00`);
/// `None` for anything else, or a time before 1970.
pub fn parse_rfc3339(text: &str) -> Option<u64> {
    let b = text.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let part = b.get(from..from + len)?;
        part.iter()
            .all(u8::is_ascii_digit)
            .then(|| std::str::from_utf8(part).ok()?.parse().ok())?
    };
    let sep = |at: usize, c: &[u8]| b.get(at).is_some_and(|x| c.contains(x));
    if !(sep(4, b"-") && sep(7, b"-") && sep(10, b"Tt ") && sep(13, b":") && sep(16, b":")) {
        return None;
    }
    let (year, month, day) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    let (hour, minute, second) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
        return None;
    }
    if second > 60 {
        return None;
    }
    let mut rest = &text[19..];
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        rest = &frac[digits..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        _ => {
            let o = rest.as_bytes();
            if o.len() != 6 || !matches!(o[0], b'+' | b'-') || o[3] != b':' {
                return None;
            }
            let (h, m) = (
                rest[1..3].parse::<i64>().ok()?,
                rest[4..6].parse::<i64>().ok()?,
            );
            let sign = if o[0] == b'-' { -1 } else { 1 };
            sign * (h * 3_600 + m * 60)
        }
    };
    // Days from civil (H. Hinnant), the inverse of `rfc3339`.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hour * 3_600 + minute * 60 + second.min(59) - offset;
    u64::try_from(secs).ok()
}

/// `90d`, `12h`, `30m`, `45s`: seconds.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let unit = |suffix: char, scale: u64| text.strip_suffix(suffix).map(|n| (n, scale));
    let Some((number, scale)) = unit('s', 1)
        .or_else(|| unit('m', 60))
        .or_else(|| unit('h', 3_600))
        .or_else(|| unit('d', 86_400))
    else {
        return Err(format!("`{text}` needs a unit: s, m, h or d (`90d`)"));
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .filter(|secs| *secs <= u64::from(u32::MAX))
        .ok_or_else(|| {
            format!("`{text}` is not a whole number with a unit (`90d`), under 136 years")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_and_junk_is_an_error_not_a_panic() {
        assert_eq!(parse_duration("90d"), Ok(90 * 86_400));
        assert_eq!(parse_duration("0s"), Ok(0));
        for bad in ["", "1", "1é", "é", "-1h", "99999999999999999999d", "1.5h"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rfc3339_dates_parse_back() {
        for secs in [0, 951_782_400, 1_795_312_091, 4_102_444_800] {
            assert_eq!(parse_rfc3339(&rfc3339(secs)), Some(secs));
        }
        assert_eq!(
            parse_rfc3339("2026-11-22T03:48:11.250+02:00"),
            Some(1_795_312_091)
        );
        assert_eq!(
            parse_rfc3339("2026-11-21T20:48:11-05:00"),
            Some(1_795_312_091)
        );
        for bad in [
            "",
            "2026-11-22",
            "2026-13-01T00:00:00Z",
            "2026-11-22T00:00:00",
            "x026-11-22T00:00:00Z",
            "2026-11-22T24:00:00Z",
            "2026-11-22T00:00:00.Z",
            "1969-12-31T23:59:59Z",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }

    #[test]
    fn dates_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_795_312_091), "2026-11-22T01:48:11Z");
    }

    #[test]
    fn a_manual_clock_moves_only_by_hand_and_clones_share_it() {
        let c = Clock::manual(100);
        let shared = c.clone();
        assert_eq!(c.now(), 100);
        shared.advance(61);
        assert_eq!(c.now(), 161);
        c.set(5);
        assert_eq!(shared.now(), 5);
        let system = Clock::system();
        system.advance(1_000);
        assert!(
            system.now() >= 1_795_312_091,
            "the system clock is untouched"
        );
    }
}
