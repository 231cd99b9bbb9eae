//! How many units a region asks the global store for, and when: a pure function of what the
//! region has counted and holds of each window's instance and the store's clock, so that the
//! rule is read, and tested, in one place.
//!
//! The region's rate of a quota is its own count in the current instance over the seconds the
//! instance has run (the region's Redis counts every node's admissions, so no node's view is
//! partial). Each ask covers what the region would spend at that rate over [`HORIZON`] (or to
//! the instance's end, if sooner), a quarter more, so that a key below its limit finds its units
//! there and one call lasts long enough: a key at a steady rate costs about one call a
//! minute. The next instance is asked [`LOOKAHEAD`] before the current one ends, so the first
//! requests of a new minute or day find units already held; at most half its limit before it
//! starts (a region whose traffic alone would spend a window can still take the rest once it
//! runs, by its top-ups: the budget goes to who asks, not in shares). The global store grants at most
//! what is left (`ledger`), so asks shrink by themselves near the end of a budget. Each ask also
//! names what it needs without the quarter: an instance the global store found contested (its
//! budget, or its predecessor's, fell short of an ask) grants only that, since the quarter
//! would stay unspent in a region while another is refused.

use crate::keys::limits::{Limits, MAX_WINDOWS};
use crate::quota::store::redis::ledger::{Ask, Instance};

/// How far ahead an ask covers at the region's rate.
pub const HORIZON: u64 = 60;
/// Asked again once what is left would last less than this at the region's rate.
pub const LOW_SECS: u64 = 15;
/// How long before an instance's end its successor is asked.
pub const LOOKAHEAD: u64 = 10;
/// What an ask wants over what the region's rate would spend: a quarter more, so that a key
/// below its limit costs about one call a horizon. An instance the global store found
/// contested grants without it (`Ask::need`, `ledger`'s `GRANT`).
pub const HEADROOM: f64 = 1.25;

/// What a decision saw of one quota in its region: the store's clock, and per window of its
/// limits (their order) the units counted and the units held of the current instance.
#[derive(Debug, Clone, Copy)]
pub struct Seen {
    pub now: u64,
    pub counts: [u64; MAX_WINDOWS],
    pub held: [u64; MAX_WINDOWS],
}

/// The asks a region makes after a decision that saw `seen`, for requests costing `cost`.
///
/// Something must be due first: with `short` (a request is waiting, refused for too few units),
/// an enforced window whose spare units do not cover `cost`; otherwise a window whose spare units
/// would run out within [`LOW_SECS`], or a next instance within [`LOOKAHEAD`] of its start that
/// `wanted` accepts (the caller's way to ask each next instance once). Then every current
/// instance with less than three quarters of a [`HORIZON`] spare is topped up in the same call,
/// so that a key's windows are asked together, about once a horizon, not each on its own.
/// Shadow windows never refuse and are never asked.
pub fn asks(
    limits: &Limits,
    seen: &Seen,
    cost: u64,
    short: bool,
    mut wanted: impl FnMut(&Instance) -> bool,
) -> Vec<Ask> {
    let now = seen.now;
    let rate = rate(limits, seen, cost);
    let mut due = false;
    let mut out = Vec::new();
    let mut tops = Vec::new();
    for (i, w) in limits.windows().iter().enumerate() {
        if w.shadow {
            continue;
        }
        let at = Instance::at(w.every, now);
        let spare = seen.held[i].saturating_sub(seen.counts[i]);
        let left = at.end.saturating_sub(now).max(1);
        let spend = |secs: u64, more: f64| (rate * secs as f64 * more).ceil() as u64 + cost;
        let low = spend(LOW_SECS, 1.0);
        due |= if short { spare < cost } else { spare < low };
        let span = left.min(HORIZON);
        let full = spend(span, HEADROOM);
        if spare.saturating_mul(4) < full.saturating_mul(3) || spare < cost {
            let less = |units: u64| units.saturating_sub(spare).max(cost);
            tops.push(Ask {
                at,
                limit: w.limit(),
                want: less(full),
                need: less(spend(span, 1.0)),
            });
        }
        if !short && left <= LOOKAHEAD {
            let next = Instance::at(w.every, at.end);
            if wanted(&next) {
                due = true;
                // At most half the limit ahead of the instance's start: a region whose own
                // traffic would spend it all leaves the rest to those that ask at the start.
                let span = (next.end - at.end).min(HORIZON);
                let ahead = |more| spend(span, more).min(w.limit() / 2 + cost);
                out.push(Ask {
                    at: next,
                    limit: w.limit(),
                    want: ahead(HEADROOM),
                    need: ahead(1.0),
                });
            }
        }
    }
    if !due {
        return Vec::new();
    }
    tops.extend(out);
    tops
}

