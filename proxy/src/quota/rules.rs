//! The quota rules, as plain arithmetic: a key's windows (`keys::limits`: any lengths, fixed
//! windows aligned to the epoch or the UTC month), admission only when every enforced window has
//! room for the request's cost, strikes for requests sent after a refusal, escalating bans, and
//! the quota's requests in flight as leases with an end ([`Leases`]).
//! The in-memory store runs exactly this code; the Redis script (`store/scripts.rs`) is its
//! transcription to Lua, and the store behaviour suite holds the two to the same results.

pub const MINUTE_SECS: u64 = 60;
pub const DAY_SECS: u64 = 86_400;

use std::borrow::Cow;

use crate::keys::limits::{Every, Limits, MAX_WINDOWS};

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
    /// Counted in every window; forward the request.
    Admitted,
    /// An enforced window has no room for the request's cost; nothing was counted.
    Limited,
    /// The key is banned (possibly by this very request); nothing was counted.
    Banned,
    /// Every window had room, but the quota's concurrency is in flight already: nothing was
    /// counted, no strike (parallel clients are not abusive).
    ConcurrencyLimited,
    /// A region's (`quota::regions`): every window had room, but the region holds too few of
    /// the units the global store grants and could get none in time (cut off from it, or
    /// another region holds the last ones): nothing counted, no strike.
    Unleased,
}

/// What a store answers for one request: enough to write every rate-limit header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub outcome: Outcome,
    /// The store's clock, Unix seconds (Redis `TIME` in Redis mode).
    pub now: u64,
    /// Units counted in each of the limits' windows (in `Limits::windows` order) in their
    /// current instance, this request's cost included if admitted.
    pub counts: [u64; MAX_WINDOWS],
    /// Unix second at which the ban ends; 0 when not banned.
    pub ban_until: u64,
    /// This very request started the ban (for counting bans, not refusals).
    pub ban_started: bool,
    /// When the limits have a concurrency: the lease this admitted request took (none
    /// otherwise), and the quota's requests in flight.
    pub lease: Lease,
}

/// A request's place among its quota's requests in flight: held until the request ends, or
/// until `end` (a Unix second by the store's clock) should nobody give it back (a node killed,
/// a release lost with the store), so that no place is ever held for good.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lease {
    /// 0: no lease was taken.
    pub end: u64,
    /// The quota's requests in flight after the decision (its leases not yet ended), this
    /// one's included.
    pub in_flight: u64,
}

impl Lease {
    pub fn taken(&self) -> bool {
        self.end > 0
    }
}

/// A quota's requests in flight, as leases: how many end at each second. Leases of one second
/// are alike, so a request gives back "one lease ending at `end`" and none needs an id of its
/// own; the pairs are at most the lease length's seconds, whatever the concurrency. The Redis
/// script keeps the same pairs (`store/scripts.rs`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Leases {
    /// (end, how many), ascending by end.
    ends: Vec<(u32, u32)>,
}

impl Leases {
    /// Drops the leases that have ended at `now`.
    fn purge(&mut self, now: u64) {
        self.ends.retain(|&(end, n)| u64::from(end) > now && n > 0);
    }

    /// The leases not ended at `now`.
    pub fn in_flight(&self, now: u64) -> u64 {
        self.ends
            .iter()
            .filter(|&&(end, _)| u64::from(end) > now)
            .map(|&(_, n)| u64::from(n))
            .sum()
    }

    /// A lease ending `secs` after `now`, when fewer than `most` are held at `now`; otherwise
    /// none (`end` 0), with the count held.
    pub fn take_within(&mut self, now: u64, most: u32, secs: u64) -> Lease {
        self.purge(now);
        let in_flight = self.in_flight(now);
        if in_flight >= u64::from(most) {
            return Lease { end: 0, in_flight };
        }
        Lease {
            end: self.take(now, secs),
            in_flight: in_flight + 1,
        }
    }

