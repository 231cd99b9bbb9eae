//! Group commit for the Redis store's decisions. While a script run is in flight to a Redis node,
//! the decisions for that node queue; when it returns, the next run carries every queued decision
//! (up to `max`) in one `ACQUIRE`: one `TIME`, each key's hash read and written once, one reply.
//! Nothing ever waits for a batch to fill: an idle lane sends a lone decision at once, so at low
//! load a batch is one decision and latency is that of a single call; under load the batch
//! grows by itself to what arrived during one round trip.
//!
//! Leases given back and renewed ride the same runs (`release`, `renew`): a release queues
//! without waiting for anything, so a request's last moments (a `Drop`) can send it, and under
//! load it costs no run of its own.
//!
//! A lane has one run in flight at a time, more only when one cannot keep up (`MAX_IN_FLIGHT`). A
//! single Redis has one lane; a Redis Cluster has one per hash slot, because a script may only
//! touch keys of one slot there.
//!
//! Decisions leave the queue in arrival order, and the script decides a batch in its order, so
//! several requests of one key in a batch are counted exactly as if they had been sent one by
//! one: exactly the limit is admitted.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redis::cluster_routing::Slot;
use tokio::sync::oneshot;

use super::acquire::{
    acquire_call, index_ban, parse_renewal, policy_args, policy_matches, Entry, RawVerdict,
};
use super::function::Acquire;
use super::link::Link;
use crate::base::metrics::METRICS;
use crate::keys::limits::Limits;
use crate::quota::rules::{BanPolicy, Lease};
use crate::quota::store::StoreError;

/// The batched half of the Redis store's `acquire`, and its leases' releases and renewals.
pub(super) struct Batches {
    link: Arc<Link>,
    acquire: Arc<Acquire>,
    prefix: Arc<str>,
    /// The most entries one script run carries.
    max: usize,
    /// How long a lease lasts unless given back or renewed, in seconds.
    lease_secs: u64,
    /// A region's decisions (`scripts::ACQUIRE`'s head ends with 1).
    regional: bool,
    lanes: Lanes,
    /// The ban policy's script arguments, built once and shared by every queued decision (a
    /// batch carries one policy; the gateway has one).
    policy: Mutex<Arc<[u64]>>,
    /// Where bans started by a batch are indexed (`INDEX_BAN` on `<prefix>:bans`).
    index_script: redis::Script,
    ban_index: String,
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
    /// Drain tasks running for this lane (each with at most one run in flight).
    draining: usize,
    /// When the lane's latest run was sent.
    last_sent: Option<Instant>,
}

/// Runs one lane may have in flight at once. One is the rule: decisions queue behind it and
/// the next run carries them all. More start only when one run cannot keep up: a full batch is
/// already waiting, or the newest run has been out for a quarter of the deadline (a slow Redis,
/// or a long network round trip), so that a decision never waits out most of its deadline
/// behind another run and a node's decisions are not capped at one batch per round trip. Runs
/// share the one multiplexed connection, so Redis still sees them in order.
const MAX_IN_FLIGHT: usize = 8;

struct Pending {
    key_id: Arc<str>,
    op: Op,
}

enum Op {
    Decide {
        limits: Limits,
        cost: u64,
        policy: Arc<[u64]>,
        reply: oneshot::Sender<Result<RawVerdict, StoreError>>,
    },
    /// Nobody waits for it: it is sent with the next run, or ends by itself.
    Release { end: u64 },
    Renew {
        end: u64,
        reply: oneshot::Sender<Result<Lease, StoreError>>,
    },
}

impl Pending {
    /// Whoever asked has stopped waiting: the entry need not be sent (a release is always).
    fn abandoned(&self) -> bool {
        match &self.op {
            Op::Decide { reply, .. } => reply.is_closed(),
            Op::Renew { reply, .. } => reply.is_closed(),
            Op::Release { .. } => false,
        }
    }

