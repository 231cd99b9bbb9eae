//! Group commit for the Redis store's decisions. While a script run is in flight to a Redis node,
//! the decisions for that node queue; when it returns, the next run carries every queued decision
//! (up to `max`) in one `ACQUIRE`: one `TIME`, each key's hash read and written once, one reply.
//! Nothing ever waits for a batch to fill: an idle lane sends a lone decision at once, so at low
//! load a batch is one decision and latency is that of a single call; under load the batch
//! grows by itself to what arrived during one round trip.
//!
//! A lane is one run in flight at a time. A single Redis has one lane; a Redis Cluster has one
//! per hash slot, because a script may only touch keys of one slot there.
//!
//! Decisions leave the queue in arrival order, and the script decides a batch in its order, so
//! several requests of one key in a batch are counted exactly as if they had been sent one by
//! one: exactly the limit is admitted.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use redis::cluster_routing::Slot;
use tokio::sync::oneshot;

use super::redis::{acquire_invocation, Link, RawVerdict};
use super::StoreError;
use crate::metrics::METRICS;
use crate::quota::{BanPolicy, Limits};

/// The batched half of the Redis store's `acquire`.
pub(super) struct Batches {
    link: Arc<Link>,
    script: redis::Script,
    prefix: Arc<str>,
    /// The most decisions one script run carries.
    max: usize,
    lanes: Lanes,
    /// The ban policy's script arguments, built once and shared by every queued decision (a
    /// batch carries one policy; the gateway has one).
    policy: Mutex<Arc<[u64]>>,
}

enum Lanes {
    One(Arc<Lane>),
    /// Created as slots are first used; at most 16,384.
    PerSlot(Mutex<HashMap<Slot, Arc<Lane>>>),
}

#[derive(Default)]
struct Lane {
    state: Mutex<LaneState>,
}

#[derive(Default)]
struct LaneState {
    queue: VecDeque<Pending>,
    /// A drain task is running for this lane (a run in flight, or about to be).
    running: bool,
}

struct Pending {
    key_id: Arc<str>,
    limits: Limits,
    policy: Arc<[u64]>,
    reply: oneshot::Sender<Result<RawVerdict, StoreError>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lane's lock leaves plain data behind (a queue and a flag), still
    // consistent: carry on rather than fail every later request.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Batches {
    pub(super) fn new(
        link: Arc<Link>,
        prefix: Arc<str>,
        max: usize,
        per_slot: bool,
    ) -> Arc<Batches> {
        Arc::new(Batches {
            link,
            script: redis::Script::new(super::scripts::ACQUIRE),
            prefix,
            max: max.max(1),
            lanes: if per_slot {
                Lanes::PerSlot(Mutex::default())
            } else {
                Lanes::One(Arc::default())
            },
            policy: Mutex::new(Arc::from(policy_args(&BanPolicy::default()))),
        })
    }

    /// Queues one decision and waits for it, at most the store's deadline from now: a request
    /// never waits longer for a batch than it would for a call of its own. A decision whose
    /// caller has given up is dropped from the queue, never sent.
    pub(super) async fn acquire(
        self: &Arc<Self>,
        key_id: &Arc<str>,
        limits: Limits,
        ban: &BanPolicy,
    ) -> Result<RawVerdict, StoreError> {
        let policy = self.policy_of(ban);
        let lane = self.lane(key_id);
        let (reply, answer) = oneshot::channel();
        let start = {
            let mut state = lock(&lane.state);
            state.queue.push_back(Pending {
                key_id: Arc::clone(key_id),
                limits,
                policy,
                reply,
            });
            !std::mem::replace(&mut state.running, true)
        };
        if start {
            tokio::spawn(Arc::clone(self).drain(lane));
        }
        let timeout = self.link.timeout();
        match tokio::time::timeout(timeout, answer).await {
            Err(_) => Err(StoreError::Timeout(timeout)),
            Ok(Err(_)) => Err(StoreError::Unavailable(
                "the batch carrying this decision was abandoned".into(),
            )),
            Ok(Ok(result)) => result,
        }
    }

    fn lane(&self, key_id: &str) -> Arc<Lane> {
        match &self.lanes {
            Lanes::One(lane) => Arc::clone(lane),
            Lanes::PerSlot(lanes) => {
                let slot = Slot::for_key(super::redis::quota_key(&self.prefix, key_id));
                Arc::clone(lock(lanes).entry(slot).or_default())
            }
        }
    }

    /// The shared arguments of `ban`, allocating only when the policy differs from the last one.
    fn policy_of(&self, ban: &BanPolicy) -> Arc<[u64]> {
        let mut last = lock(&self.policy);
        if !policy_matches(&last, ban) {
            *last = Arc::from(policy_args(ban));
        }
        Arc::clone(&last)
    }

