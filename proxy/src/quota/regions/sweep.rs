//! Giving back what a region holds of a quota whose traffic left it: each node remembers the
//! quotas it got units for and when it last decided one of their requests; once a quota has
//! been quiet on the node for [`IDLE_SECS`], the node takes back what the region holds and did
//! not spend (`RedisStore::give`, which gives nothing while any node of the region still admits
//! the quota) and gives it back to the global store, where another region can be granted it.
//! Taken out of the region first: the units are never spendable in two places at once; a
//! give-back lost on the way leaves them counted as granted (under-admission, never over), and
//! none is tried while the global store was just found away. A node tracks the quotas it got
//! units for, and those its decisions find the region holding spare units of (a node started
//! after the grant: a restart or a rolling upgrade). A window's spare units are given back
//! only from a twentieth of its limit (`worth_giving`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::RegionalStore;
use crate::base::clock::unix_now;
use crate::base::metrics::METRICS;
use crate::keys::limits::{Every, Limits};
use crate::quota::store::redis::ledger::Instance;
use crate::quota::store::StoreError;

/// How long a quota must have had no admission, on this node and in its region, before what
/// the region holds of it is given back.
pub const IDLE_SECS: u64 = 3;
/// How often the sweep looks.
pub const EVERY: Duration = Duration::from_secs(1);
/// A quota quiet this long is no longer tracked (its instances have ended, or the units stay
/// with a node of the region still deciding it).
const FORGET_SECS: u64 = 3_600;

/// The fewest spare units of a window worth giving back: a twentieth of its limit, 2 at least.
/// Fewer stay with the region (at most that much under-admission a region, per window): a
/// quiet key's unit or two is not worth a call to the global store, nor the wait its next
/// request would have for a grant.
fn worth_giving(limit: u64) -> u64 {
    (limit / 20).max(2)
}

/// A quota this node got units for.
pub struct Tracked {
    limits: Mutex<Limits>,
    /// Unix seconds: this node's last decision of it, and its last give-back look.
    last: AtomicU64,
    looked: AtomicU64,
}

impl RegionalStore {
    /// Notes a decision of `quota`, when tracked (one read lock, one store); whether it is.
    pub(super) fn touch(&self, quota: &Arc<str>) -> bool {
        let tracked = self.tracked.read().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = tracked.get(quota) {
            t.last.store(unix_now(), Ordering::Relaxed);
            return true;
        }
        false
    }

    /// How many quotas this node tracks for give-backs.
    pub fn tracking(&self) -> usize {
        self.tracked.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Tracks `quota`, which this node just got units for, under `limits`.
    pub(super) fn track(&self, quota: &Arc<str>, limits: Limits) {
        let now = unix_now();
        let mut tracked = self.tracked.write().unwrap_or_else(|p| p.into_inner());
        let t = tracked.entry(Arc::clone(quota)).or_insert_with(|| {
            Arc::new(Tracked {
                limits: Mutex::new(limits),
                last: AtomicU64::new(now),
                looked: AtomicU64::new(0),
            })
        });
        *t.limits.lock().unwrap_or_else(|p| p.into_inner()) = limits;
        t.last.store(now, Ordering::Relaxed);
    }

    /// One pass: gives back what quiet quotas hold. A quota whose region was quiet too is no
    /// longer tracked once its units went back (a new grant tracks it again); one still
    /// admitted by another node of the region is looked at again [`IDLE_SECS`] later, and
    /// forgotten after [`FORGET_SECS`] of quiet on this node.
    pub async fn sweep(&self) {
        if self.away() {
            // A give-back takes the units out of the region first: while the global store does
            // not answer, they would be lost on the way.
            return;
        }
        let now = unix_now();
        let (idle, forgotten): (Vec<_>, Vec<_>) = {
            let tracked = self.tracked.read().unwrap_or_else(|p| p.into_inner());
            let quiet = |t: &Tracked, secs| {
                now.saturating_sub(t.last.load(Ordering::Relaxed)) >= secs
                    && now.saturating_sub(t.looked.load(Ordering::Relaxed)) >= IDLE_SECS
            };
            let idle = tracked
                .iter()
                .filter(|(_, t)| quiet(t, IDLE_SECS))
                .map(|(q, t)| (Arc::clone(q), Arc::clone(t)));
            idle.partition(|(_, t)| !quiet(t, FORGET_SECS))
        };
        let mut done: Vec<Arc<str>> = forgotten.into_iter().map(|(q, _)| q).collect();
        for (quota, t) in idle {
            t.looked.store(now, Ordering::Relaxed);
            let limits = *t.limits.lock().unwrap_or_else(|p| p.into_inner());
            match self.give_back(&quota, &limits).await {
                Ok(true) => done.push(quota),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "could not give a region's unspent units back")
                }
            }
        }
        if !done.is_empty() {
            let mut tracked = self.tracked.write().unwrap_or_else(|p| p.into_inner());
            for quota in done {
                // Unless a grant tracked it again meanwhile.
                if tracked.get(&quota).is_some_and(|t| {
                    now.saturating_sub(t.last.load(Ordering::Relaxed)) >= IDLE_SECS
                }) {
                    tracked.remove(&quota);
                }
            }
        }
    }

    /// Takes back what the region holds of `quota`'s current and next instances and gives it
    /// to the global store; whether the region was quiet (false: another node still admits it).
    async fn give_back(&self, quota: &Arc<str>, limits: &Limits) -> Result<bool, StoreError> {
        let windows: Vec<(u32, u64)> = limits
            .windows()
            .iter()
            .filter(|w| !w.shadow)
            .map(|w| (w.every.code(), worth_giving(w.limit())))
            .collect();
        let Some(taken) = self.store.give(quota, IDLE_SECS, &windows).await? else {
            return Ok(false);
        };
        let back: Vec<(Instance, u64)> = taken
            .into_iter()
            .map(|(code, index, units)| (Instance::new(Every::from_code(code), index), units))
            .collect();
        if back.is_empty() {
            return Ok(true);
        }
        let id = self.request_id();
        let given = match self.ledger.give_back(quota, &self.region, &id, &back).await {
            Err(StoreError::Timeout(_) | StoreError::Unavailable(_)) => {
                self.ledger.give_back(quota, &self.region, &id, &back).await
            }
            other => other,
        };
        let result = if given.is_ok() {
            "given_back"
        } else {
            "give_back_lost"
        };
        METRICS.region_grants.with_label_values(&[result]).inc();
        given.map(|_| true)
    }
}