    /// Adds a lease ending `secs` after `now`; returns its end.
    fn take(&mut self, now: u64, secs: u64) -> u64 {
        let end = narrow(now + secs.max(1));
        match self.ends.iter_mut().find(|(e, _)| *e == end) {
            Some((_, n)) => *n = n.saturating_add(1),
            None => {
                self.ends.push((end, 1));
                self.ends.sort_unstable();
            }
        }
        u64::from(end)
    }

    /// Gives back one lease ending at `end`; false when there is none (it ended, or the store
    /// lost it).
    pub fn give_back(&mut self, now: u64, end: u64) -> bool {
        self.purge(now);
        let Some(at) = self.ends.iter().position(|&(e, _)| u64::from(e) == end) else {
            return false;
        };
        self.ends[at].1 -= 1;
        if self.ends[at].1 == 0 {
            self.ends.remove(at);
        }
        true
    }

    /// Moves a lease ending at `end` to end `secs` after `now`; one that is gone (it ended
    /// before its renewal came, or the store lost it) is taken again, since its request is
    /// still in flight. Returns the new end.
    pub fn renew(&mut self, now: u64, end: u64, secs: u64) -> u64 {
        self.give_back(now, end);
        self.take(now, secs)
    }

    /// Whether no lease is held at `now` (the entry can go).
    pub fn is_empty(&self, now: u64) -> bool {
        self.in_flight(now) == 0
    }
}

/// One window's count in a key's state: which length (`Every::code`), which instance of it
/// (`Every::index`) and the units counted there. Kept by length, not by position, so a plan
/// edit that adds or removes a window leaves every other window's count where it was.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Slot {
    pub every: u32,
    pub window: u32,
    pub count: u32,
}

/// One API key's (or customer's) counters. Window numbers say which instance a count belongs to,
/// so a count from an older window reads as zero without anything having to reset it.
///
/// Every field is 32 bits: windows and Unix seconds fit until 2106, counts fit because limits
/// are capped at `u32::MAX`, and whatever could pass the cap (a ban configured to end after
/// 2106) is held at it. The arithmetic is done in `u64`, so nothing can wrap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyState {
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
    /// The windows' counts, `len` of them.
    pub slots: [Slot; MAX_WINDOWS],
    pub len: u8,
}