    /// Sends the lane's queue, one batch at a time, until it is empty. Runs as its own task, so
    /// a caller that stops waiting (its request ended) never strands the decisions behind it.
    async fn drain(self: Arc<Self>, lane: Arc<Lane>) {
        let mut guard = Stop {
            lane: &lane,
            armed: true,
        };
        loop {
            let batch = {
                let mut state = lock(&lane.state);
                state.queue.retain(|p| !p.reply.is_closed());
                if state.queue.is_empty() {
                    state.running = false;
                    guard.armed = false;
                    return;
                }
                take_batch(&mut state.queue, self.max)
            };
            METRICS.store_batch_size.observe(batch.len() as f64);
            let invocation = acquire_invocation(
                &self.script,
                &self.prefix,
                &batch[0].policy,
                batch.iter().map(|p| (&*p.key_id, p.limits)),
            );
            let result = self.link.run::<Vec<i64>>(&invocation).await;
            match result {
                Ok(values) if values.len() == batch.len() * 5 => {
                    for (p, v) in batch.into_iter().zip(values.chunks_exact(5)) {
                        let _ = p.reply.send(Ok([v[0], v[1], v[2], v[3], v[4]]));
                    }
                }
                Ok(values) => {
                    let e = StoreError::Protocol(format!(
                        "acquire returned {} values for {} decisions",
                        values.len(),
                        batch.len()
                    ));
                    for p in batch {
                        let _ = p.reply.send(Err(e.clone()));
                    }
                }
                Err(e) => {
                    for p in batch {
                        let _ = p.reply.send(Err(e.clone()));
                    }
                }
            }
        }
    }
}

/// Takes up to `max` decisions from the front of the queue, stopping at the first whose ban
/// policy differs from the first's (one batch carries one policy, and arrival order holds).
fn take_batch(queue: &mut VecDeque<Pending>, max: usize) -> Vec<Pending> {
    let mut batch: Vec<Pending> = Vec::with_capacity(queue.len().min(max));
    while batch.len() < max {
        let same = match (queue.front(), batch.first()) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(p), Some(first)) => {
                Arc::ptr_eq(&p.policy, &first.policy) || p.policy == first.policy
            }
        };
        if !same {
            break;
        }
        batch.extend(queue.pop_front());
    }
    batch
}

/// Should a lane's drain task end without emptying it (a panic, or the runtime shutting down),
/// the lane is marked idle so that the next decision starts a new one; the stranded decisions'
/// callers see their channel closed at once rather than waiting out the deadline.
struct Stop<'a> {
    lane: &'a Lane,
    armed: bool,
}

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut state = lock(&self.lane.state);
            state.running = false;
            state.queue.clear();
        }
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

fn policy_matches(args: &[u64], ban: &BanPolicy) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(
        policy: &Arc<[u64]>,
    ) -> (Pending, oneshot::Receiver<Result<RawVerdict, StoreError>>) {
        let (reply, rx) = oneshot::channel();
        (
            Pending {
                key_id: Arc::from("k"),
                limits: Limits {
                    per_minute: 1,
                    per_day: 1,
                },
                policy: Arc::clone(policy),
                reply,
            },
            rx,
        )
    }

    #[test]
    fn a_batch_stops_at_the_bound_and_at_a_change_of_policy() {
        let a: Arc<[u64]> = Arc::from(policy_args(&BanPolicy::default()));
        let b: Arc<[u64]> = Arc::from(policy_args(&BanPolicy {
            strikes: 3,
            ..BanPolicy::default()
        }));
        let mut queue = VecDeque::new();
        let mut receivers = Vec::new();
        for policy in [&a, &a, &a, &b, &a] {
            let (p, rx) = pending(policy);
            queue.push_back(p);
            receivers.push(rx);
        }
        assert_eq!(take_batch(&mut queue, 2).len(), 2);
        assert_eq!(
            take_batch(&mut queue, 128).len(),
            1,
            "stops before the other policy"
        );
        assert_eq!(take_batch(&mut queue, 128).len(), 1);
        assert_eq!(take_batch(&mut queue, 128).len(), 1);
        assert!(take_batch(&mut queue, 128).is_empty());
    }

    #[test]
    fn policy_arguments_match_their_policy_only() {
        let ban = BanPolicy::default();
        let args = policy_args(&ban);
        assert_eq!(args[..3], [ban.strikes, ban.decay_secs, 4]);
        assert!(policy_matches(&args, &ban));
        assert!(!policy_matches(
            &args,
            &BanPolicy {
                durations: vec![60],
                ..BanPolicy::default()
            }
        ));
        let empty = BanPolicy {
            durations: vec![],
            ..BanPolicy::default()
        };
        assert_eq!(policy_args(&empty)[2..], [1, 60]);
        assert!(policy_matches(&policy_args(&empty), &empty));
    }
}
