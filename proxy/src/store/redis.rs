//! The shared store: decisions go to Redis as one Lua script run per batch (group commit,
//! `batch.rs`; a batch of one at low load), over a reconnecting multiplexed connection, every
//! call under a deadline. A single Redis or a Redis Cluster: all of one API key's state is one
//! key, and a batch on a cluster holds keys of one slot, so every script touches one slot.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;

use super::batch::{policy_args, Batches};
use super::{scripts, Ban, QuotaStore, StoreConfigError, StoreError, Usage};
use crate::quota::{BanPolicy, Limits, Outcome, Verdict};

/// Where the store's Redis is: one server, or the seed nodes of a cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    Single(String),
    Cluster(Vec<String>),
}

impl RedisTarget {
    /// `redis://host:port/db` (also `rediss://`, `unix://`) is one server;
    /// `redis+cluster://host:port,host:port` or a comma-separated list of `redis://` URLs is a
    /// cluster, given by some of its nodes.
    pub fn parse(url: &str) -> Result<RedisTarget, StoreConfigError> {
        let url = url.trim();
        let nodes: Vec<String> = if let Some(rest) = url.strip_prefix("redis+cluster://") {
            rest.trim_end_matches('/')
                .split(',')
                .map(|n| format!("redis://{}", n.trim()))
                .collect()
        } else if url.contains(',') {
            url.split(',').map(|n| n.trim().to_owned()).collect()
        } else {
            redis::Client::open(url).map_err(|e| StoreConfigError(e.to_string()))?;
            return Ok(RedisTarget::Single(url.to_owned()));
        };
        for node in &nodes {
            redis::Client::open(node.as_str())
                .map_err(|e| StoreConfigError(format!("cluster node `{node}`: {e}")))?;
        }
        Ok(RedisTarget::Cluster(nodes))
    }
}

enum Client {
    Single(redis::Client),
    Cluster(Box<ClusterClient>),
}

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// The connection every call goes through, and the deadline each one runs under. Shared by the
/// store and its batches' drain tasks.
pub(super) struct Link {
    client: Client,
    /// Created on first use, inside the runtime that serves requests, so the connection's
    /// driver task lives where its callers do.
    conn: OnceCell<Conn>,
    timeout: Duration,
}

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
    pub fn new(url: &str, prefix: &str, timeout: Duration) -> Result<RedisStore, StoreConfigError> {
        let client = match RedisTarget::parse(url)? {
            RedisTarget::Single(url) => Client::Single(
                redis::Client::open(url).map_err(|e| StoreConfigError(e.to_string()))?,
            ),
            RedisTarget::Cluster(nodes) => Client::Cluster(Box::new(
                ClusterClient::builder(nodes)
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .retries(2)
                    .build()
                    .map_err(|e| StoreConfigError(e.to_string()))?,
            )),
        };
        let store = RedisStore {
            link: Arc::new(Link {
                client,
                conn: OnceCell::new(),
                timeout,
            }),
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
            let per_slot = matches!(self.link.client, Client::Cluster(_));
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
        limits: Limits,
        ban: &BanPolicy,
    ) -> Result<RawVerdict, StoreError> {
        let policy = policy_args(ban);
        let invocation = acquire_invocation(
            &self.acquire,
            &self.prefix,
            &policy,
            std::iter::once((key_id, limits)),
        );
        let r: Vec<i64> = self.link.run(&invocation).await?;
        <RawVerdict>::try_from(r.as_slice())
            .map_err(|_| StoreError::Protocol(format!("acquire returned {r:?}")))
    }
}

impl Link {
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn conn(&self) -> Result<Conn, StoreError> {
        self.conn
            .get_or_try_init(|| async {
                match &self.client {
                    Client::Single(client) => {
                        let config = ConnectionManagerConfig::new()
                            .set_connection_timeout(Some(self.timeout))
                            .set_response_timeout(Some(self.timeout))
                            .set_number_of_retries(1)
                            .set_max_delay(Duration::from_millis(500));
                        ConnectionManager::new_lazy_with_config(client.clone(), config)
                            .map(Conn::Single)
                            .map_err(|e| StoreError::Unavailable(e.to_string()))
                    }
                    // Learning the cluster's slots takes a round trip to a seed node; bounded
                    // like any call, and retried by the next request when it fails.
                    Client::Cluster(client) => {
                        match tokio::time::timeout(self.timeout * 4, client.get_async_connection())
                            .await
                        {
                            Err(_) => Err(StoreError::Timeout(self.timeout * 4)),
                            Ok(Err(e)) => Err(StoreError::Unavailable(e.to_string())),
                            Ok(Ok(c)) => Ok(Conn::Cluster(c)),
                        }
                    }
                }
            })
            .await
            .cloned()
    }

    /// Runs one plain command under the deadline.
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, StoreError> {
        let call = async {
            let result = match self.conn().await? {
                Conn::Single(mut c) => cmd.query_async::<T>(&mut c).await,
                Conn::Cluster(mut c) => cmd.query_async::<T>(&mut c).await,
            };
            result.map_err(|e| StoreError::Unavailable(e.to_string()))
        };
        match tokio::time::timeout(self.timeout, call).await {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(result) => result,
        }
    }

    /// Runs one script invocation under the deadline.
    pub(super) async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let call = async {
            match self.conn().await? {
                Conn::Single(mut c) => invoke_on(invocation, &mut c).await,
                Conn::Cluster(mut c) => invoke_on(invocation, &mut c).await,
            }
        };
        match tokio::time::timeout(self.timeout, call).await {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(result) => result,
        }
    }
}

async fn invoke_on<T: redis::FromRedisValue>(
    invocation: &redis::ScriptInvocation<'_>,
    conn: &mut (impl ConnectionLike + Send),
) -> Result<T, StoreError> {
    invocation.invoke_async(conn).await.map_err(|e| {
        if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_cluster_error() {
            StoreError::Unavailable(e.to_string())
        } else {
            StoreError::Protocol(e.to_string())
        }
    })
}

#[async_trait]
impl QuotaStore for RedisStore {
    async fn acquire(
        &self,
        key_id: &Arc<str>,
        limits: Limits,
        ban: &BanPolicy,
    ) -> Result<Verdict, StoreError> {
        let raw = match &self.batches {
            Some(batches) => batches.acquire(key_id, limits, ban).await?,
            None => self.acquire_alone(key_id, limits, ban).await?,
        };
        let [outcome, now, minute_count, day_count, ban_until] = raw;
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
        Ok(Verdict {
            outcome: outcome_of,
            ban_started: outcome == 3,
            now: n(now),
            minute_count: n(minute_count),
            day_count: n(day_count),
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
            .arg(format!("({}", crate::clock::unix_now()))
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
        let [now, minute, day, refused, last, ban_until] = r[..] else {
            return Err(StoreError::Protocol(format!("usage returned {r:?}")));
        };
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(Usage {
            now: n(now),
            minute: n(minute),
            day: n(day),
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
}
