//! The shared store: one Lua script per request (one round trip), over a reconnecting
//! multiplexed connection, every call under a deadline.

use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::OnceCell;

use super::{scripts, Ban, QuotaStore, StoreError};
use crate::quota::{BanPolicy, Limits, Outcome, Verdict};

pub struct RedisStore {
    client: redis::Client,
    /// Created on first use, inside the runtime that serves requests, so the connection's
    /// driver task lives where its callers do.
    conn: OnceCell<ConnectionManager>,
    prefix: String,
    timeout: Duration,
    acquire: redis::Script,
    lift_ban: redis::Script,
    ban_of: redis::Script,
}

impl RedisStore {
    /// `prefix` namespaces every key (one per environment); `timeout` bounds every call.
    pub fn new(url: &str, prefix: &str, timeout: Duration) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url).map_err(|e| StoreError::Config(e.to_string()))?;
        Ok(RedisStore {
            client,
            conn: OnceCell::new(),
            prefix: prefix.to_owned(),
            timeout,
            acquire: redis::Script::new(scripts::ACQUIRE),
            lift_ban: redis::Script::new(scripts::LIFT_BAN),
            ban_of: redis::Script::new(scripts::BAN_OF),
        })
    }

    /// The Redis key holding all of `key_id`'s state.
    pub fn redis_key(&self, key_id: &str) -> String {
        format!("{}:quota:{{{}}}", self.prefix, key_id)
    }

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        self.conn
            .get_or_try_init(|| async {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(500));
                ConnectionManager::new_lazy_with_config(self.client.clone(), config)
                    .map_err(|e| StoreError::Unavailable(e.to_string()))
            })
            .await
            .cloned()
    }

    /// Runs `script` on `key_id`'s hash under the deadline.
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        script: &redis::Script,
        key_id: &str,
        args: &[u64],
    ) -> Result<T, StoreError> {
        let mut conn = self.conn().await?;
        let mut invocation = script.key(self.redis_key(key_id));
        for a in args {
            invocation.arg(*a);
        }
        match tokio::time::timeout(self.timeout, invocation.invoke_async(&mut conn)).await {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(Err(e)) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => {
                Err(StoreError::Unavailable(e.to_string()))
            }
            Ok(Err(e)) => Err(StoreError::Protocol(e.to_string())),
            Ok(Ok(v)) => Ok(v),
        }
    }
}

#[async_trait]
impl QuotaStore for RedisStore {
    async fn acquire(
        &self,
        key_id: &str,
        limits: Limits,
        ban: &BanPolicy,
    ) -> Result<Verdict, StoreError> {
        let mut args = vec![
            limits.per_minute,
            limits.per_day,
            ban.strikes,
            ban.decay_secs,
        ];
        args.extend(&ban.durations);
        if ban.durations.is_empty() {
            args.push(60);
        }
        let r: Vec<i64> = self.invoke(&self.acquire, key_id, &args).await?;
        let [outcome, now, minute_count, day_count, ban_until] = r[..] else {
            return Err(StoreError::Protocol(format!("acquire returned {r:?}")));
        };
        let outcome_of = match outcome {
            0 => Outcome::Admitted,
            1 => Outcome::Limited,
            2 | 3 => Outcome::Banned,
            other => return Err(StoreError::Protocol(format!("unknown outcome {other}"))),
        };
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
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
        Ok(lifted == 1)
    }

    async fn ban_of(&self, key_id: &str) -> Result<Option<Ban>, StoreError> {
        let until: i64 = self.invoke(&self.ban_of, key_id, &[]).await?;
        Ok((until > 0).then(|| Ban {
            key_id: key_id.to_owned(),
            until: u64::try_from(until).unwrap_or(0),
        }))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        let cmd = redis::cmd("PING");
        let ping = cmd.query_async::<String>(&mut conn);
        match tokio::time::timeout(self.timeout, ping).await {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(StoreError::Unavailable(e.to_string())),
            Ok(Ok(_)) => Ok(()),
        }
    }
}
