//! The global store's ledger of grants, for a fleet in several regions (issue 48): for each
//! quota and window instance (the minute 12:34 of a key, its day), the units the global store
//! has granted to each region, and never more in all than the limit in force. A region admits
//! a request only out of units it was granted, so the regions together never pass a limit
//! whatever the traffic does; this file is the global half, the region's own count of what it
//! holds and spends is the regional store's (`quota::regions`).
//!
//! What the ledger promises, and how:
//!
//! - **Never past the limit.** A grant is `min(wanted, limit - granted in all)`, decided in one
//!   script per quota (every instance's key carries the quota's hash tag, so one slot). A limit
//!   lowered by a plan edit grants nothing more once the total reaches it; what was granted
//!   before stays granted (the regions may spend it), as a lowered limit in one region keeps
//!   what was admitted.
//! - **Nothing granted twice, nothing lost as unspent.** A grant whose answer is lost (a
//!   timeout, a connection cut) stays counted: the region asks again with the same request id
//!   and, while no other grant of that region came between, gets the same answer, counted once;
//!   otherwise (another node of the region asked meanwhile), or when it never asks again, the
//!   lost units stay counted and unspent (under-admission, never over). Only a region's last
//!   grant is remembered, so an instance's hash keeps a few fields whatever its traffic.
//! - **Across a failover or restart of the global store.** A grant is used only once the
//!   replicas have acknowledged it (`WAIT`, sent after the script on the same connection, which
//!   the script's write precedes); one not acknowledged in time counts as granted and is never
//!   spent. `replicas` must count every replica Sentinel may promote. A restart of the primary
//!   must not forget an acknowledged grant either: the global store needs `appendfsync always`
//!   (the book's "Regions"). `WAIT` holds the connection it is sent on: the ledger's connection
//!   is its own, apart from the region's store.
//! - **Units given back.** A region whose traffic for a key stopped gives back what it holds and
//!   did not spend (having first taken it out of its own count, so it can no longer spend it):
//!   the ledger lowers its grant and the total by at most what it granted that region. A
//!   give-back is idempotent by its request id, however many came between: applied twice, it
//!   would let the ledger grant units a region may still spend.
//!
//! Keys: `<prefix>:grants:{<quota id>}:<window code>:<instance>`, a hash with the fields:
//! `t` (the total granted); `g:<region>` (granted to the region); `r:<region>` (the region's
//! last grant: its request id and units); `n:<region>` (the grant calls the region made that
//! named this instance first: summed over a quota's hashes, its calls, for the harness's
//! figures); `s` (a grant of the instance fell short: it is contested, and so is its successor;
//! see `GRANT`); `b:<region>:<id>` (what give-back `id` took; give-backs come once a key leaves
//! a region). Each expires [`KEEP_AFTER_END`] after its instance ends. Every node of every region
//! must use the same `key_prefix` (the environment's default): the ledger's keys are under it.
//!
//! The scripts run by `EVALSHA` (loaded on a server that lacks them), as the quota scripts do,
//! so the `gateway` ACL user needs no `EVAL`.

use std::sync::Arc;
use std::time::Duration;

use crate::base::redis::RedisAccess;
use crate::keys::limits::Every;
use crate::quota::store::{StoreConfigError, StoreError};

use super::link::Link;

/// How long an instance's grants are kept after it ends: longer than any clock skew between a
/// region's Redis and the global one, so a region never finds an instance's grants gone while
/// its own clock still counts in it.
pub const KEEP_AFTER_END: u64 = 3_600;

/// One window instance a region asks units of, or gives units back to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Instance {
    pub every: Every,
    /// Which instance of the window (`Every::index`).
    pub index: u64,
    /// When it ends, Unix seconds (`Every::start_of(index + 1)`).
    pub end: u64,
}

impl Instance {
    /// The instance of `every` that holds Unix second `now`.
    pub fn at(every: Every, now: u64) -> Instance {
        Instance::new(every, every.index(now))
    }

