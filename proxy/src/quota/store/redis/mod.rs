//! The shared store: decisions go to Redis as one Lua script run per batch (group commit,
//! `batch.rs`; a batch of one at low load), over a reconnecting multiplexed connection, every
//! call under a deadline. A single Redis or a Redis Cluster: all of one API key's state is one
//! key, and a batch on a cluster holds keys of one slot, so every script touches one slot.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
mod acquire;
pub mod ban_feed;
mod batch;
mod errors;
mod function;
mod held;
pub use self::held::Held;
pub mod ledger;
mod link;
mod top;

use self::acquire::{
    acquire_call, ban_index, index_ban, policy_args, quota_key, split_reply, Entry, RawVerdict,
};
use self::batch::Batches;
use self::function::Acquire;
use self::link::Link;
use crate::base::redis::RedisAccess;
use crate::keys::limits::{Every, Limits, MAX_WINDOWS};
use crate::quota::rules::{BanPolicy, Lease, Verdict};
use crate::quota::store::memory::DEFAULT_LEASE_SECS;
use crate::quota::store::{
    scripts, Ban, QuotaStore, StoreConfigError, StoreError, TopWindow, Usage,
};

pub struct RedisStore {
    link: Arc<Link>,
    prefix: Arc<str>,
    /// Group commit: decisions when `batched`, and the leases' releases and renewals always.
    batches: Arc<Batches>,
    /// False: one script run per decision (`store_batch_max = 1`).
    batched: bool,
    batch_max: usize,
    lease_secs: u64,
    /// A region's store (`quota::regions`): admits only out of the units the region holds.
    regional: bool,
    acquire: Arc<Acquire>,
    lift_ban: redis::Script,
    ban_of: redis::Script,
    index_ban: redis::Script,
    probe: redis::Script,
    usage: redis::Script,
    reset_usage: redis::Script,
    hold: redis::Script,
    give: redis::Script,
    import_ban: redis::Script,
}

/// The most decisions one script run carries by default: large enough that a saturated Redis
/// spends its time deciding rather than parsing calls, small enough that one run stays a few
/// hundred microseconds.
pub const DEFAULT_BATCH_MAX: usize = 128;

impl RedisStore {
    /// `prefix` namespaces every key (one per environment); `timeout` bounds every call.
    /// Decisions are batched up to [`DEFAULT_BATCH_MAX`] ([`RedisStore::with_batch_max`]).
    /// `url` carries everything needed to connect (no TLS files, no password files): the
    /// gateway itself builds its store with [`RedisStore::connecting`].
    pub fn new(url: &str, prefix: &str, timeout: Duration) -> Result<RedisStore, StoreConfigError> {
        RedisStore::connecting(RedisAccess::from_url(url)?, prefix, timeout)
    }

    /// As [`RedisStore::new`], reaching Redis as `access` says (TLS, credentials, Sentinels).
    /// Reads its password and certificate files now, and again whenever it reconnects.
    pub fn connecting(
        access: RedisAccess,
        prefix: &str,
        timeout: Duration,
    ) -> Result<RedisStore, StoreConfigError> {
        let link =
            Arc::new(Link::new(access, timeout).map_err(|e| StoreConfigError(e.to_string()))?);
        let prefix: Arc<str> = Arc::from(prefix);
        let acquire = Arc::new(Acquire::new());
        let store = RedisStore {
            batches: Batches::new(
                Arc::clone(&link),
                Arc::clone(&acquire),
                Arc::clone(&prefix),
                DEFAULT_BATCH_MAX,
                link.is_cluster(),
                DEFAULT_LEASE_SECS,
                false,
            ),
            link,
            prefix,
            batched: true,
            batch_max: DEFAULT_BATCH_MAX,
            lease_secs: DEFAULT_LEASE_SECS,
            regional: false,
            acquire,
            lift_ban: redis::Script::new(scripts::LIFT_BAN),
            ban_of: redis::Script::new(scripts::BAN_OF),
            index_ban: redis::Script::new(scripts::INDEX_BAN),
            probe: redis::Script::new(scripts::PROBE),
            usage: redis::Script::new(scripts::USAGE),
            reset_usage: redis::Script::new(scripts::RESET_USAGE),
            hold: redis::Script::new(scripts::HOLD),
            give: redis::Script::new(scripts::GIVE),
            import_ban: redis::Script::new(scripts::IMPORT_BAN),
        };
        Ok(store.with_batch_max(DEFAULT_BATCH_MAX))
    }

