//! Bans across regions: a ban a region's decision starts is published to the global store's
//! feed (`store::redis::ban_feed`); every node reads the feed every [`EVERY`] and writes the
//! bans new to it into its region's Redis (`RedisStore::import_ban`), where the region's
//! decisions refuse them as their own and `bans list` shows them. A ban is thus in force in
//! every region within a second of its start while the global store answers (a publish, a
//! read, an import: three calls, two of them across regions).
//!
//! A `bans lift` takes the ban out of the feed before the region's own lift, and fails when the
//! global store does not answer (then nothing is lifted anywhere, and the operator tries
//! again); nodes that had seen the ban lift it in their region. A ban that could not be
//! published (the global store away) is published by the next read that reaches it. A region
//! cut off keeps enforcing every ban it has (they live in its Redis); what is published
//! meanwhile arrives with the first read after.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::{lock, RegionalStore};
use crate::base::clock::unix_now;
use crate::quota::store::redis::ban_feed::FeedRead;

/// How often each node reads the feed: with a publish and an import, well inside the 1 s a
/// ban takes to hold in every region; one `GET` each time the feed has not changed.
pub const EVERY: Duration = Duration::from_millis(250);

/// What this node last read of the feed, and the bans it could not publish yet.
#[derive(Default)]
pub struct Following {
    /// The feed's version this node has applied (0: none yet).
    version: u64,
    /// The bans of that version this node has written into its region, by quota id.
    seen: HashMap<String, u64>,
    /// Bans started here whose publish failed, by quota id (the latest end).
    unpublished: HashMap<Arc<str>, u64>,
}

impl RegionalStore {
    /// Publishes, in the background, the ban a decision of `quota` just started.
    pub(super) fn publish_ban(self: &Arc<Self>, quota: &Arc<str>, until: u64) {
        let (me, quota) = (Arc::clone(self), Arc::clone(quota));
        tokio::spawn(async move {
            if let Err(e) = me.feed.publish(&quota, until).await {
                tracing::warn!(error = %e, quota = %quota, "could not publish a ban to the other regions yet");
                let mut following = lock(&me.following);
                let end = following.unpublished.entry(quota).or_default();
                *end = (*end).max(until);
            }
        });
    }

    /// Takes `quota`'s ban out of the feed, so that every region lifts it.
    pub(super) async fn unpublish_ban(
        &self,
        quota: &str,
    ) -> Result<(), crate::quota::store::StoreError> {
        lock(&self.following).unpublished.remove(quota);
        self.feed.publish(quota, 0).await.map(|_| ())
    }

    /// One read of the feed: publishes what could not be, then writes the bans new to this node
    /// into the region and lifts those taken out of the feed.
    pub async fn follow_bans(&self) {
        self.publish_pending().await;
        let known = lock(&self.following).version;
        let read = match self.feed.read_since(known).await {
            Ok(Some(read)) => read,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "could not read the bans of the other regions");
                return;
            }
        };
        let applied = self.apply(known, &read).await;
        let mut following = lock(&self.following);
        following.seen = applied.seen;
        if applied.whole {
            following.version = read.version;
        }
    }

    async fn publish_pending(&self) {
        let pending = std::mem::take(&mut lock(&self.following).unpublished);
        for (quota, until) in pending {
            if until <= unix_now() {
                continue;
            }
            if self.feed.publish(&quota, until).await.is_err() {
                let mut following = lock(&self.following);
                let end = following.unpublished.entry(quota).or_default();
                *end = (*end).max(until);
            }
        }
    }

    /// Writes `read` into the region: bans new to this node imported, bans gone from a feed
    /// that moved forward (not one that went back: a global store that lost its data lifts
    /// nothing) lifted while they had time left.
    async fn apply(&self, known: u64, read: &FeedRead) -> Applied {
        let now = unix_now();
        let before = lock(&self.following).seen.clone();
        let mut applied = Applied {
            seen: HashMap::with_capacity(read.bans.len()),
            whole: true,
        };
        for (quota, until) in &read.bans {
            if *until <= now || before.get(quota) == Some(until) {
                applied.seen.insert(quota.clone(), *until);
                continue;
            }
            match self.store.import_ban(quota, *until).await {
                Ok(_) => {
                    applied.seen.insert(quota.clone(), *until);
                }
                Err(e) => {
                    tracing::warn!(error = %e, quota = %quota, "could not write another region's ban into this region");
                    applied.whole = false;
                }
            }
        }
        if read.version > known && known != 0 {
            for (quota, until) in before {
                if until > now + 1
                    && !applied.seen.contains_key(&quota)
                    && !self.lift_here(&quota).await
                {
                    applied.seen.insert(quota, until);
                    applied.whole = false;
                }
            }
        }
        applied
    }

    /// Lifts `quota`'s ban in this region (lifted in another); whether that was done.
    async fn lift_here(&self, quota: &str) -> bool {
        use crate::quota::store::QuotaStore;
        match self.store.lift_ban(quota).await {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(error = %e, quota = %quota, "could not lift in this region a ban lifted in another");
                false
            }
        }
    }
}

/// What a read wrote: the bans now in the region as the feed has them, and whether all of it
/// was written (otherwise the same version is read again).
struct Applied {
    seen: HashMap<String, u64>,
    whole: bool,
}
