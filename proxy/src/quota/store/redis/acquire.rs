//! The `ACQUIRE` call (see `scripts.rs` for its KEYS and ARGV): the Redis key of a quota, the
//! script's arguments for a ban policy and a batch of entries (decisions, and leases given back
//! or renewed), its answers, and the index of active bans. Used alike by a run of one decision
//! and by a group-committed batch.

use std::collections::HashMap;
use std::sync::Arc;

use super::function::AcquireCall;
use super::link::Link;
use crate::keys::limits::{Limits, MAX_WINDOWS};
use crate::quota::rules::{BanPolicy, Lease, Outcome, Verdict};
use crate::quota::store::StoreError;

/// `ACQUIRE`'s answer for one decision (the run's `now` included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RawVerdict {
    /// 0 admitted, 1 limited, 2 banned, 3 banned by this very request, 4 refused for the
    /// concurrency, 5 a region's, refused for too few units held.
    pub outcome: i64,
    pub now: i64,
    pub ban_until: i64,
    /// In the order of the decision's limits' windows.
    pub counts: [i64; MAX_WINDOWS],
    /// Limits with a concurrency: the lease taken (0: none) and the requests in flight.
    pub lease_end: i64,
    pub in_flight: i64,
    /// A region's decisions: the units it holds of each window's instance (0 otherwise).
    pub held: [i64; MAX_WINDOWS],
}

/// One entry of an `ACQUIRE` run.
#[derive(Debug, Clone, Copy)]
pub(super) enum Entry<'k> {
    /// A request to decide.
    Decide {
        key_id: &'k str,
        limits: &'k Limits,
        cost: u64,
    },
    /// A lease ending at `end` to give back.
    Release { key_id: &'k str, end: u64 },
    /// A lease ending at `end` to renew.
    Renew { key_id: &'k str, end: u64 },
}

impl<'k> Entry<'k> {
    fn key_id(&self) -> &'k str {
        match self {
            Entry::Decide { key_id, .. }
            | Entry::Release { key_id, .. }
            | Entry::Renew { key_id, .. } => key_id,
        }
    }

    /// How many integers `ACQUIRE` answers for this entry (after the run's `now`), in a run of
    /// a region's decisions or not.
    pub fn width(&self, regional: bool) -> usize {
        match self {
            Entry::Decide { limits, .. } => RawVerdict::width(limits, regional),
            Entry::Release { .. } => 0,
            Entry::Renew { .. } => 2,
        }
    }
}

impl RawVerdict {
    /// How many integers `ACQUIRE` answers for a decision under `limits` (after the run's
    /// `now`), a region's or not.
    pub fn width(limits: &Limits, regional: bool) -> usize {
        let m = limits.windows().len();
        1 + m + if limits.concurrency().is_some() { 2 } else { 0 } + if regional { m } else { 0 }
    }

    /// The decision under `limits` in `values` (exactly [`RawVerdict::width`] of them), in a
    /// run whose clock read `now`.
    pub fn parse(
        now: i64,
        values: &[i64],
        limits: &Limits,
        regional: bool,
    ) -> Result<RawVerdict, StoreError> {
        let bad = || StoreError::Protocol(format!("acquire returned {values:?} for a decision"));
        if values.len() != RawVerdict::width(limits, regional) {
            return Err(bad());
        }
        let (&first, rest) = values.split_first().ok_or_else(bad)?;
        if first < 0 {
            return Err(bad());
        }
        let m = limits.windows().len();
        let (counts, rest) = rest.split_at(m);
        let (held, lease) = rest.split_at(if regional { m } else { 0 });
        let mut raw = RawVerdict {
            // `outcome + 8 * ban_until`, one number (see ACQUIRE).
            outcome: first & 7,
            now,
            ban_until: first >> 3,
            counts: [0; MAX_WINDOWS],
            lease_end: lease.first().copied().unwrap_or(0),
            in_flight: lease.get(1).copied().unwrap_or(0),
            held: [0; MAX_WINDOWS],
        };
        raw.counts[..counts.len()].copy_from_slice(counts);
        raw.held[..held.len()].copy_from_slice(held);
        Ok(raw)
    }