    /// At most `max` decisions per script run; 1 sends each decision in a call of its own,
    /// several in flight at once (the behaviour before group commit, kept for comparison).
    pub fn with_batch_max(mut self, max: usize) -> RedisStore {
        self.batched = max > 1;
        self.batch_max = max.max(1);
        self.rebuild_batches();
        self
    }

    /// Leases last `secs` seconds unless given back or renewed.
    pub fn with_lease_secs(mut self, secs: u64) -> RedisStore {
        self.lease_secs = secs.max(1);
        self.rebuild_batches();
        self
    }

    /// A region's store: every decision is admitted only out of the units the region holds of
    /// the global store's budget (`scripts::regional_lua`), and refused with
    /// [`crate::quota::rules::Outcome::Unleased`] when they are too few.
    pub fn regional(mut self) -> RedisStore {
        self.regional = true;
        self.rebuild_batches();
        self
    }

    fn rebuild_batches(&mut self) {
        self.batches = Batches::new(
            Arc::clone(&self.link),
            Arc::clone(&self.acquire),
            Arc::clone(&self.prefix),
            self.batch_max,
            self.link.is_cluster(),
            self.lease_secs,
            self.regional,
        );
    }

    /// The releases this store has queued and not sent: what a stopping gateway hands to a
    /// store of its own ([`RedisStore::release_now`]) once the runtime this one's connection
    /// lived on is gone.
    pub fn unsent_releases(&self) -> Vec<(Arc<str>, u64)> {
        self.batches.take_releases()
    }

    /// Gives back `releases` in one run per lane's worth, waiting for them (a stop's last
    /// step; a request's releases never wait).
    pub async fn release_now(&self, releases: &[(Arc<str>, u64)]) -> Result<(), StoreError> {
        for chunk in releases.chunks(self.batch_max.max(128)) {
            let policy = policy_args(&BanPolicy::default());
            let entries = chunk
                .iter()
                .map(|(key_id, end)| Entry::Release { key_id, end: *end });
            if self.link.is_cluster() {
                // One slot a run: one release a run.
                for entry in entries {
                    let call = acquire_call(
                        &self.prefix,
                        &policy,
                        self.lease_secs,
                        self.regional,
                        std::iter::once(entry),
                    );
                    self.link.acquire(&self.acquire, &call).await?;
                }
            } else {
                let call = acquire_call(
                    &self.prefix,
                    &policy,
                    self.lease_secs,
                    self.regional,
                    entries,
                );
                self.link.acquire(&self.acquire, &call).await?;
            }
        }
        Ok(())
    }

    /// The Redis key holding all of `key_id`'s state.
    pub fn redis_key(&self, key_id: &str) -> String {
        quota_key(&self.prefix, key_id)
    }