/// Held at `u32::MAX` rather than wrapped.
pub fn narrow(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

impl KeyState {
    /// The slots in use.
    pub fn slots(&self) -> &[Slot] {
        &self.slots[..usize::from(self.len)]
    }

    /// The instance of `every` to count in at `now`, and its count. Only a newer window starts
    /// from zero: a clock that steps back by up to one window (NTP, a failover to a node whose
    /// clock lags) keeps counting in the stored window, or a backwards step over midnight would
    /// zero today's count and admit it all again. A stored window further ahead came from a
    /// clock that had jumped forward; it is not kept, or the key would stay pinned to it.
    pub fn current(&self, every: Every, now: u64) -> (u64, u64) {
        let code = every.code();
        let slot = self.slots().iter().find(|s| s.every == code);
        let window = ahead_by_one(
            slot.map_or(u64::MAX, |s| u64::from(s.window)),
            every.index(now),
        );
        let count = slot
            .filter(|s| u64::from(s.window) == window)
            .map_or(0, |s| u64::from(s.count));
        (window, count)
    }

    /// Stores `count` for instance `window` of `every`: in its own slot, else a free one, else
    /// (more lengths than slots: keys of several plans sharing one quota, or a plan edit) the
    /// slot of a length `limits` lack, one whose window has ended first. One always exists:
    /// `limits` have at most six lengths, and `every`, one of them, has no slot.
    fn put(&mut self, now: u64, limits: &Limits, every: Every, window: u64, count: u64) {
        let code = every.code();
        let len = usize::from(self.len);
        let foreign = |s: &Slot| limits.get(Every::from_code(s.every)).is_none();
        let at = self.slots[..len]
            .iter()
            .position(|s| s.every == code)
            .or((len < MAX_WINDOWS).then_some(len))
            .or_else(|| {
                let slots = &self.slots;
                (slots.iter().position(|s| foreign(s) && s.ended(now)))
                    .or_else(|| slots.iter().position(foreign))
            })
            .unwrap_or(MAX_WINDOWS - 1);
        if at == len {
            self.len += 1;
        }
        self.slots[at] = Slot {
            every: code,
            window: narrow(window),
            count: narrow(count),
        };
    }

    /// Decides one request costing `cost` units at `now` and updates the counters.
    pub fn acquire(&mut self, now: u64, limits: &Limits, cost: u64, ban: &BanPolicy) -> Verdict {
        self.acquire_leased(now, limits, cost, ban, None)
    }

    /// [`KeyState::acquire`], and when the limits have a concurrency, a lease of `secs` seconds
    /// from `leases` too: a refusal is decided in this order, a ban, then a window without room
    /// (a strike), then the concurrency (no strike, nothing counted).
    pub fn acquire_leased(
        &mut self,
        now: u64,
        limits: &Limits,
        cost: u64,
        ban: &BanPolicy,
        leases: Option<(&mut Leases, u64)>,
    ) -> Verdict {
        let windows = limits.windows();
        let mut counts = [0u64; MAX_WINDOWS];
        let mut instances = [0u64; MAX_WINDOWS];
        for (k, w) in windows.iter().enumerate() {
            (instances[k], counts[k]) = self.current(w.every, now);
        }
        let verdict = |outcome, s: &KeyState, counts| Verdict {
            outcome,
            now,
            counts,
            ban_until: if u64::from(s.ban_until) > now {
                u64::from(s.ban_until)
            } else {
                0
            },
            ban_started: false,
            lease: Lease::default(),
        };
        // A banned request changes nothing, as in the Lua script (which writes nothing then).
        if u64::from(self.ban_until) > now {
            return verdict(Outcome::Banned, self, counts);
        }
        let fits = windows
            .iter()
            .zip(counts)
            .all(|(w, count)| w.shadow || count + cost <= w.limit());
        if fits {
            let lease = match limits.concurrency().zip(leases) {
                Some((most, (leases, secs))) => leases.take_within(now, most, secs),
                None => Lease::default(),
            };
            if lease.in_flight > 0 && !lease.taken() {
                return Verdict {
                    lease,
                    ..verdict(Outcome::ConcurrencyLimited, self, counts)
                };
            }
            self.count_elsewhere(now, limits, cost);
            for (k, w) in windows.iter().enumerate() {
                counts[k] += cost;
                self.put(now, limits, w.every, instances[k], counts[k]);
            }
            self.last_admitted = narrow(now);
            return Verdict {
                lease,
                ..verdict(Outcome::Admitted, self, counts)
            };
        }
        let started = self.refuse(now, ban);
        Verdict {
            ban_started: started,
            ..verdict(
                if started {
                    Outcome::Banned
                } else {
                    Outcome::Limited
                },
                self,
                counts,
            )
        }
    }

    /// Counts an admitted request's cost in the windows of this state that `limits` lack and that
    /// are still running: a customer's keys on plans of other windows share every window's count
    /// (a key on a plan without a month still spends the customer's month).
    fn count_elsewhere(&mut self, now: u64, limits: &Limits, cost: u64) {
        for slot in &mut self.slots[..usize::from(self.len)] {
            let every = Every::from_code(slot.every);
            if limits.get(every).is_some() {
                continue;
            }
            let current = every.index(now);
            let window = u64::from(slot.window);
            if window == current || window == current + 1 {
                slot.count = narrow(u64::from(slot.count) + cost);
            }
        }
    }

    /// Counts a refusal and a strike; true when the strike starts a ban.
    fn refuse(&mut self, now: u64, ban: &BanPolicy) -> bool {
        let day = narrow(now / DAY_SECS);
        let minute = narrow(now / MINUTE_SECS);
        if self.refused_day != day {
            self.refused_day = day;
            self.refused = 0;
        }
        self.refused = self.refused.saturating_add(1);
        if self.strike_window != minute {
            self.strike_window = minute;
            self.strikes = 0;
        }
        self.strikes = self.strikes.saturating_add(1);
        if u64::from(self.strikes) <= ban.strikes {
            return false;
        }
        if u64::from(self.level_until) <= now {
            self.ban_level = 0;
        }
        let until = now + ban.duration_for_level(u64::from(self.ban_level));
        self.ban_until = narrow(until);
        self.ban_level = self.ban_level.saturating_add(1);
        self.level_until = narrow(until + ban.decay_secs);
        self.strikes = 0;
        true
    }

    /// The count of every window this state holds a current instance of, at `now`.
    pub fn windows_now(&self, now: u64) -> Vec<(Every, u64)> {
        self.slots()
            .iter()
            .map(|s| Every::from_code(s.every))
            .map(|every| (every, self.current(every, now).1))
            .filter(|&(_, count)| count > 0)
            .collect()
    }

    /// Requests refused today (by the clock's day at `now`).
    pub fn refused_today(&self, now: u64) -> u64 {
        if u64::from(self.refused_day) == now / DAY_SECS {
            u64::from(self.refused)
        } else {
            0
        }
    }

    /// Zeroes every window's count (an operator's goodwill gesture); bans and strikes stay.
    pub fn reset_counts(&mut self) {
        for slot in &mut self.slots {
            slot.count = 0;
        }
    }

    /// True when nothing in this state can matter any more: every window it counts in has
    /// ended, as has the day of its refusals, and no ban or ban level is pending. Such entries are evicted to keep memory
    /// bounded.
    pub fn is_idle(&self, now: u64) -> bool {
        u64::from(self.ban_until) <= now
            && u64::from(self.level_until) <= now
            && u64::from(self.refused_day) < now / DAY_SECS
            && self.slots().iter().all(|s| s.ended(now))
    }
}

impl Slot {
    /// Whether this slot's window instance is over at `now`.
    fn ended(&self, now: u64) -> bool {
        u64::from(self.window) < Every::from_code(self.every).index(now)
    }
}

/// The window to count in: the stored one when it is exactly one ahead of the clock's (the
/// clock stepped back a little), else the clock's.
fn ahead_by_one(stored: u64, current: u64) -> u64 {
    if stored == current.saturating_add(1) {
        stored
    } else {
        current
    }
}

/// What binds a response's `X-RateLimit-*`: one of the limits' windows, or a ban (whose end is
/// the reset, whatever the windows hold). Its name is the `window` label of
/// `pet_gateway_rate_limited_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    Window(Every),
    Ban,
}