    fn entry(&self) -> Entry<'_> {
        let key_id = &*self.key_id;
        match &self.op {
            Op::Decide { limits, cost, .. } => Entry::Decide {
                key_id,
                limits,
                cost: *cost,
            },
            Op::Release { end } => Entry::Release { key_id, end: *end },
            Op::Renew { end, .. } => Entry::Renew { key_id, end: *end },
        }
    }

    fn policy(&self) -> Option<&Arc<[u64]>> {
        match &self.op {
            Op::Decide { policy, .. } => Some(policy),
            _ => None,
        }
    }

    /// Tells whoever waits that the run carrying this entry failed with `e`.
    fn fail(self, e: &StoreError) {
        match self.op {
            Op::Decide { reply, .. } => drop(reply.send(Err(e.clone()))),
            Op::Renew { reply, .. } => drop(reply.send(Err(e.clone()))),
            Op::Release { .. } => {}
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lane's lock leaves plain data behind (a queue and a flag), still
    // consistent: carry on rather than fail every later request.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Batches {
    pub(super) fn new(
        link: Arc<Link>,
        acquire: Arc<Acquire>,
        prefix: Arc<str>,
        max: usize,
        per_slot: bool,
        lease_secs: u64,
        regional: bool,
    ) -> Arc<Batches> {
        Arc::new(Batches {
            link,
            acquire,
            prefix: Arc::clone(&prefix),
            max: max.max(1),
            lease_secs,
            regional,
            lanes: if per_slot {
                Lanes::PerSlot(Mutex::default())
            } else {
                Lanes::One(Arc::default())
            },
            policy: Mutex::new(Arc::from(policy_args(&BanPolicy::default()))),
            index_script: redis::Script::new(crate::quota::store::scripts::INDEX_BAN),
            ban_index: super::acquire::ban_index(&prefix),
        })
    }

    /// Queues one decision and waits for it, at most the store's deadline from now: a request
    /// never waits longer for a batch than it would for a call of its own. A decision whose
    /// caller has given up is dropped from the queue, never sent; one already sent that took a
    /// lease is given back when its answer comes.
    pub(super) async fn acquire(
        self: &Arc<Self>,
        key_id: &Arc<str>,
        limits: Limits,
        cost: u64,
        ban: &BanPolicy,
    ) -> Result<RawVerdict, StoreError> {
        let policy = self.policy_of(ban);
        let (reply, answer) = oneshot::channel();
        let op = Op::Decide {
            limits,
            cost,
            policy,
            reply,
        };
        self.queue(key_id, op);
        let timeout = self.link.timeout();
        match tokio::time::timeout(timeout, answer).await {
            Err(_) => Err(StoreError::Timeout(timeout)),
            Ok(Err(_)) => Err(StoreError::Unavailable(
                "the batch carrying this decision was abandoned".into(),
            )),
            Ok(Ok(result)) => result,
        }
    }

    /// Queues the release of a lease; never waits.
    pub(super) fn release(self: &Arc<Self>, key_id: &Arc<str>, end: u64) {
        self.queue(key_id, Op::Release { end });
    }

    /// Queues the renewal of a lease and waits for it, at most the store's deadline.
    pub(super) async fn renew(
        self: &Arc<Self>,
        key_id: &Arc<str>,
        end: u64,
    ) -> Result<Lease, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.queue(key_id, Op::Renew { end, reply });
        let timeout = self.link.timeout();
        match tokio::time::timeout(timeout, answer).await {
            Err(_) => Err(StoreError::Timeout(timeout)),
            Ok(Err(_)) => Err(StoreError::Unavailable(
                "the batch carrying this renewal was abandoned".into(),
            )),
            Ok(Ok(result)) => result,
        }
    }

    /// The releases still queued, taken out of every lane: what a stop has left to send
    /// (through a connection of its own, the runtime of this one being gone).
    pub(super) fn take_releases(&self) -> Vec<(Arc<str>, u64)> {
        let lanes: Vec<Arc<Lane>> = match &self.lanes {
            Lanes::One(lane) => vec![Arc::clone(lane)],
            Lanes::PerSlot(lanes) => lock(lanes).values().cloned().collect(),
        };
        let mut out = Vec::new();
        for lane in lanes {
            let mut state = lock(&lane.state);
            for p in std::mem::take(&mut state.queue) {
                match p.op {
                    Op::Release { end } => out.push((p.key_id, end)),
                    other => state.queue.push_back(Pending {
                        key_id: p.key_id,
                        op: other,
                    }),
                }
            }
        }
        out
    }

    /// Starts a drain on every lane that has entries queued and none running: releases left
    /// behind by a run that failed (the store away) go out once it answers again.
    pub(super) fn kick(self: &Arc<Self>) {
        let lanes: Vec<Arc<Lane>> = match &self.lanes {
            Lanes::One(lane) => vec![Arc::clone(lane)],
            Lanes::PerSlot(lanes) => lock(lanes).values().cloned().collect(),
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for lane in lanes {
            {
                let mut state = lock(&lane.state);
                if state.draining > 0 || state.queue.is_empty() {
                    continue;
                }
                state.draining += 1;
            }
            let guard = Draining {
                lane,
                finished: false,
            };
            runtime.spawn(Arc::clone(self).drain(guard));
        }
    }

    /// Puts `op` on its lane's queue and starts a drain task when none can carry it soon. With
    /// no runtime to start one on (a release from a `Drop` outside one, or during a runtime's
    /// shutdown), the entry waits for the lane's next drain.
    fn queue(self: &Arc<Self>, key_id: &Arc<str>, op: Op) {
        let lane = self.lane(key_id);
        let timeout = self.link.timeout();
        let start = {
            let mut state = lock(&lane.state);
            state.queue.push_back(Pending {
                key_id: Arc::clone(key_id),
                op,
            });
            let start = another_run(
                state.draining,
                state.queue.len(),
                self.max,
                state.last_sent.map(|t| t.elapsed()),
                timeout,
            );
            if start {
                state.draining += 1;
            }
            start
        };
        if start {
            // The guard exists before the task does: a task dropped before its first poll (its
            // runtime shutting down) still hands its place back.
            let guard = Draining {
                lane,
                finished: false,
            };
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(Arc::clone(self).drain(guard));
            }
        }
    }

    fn lane(&self, key_id: &str) -> Arc<Lane> {
        match &self.lanes {
            Lanes::One(lane) => Arc::clone(lane),
            Lanes::PerSlot(lanes) => {
                let slot = Slot::for_key(super::acquire::quota_key(&self.prefix, key_id));
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
    /// a caller that stops waiting (its request ended) never strands the entries behind it.
    async fn drain(self: Arc<Self>, mut guard: Draining) {
        loop {
            let batch = {
                let mut state = lock(&guard.lane.state);
                state.queue.retain(|p| !p.abandoned());
                if state.queue.is_empty() {
                    state.draining -= 1;
                    guard.finished = true;
                    return;
                }
                state.last_sent = Some(Instant::now());
                take_batch(&mut state.queue, self.max)
            };
            METRICS.store_batch_size.observe(batch.len() as f64);
            let policy = match batch.iter().find_map(Pending::policy) {
                Some(policy) => Arc::clone(policy),
                // Leases alone: any policy will do, none is used.
                None => Arc::clone(&lock(&self.policy)),
            };
            let call = acquire_call(
                &self.prefix,
                &policy,
                self.lease_secs,
                self.regional,
                batch.iter().map(Pending::entry),
            );
            let result = self.link.acquire(&self.acquire, &call).await;
            let width: usize = 1 + batch
                .iter()
                .map(|p| p.entry().width(self.regional))
                .sum::<usize>();
            match result {
                Ok(values) if values.len() == width => {
                    let (now, values) = values.split_at(1);
                    self.answer(&guard.lane, batch, now[0], values).await
                }
                Ok(values) => {
                    let e = StoreError::Protocol(format!(
                        "acquire returned {} values for {} entries",
                        values.len(),
                        batch.len()
                    ));
                    for p in batch {
                        p.fail(&e);
                    }
                }
                Err(e) => {
                    if self.failed(&guard.lane, batch, &e) {
                        // Not again at once: the next entry queued starts the next try.
                        lock(&guard.lane.state).draining -= 1;
                        guard.finished = true;
                        return;
                    }
                }
            }
        }
    }

    /// A run the store did not answer in time, or at all: its entries fail, and the decisions
    /// queued behind it learn so now rather than each waiting out a run of its own, so that an
    /// outage costs a deadline once, not once per queued request. Queued releases stay for the
    /// lane's next run, and so do this run's when it surely did not run (`Refused`: as across a
    /// Redis restart); after a timeout or a connection lost mid-call it may have run, and a
    /// release applied twice would free another request's place: those leases end by
    /// themselves. Returns whether the lane stops draining (the failure was transient).
    fn failed(&self, lane: &Lane, batch: Vec<Pending>, e: &StoreError) -> bool {
        let transient = !matches!(e, StoreError::Protocol(_));
        let unsent = matches!(e, StoreError::Refused(_));
        let (again, batch): (Vec<Pending>, Vec<Pending>) = batch
            .into_iter()
            .partition(|p| unsent && matches!(p.op, Op::Release { .. }));
        let queued = if transient {
            let mut state = lock(&lane.state);
            let (mut releases, rest): (VecDeque<Pending>, VecDeque<Pending>) =
                std::mem::take(&mut state.queue)
                    .into_iter()
                    .partition(|p| matches!(p.op, Op::Release { .. }));
            for p in again.into_iter().rev() {
                releases.push_front(p);
            }
            state.queue = releases;
            rest
        } else {
            VecDeque::new()
        };
        for p in batch.into_iter().chain(queued) {
            p.fail(e);
        }
        transient
    }

    /// Hands each entry of a run its part of `values`. Bans the run started are indexed first,
    /// before anyone is answered, and not by the callers, who may have stopped waiting: `bans
    /// list` must show every ban in force, and a caller that has its answer finds it listed. A
    /// decision whose caller left (its deadline passed) and that took a lease gives it back.
    async fn answer(&self, lane: &Lane, batch: Vec<Pending>, now: i64, values: &[i64]) {
        let mut rest = values;
        let mut parts = Vec::with_capacity(batch.len());
        for p in &batch {
            let (one, after) = rest.split_at(p.entry().width(self.regional));
            rest = after;
            parts.push(one);
        }
        for (p, one) in batch.iter().zip(&parts) {
            if let Op::Decide { limits, .. } = &p.op {
                if let Some(v) = RawVerdict::parse(now, one, limits, self.regional)
                    .ok()
                    .filter(|v| v.outcome == 3)
                {
                    index_ban(
                        Arc::clone(&self.link),
                        self.index_script.clone(),
                        self.ban_index.clone(),
                        Arc::clone(&p.key_id),
                        u64::try_from(v.ban_until).unwrap_or(0),
                    )
                    .await;
                }
            }
        }
        let mut orphans = Vec::new();
        for (p, one) in batch.into_iter().zip(parts) {
            match p.op {
                Op::Decide { limits, reply, .. } => {
                    if let Err(Ok(late)) =
                        reply.send(RawVerdict::parse(now, one, &limits, self.regional))
                    {
                        if late.took_lease() {
                            orphans.push((p.key_id, late.lease_end as u64));
                        }
                    }
                }
                // A renewal its caller gave up on moved the lease all the same: the new one
                // goes back (the caller, renewing again, takes its own).
                Op::Renew { reply, .. } => {
                    if let Err(Ok(late)) = reply.send(parse_renewal(one)) {
                        orphans.push((p.key_id, late.end));
                    }
                }
                Op::Release { .. } => {}
            }
        }
        if !orphans.is_empty() {
            let mut state = lock(&lane.state);
            for (key_id, end) in orphans {
                state.queue.push_back(Pending {
                    key_id,
                    op: Op::Release { end },
                });
            }
        }
    }
}

/// Whether an entry just queued should start a drain task of its own: always on an idle lane;
/// beside those running only when they cannot keep up (`MAX_IN_FLIGHT`).
fn another_run(
    draining: usize,
    queued: usize,
    max: usize,
    newest_run_age: Option<Duration>,
    timeout: Duration,
) -> bool {
    let behind = queued >= max || newest_run_age.is_some_and(|age| age >= timeout / 4);
    draining == 0 || (behind && draining < MAX_IN_FLIGHT)
}

/// Takes up to `max` entries from the front of the queue, stopping at the first decision whose
/// ban policy differs from the batch's first (one batch carries one policy, and arrival order
/// holds); releases and renewals carry none and go with any.
fn take_batch(queue: &mut VecDeque<Pending>, max: usize) -> Vec<Pending> {
    let mut batch: Vec<Pending> = Vec::with_capacity(queue.len().min(max));
    let mut first: Option<Arc<[u64]>> = None;
    while batch.len() < max {
        let Some(next) = queue.front() else {
            break;
        };
        if let Some(policy) = next.policy() {
            match &first {
                None => first = Some(Arc::clone(policy)),
                Some(f) if Arc::ptr_eq(f, policy) || f == policy => {}
                Some(_) => break,
            }
        }
        batch.extend(queue.pop_front());
    }
    batch
}

/// A drain task's place on its lane. Should the task end without emptying the lane (a panic, or
/// its runtime shutting down, even before its first poll), the place is handed back so that the
/// next entry starts a new one, and when no other task drains the lane the stranded
/// decisions' callers see their channel closed at once rather than waiting out the deadline;
/// releases stay queued for the next drain (or the stop's last flush).
struct Draining {
    lane: Arc<Lane>,
    finished: bool,
}

impl Drop for Draining {
    fn drop(&mut self) {
        if !self.finished {
            let mut state = lock(&self.lane.state);
            state.draining = state.draining.saturating_sub(1);
            if state.draining == 0 {
                state.queue.retain(|p| matches!(p.op, Op::Release { .. }));
            }
        }
    }
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
                op: Op::Decide {
                    limits: Limits::minute_day(1, 1).unwrap(),
                    cost: 1,
                    policy: Arc::clone(policy),
                    reply,
                },
            },
            rx,
        )
    }

    fn release() -> Pending {
        Pending {
            key_id: Arc::from("k"),
            op: Op::Release { end: 1 },
        }
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
    fn releases_ride_with_any_policy_and_survive_an_abandoned_lane() {
        let a: Arc<[u64]> = Arc::from(policy_args(&BanPolicy::default()));
        let b: Arc<[u64]> = Arc::from(policy_args(&BanPolicy {
            strikes: 3,
            ..BanPolicy::default()
        }));
        let (first, _rx1) = pending(&a);
        let (other, _rx2) = pending(&b);
        let mut queue: VecDeque<Pending> = [release(), first, release(), other].into();
        assert_eq!(
            take_batch(&mut queue, 128).len(),
            3,
            "releases join the batch"
        );
        assert_eq!(take_batch(&mut queue, 128).len(), 1);
        // A drain that ends unfinished keeps the releases queued and drops the rest.
        let lane = Arc::new(Lane::default());
        let (gone, _rx3) = pending(&a);
        {
            let mut state = lock(&lane.state);
            state.queue.extend([release(), gone]);
            state.draining = 1;
        }
        drop(Draining {
            lane: Arc::clone(&lane),
            finished: false,
        });
        let state = lock(&lane.state);
        assert_eq!(state.queue.len(), 1);
        assert!(matches!(state.queue[0].op, Op::Release { .. }));
    }

    #[test]
    fn a_second_run_starts_only_when_one_cannot_keep_up() {
        let t = Duration::from_millis(100);
        let young = Some(Duration::from_millis(5));
        assert!(
            another_run(0, 1, 128, None, t),
            "an idle lane sends at once"
        );
        assert!(
            !another_run(1, 5, 128, young, t),
            "a few queue behind one run"
        );
        assert!(
            another_run(1, 128, 128, young, t),
            "a full batch waits: send it"
        );
        assert!(
            another_run(1, 1, 128, Some(Duration::from_millis(25)), t),
            "the run out for a quarter of the deadline: do not wait behind it"
        );
        assert!(
            !another_run(MAX_IN_FLIGHT, 500, 128, Some(t), t),
            "never more than MAX_IN_FLIGHT runs"
        );
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
