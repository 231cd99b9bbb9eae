//! Bans across regions: a ban a region's decision starts is published to the global store's
//! feed (`store::redis::ban_feed`); every node reads the feed every [`EVERY`] and writes the
//! bans new to it into its region's Redis (`RedisStore::import_ban`), where the region's
//! decisions refuse them as their own and `bans list` shows them. A ban is thus in force in
//! every region within a second of its start while the global store answers (a publish, a
//! read, an import: three calls, two of them across regions).
//!
//! A `bans lift` writes a lift into the feed before the region's own lift, and answers an error
//! when the global store does not (the lift may still have reached it: then every region lifts
//! the ban all the same, and a retry does no harm). A node that reads a lift lifts the ban in
//! its region when it ends no later than the lifted one (not a ban the region started since).
//! A ban that could not be published (the global store away) is published by a later read that
//! reaches it, unless a lift came meanwhile. A region cut off keeps enforcing every ban it has
//! (they live in its Redis); what is published meanwhile arrives with its first read after.
//! Every [`WHOLE_EVERY`] a node writes every ban of the feed into its region again, so a
//! region's Redis restarted empty gets them back.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{lock, RegionalStore};
use crate::base::clock::unix_now;
use crate::quota::store::redis::ban_feed::{FeedAt, FeedRead, Record};
use crate::quota::store::StoreError;

/// How often each node reads the feed: with a publish and an import, well inside the 1 s a
/// ban takes to hold in every region; two `GET`s in one round trip while the feed is unchanged.
pub const EVERY: Duration = Duration::from_millis(250);

/// How often a node writes every ban of the feed into its region again, changed or not.
const WHOLE_EVERY: Duration = Duration::from_secs(10);

/// What this node last read of the feed, and the bans it could not publish yet.
#[derive(Default)]
pub struct Following {
    /// The feed's state this node has applied whole (`None`: none yet, or read it again).
    at: Option<FeedAt>,
    /// The records of it this node has applied, by quota id.
    seen: HashMap<String, Record>,
    /// When this node last wrote every ban again.
    whole_at: Option<Instant>,
    /// Bans started here whose publish failed, by quota id: when they started, when they end.
    unpublished: HashMap<Arc<str>, (u64, u64)>,
}

impl RegionalStore {
    /// Publishes, in the background, the ban a decision of `quota` started at `started` (the
    /// region's clock) until `until`.
    pub(super) fn publish_ban(self: &Arc<Self>, quota: &Arc<str>, started: u64, until: u64) {
        let (me, quota) = (Arc::clone(self), Arc::clone(quota));
        tokio::spawn(async move {
            me.publish_now(&quota, started, until, started).await;
        });
    }

    /// Lifts `quota`'s ban in every region, by the feed.
    pub(super) async fn lift_everywhere(&self, quota: &str) -> Result<(), StoreError> {
        self.feed.lift(quota).await
    }

    /// One read of the feed: publishes what could not be, then writes the bans new to this node
    /// into the region and lifts the bans lifted in another.
    pub async fn follow_bans(&self) {
        self.publish_pending().await;
        let known = {
            let mut following = lock(&self.following);
            if following
                .whole_at
                .is_none_or(|t| t.elapsed() >= WHOLE_EVERY)
            {
                following.whole_at = Some(Instant::now());
                following.at = None;
                following
                    .seen
                    .retain(|_, r| matches!(r, Record::Lift { .. }));
            }
            following.at.clone()
        };
        let read = match self.feed.read_since(known.as_ref()).await {
            Ok(Some(read)) => read,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "could not read the bans of the other regions");
                return;
            }
        };
        if read.malformed > 0 {
            tracing::warn!(
                malformed = read.malformed,
                "the global store's feed of bans holds records that do not parse; skipped"
            );
        }
        let whole = self.apply(&read).await;
        let mut following = lock(&self.following);
        if known.is_none() {
            // Read whole: what the feed no longer holds is forgotten (the map stays its size).
            let held: std::collections::HashSet<&str> =
                read.records.iter().map(|(q, _)| q.as_str()).collect();
            following.seen.retain(|q, _| held.contains(q.as_str()));
        }
        following.at = whole.then_some(read.at);
    }

    /// Publishes one ban, by the region's clock at `now`; one that fails waits in
    /// `unpublished` for a later read. Whether the global store answered.
    async fn publish_now(&self, quota: &Arc<str>, started: u64, until: u64, now: u64) -> bool {
        match self.feed.publish(quota, (started, until, now)).await {
            Ok(true) => true,
            Ok(false) => {
                tracing::debug!(quota = %quota, "a ban not published: a later one, or a lift since it started");
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, quota = %quota, "could not publish a ban to the other regions yet");
                lock(&self.following)
                    .unpublished
                    .insert(Arc::clone(quota), (started, until));
                false
            }
        }
    }

    /// The bans whose publish failed, again, until one fails (the global store is still away:
    /// the rest wait for the next read rather than a deadline each).
    async fn publish_pending(&self) {
        let pending = std::mem::take(&mut lock(&self.following).unpublished);
        let mut away = false;
        for (quota, (started, until)) in pending {
            if until <= unix_now() {
                continue;
            }
            if away {
                lock(&self.following)
                    .unpublished
                    .insert(quota, (started, until));
            } else {
                away = !self.publish_now(&quota, started, until, unix_now()).await;
            }
        }
    }

    /// Writes the records of `read` new to this node into the region; whether every one was
    /// (otherwise the feed is read whole again).
    async fn apply(&self, read: &FeedRead) -> bool {
        let now = unix_now();
        let mut whole = true;
        for (quota, record) in &read.records {
            if lock(&self.following).seen.get(quota) == Some(record) {
                continue;
            }
            let done = match *record {
                Record::Ban { until, .. } if until <= now => true,
                Record::Ban { until, .. } => self.import_here(quota, until).await,
                Record::Lift { until, .. } => self.lift_here(quota, until).await,
            };
            if done {
                lock(&self.following).seen.insert(quota.clone(), *record);
            }
            whole &= done;
        }
        whole
    }

    async fn import_here(&self, quota: &str, until: u64) -> bool {
        match self.store.import_ban(quota, until).await {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(error = %e, quota = %quota, "could not write another region's ban into this region");
                false
            }
        }
    }

    /// Lifts `quota`'s ban in this region when it ends no later than `until` (the lifted ban's
    /// end: a later one started here since); whether that was decided.
    async fn lift_here(&self, quota: &str, until: u64) -> bool {
        // Two seconds for the clocks of the global store and the region.
        match self.store.lift_imported(quota, until + 2).await {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(error = %e, quota = %quota, "could not lift in this region a ban lifted in another");
                false
            }
        }
    }
}