impl Binding {
    pub fn name(self) -> Cow<'static, str> {
        match self {
            Binding::Window(every) => every.name(),
            Binding::Ban => Cow::Borrowed("ban"),
        }
    }
}

/// The numbers behind the rate-limit headers of one response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateView {
    pub limits: Limits,
    pub now: u64,
    /// Units remaining in each of the limits' windows (`Limits::windows` order; limits fit 32
    /// bits, and a view is copied from phase to phase).
    pub remaining_by_window: [u32; MAX_WINDOWS],
    /// The binding window, reported in `X-RateLimit-*`.
    pub limit: u64,
    pub remaining: u64,
    pub reset: u64,
    /// Whole seconds, at least 1; only on refusals.
    pub retry_after: Option<u64>,
    /// Which window `limit`, `remaining` and `reset` are of.
    pub binding: Binding,
    /// Shadow windows this request went past (admitted, as shadow windows never refuse): bit k
    /// for window k.
    pub shadow_over: u8,
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
        let verdict = Verdict {
            outcome,
            now,
            counts: [0; MAX_WINDOWS],
            ban_until,
            ban_started: false,
            lease: Lease::default(),
        };
        Self::new(&verdict, limits, 0)
    }

    /// The view of `v`, a decision on a request costing `cost` under `limits`. The binding
    /// window: on an admission, the enforced window with the least room left (the shortest on a
    /// tie); on a refusal, the refusing window that resets last, so `X-RateLimit-Reset` is never
    /// sooner than `Retry-After` (the time until every refusing window has room).
    pub fn new(v: &Verdict, limits: Limits, cost: u64) -> RateView {
        let now = v.now;
        let windows = limits.windows();
        let mut remaining_by_window = [0u32; MAX_WINDOWS];
        let mut shadow_over = 0u8;
        for (k, w) in windows.iter().enumerate() {
            remaining_by_window[k] = narrow(w.limit().saturating_sub(v.counts[k]));
            if w.shadow && v.outcome == Outcome::Admitted && v.counts[k] > w.limit() {
                shadow_over |= 1 << k;
            }
        }
        let enforced = || windows.iter().enumerate().filter(|(_, w)| !w.shadow);
        let least_room = enforced()
            .min_by_key(|&(k, _)| remaining_by_window[k])
            .map(|(k, _)| k);
        let refusing = enforced()
            .filter(|&(k, w)| v.counts[k] + cost.max(1) > w.limit())
            .max_by_key(|(_, w)| w.every.reset(now))
            .map(|(k, _)| k);
        let chosen = match v.outcome {
            Outcome::Admitted | Outcome::ConcurrencyLimited => least_room,
            _ => refusing.or(least_room),
        }
        .unwrap_or(0);
        let every = windows.get(chosen).map_or(Every::MINUTE, |w| w.every);
        let mut view = RateView {
            limits,
            now,
            remaining_by_window,
            limit: windows.get(chosen).map_or(0, |w| w.limit()),
            remaining: u64::from(remaining_by_window[chosen]),
            reset: every.reset(now),
            retry_after: None,
            binding: Binding::Window(every),
            shadow_over,
        };
        match v.outcome {
            Outcome::Admitted => {}
            // A place frees when any request of the quota ends, usually well within a second;
            // the windows' reset says nothing of it, so `Retry-After` is not bound to it.
            Outcome::ConcurrencyLimited => view.retry_after = Some(CONCURRENCY_RETRY_AFTER),
            // The next grant is one cross-region call away, or a give-back another region makes
            // once its traffic stops.
            Outcome::Unleased => view.retry_after = Some(1),
            Outcome::Limited => view.retry_after = Some(view.reset.saturating_sub(now).max(1)),
            Outcome::Banned => {
                // A banned key can send nothing, whatever its windows hold: every header
                // (`X-RateLimit-Remaining` and every window of `RateLimit`) says 0.
                view.remaining = 0;
                view.remaining_by_window = [0; MAX_WINDOWS];
                view.reset = v.ban_until.max(now + 1);
                view.binding = Binding::Ban;
                view.retry_after = Some(view.reset - now);
            }
        }
        view
    }

    /// The shadow windows this request went past, by name (`10s,month`), if any: what they would
    /// have refused, for the access log.
    pub fn shadow_refused(&self) -> Option<String> {
        if self.shadow_over == 0 {
            return None;
        }
        let names: Vec<Cow<'static, str>> = self.shadow_windows().map(|w| w.every.name()).collect();
        Some(names.join(","))
    }

    /// The shadow windows this request went past.
    pub fn shadow_windows(&self) -> impl Iterator<Item = &crate::keys::limits::WindowLimit> {
        let over = self.shadow_over;
        self.limits
            .windows()
            .iter()
            .enumerate()
            .filter(move |(k, _)| over & (1 << k) != 0)
            .map(|(_, w)| w)
    }

    /// The remaining units of the enforced window of length `every`, if the limits have one.
    pub fn remaining_of(&self, every: Every) -> Option<u64> {
        let k = self
            .limits
            .windows()
            .iter()
            .position(|w| w.every == every && !w.shadow)?;
        Some(u64::from(self.remaining_by_window[k]))
    }

    /// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers): every enforced window. The
    /// response path writes it with [`RateView::push_policy`]; this is for tests.
    #[cfg(test)]
    pub fn policy_header(&self) -> String {
        let mut out = String::with_capacity(40 * self.limits.windows().len());
        self.push_policy(&mut out);
        out
    }

    /// `RateLimit-Policy`'s value written at the end of `out`.
    pub fn push_policy(&self, out: &mut String) {
        let start = out.len();
        for w in self.limits.enforced() {
            push_item(
                out,
                out.len() > start,
                &w.every.name(),
                "q",
                w.limit(),
                "w",
                w.every.secs_at(self.now),
            );
        }
    }

    /// `RateLimit` (draft-ietf-httpapi-ratelimit-headers): each enforced window's remaining
    /// units and seconds to its reset.
    #[cfg(test)]
    pub fn ratelimit_header(&self) -> String {
        let mut out = String::with_capacity(40 * self.limits.windows().len());
        self.push_ratelimit(&mut out);
        out
    }

    /// `RateLimit`'s value written at the end of `out`.
    pub fn push_ratelimit(&self, out: &mut String) {
        let start = out.len();
        for (w, &remaining) in self.limits.windows().iter().zip(&self.remaining_by_window) {
            if !w.shadow {
                let t = w.every.reset(self.now) - self.now;
                let more = out.len() > start;
                push_item(out, more, &w.every.name(), "r", remaining.into(), "t", t);
            }
        }
    }
}