    /// Whether this decision took a lease that someone must give back.
    pub fn took_lease(&self) -> bool {
        self.outcome == 0 && self.lease_end > 0
    }

    /// The decision as the store trait answers it.
    pub fn verdict(&self) -> Result<Verdict, StoreError> {
        let outcome = match self.outcome {
            0 => Outcome::Admitted,
            1 => Outcome::Limited,
            2 | 3 => Outcome::Banned,
            4 => Outcome::ConcurrencyLimited,
            5 => Outcome::Unleased,
            other => return Err(StoreError::Protocol(format!("unknown outcome {other}"))),
        };
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        let mut counts = [0u64; MAX_WINDOWS];
        for (w, &c) in counts.iter_mut().zip(&self.counts) {
            *w = n(c);
        }
        Ok(Verdict {
            outcome,
            ban_started: self.outcome == 3,
            now: n(self.now),
            counts,
            ban_until: n(self.ban_until),
            lease: Lease {
                end: n(self.lease_end),
                in_flight: n(self.in_flight),
            },
        })
    }
}

/// A renewal's answer, `{lease_end, in_flight}`.
pub(super) fn parse_renewal(values: &[i64]) -> Result<Lease, StoreError> {
    match values {
        &[end, in_flight] if end > 0 => Ok(Lease {
            end: end as u64,
            in_flight: u64::try_from(in_flight).unwrap_or(0),
        }),
        other => Err(StoreError::Protocol(format!(
            "a lease renewal returned {other:?}"
        ))),
    }
}

/// The Redis key holding all of `key_id`'s state.
pub(super) fn quota_key(prefix: &str, key_id: &str) -> String {
    format!("{prefix}:windows:{{{key_id}}}")
}

/// The sorted set indexing an environment's active bans.
pub(super) fn ban_index(prefix: &str) -> String {
    format!("{prefix}:bans")
}

/// Records (or, with `until` 0, removes) a ban in the index. A failure is logged, not
/// returned: the ban itself is in force either way; only `bans list` would miss it.
pub(super) async fn index_ban(
    link: Arc<Link>,
    script: redis::Script,
    index: String,
    key_id: Arc<str>,
    until: u64,
) {
    let mut invocation = script.key(index);
    invocation.arg(&*key_id).arg(until);
    if let Err(e) = link.run::<i64>(&invocation).await {
        tracing::warn!(error = %e, key_id = %key_id, "could not update the ban index; `bans list` may miss this change");
    }
}

/// `ACQUIRE`'s answer: the run's clock, and the entries' integers after it.
pub(super) fn split_reply(values: &[i64]) -> Result<(i64, &[i64]), StoreError> {
    match values.split_first() {
        Some((&now, rest)) => Ok((now, rest)),
        None => Err(StoreError::Protocol("acquire returned nothing".into())),
    }
}

/// One `ACQUIRE` run of `entries` under the ban policy's arguments `policy`
/// (`batch::policy_args`), leases lasting `lease_secs`, a region's decisions or not. Each distinct set of limits is sent
/// once, however many decisions of the batch share it (most share a plan's), and each quota's
/// key once, however many entries name it. The releases go first (their requests ended before
/// the run: the places they free are free for its decisions), those of one quota and one end as
/// one entry with their number: a busy quota's releases cost the script one entry a second, not
/// one each.
pub(super) fn acquire_call<'k>(
    prefix: &str,
    policy: &[u64],
    lease_secs: u64,
    regional: bool,
    entries: impl Iterator<Item = Entry<'k>> + Clone,
) -> AcquireCall {
    let mut sets: Vec<&Limits> = Vec::new();
    let mut releases: Vec<(&str, u64, u64)> = Vec::new();
    for entry in entries.clone() {
        match entry {
            Entry::Release { key_id, end } => {
                match releases.iter_mut().find(|r| r.0 == key_id && r.1 == end) {
                    Some(r) => r.2 += 1,
                    None => releases.push((key_id, end, 1)),
                }
            }
            Entry::Decide { limits, .. } => {
                if !sets.contains(&limits) {
                    sets.push(limits);
                }
            }
            Entry::Renew { .. } => {}
        }
    }
    let mut keys = Keys::default();
    let mut packed = Vec::with_capacity(24 * (releases.len() + 8));
    for (key_id, end, n) in &releases {
        pack(
            &mut packed,
            [keys.number(key_id), -1 - number(*n), number(*end)],
        );
    }
    for entry in entries {
        let (first, second) = match entry {
            Entry::Decide { limits, cost, .. } => {
                let set = sets.iter().position(|s| *s == limits).unwrap_or(0) + 1;
                (set as i64, number(cost))
            }
            Entry::Release { .. } => continue,
            Entry::Renew { end, .. } => (-1, number(end)),
        };
        pack(&mut packed, [keys.number(entry.key_id()), first, second]);
    }
    AcquireCall {
        keys: keys.order.iter().map(|k| quota_key(prefix, k)).collect(),
        head: head(policy, lease_secs, regional, &sets),
        entries: packed,
    }
}

