//! Bans across regions (issue 48), on the global store: a ban started in one region's Redis
//! is published here, and every node of every region reads the feed a few times a second and
//! writes what is new into its own region's Redis (`RedisStore::import_ban`), so the ban holds
//! everywhere within a second while the global store answers. A ban lifted (`bans lift`) is
//! taken out of the feed first, and the nodes that had seen it lift it in their region.
//!
//! Keys: `<prefix>:region-bans`, a hash from quota id to the ban's end (Unix seconds; the
//! latest end published), and `<prefix>:region-bans:version`, raised by every change, so a
//! node's read of an unchanged feed is one `GET`. Ended bans are pruned by the next change.
//! A version that went back (the global store lost its data) is a new feed, never a lift.

use std::time::Duration;

use crate::base::redis::RedisAccess;
use crate::quota::store::{StoreConfigError, StoreError};

use super::link::Link;

/// Publishes a ban's end, or takes a ban out (end 0).
///
/// - `KEYS[1]`: the feed's hash; `KEYS[2]`: its version.
/// - `ARGV[1]`: the quota id; `ARGV[2]`: the ban's end, Unix seconds, or 0 to lift it.
/// - Returns the feed's version after the call (unchanged when nothing changed: an end no
///   later than the one published, a lift of a ban not in the feed).
const PUBLISH: &str = r#"
local quota, till = ARGV[1], tonumber(ARGV[2])
local now = tonumber(redis.call('TIME')[1])
if till > 0 then
  local was = tonumber(redis.call('HGET', KEYS[1], quota) or '0')
  if till <= was or till <= now then return tonumber(redis.call('GET', KEYS[2]) or '0') end
  redis.call('HSET', KEYS[1], quota, till)
elseif redis.call('HDEL', KEYS[1], quota) == 0 then
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if tonumber(all[i + 1]) <= now then redis.call('HDEL', KEYS[1], all[i]) end
end
return redis.call('INCR', KEYS[2])
"#;

/// The feed of bans, on the global store. Its connection is its own: the ledger's waits on
/// replicas (`WAIT`) and must not hold a feed read up.
pub struct BanFeed {
    link: Link,
    publish: redis::Script,
    hash: String,
    version: String,
}

/// The feed as read: its version and every ban in it (quota id, end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedRead {
    pub version: u64,
    pub bans: Vec<(String, u64)>,
}

impl BanFeed {
    /// The feed on the global store `access` says, under `prefix` (the environment's).
    pub fn new(
        access: RedisAccess,
        prefix: &str,
        timeout: Duration,
    ) -> Result<BanFeed, StoreConfigError> {
        Ok(BanFeed {
            link: Link::new(access, timeout).map_err(|e| StoreConfigError(e.to_string()))?,
            publish: redis::Script::new(PUBLISH),
            hash: format!("{prefix}:region-bans"),
            version: format!("{prefix}:region-bans:version"),
        })
    }

    /// Publishes that `quota`'s ban ends at `until` (0: lifted); the feed's version after.
    pub async fn publish(&self, quota: &str, until: u64) -> Result<u64, StoreError> {
        let mut invocation = self.publish.key(&self.hash);
        invocation.key(&self.version).arg(quota).arg(until);
        self.link.run(&invocation).await
    }

    /// The feed, unless its version is still `known`.
    pub async fn read_since(&self, known: u64) -> Result<Option<FeedRead>, StoreError> {
        let version: Option<u64> = self
            .link
            .query(redis::cmd("GET").arg(&self.version))
            .await?;
        let version = version.unwrap_or(0);
        if version == known {
            return Ok(None);
        }
        let mut pipe = redis::pipe();
        pipe.cmd("GET")
            .arg(&self.version)
            .cmd("HGETALL")
            .arg(&self.hash);
        let (version, fields): (Option<u64>, Vec<(String, u64)>) = self.link.pipe(&pipe).await?;
        Ok(Some(FeedRead {
            version: version.unwrap_or(0),
            bans: fields,
        }))
    }
}