/// One item of the structured headers, `"<name>";<a>=<x>;<b>=<y>`, after a comma when `more`:
/// written without the formatting machinery, on every response.
fn push_item(out: &mut String, more: bool, name: &str, a: &str, x: u64, b: &str, y: u64) {
    if more {
        out.push_str(", ");
    }
    out.push('"');
    out.push_str(name);
    out.push_str("\";");
    out.push_str(a);
    out.push('=');
    out.push_str(itoa::Buffer::new().format(x));
    out.push(';');
    out.push_str(b);
    out.push('=');
    out.push_str(itoa::Buffer::new().format(y));
}

/// `Retry-After` of a 429 `concurrency_limited`: a short fixed delay.
pub const CONCURRENCY_RETRY_AFTER: u64 = 1;

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

    fn md(per_minute: u64, per_day: u64) -> Limits {
        Limits::minute_day(per_minute, per_day).unwrap()
    }

    fn free() -> Limits {
        md(60, 1000)
    }

    #[test]
    fn a_clock_stepping_back_over_midnight_keeps_the_day_count() {
        let ban = BanPolicy::default();
        let tight = md(100, 5);
        let mut s = KeyState::default();
        let midnight = 20_000 * DAY_SECS;
        for _ in 0..5 {
            assert_eq!(
                s.acquire(midnight + 3, &tight, 1, &ban).outcome,
                Outcome::Admitted
            );
        }
        // The clock steps back 5 s, into yesterday, then forward again.
        for t in [midnight - 2, midnight + 4] {
            let v = s.acquire(t, &tight, 1, &ban);
            assert_eq!(v.outcome, Outcome::Limited, "at {t}");
            assert_eq!(v.counts[1], 5);
        }
        // A stored window far ahead (the clock had jumped forward, then back) is not kept: the
        // key is not pinned to it.
        let mut s = KeyState::default();
        s.acquire(midnight + 10 * DAY_SECS, &tight, 1, &ban);
        let v = s.acquire(midnight + 3, &tight, 1, &ban);
        assert_eq!((v.outcome, v.counts[1]), (Outcome::Admitted, 1));
    }

    #[test]
    fn admits_up_to_the_minute_limit_then_refuses_without_counting() {
        let ban = BanPolicy::default();
        let mut s = KeyState::default();
        let minute_start = 60 * 16_667;
        let t0 = minute_start + 20;
        for i in 1..=60 {
            let v = s.acquire(t0, &free(), 1, &ban);
            assert_eq!(v.outcome, Outcome::Admitted);
            let view = RateView::new(&v, free(), 1);
            assert_eq!((view.limit, view.remaining), (60, 60 - i));
        }
        let v = s.acquire(t0 + 5, &free(), 1, &ban);
        assert_eq!(v.outcome, Outcome::Limited);
        assert_eq!(v.counts[1], 60, "refused requests do not count");
        let view = RateView::new(&v, free(), 1);
        assert_eq!(view.reset, minute_start + 60);
        assert_eq!(view.retry_after, Some(35));
        assert_eq!(view.binding, Binding::Window(Every::MINUTE));
        // The next minute has room again.
        assert_eq!(
            s.acquire(t0 + 40, &free(), 1, &ban).outcome,
            Outcome::Admitted
        );
    }

    #[test]
    fn the_day_binds_when_it_has_fewer_remaining() {
        let limits = md(100, 5);
        let mut s = KeyState::default();
        let now = 10 * DAY_SECS + 3_600;
        for _ in 0..5 {
            assert_eq!(
                s.acquire(now, &limits, 1, &BanPolicy::default()).outcome,
                Outcome::Admitted
            );
        }
        let v = s.acquire(now, &limits, 1, &BanPolicy::default());
        assert_eq!(v.outcome, Outcome::Limited);
        let view = RateView::new(&v, limits, 1);
        assert_eq!(
            (view.limit, view.remaining, view.reset),
            (5, 0, 11 * DAY_SECS)
        );
        assert_eq!(view.retry_after, Some(DAY_SECS - 3_600));
        assert_eq!(view.binding, Binding::Window(Every::DAY));
    }

    #[test]
    fn strikes_past_the_threshold_ban_with_escalating_then_decaying_levels() {
        let limits = md(1, 1000);
        let ban = BanPolicy {
            strikes: 2,
            durations: vec![10, 100],
            decay_secs: 1_000,
        };
        let mut s = KeyState::default();
        let t = 600;
        assert_eq!(s.acquire(t, &limits, 1, &ban).outcome, Outcome::Admitted);
        assert_eq!(s.acquire(t, &limits, 1, &ban).outcome, Outcome::Limited);
        assert_eq!(s.acquire(t, &limits, 1, &ban).outcome, Outcome::Limited);
        let v = s.acquire(t, &limits, 1, &ban);
        assert_eq!(
            (v.outcome, v.ban_until, v.ban_started),
            (Outcome::Banned, t + 10, true)
        );
        let view = RateView::new(&v, limits, 1);
        assert_eq!(
            (view.remaining, view.reset, view.retry_after, view.binding),
            (0, t + 10, Some(10), Binding::Ban)
        );
        let during = s.acquire(t + 9, &limits, 1, &ban);
        assert_eq!(
            (during.outcome, during.ban_started),
            (Outcome::Banned, false)
        );
        // Ban over; a new minute has room.
        assert_eq!(
            s.acquire(t + 60, &limits, 1, &ban).outcome,
            Outcome::Admitted
        );
        // Second ban inside the decay period is longer.
        for _ in 0..2 {
            assert_eq!(
                s.acquire(t + 60, &limits, 1, &ban).outcome,
                Outcome::Limited
            );
        }
        assert_eq!(s.acquire(t + 60, &limits, 1, &ban).ban_until, t + 160);
        // Third, still escalated: the last duration repeats.
        let t2 = t + 240;
        assert_eq!(s.acquire(t2, &limits, 1, &ban).outcome, Outcome::Admitted);
        for _ in 0..2 {
            s.acquire(t2, &limits, 1, &ban);
        }
        assert_eq!(s.acquire(t2, &limits, 1, &ban).ban_until, t2 + 100);
        // After a quiet period longer than the decay the level starts over.
        let t3 = t2 + 100 + 1_000 + 60;
        assert_eq!(s.acquire(t3, &limits, 1, &ban).outcome, Outcome::Admitted);
        for _ in 0..2 {
            s.acquire(t3, &limits, 1, &ban);
        }
        assert_eq!(s.acquire(t3, &limits, 1, &ban).ban_until, t3 + 10);
    }

    #[test]
    fn headers_are_formatted_per_the_draft() {
        let v = Verdict {
            outcome: Outcome::Admitted,
            now: 120 + 18,
            counts: [1, 1, 0, 0, 0, 0],
            ban_until: 0,
            ban_started: false,
            lease: Lease::default(),
        };
        let view = RateView::new(&v, free(), 1);
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
        let banned = RateView::banned(free(), now, now + 30);
        assert_eq!(
            (
                banned.binding,
                banned.remaining,
                banned.reset,
                banned.retry_after
            ),
            (Binding::Ban, 0, now + 30, Some(30))
        );
        assert_eq!(
            (banned.remaining_by_window[0], banned.remaining_by_window[1]),
            (0, 0),
            "every header of a banned key says 0 remaining"
        );
        assert!(banned.ratelimit_header().contains("\"minute\";r=0;"));
        let open = RateView::unmetered(free(), now);
        assert_eq!(
            (open.binding, open.limit, open.remaining, open.retry_after),
            (Binding::Window(Every::MINUTE), 60, 60, None)
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
    fn a_concurrency_refusal_spends_nothing_strikes_nothing_and_keeps_the_headers() {
        let limits = md(100, 1000).with_concurrency(2);
        let ban = BanPolicy {
            strikes: 0,
            ..BanPolicy::default()
        };
        let (mut s, mut leases) = (KeyState::default(), Leases::default());
        let now = 60 * 16_667 + 5;
        let first = s.acquire_leased(now, &limits, 1, &ban, Some((&mut leases, 10)));
        assert_eq!(
            (first.outcome, first.lease),
            (
                Outcome::Admitted,
                Lease {
                    end: now + 10,
                    in_flight: 1
                }
            )
        );
        let second = s.acquire_leased(now + 1, &limits, 1, &ban, Some((&mut leases, 10)));
        assert_eq!(second.lease.in_flight, 2);
        let before = s;
        let refused = s.acquire_leased(now + 1, &limits, 1, &ban, Some((&mut leases, 10)));
        assert_eq!(refused.outcome, Outcome::ConcurrencyLimited);
        assert_eq!(
            refused.lease,
            Lease {
                end: 0,
                in_flight: 2
            }
        );
        assert_eq!(
            s, before,
            "no count, no strike, no ban (strikes = 0 would ban)"
        );
        let view = RateView::new(&refused, limits, 1);
        assert_eq!(
            (view.remaining, view.retry_after, view.binding),
            (
                98,
                Some(CONCURRENCY_RETRY_AFTER),
                Binding::Window(Every::MINUTE)
            )
        );
        // One given back: the next request takes its place.
        assert!(leases.give_back(now + 2, first.lease.end));
        assert!(
            !leases.give_back(now + 2, first.lease.end),
            "given back once"
        );
        let third = s.acquire_leased(now + 2, &limits, 1, &ban, Some((&mut leases, 10)));
        assert_eq!(third.outcome, Outcome::Admitted);
        // A window without room wins over the concurrency: a strike, `rate_limited`.
        let tight = md(1, 1000).with_concurrency(1);
        let (mut t, mut l) = (KeyState::default(), Leases::default());
        t.acquire_leased(now, &tight, 1, &BanPolicy::default(), Some((&mut l, 10)));
        let v = t.acquire_leased(now, &tight, 1, &BanPolicy::default(), Some((&mut l, 10)));
        assert_eq!((v.outcome, t.strikes), (Outcome::Limited, 1));
    }

    #[test]
    fn leases_end_by_themselves_and_renewals_move_them() {
        let mut leases = Leases::default();
        let end = leases.take(100, 15);
        leases.take(100, 15);
        leases.take(103, 15);
        assert_eq!(leases.in_flight(100), 3);
        assert_eq!(leases.ends.len(), 2, "leases of one second share a pair");
        // Nobody gives them back (a node killed): they end by themselves.
        assert_eq!(leases.in_flight(end), 1);
        assert!(leases.is_empty(118));
        // A renewal moves a lease; one that ended meanwhile is taken again (still in flight).
        let mut leases = Leases::default();
        let end = leases.take(100, 15);
        let renewed = leases.renew(110, end, 15);
        assert_eq!((renewed, leases.in_flight(124)), (125, 1));
        let again = leases.renew(200, renewed, 15);
        assert_eq!((again, leases.in_flight(200)), (215, 1));
        assert!(!leases.give_back(200, renewed));
        assert!(leases.give_back(200, again));
        assert!(leases.is_empty(200));
    }

    #[test]
    fn idle_states_are_those_of_past_days_without_bans() {
        let mut s = KeyState::default();
        s.acquire(DAY_SECS + 5, &free(), 1, &BanPolicy::default());
        assert!(!s.is_idle(DAY_SECS + 100));
        assert!(s.is_idle(2 * DAY_SECS));
    }
}