/// The quotas' keys of a run, each once, and each one's number in `KEYS` (from 1). By a map: a
/// run holds up to `store_batch_max` (1,024) quotas, and a scan per entry would be quadratic.
#[derive(Default)]
struct Keys<'k> {
    order: Vec<&'k str>,
    numbers: HashMap<&'k str, i64>,
}

impl<'k> Keys<'k> {
    fn number(&mut self, key_id: &'k str) -> i64 {
        let next = self.order.len() as i64 + 1;
        let n = *self.numbers.entry(key_id).or_insert(next);
        if n == next {
            self.order.push(key_id);
        }
        n
    }
}

/// A number of ours as the script's signed 64 bits: one past `i64::MAX` (a ban policy's "never"
/// written as `u64::MAX` in a flag, say) stays the largest, as it was when numbers went as
/// text, rather than wrapping to a negative one.
pub(super) fn number(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

// The script keeps each set's answer width at index 21 of the set's table, past the six
// windows' three numbers and the concurrency (`scripts::acquire_library_lua`).
const _: () = assert!(MAX_WINDOWS <= 6, "ACQUIRE keeps a set's width at index 21");

/// `ACQUIRE`'s head (`ARGV[1]`): the ban policy, the lease's length, the sets of limits, and
/// for a region's decisions a last 1.
fn head(policy: &[u64], lease_secs: u64, regional: bool, sets: &[&Limits]) -> Vec<u8> {
    let mut head = Vec::with_capacity(8 * (policy.len() + 2 + sets.len() * 14));
    pack(&mut head, policy.iter().map(|a| number(*a)));
    pack(&mut head, [number(lease_secs), sets.len() as i64]);
    for limits in sets {
        pack(&mut head, [limits.windows().len() as i64]);
        for w in limits.windows() {
            let limit = i64::from(w.limit);
            pack(
                &mut head,
                [
                    i64::from(w.every.code()),
                    if w.shadow { -limit } else { limit },
                ],
            );
        }
        pack(&mut head, [i64::from(limits.concurrency().unwrap_or(0))]);
    }
    if regional {
        pack(&mut head, [1]);
    }
    head
}

/// Numbers as `ACQUIRE` unpacks them: little-endian signed 64-bit integers.
pub(super) fn pack(out: &mut Vec<u8>, numbers: impl IntoIterator<Item = i64>) {
    for n in numbers {
        out.extend_from_slice(&n.to_le_bytes());
    }
}

/// `ACQUIRE`'s `ARGV[1..3+n]` for `ban`.
pub(super) fn policy_args(ban: &BanPolicy) -> Vec<u64> {
    let lengths: &[u64] = if ban.durations.is_empty() {
        &[60]
    } else {
        &ban.durations
    };
    let mut args = Vec::with_capacity(3 + lengths.len());
    args.extend([ban.strikes, ban.decay_secs, lengths.len() as u64]);
    args.extend_from_slice(lengths);
    args
}

pub(super) fn policy_matches(args: &[u64], ban: &BanPolicy) -> bool {
    let lengths: &[u64] = if ban.durations.is_empty() {
        &[60]
    } else {
        &ban.durations
    };
    args.len() == 3 + lengths.len()
        && args[0] == ban.strikes
        && args[1] == ban.decay_secs
        && args[3..] == *lengths
}
