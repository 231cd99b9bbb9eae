//! The `ACQUIRE` call (see `scripts.rs` for its KEYS and ARGV): the Redis key of a quota, the
//! script's arguments for a ban policy and a batch of decisions, its answer, and the index of
//! active bans. Used alike by a run of one decision and by a group-committed batch.

use std::sync::Arc;

use super::link::Link;
use crate::keys::plans::Limits;
use crate::quota::rules::BanPolicy;

/// `ACQUIRE`'s five integers for one decision.
pub(super) type RawVerdict = [i64; 5];

/// The Redis key holding all of `key_id`'s state.
pub(super) fn quota_key(prefix: &str, key_id: &str) -> String {
    format!("{prefix}:state:{{{key_id}}}")
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

/// One `ACQUIRE` run deciding `decisions` (key id and limits each) under the ban policy's
/// arguments `policy` (`batch::policy_args`).
pub(super) fn acquire_invocation<'a, 'k>(
    script: &'a redis::Script,
    prefix: &str,
    policy: &[u64],
    decisions: impl Iterator<Item = (&'k str, Limits)> + Clone,
) -> redis::ScriptInvocation<'a> {
    let mut invocation = script.prepare_invoke();
    for (key_id, _) in decisions.clone() {
        invocation.key(quota_key(prefix, key_id));
    }
    for a in policy {
        invocation.arg(*a);
    }
    for (_, limits) in decisions {
        invocation.arg(limits.per_minute).arg(limits.per_day);
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
