//! The `ACQUIRE` call (see `scripts.rs` for its KEYS and ARGV): the Redis key of a quota, the
//! script's arguments for a ban policy and a batch of decisions, its answer, and the index of
//! active bans. Used alike by a run of one decision and by a group-committed batch.

use std::sync::Arc;

use super::link::Link;
use crate::keys::limits::{Limits, MAX_WINDOWS};
use crate::quota::rules::BanPolicy;
use crate::quota::store::StoreError;

/// `ACQUIRE`'s answer for one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RawVerdict {
    /// 0 admitted, 1 limited, 2 banned, 3 banned by this very request.
    pub outcome: i64,
    pub now: i64,
    pub ban_until: i64,
    /// In the order of the decision's limits' windows.
    pub counts: [i64; MAX_WINDOWS],
}

impl RawVerdict {
    /// How many integers `ACQUIRE` answers for a decision under `limits`.
    pub fn width(limits: &Limits) -> usize {
        3 + limits.windows().len()
    }

    /// The decision in `values` (exactly [`RawVerdict::width`] of them).
    pub fn parse(values: &[i64]) -> Result<RawVerdict, StoreError> {
        let (head, counts) = values.split_at_checked(3).ok_or_else(|| {
            StoreError::Protocol(format!("acquire returned {values:?} for a decision"))
        })?;
        if counts.len() > MAX_WINDOWS {
            return Err(StoreError::Protocol(format!(
                "acquire returned {} counts",
                counts.len()
            )));
        }
        let mut raw = RawVerdict {
            outcome: head[0],
            now: head[1],
            ban_until: head[2],
            counts: [0; MAX_WINDOWS],
        };
        raw.counts[..counts.len()].copy_from_slice(counts);
        Ok(raw)
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

/// One `ACQUIRE` run deciding `decisions` (key id, limits and cost each) under the ban
/// policy's arguments `policy` (`batch::policy_args`). Each distinct set of limits is sent
/// once, however many decisions of the batch share it (most share a plan's).
pub(super) fn acquire_invocation<'a, 'k>(
    script: &'a redis::Script,
    prefix: &str,
    policy: &[u64],
    decisions: impl Iterator<Item = (&'k str, &'k Limits, u64)> + Clone,
) -> redis::ScriptInvocation<'a> {
    let mut invocation = script.prepare_invoke();
    let mut sets: Vec<&Limits> = Vec::new();
    for (key_id, limits, _) in decisions.clone() {
        invocation.key(quota_key(prefix, key_id));
        if !sets.contains(&limits) {
            sets.push(limits);
        }
    }
    for a in policy {
        invocation.arg(*a);
    }
    invocation.arg(sets.len());
    for limits in &sets {
        invocation.arg(limits.windows().len());
        for w in limits.windows() {
            let limit = i64::from(w.limit);
            invocation
                .arg(w.every.code())
                .arg(if w.shadow { -limit } else { limit });
        }
    }
    for (_, limits, cost) in decisions {
        let set = sets.iter().position(|s| *s == limits).unwrap_or(0) + 1;
        invocation.arg(set).arg(cost);
    }
    invocation
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
