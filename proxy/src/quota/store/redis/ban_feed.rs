//! Bans across regions (issue 48), on the global store: a ban started in one region's Redis
//! is published here, and every node of every region reads the feed a few times a second and
//! writes what is new into its own region's Redis (`RedisStore::import_ban`), so the ban holds
//! everywhere within a second while the global store answers. A ban lifted (`bans lift`) leaves
//! a lift in the feed, kept until the ban would have ended, and the nodes lift it in their
//! region; a ban that started before the lift is never published again over it (a node's retry
//! of a publish that failed, another region's ban of the same strikes).
//!
//! Keys: `<prefix>:region-bans`, a hash from quota id to `b <started> <until>` (a ban: when it
//! started and ends, Unix seconds, the latest end published) or `l <lifted> <until>` (a lift:
//! when, and until when it stands); `<prefix>:region-bans:version`, raised by every change, and
//! `<prefix>:region-bans:epoch`, set by the first change to a feed that has none. A node reads
//! the hash only when the pair changed: a global store that lost its data starts a new epoch,
//! read whole, and since a lift is a record, never an absence, a feed that lost its data lifts
//! nothing. Ended records are pruned by the next change.

use std::time::Duration;

use crate::base::redis::RedisAccess;
use crate::quota::store::{StoreConfigError, StoreError};

use super::link::Link;

/// The feed's Lua: its records' parsing (a malformed value reads as nothing), pruning and the
/// version's raise.
macro_rules! feed_lua {
    () => {
        r#"
local function parse(v)
  if not v then return nil end
  local kind, at, till = string.match(v, '^([bl]) (%d+) (%d+)$')
  if not kind then return nil end
  return kind, tonumber(at), tonumber(till)
end
local time = redis.call('TIME')
local now = tonumber(time[1])
local function changed()
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local _, _, till = parse(all[i + 1])
    if not till or till <= now then redis.call('HDEL', KEYS[1], all[i]) end
  end
  redis.call('SET', KEYS[3], time[1] .. time[2], 'NX')
  return redis.call('INCR', KEYS[2])
end
"#
    };
}

/// Publishes a ban.
///
/// - `KEYS[1]`: the feed's hash; `KEYS[2]`: its version; `KEYS[3]`: its epoch.
/// - `ARGV[1]`: the quota id; `ARGV[2]`: how long ago the ban started, `ARGV[3]` how long it
///   has to run (seconds, by the region's clock: the global store dates it by its own, so the
///   two clocks need not agree).
/// - Returns 1 when the feed changed, 0 when not: an end no later than the one published, a
///   ban ended, or one that started before a lift of the quota still standing.
const PUBLISH: &str = concat!(
    feed_lua!(),
    r#"
local quota = ARGV[1]
local started, till = now - tonumber(ARGV[2]), now + tonumber(ARGV[3])
local kind, at, was = parse(redis.call('HGET', KEYS[1], quota))
if till <= now or (kind == 'b' and till <= was) or (kind == 'l' and started <= at) then
  return 0
end
redis.call('HSET', KEYS[1], quota, 'b ' .. started .. ' ' .. till)
changed()
return 1
"#
);

/// Lifts a ban in every region: its record becomes a lift, standing until the ban's end (a day
/// when the feed had none: a publish of it may still be on its way).
///
/// - `KEYS`: as [`PUBLISH`]'s. `ARGV[1]`: the quota id.
/// - Returns 1.
const LIFT: &str = concat!(
    feed_lua!(),
    r#"
local quota = ARGV[1]
local kind, _, was = parse(redis.call('HGET', KEYS[1], quota))
local till = math.max(was or 0, now + 86400)
if kind == 'b' then till = math.max(was, now + 1) end
redis.call('HSET', KEYS[1], quota, 'l ' .. now .. ' ' .. till)
changed()
return 1
"#
);

/// The feed of bans, on the global store. Its connection is its own: the ledger's waits on
/// replicas (`WAIT`) and must not hold a feed read up.
pub struct BanFeed {
    link: Link,
    publish: redis::Script,
    lift: redis::Script,
    keys: [String; 3],
    /// Replicas that must acknowledge a change (the ledger's `global_store_replicas`): a lift
    /// lost in a failover would bring its ban back in every region.
    replicas: u32,
}

/// One record of the feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// A ban: when it started, when it ends.
    Ban { started: u64, until: u64 },
    /// A lift: when, and until when it stands (the lifted ban's end).
    Lift { lifted: u64, until: u64 },
}