    /// Runs `script` on `key_id`'s hash under the deadline.
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        script: &redis::Script,
        key_id: &str,
        args: &[u64],
    ) -> Result<T, StoreError> {
        let mut invocation = script.key(self.redis_key(key_id));
        for a in args {
            invocation.arg(*a);
        }
        self.link.run(&invocation).await
    }

    async fn index_ban_now(&self, key_id: &Arc<str>, until: u64) {
        index_ban(
            Arc::clone(&self.link),
            self.index_ban.clone(),
            ban_index(&self.prefix),
            Arc::clone(key_id),
            until,
        )
        .await
    }

    /// One decision in a script run of its own. One that may take a lease runs as a task of
    /// its own, so that a late answer (past the deadline, its caller gone) still gives the lease
    /// back.
    async fn acquire_alone(
        &self,
        key_id: &Arc<str>,
        limits: &Limits,
        cost: u64,
        ban: &BanPolicy,
    ) -> Result<RawVerdict, StoreError> {
        let policy = policy_args(ban);
        let run = {
            let (link, acquire, prefix) = (
                Arc::clone(&self.link),
                Arc::clone(&self.acquire),
                Arc::clone(&self.prefix),
            );
            let (key_id, limits, lease_secs, regional) =
                (Arc::clone(key_id), *limits, self.lease_secs, self.regional);
            async move {
                let entry = Entry::Decide {
                    key_id: &key_id,
                    limits: &limits,
                    cost,
                };
                let once = std::iter::once(entry);
                let call = acquire_call(&prefix, &policy, lease_secs, regional, once);
                let r = link.acquire(&acquire, &call).await?;
                let (now, one) = split_reply(&r)?;
                RawVerdict::parse(now, one, &limits, regional)
            }
        };
        if limits.concurrency().is_none() {
            return run.await;
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        let batches = Arc::clone(&self.batches);
        let quota = Arc::clone(key_id);
        tokio::spawn(async move {
            if let Err(Ok(late)) = reply.send(run.await) {
                if late.took_lease() {
                    batches.release(&quota, late.lease_end as u64);
                }
            }
        });
        let timeout = self.link.timeout();
        match tokio::time::timeout(timeout, answer).await {
            Err(_) => Err(StoreError::Timeout(timeout)),
            Ok(Err(_)) => Err(StoreError::Unavailable("the decision's task ended".into())),
            Ok(Ok(result)) => result,
        }
    }
}

impl RedisStore {
    /// [`QuotaStore::acquire`], with the units the region holds of each window's instance
    /// (in the limits' window order; all 0 for a store that is not a region's).
    pub async fn decide(
        &self,
        key_id: &Arc<str>,
        limits: Limits,
        cost: u64,
        ban: &BanPolicy,
    ) -> Result<(Verdict, [u64; MAX_WINDOWS]), StoreError> {
        let (verdict, raw) = self.decide_raw(key_id, limits, cost, ban).await?;
        Ok((verdict, raw.held.map(|h| u64::try_from(h).unwrap_or(0))))
    }

    /// A decision, and the script's answer for it.
    async fn decide_raw(
        &self,
        key_id: &Arc<str>,
        limits: Limits,
        cost: u64,
        ban: &BanPolicy,
    ) -> Result<(Verdict, RawVerdict), StoreError> {
        let raw = if self.batched {
            self.batches.acquire(key_id, limits, cost, ban).await?
        } else {
            self.acquire_alone(key_id, &limits, cost, ban).await?
        };
        let verdict = raw.verdict()?;
        // A batch indexes the bans it starts itself (batch.rs).
        if verdict.ban_started && !self.batched {
            self.index_ban_now(key_id, verdict.ban_until).await;
        }
        Ok((verdict, raw))
    }
}

#[async_trait]
impl QuotaStore for RedisStore {
    async fn acquire(
        &self,
        key_id: &Arc<str>,
        limits: Limits,
        cost: u64,
        ban: &BanPolicy,
    ) -> Result<Verdict, StoreError> {
        Ok(self.decide_raw(key_id, limits, cost, ban).await?.0)
    }

    fn release(&self, quota_id: &Arc<str>, lease: Lease) {
        if lease.taken() {
            self.batches.release(quota_id, lease.end);
        }
    }

    fn flush(&self) {
        self.batches.kick();
    }

    async fn renew(&self, quota_id: &Arc<str>, lease: Lease) -> Result<Lease, StoreError> {
        self.batches.renew(quota_id, lease.end).await
    }

    async fn lift_ban(&self, key_id: &str) -> Result<bool, StoreError> {
        let lifted: i64 = self.invoke(&self.lift_ban, key_id, &[]).await?;
        self.index_ban_now(&Arc::from(key_id), 0).await;
        Ok(lifted == 1)
    }

    async fn ban_of(&self, key_id: &str) -> Result<Option<Ban>, StoreError> {
        let until: i64 = self.invoke(&self.ban_of, key_id, &[]).await?;
        Ok((until > 0).then(|| Ban {
            key_id: key_id.to_owned(),
            until: u64::try_from(until).unwrap_or(0),
        }))
    }