    /// Instance `index` of `every`.
    pub fn new(every: Every, index: u64) -> Instance {
        Instance {
            every,
            index,
            end: every.start_of(index + 1),
        }
    }
}

/// One instance a region asks units of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    pub at: Instance,
    /// The limit in force.
    pub limit: u64,
    /// The units wanted: what the region would spend over the ask's span, a quarter more, so
    /// that a key below its limit asks about once a horizon (`regions::sizing`).
    pub want: u64,
    /// The same without the quarter: what an instance the ledger found contested grants at
    /// most, where the quarter would be stranded in a region that does not spend it.
    pub need: u64,
}

/// What a grant gave: the units for each instance asked, in the order asked, and whether every
/// replica of the global store acknowledged it in time. Units not acknowledged must not be
/// spent: they stay counted as granted (see the module's doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub units: Vec<u64>,
    pub durable: bool,
}

/// The ledger, on the global store.
pub struct Ledger {
    link: Link,
    grant: redis::Script,
    give_back: redis::Script,
    prefix: Arc<str>,
    /// Replicas that must acknowledge a grant before it is spent (0: a global store without
    /// replicas, whose grants are durable once its AOF has them).
    replicas: u32,
    /// Until when (Unix milliseconds) grants are refused here without a call: the global store
    /// answered `NOREPLICAS` (each such call holds the connection for its `WAIT`).
    refused_until: std::sync::atomic::AtomicU64,
}

/// How long grants are refused here after a `NOREPLICAS`.
const NO_REPLICAS_FOR_MS: u64 = 1_000;

/// Grants units of each instance to a region.
///
/// - `KEYS[i]`, `i` from 1 to `n`: the instances' hashes, each of the quota's hash tag;
///   `KEYS[n+i]`: the hash of instance `i`'s predecessor (the minute before), read only.
/// - `ARGV[1]`: the region; `ARGV[2]`: the request id (a retry sends the same one; no spaces);
///   `ARGV[3]`: the replicas that must acknowledge it; then per instance `i`: `ARGV[4i]` its
///   limit in force, `ARGV[4i+1]` the units wanted, `ARGV[4i+2]` the units needed (wanted
///   without the quarter), `ARGV[4i+3]` when its hash expires (Unix seconds).
/// - An instance is contested once a grant of it or of its predecessor fell short of what was
///   wanted (the field `s`): the budget does not cover every region's asks, and a quarter more
///   than a region spends would be stranded there while another region is refused. A contested
///   instance grants at most what is needed. A key below its limit is never short, and keeps
///   the quarter that spares it a call. (A predecessor's hash is kept [`KEEP_AFTER_END`] past
///   its end: a day contested yesterday is contested today only in its first hour, unless
///   short again.)
/// - Returns the units granted per instance; an error `NOREPLICAS`, granting nothing, while
///   fewer replicas than required are online and heard from within the last second (after a
///   failover, until the old primary is back as a replica; a replica cut off or hung, which
///   Redis still lists as online until `repl-timeout`): each grant then could not be acknowledged, would count as granted and never
///   be spent, and a region asking for each request would burn a window's whole budget. The region's last request id, sent again, returns
///   what it was granted then and grants nothing again; its record is written again, so a
///   `WAIT` after the retry, on whatever connection, covers the first write too. An
///   instance whose hash would already have expired by the global store's clock (a region's
///   clock far ahead or behind) is granted nothing: its grants would be forgotten at once.
const GRANT: &str = r#"
local region, id, replicas = ARGV[1], ARGV[2], tonumber(ARGV[3])
if replicas > 0 then
  local online = 0
  for lag in string.gmatch(redis.call('INFO', 'replication'), 'state=online,offset=%d+,lag=(%d+)') do
    if tonumber(lag) <= 1 then online = online + 1 end
  end
  if online < replicas then
    return redis.error_reply('NOREPLICAS ' .. online .. ' of ' .. replicas .. ' replicas online: nothing granted')
  end
