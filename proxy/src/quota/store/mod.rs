//! Where quota counters and bans live. One trait, two implementations with identical
//! behaviour (the suite in `proxy/tests/store_behaviour.rs` runs the same tests against both):
//!
//! - [`memory::MemoryStore`]: in this process; the embedded default for a single node.
//! - [`redis::RedisStore`]: in Redis, so that every gateway node shares one exact count.

pub mod memory;
mod packed;
mod ranking;
pub mod redis;
pub mod scripts;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::keys::limits::{Every, Limits};
use crate::quota::rules::{BanPolicy, Lease, Verdict};

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("quota store did not answer within {0:?}")]
    Timeout(Duration),
    #[error("quota store unreachable: {0}")]
    Unavailable(String),
    /// Unreachable, and the call surely did not run: no connection, a connection refused or
    /// found closed as the call was sent, a server that answered it would not (a demoted
    /// primary, one still loading, refused credentials). What must not run twice (a lease's
    /// release) may be sent again after this, never after [`StoreError::Unavailable`] or a
    /// timeout.
    #[error("quota store unreachable: {0}")]
    Refused(String),
    #[error("quota store answered something unexpected: {0}")]
    Protocol(String),
}

/// A store that cannot be built from its settings: found once, at start-up or by `check`,
/// never on a request.
#[derive(Debug, Clone, thiserror::Error)]
#[error("quota store: {0}")]
pub struct StoreConfigError(pub String);

impl From<crate::base::redis::RedisUrlError> for StoreConfigError {
    fn from(e: crate::base::redis::RedisUrlError) -> StoreConfigError {
        StoreConfigError(e.0)
    }
}

impl StoreError {
    /// For the `kind` label of `pet_gateway_store_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Unavailable(_) | StoreError::Refused(_) => "unavailable",
            StoreError::Protocol(_) => "protocol",
        }
    }
}

/// Units counted in the current windows, by the store's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    pub now: u64,
    /// Each window length the quota has a count in, and the count of its current instance
    /// (lengths with nothing counted may be left out).
    pub windows: Vec<(Every, u64)>,
    /// Requests refused today by a full window or a ban's start (not those refused during a
    /// ban: ban caches answer them without the store).
    pub refused_today: u64,
    /// When a request was last admitted, Unix seconds; 0: not since the key's state expired.
    pub last_admitted: u64,
    /// The end of the key's ban, Unix seconds; 0 when not banned.
    pub ban_until: u64,
    /// The quota's requests in flight (leases not ended), when it has a concurrency.
    pub in_flight: u64,
    /// In a region (`quota::regions`): what the global store has granted of the current
    /// windows, as this node last read it; `None` without regions, or never read.
    pub global: Option<GlobalUsage>,
}

/// What the global store had granted of a quota's current windows, to every region together
/// and to this one, when a node of this region last read it (`as_of`, Unix seconds). Granted is
/// not spent: the units a region holds and has not spent are granted too, so what is granted
/// in all is at least what was admitted everywhere, and never more than the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalUsage {
    pub as_of: u64,
    /// Each window length, the instance read, granted in all, granted to this region.
    pub windows: Vec<(Every, u64, u64, u64)>,
}

impl Usage {
    /// The count of the current window of length `every`.
    pub fn count(&self, every: Every) -> u64 {
        self.windows
            .iter()
            .find(|(e, _)| *e == every)
            .map_or(0, |&(_, n)| n)
    }
}

/// A period of the top consumers' index (`GET /usage/top`): the UTC calendar day or month,
/// by the store's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TopWindow {
    Day,
    Month,
}

impl TopWindow {
    /// `day` or `month`, as the API and the command line write it.
    pub fn parse(text: &str) -> Option<TopWindow> {
        match text {
            "day" => Some(TopWindow::Day),
            "month" => Some(TopWindow::Month),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TopWindow::Day => "day",
            TopWindow::Month => "month",
        }
    }

    /// The window length a plan names for this period (`1d`, `month`).
    pub fn every(self) -> Every {
        match self {
            TopWindow::Day => Every::DAY,
            TopWindow::Month => Every::Month,
        }
    }
}