/// The region's recent rate, units a second: the highest of its windows' counts over the
/// seconds their instance has run, [`LOW_SECS`] at least (a quarter of the window, if less). The
/// shortest window says most of the last moments (a day's count over its hours says little of a
/// key that started sending a minute ago); the count is the cost at least, so a first request
/// asks for itself. The floor keeps an instance's first requests from reading one request in
/// its first second as a whole budget's rate: a region whose first request of a minute asked
/// for a unit a second took the whole minute of a contested key, spent a share and stranded
/// the rest while the other regions were refused (36 of 60 in the harness).
fn rate(limits: &Limits, seen: &Seen, cost: u64) -> f64 {
    let mut rate = 0f64;
    for (i, w) in limits.windows().iter().enumerate() {
        let start = w.every.start_of(w.every.index(seen.now));
        let floor = LOW_SECS.min(w.every.secs_at(seen.now) / 4).max(1);
        let ran = (seen.now.saturating_sub(start) + 1).max(floor);
        rate = rate.max(seen.counts[i].max(cost) as f64 / ran as f64);
    }
    rate
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::limits::{Every, WindowLimit};

    fn minute_and_day() -> Limits {
        Limits::new(&[
            WindowLimit::new(Every::MINUTE, 60).unwrap(),
            WindowLimit::new(Every::DAY, 1000).unwrap(),
        ])
        .unwrap()
    }

    fn seen(now: u64, counts: [u64; 2], held: [u64; 2]) -> Seen {
        let mut s = Seen {
            now,
            counts: [0; MAX_WINDOWS],
            held: [0; MAX_WINDOWS],
        };
        s.counts[..2].copy_from_slice(&counts);
        s.held[..2].copy_from_slice(&held);
        s
    }

    #[test]
    fn a_first_request_asks_for_itself_and_what_its_rate_would_spend() {
        // 12:00:00 of some day, nothing counted or held: short by the cost.
        let now = 1_800_000_000 - 1_800_000_000 % 86_400;
        let asks = asks(
            &minute_and_day(),
            &seen(now, [0, 0], [0, 0]),
            1,
            true,
            |_| true,
        );
        assert_eq!(asks.len(), 2);
        assert!(asks.iter().all(|a| a.want >= 1 && a.need >= 1));
        assert_eq!(asks[0].limit, 60);
        assert_eq!(asks[1].limit, 1000);
    }

    #[test]
    fn a_region_with_enough_spare_asks_nothing_until_near_the_end() {
        let start = 1_800_000_000 - 1_800_000_000 % 86_400;
        // 30 s into the minute, 30 counted (1 a second), 60 held: 30 spare, above 15 s of rate.
        let s = seen(start + 29, [30, 30], [60, 200]);
        assert!(asks(&minute_and_day(), &s, 1, false, |_| true).is_empty());
        // 5 s before the minute's end: the next minute is asked, about a minute at the rate but
        // half the limit at most, and the day (less than 45 s spare) topped up in the same call.
        let s = seen(start + 55, [56, 56], [75, 90]);
        let a = asks(&minute_and_day(), &s, 1, false, |_| true);
        assert_eq!(a.len(), 2, "{a:?}");
        assert_eq!(a[0].at.every, Every::DAY);
        assert_eq!(a[1].at.index, Every::MINUTE.index(start + 60));
        assert_eq!(a[1].want, 31, "half the limit at most: {a:?}");
        // A next instance asked already (the caller says so): nothing is due.
        assert!(asks(&minute_and_day(), &s, 1, false, |_| false).is_empty());
    }

    #[test]
    fn an_ask_names_what_the_rate_would_spend_beside_the_quarter_more_it_wants() {
        let start = 1_800_000_000 - 1_800_000_000 % 86_400;
        // 50 s into the minute, 20 counted (24 a minute): the next minute, 10 s ahead.
        let s = seen(start + 50, [20, 20], [31, 400]);
        let a = asks(&minute_and_day(), &s, 1, false, |_| true);
        let next = a
            .iter()
            .find(|a| a.at.index == Every::MINUTE.index(start + 60));
        let next = next.expect("the next minute asked");
        assert_eq!((next.need, next.want), (25, 31), "{a:?}");
        // A top-up wants the quarter too, and needs without it, less what is spare either way.
        let s = seen(start + 30, [30, 30], [36, 400]);
        let a = asks(&minute_and_day(), &s, 1, false, |_| false);
        let minute = a
            .iter()
            .find(|a| a.at.every == Every::MINUTE)
            .expect("topped up");
        assert!(minute.need < minute.want, "{a:?}");
        assert_eq!(
            minute.need,
            31 - 6,
            "30 s at 1 a second and the cost, less 6 spare"
        );
    }

    #[test]
    fn an_instances_first_request_asks_for_a_rate_over_fifteen_seconds_not_its_first_one() {
        let start = 1_800_000_000 - 1_800_000_000 % 86_400 + 3_600;
        // The first request of a minute, short: the day's count says little (3 an hour).
        let s = seen(start, [0, 3], [0, 400]);
        let a = asks(&minute_and_day(), &s, 1, true, |_| false);
        let minute = a
            .iter()
            .find(|a| a.at.every == Every::MINUTE)
            .expect("asked");
        // 1 unit over 15 s for the minute's 60 s, and the request itself: 5, not the 60 (need)
        // and 76 (want) of a unit a second.
        assert_eq!((minute.need, minute.want), (5, 6), "{a:?}");
        // A short window's floor is a quarter of it: 2 counted in the first 2 s of 8 are a unit
        // a second (a floor of 8 s would read a quarter of that, and ask short each second).
        let eight = Limits::new(&[WindowLimit::new(Every::Secs(8), 10).unwrap()]).unwrap();
        let a = asks(&eight, &seen(start + 1, [2, 0], [2, 0]), 1, true, |_| false);
        assert_eq!(
            a[0].need,
            7 + 1,
            "1 a second for the 7 s left, and the cost: {a:?}"
        );
    }

    #[test]
    fn shadow_windows_are_never_asked() {
        let limits = Limits::new(&[WindowLimit {
            every: Every::MINUTE,
            limit: 5,
            shadow: true,
        }])
        .unwrap();
        assert!(asks(
            &limits,
            &seen(1_800_000_000, [9, 0], [0, 0]),
            1,
            true,
            |_| true
        )
        .is_empty());
    }
}