end
local g, r, n, mine = 'g:' .. region, 'r:' .. region, 'n:' .. region, ARGV[2] .. ' '
local now = tonumber(redis.call('TIME')[1])
local n_inst = #KEYS / 2
local out = {}
for i = 1, n_inst do
  local h = KEYS[i]
  local limit, want, need, exat = tonumber(ARGV[4 * i]), tonumber(ARGV[4 * i + 1]), tonumber(ARGV[4 * i + 2]), tonumber(ARGV[4 * i + 3])
  local last = redis.call('HGET', h, r)
  if last and string.sub(last, 1, #mine) == mine then
    redis.call('HSET', h, r, last)
    out[i] = tonumber(string.sub(last, #mine + 1))
  elseif exat <= now then
    out[i] = 0
  else
    if redis.call('HGET', h, 's') or redis.call('HGET', KEYS[n_inst + i], 's') then
      want = math.min(want, need)
    end
    local total = tonumber(redis.call('HGET', h, 't') or '0')
    local units = math.max(0, math.min(want, limit - total))
    if units > 0 then
      redis.call('HINCRBY', h, 't', units)
      redis.call('HINCRBY', h, g, units)
    end
    if units < want then redis.call('HSET', h, 's', 1) end
    redis.call('HSET', h, r, mine .. units)
    if i == 1 then redis.call('HINCRBY', h, n, 1) end
    redis.call('EXPIREAT', h, exat)
    out[i] = units
  end
end
return out
"#;

/// Gives back a region's unspent units of each instance.
///
/// - `KEYS[i]`: the instances' hashes.
/// - `ARGV[1]`: the region; `ARGV[2]`: the request id; then per instance `ARGV[2 + i]`: the
///   units given back.
/// - Returns the units taken back per instance: at most what the region was granted there. A
///   request id seen before returns what it took then and takes nothing again, whatever came
///   between (each give-back is remembered by its id, not only the last).
const GIVE_BACK: &str = r#"
local region, id = ARGV[1], ARGV[2]
local g, b = 'g:' .. region, 'b:' .. region .. ':' .. id
local out = {}
for i = 1, #KEYS do
  local h = KEYS[i]
  local last = redis.call('HGET', h, b)
  if last then
    out[i] = tonumber(last)
  else
    local held = tonumber(redis.call('HGET', h, g) or '0')
    local units = math.max(0, math.min(tonumber(ARGV[2 + i]), held))
    if units > 0 then
      redis.call('HINCRBY', h, g, -units)
      redis.call('HINCRBY', h, 't', -units)
    end
    if redis.call('EXISTS', h) == 1 then redis.call('HSET', h, b, units) end
    out[i] = units
  end
end
return out
"#;

impl Ledger {
    /// The ledger on the global store `access` says, under `prefix` (the environment's), each
    /// call bounded by `timeout`; `replicas` must acknowledge each grant before it is spent.
    pub fn new(
        access: RedisAccess,
        prefix: &str,
        timeout: Duration,
        replicas: u32,
    ) -> Result<Ledger, StoreConfigError> {
        Ok(Ledger {
            link: Link::new(access, timeout).map_err(|e| StoreConfigError(e.to_string()))?,
            grant: redis::Script::new(GRANT),
            give_back: redis::Script::new(GIVE_BACK),
            prefix: Arc::from(prefix),
            replicas,
            refused_until: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn key(&self, quota: &str, at: &Instance) -> String {
        format!(
            "{}:grants:{{{quota}}}:{}:{}",
            self.prefix,
            at.every.code(),
            at.index
        )
    }

    /// Asks units of each instance of `asks` for `region`, as request `id` (a retry after a
    /// lost answer sends the same id).
    pub async fn grant(
        &self,
        quota: &str,
        region: &str,
        id: &str,
        asks: &[Ask],
    ) -> Result<Grant, StoreError> {
        let mut call = redis::cmd("EVALSHA");
        call.arg(self.grant.get_hash()).arg(asks.len() * 2);
        for ask in asks {
            call.arg(self.key(quota, &ask.at));
        }
        for ask in asks {
            let before = Instance::new(ask.at.every, ask.at.index.saturating_sub(1));
            call.arg(self.key(quota, &before));
        }
        call.arg(region).arg(id).arg(self.replicas);
        for ask in asks {
            call.arg(ask.limit)
                .arg(ask.want)
                .arg(ask.need.min(ask.want))
                .arg(ask.at.end.saturating_add(KEEP_AFTER_END));
        }
        use std::sync::atomic::Ordering;
        let now_ms = crate::base::clock::unix_now_ms();
        if now_ms < self.refused_until.load(Ordering::Relaxed) {
            return Err(StoreError::Unavailable(
                "NOREPLICAS: the global store had too few replicas online a moment ago".into(),
            ));
        }
        let answer = self
            .link
            .eval_waited::<Vec<u64>>(&call, GRANT, self.replicas)
            .await;
        if matches!(&answer, Err(StoreError::Unavailable(e)) if e.contains("NOREPLICAS")) {
            let until = crate::base::clock::unix_now_ms() + NO_REPLICAS_FOR_MS;
            self.refused_until.store(until, Ordering::Relaxed);
        }
        let (units, acked) = answer?;
        Ok(Grant {
            units: check_len(units, asks.len())?,
            durable: acked >= self.replicas,
        })
    }

    /// Gives back `region`'s unspent units of each instance (the instance, the units), as
    /// request `id`; the units taken back per instance.
    pub async fn give_back(
        &self,
        quota: &str,
        region: &str,
        id: &str,
        units: &[(Instance, u64)],
    ) -> Result<Vec<u64>, StoreError> {
        let mut invocation = self.give_back.prepare_invoke();
        for (at, _) in units {
            invocation.key(self.key(quota, at));
        }
        invocation.arg(region).arg(id);
        for (_, n) in units {
            invocation.arg(n);
        }
        check_len(self.link.run(&invocation).await?, units.len())
    }

    /// What was granted of each instance `at`, in all and to `region`, in one round trip (for
    /// `GET /v1/rate_limit`).
    pub async fn totals(
        &self,
        quota: &str,
        region: &str,
        at: &[Instance],
    ) -> Result<Vec<(u64, u64)>, StoreError> {
        let mut pipe = redis::pipe();
        for i in at {
            pipe.cmd("HMGET")
                .arg(self.key(quota, i))
                .arg("t")
                .arg(format!("g:{region}"));
        }
        let read: Vec<(Option<u64>, Option<u64>)> = self.link.pipe(&pipe).await?;
        Ok(read
            .into_iter()
            .map(|(t, g)| (t.unwrap_or(0), g.unwrap_or(0)))
            .collect())
    }

    /// What each region was granted of one instance, and the total (for tests and the harness).
    pub async fn granted(
        &self,
        quota: &str,
        at: &Instance,
    ) -> Result<(u64, Vec<(String, u64)>), StoreError> {
        let fields: Vec<(String, String)> = self
            .link
            .query(redis::cmd("HGETALL").arg(self.key(quota, at)))
            .await?;
        let mut total = 0;
        let mut regions = Vec::new();
        for (field, value) in fields {
            let n = value.parse::<u64>().unwrap_or(0);
            if field == "t" {
                total = n;
            } else if let Some(region) = field.strip_prefix("g:") {
                regions.push((region.to_owned(), n));
            }
        }
        regions.sort();
        Ok((total, regions))
    }
}

/// A script's answer of one figure per instance asked (the ledger's, a region's `HOLD`).
pub(super) fn check_len(units: Vec<u64>, asked: usize) -> Result<Vec<u64>, StoreError> {
    if units.len() == asked {
        Ok(units)
    } else {
        Err(StoreError::Protocol(format!(
            "{} figures answered for {asked} instances",
            units.len()
        )))
    }
}