impl Record {
    /// As the scripts' `parse`: a kind `b` or `l` and two counts, nothing else.
    fn parse(text: &str) -> Option<Record> {
        let mut parts = text.split(' ');
        let (kind, at, until) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || !at.bytes().chain(until.bytes()).all(|b| b.is_ascii_digit()) {
            return None;
        }
        let (at, until) = (at.parse().ok()?, until.parse().ok()?);
        match kind {
            "b" => Some(Record::Ban { started: at, until }),
            "l" => Some(Record::Lift { lifted: at, until }),
            _ => None,
        }
    }
}

/// Which state of the feed: its epoch (new when the global store lost its data) and version.
pub type FeedAt = (String, u64);

/// The feed as read: which state, and every record in it by quota id (malformed ones left
/// out, and counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedRead {
    pub at: FeedAt,
    pub records: Vec<(String, Record)>,
    pub malformed: usize,
}

impl BanFeed {
    /// The feed on the global store `access` says, under `prefix` (the environment's).
    pub fn new(
        access: RedisAccess,
        prefix: &str,
        timeout: Duration,
        replicas: u32,
    ) -> Result<BanFeed, StoreConfigError> {
        let hash = format!("{prefix}:region-bans");
        Ok(BanFeed {
            link: Link::new(access, timeout).map_err(|e| StoreConfigError(e.to_string()))?,
            publish: redis::Script::new(PUBLISH),
            lift: redis::Script::new(LIFT),
            keys: [format!("{hash}:version"), format!("{hash}:epoch"), hash],
            replicas,
        })
    }

    /// Runs `script` on the feed's keys with `args`, then (one round trip) waits for the
    /// replicas; a change they did not acknowledge in time is an error (it may be lost in a
    /// failover: the caller tries again).
    async fn change(
        &self,
        script: &redis::Script,
        source: &str,
        args: &[String],
    ) -> Result<i64, StoreError> {
        let mut call = redis::cmd("EVALSHA");
        call.arg(script.get_hash()).arg(3);
        call.arg(&self.keys[2])
            .arg(&self.keys[0])
            .arg(&self.keys[1]);
        call.arg(args);
        let (changed, acked) = self
            .link
            .eval_waited::<i64>(&call, source, self.replicas)
            .await?;
        if acked < self.replicas {
            return Err(StoreError::Unavailable(format!(
                "the ban feed's change was acknowledged by {acked} of {} replicas",
                self.replicas
            )));
        }
        Ok(changed)
    }

    /// Publishes that `quota`'s ban started at `started` and ends at `until`, both by the
    /// region's clock, whose time is `now`; whether the feed took it.
    pub async fn publish(
        &self,
        quota: &str,
        (started, until, now): (u64, u64, u64),
    ) -> Result<bool, StoreError> {
        let args = [
            quota.to_owned(),
            now.saturating_sub(started).to_string(),
            until.saturating_sub(now).to_string(),
        ];
        Ok(self.change(&self.publish, PUBLISH, &args).await? == 1)
    }

    /// Lifts `quota`'s ban in every region.
    pub async fn lift(&self, quota: &str) -> Result<(), StoreError> {
        self.change(&self.lift, LIFT, &[quota.to_owned()])
            .await
            .map(drop)
    }

    /// The feed, unless it is still at `known` (`None`: read it whole).
    pub async fn read_since(&self, known: Option<&FeedAt>) -> Result<Option<FeedRead>, StoreError> {
        let at = self.at().await?;
        if known == Some(&at) {
            return Ok(None);
        }
        let fields: Vec<(String, String)> = self
            .link
            .query(redis::cmd("HGETALL").arg(&self.keys[2]))
            .await?;
        let total = fields.len();
        let records: Vec<(String, Record)> = fields
            .into_iter()
            .filter_map(|(quota, text)| Record::parse(&text).map(|r| (quota, r)))
            .collect();
        Ok(Some(FeedRead {
            at,
            malformed: total - records.len(),
            records,
        }))
    }

    async fn at(&self) -> Result<FeedAt, StoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("GET")
            .arg(&self.keys[0])
            .cmd("GET")
            .arg(&self.keys[1]);
        let (version, epoch): (Option<Vec<u8>>, Option<Vec<u8>>) = self.link.pipe(&pipe).await?;
        let text =
            |v: Option<Vec<u8>>| String::from_utf8_lossy(&v.unwrap_or_default()).into_owned();
        // A version that does not parse reads as 0: the pair still moves with the epoch.
        Ok((text(epoch), text(version).parse().unwrap_or(0)))
    }
}