/// A ban as the admin commands show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ban {
    pub key_id: String,
    pub until: u64,
}

#[async_trait]
pub trait QuotaStore: Send + Sync {
    /// Decides one request of `key_id` (an API key's id, never the key; shared, so the embedded
    /// store keeps a reference rather than a copy per key) costing `cost` units under `limits`:
    /// refuses during a ban; admits and counts `cost` in every window when every enforced one
    /// has room for it; otherwise counts a strike and bans once the strikes pass the policy's
    /// threshold. Atomic: concurrent calls for one key never admit more than the limits.
    async fn acquire(
        &self,
        key_id: &Arc<str>,
        limits: Limits,
        cost: u64,
        ban: &BanPolicy,
    ) -> Result<Verdict, StoreError>;

    /// Gives back a lease an admitted request took ([`Verdict::lease`]) once it has ended.
    /// Never waits: the store sends it on its own (Redis: with the next run of its lane), so
    /// it can be called from a request's last moments, even a `Drop`. A release that is lost
    /// (the store away) leaves the lease to end by itself.
    fn release(&self, quota_id: &Arc<str>, lease: Lease);

    /// Sends now what waits to be sent (releases left queued by a failed run), where the store
    /// queues anything; called from time to time by the lease renewals' task. Never waits.
    fn flush(&self) {}

    /// Moves a lease of a request still in flight to end a lease length from now (its
    /// request outlives it: a slow upload, a long answer); returns the new end. A lease that is
    /// gone (ended, or lost with the store) is taken again: its request is still in flight.
    async fn renew(&self, quota_id: &Arc<str>, lease: Lease) -> Result<Lease, StoreError>;

    /// Ends a key's ban now (and forgets its strikes); returns whether one was active.
    async fn lift_ban(&self, key_id: &str) -> Result<bool, StoreError>;

    /// The ban of `key_id`, if one is active.
    async fn ban_of(&self, key_id: &str) -> Result<Option<Ban>, StoreError>;

    /// Every active ban, in one call (for `bans list`, and for each node to drop cached bans
    /// that were lifted elsewhere).
    async fn bans(&self) -> Result<Vec<Ban>, StoreError>;

    /// Runs the same kind of operation as [`QuotaStore::acquire`] (a script that writes) on a
    /// key of its own, so that a store that answers `PING` but cannot run scripts or take
    /// writes (paused, out of memory, a read-only replica) counts as failing.
    async fn probe(&self) -> Result<(), StoreError>;

    /// What `quota_id` has used in its current windows (for `keys show`).
    async fn usage(&self, quota_id: &str) -> Result<Usage, StoreError>;

    /// Zeroes the counts of the current windows (an operator's goodwill gesture); bans and
    /// strikes stay (`lift_ban` ends a ban).
    async fn reset_usage(&self, quota_id: &str) -> Result<(), StoreError>;

    /// Whether the store answers (for `/readyz`).
    async fn ping(&self) -> Result<(), StoreError>;

    /// Adds units spent by quota holders (quota ids: a key's, or `customer:<name>`) to the top
    /// consumers' index of UTC day `day` and month `month` (`Every::index`). Called once a
    /// second by each node's flush of its tally, never on a request; one call per flush.
    async fn add_top(
        &self,
        day: u64,
        month: u64,
        entries: &[(Arc<str>, u64)],
    ) -> Result<(), StoreError>;

    /// The `limit` holders that spent the most in the current `window` by the store's clock,
    /// heaviest first, with the period's index; without reading every key.
    async fn top(
        &self,
        window: TopWindow,
        limit: usize,
    ) -> Result<(u64, Vec<(String, u64)>), StoreError>;

    /// Claims `name` for `claimant` until Unix second `until`: true for the claimant that
    /// claimed it first across the fleet (a notice every node would otherwise send, such as a
    /// key's expiry coming), and for it again when it asks again (a claim whose answer was
    /// lost to a timeout is not lost); false for every other claimant until then.
    async fn claim_once(&self, name: &str, claimant: &str, until: u64) -> Result<bool, StoreError>;
}
