//! The shared store: decisions go to Redis as one Lua script run per batch (group commit,
//! `batch.rs`; a batch of one at low load), over a reconnecting multiplexed connection, every
//! call under a deadline. A single Redis or a Redis Cluster: all of one API key's state is one
//! key, and a batch on a cluster holds keys of one slot, so every script touches one slot.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
mod acquire;
mod batch;
mod link;
mod top;

use self::acquire::{acquire_invocation, ban_index, index_ban, policy_args, quota_key, RawVerdict};
use self::batch::Batches;
use self::link::Link;
use crate::base::redis::RedisAccess;
use crate::keys::limits::{Every, Limits, MAX_WINDOWS};
use crate::quota::rules::{BanPolicy, Outcome, Verdict};
use crate::quota::store::{
    scripts, Ban, QuotaStore, StoreConfigError, StoreError, TopWindow, Usage,
};

pub struct RedisStore {
    link: Arc<Link>,
    prefix: Arc<str>,
    /// `None`: one script run per decision (`store_batch_max = 1`).
    batches: Option<Arc<Batches>>,
    acquire: redis::Script,
    lift_ban: redis::Script,
    ban_of: redis::Script,
    index_ban: redis::Script,
    probe: redis::Script,
    usage: redis::Script,
    reset_usage: redis::Script,
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
        let link = Link::new(access, timeout).map_err(|e| StoreConfigError(e.to_string()))?;
        let store = RedisStore {
            link: Arc::new(link),
            prefix: Arc::from(prefix),
            batches: None,
            acquire: redis::Script::new(scripts::ACQUIRE),
            lift_ban: redis::Script::new(scripts::LIFT_BAN),
            ban_of: redis::Script::new(scripts::BAN_OF),
            index_ban: redis::Script::new(scripts::INDEX_BAN),
            probe: redis::Script::new(scripts::PROBE),
            usage: redis::Script::new(scripts::USAGE),
            reset_usage: redis::Script::new(scripts::RESET_USAGE),
        };
        Ok(store.with_batch_max(DEFAULT_BATCH_MAX))
    }

    /// At most `max` decisions per script run; 1 sends each decision in a call of its own,
    /// several in flight at once (the behaviour before group commit, kept for comparison).
    pub fn with_batch_max(mut self, max: usize) -> RedisStore {
        self.batches = (max > 1).then(|| {
            let per_slot = self.link.is_cluster();
            Batches::new(
                Arc::clone(&self.link),
                Arc::clone(&self.prefix),
                max,
                per_slot,
            )
        });
        self
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

    /// One decision in a script run of its own.
    async fn acquire_alone(
        &self,
        key_id: &str,
        limits: &Limits,
        cost: u64,
        ban: &BanPolicy,
    ) -> Result<RawVerdict, StoreError> {
        let policy = policy_args(ban);
        let invocation = acquire_invocation(
            &self.acquire,
            &self.prefix,
            &policy,
            std::iter::once((key_id, limits, cost)),
        );
        let r: Vec<i64> = self.link.run(&invocation).await?;
        if r.len() != RawVerdict::width(limits) {
            return Err(StoreError::Protocol(format!("acquire returned {r:?}")));
        }
        RawVerdict::parse(&r)
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
        let raw = match &self.batches {
            Some(batches) => batches.acquire(key_id, limits, cost, ban).await?,
            None => self.acquire_alone(key_id, &limits, cost, ban).await?,
        };
        let RawVerdict {
            outcome,
            now,
            ban_until,
            counts,
        } = raw;
        let outcome_of = match outcome {
            0 => Outcome::Admitted,
            1 => Outcome::Limited,
            2 | 3 => Outcome::Banned,
            other => return Err(StoreError::Protocol(format!("unknown outcome {other}"))),
        };
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        // A batch indexes the bans it starts itself (batch.rs).
        if outcome == 3 && self.batches.is_none() {
            self.index_ban_now(key_id, n(ban_until)).await;
        }
        let mut wide = [0u64; MAX_WINDOWS];
        for (w, c) in wide.iter_mut().zip(counts) {
            *w = n(c);
        }
        Ok(Verdict {
            outcome: outcome_of,
            ban_started: outcome == 3,
            now: n(now),
            counts: wide,
            ban_until: n(ban_until),
        })
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
        let Some((&[now, refused, last, ban_until], pairs)) = r.split_first_chunk::<4>() else {
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
        })
    }

    async fn reset_usage(&self, quota_id: &str) -> Result<(), StoreError> {
        self.invoke::<i64>(&self.reset_usage, quota_id, &[])
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
            self.link.pipe(&pipeline).await?;
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