    async fn bans(&self) -> Result<Vec<Ban>, StoreError> {
        // A plain read (works on a full Redis and on a replica); ended bans still in the index
        // are left out by their score.
        let mut cmd = redis::cmd("ZRANGEBYSCORE");
        cmd.arg(ban_index(&self.prefix))
            .arg(format!("({}", crate::base::clock::unix_now()))
            .arg("+inf")
            .arg("WITHSCORES");
        let listed: Vec<(String, u64)> = self.link.query(&cmd).await?;
        Ok(listed
            .into_iter()
            .map(|(key_id, until)| Ban { key_id, until })
            .collect())
    }

    async fn usage(&self, quota_id: &str) -> Result<Usage, StoreError> {
        let r: Vec<i64> = self.invoke(&self.usage, quota_id, &[]).await?;
        let Some((&[now, refused, last, ban_until, in_flight], pairs)) = r.split_first_chunk::<5>()
        else {
            return Err(StoreError::Protocol(format!("usage returned {r:?}")));
        };
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        let windows = pairs
            .chunks_exact(2)
            .filter(|p| p[1] > 0)
            .filter_map(|p| Some((Every::from_code(u32::try_from(p[0]).ok()?), n(p[1]))))
            .collect();
        Ok(Usage {
            now: n(now),
            windows,
            refused_today: n(refused),
            last_admitted: n(last),
            ban_until: n(ban_until),
            in_flight: n(in_flight),
            global: None,
        })
    }

    async fn reset_usage(&self, quota_id: &str) -> Result<(), StoreError> {
        self.invoke::<i64>(&self.reset_usage, quota_id, &[u64::from(self.regional)])
            .await
            .map(drop)
    }

    async fn probe(&self) -> Result<(), StoreError> {
        let key = format!("{}:probe-state", self.prefix);
        self.link.run::<i64>(&self.probe.key(key)).await.map(drop)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.link
            .query::<String>(&redis::cmd("PING"))
            .await
            .map(drop)
    }

    /// `SET <prefix>:once:{<name>} <claimant> NX EXAT <until>`: Redis decides who was first;
    /// when the set is refused, the value says whether that was this claimant all along.
    async fn claim_once(&self, name: &str, claimant: &str, until: u64) -> Result<bool, StoreError> {
        let key = format!("{}:once:{{{name}}}", self.prefix);
        let mut cmd = redis::cmd("SET");
        cmd.arg(&key)
            .arg(claimant)
            .arg("NX")
            .arg("EXAT")
            .arg(until.max(1));
        let set: Option<String> = self.link.query(&cmd).await?;
        if set.is_some() {
            return Ok(true);
        }
        let first: Option<String> = self.link.query(redis::cmd("GET").arg(&key)).await?;
        Ok(first.as_deref() == Some(claimant))
    }

    async fn add_top(
        &self,
        day: u64,
        month: u64,
        entries: &[(Arc<str>, u64)],
    ) -> Result<(), StoreError> {
        let per_set = self.link.is_cluster();
        for pipeline in top::add_pipelines(&self.prefix, day, month, entries, per_set) {
            self.link.pipe::<()>(&pipeline).await?;
        }
        Ok(())
    }

    /// Two calls: `TIME` (the period is the store's, as every window is), then the set's
    /// `ZREVRANGE`.
    async fn top(
        &self,
        window: TopWindow,
        limit: usize,
    ) -> Result<(u64, Vec<(String, u64)>), StoreError> {
        let (now, _micros): (u64, u64) = self.link.query(&redis::cmd("TIME")).await?;
        let index = window.every().index(now);
        if limit == 0 {
            return Ok((index, Vec::new()));
        }
        let mut cmd = redis::cmd("ZREVRANGE");
        cmd.arg(top::top_key(&self.prefix, window, index))
            .arg(0)
            .arg(limit.saturating_sub(1))
            .arg("WITHSCORES");
        let ranked: Vec<(String, f64)> = self.link.query(&cmd).await?;
        // Scores are sums of whole units, exact in a double up to 2^53.
        let ranked = ranked
            .into_iter()
            .map(|(holder, used)| (holder, used.max(0.0) as u64))
            .collect();
        Ok((index, ranked))
    }
}
