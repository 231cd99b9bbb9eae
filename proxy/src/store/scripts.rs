//! Every Lua script the Redis store runs, in one place, each with its KEYS and ARGV.
//!
//! All of one API key's state is one Redis hash, `<prefix>:quota:{<key id>}`: a single key
//! cannot span Redis Cluster slots, the braces make the key id its hash tag should more keys
//! join it, and the environment's prefix keeps production and staging apart on a shared Redis.
//!
//! Hash fields (all integers, Unix seconds for times):
//!
//! | field | meaning |
//! |---|---|
//! | `mw`, `mc` | minute window number (`now / 60`) and requests admitted in it |
//! | `dw`, `dc` | day window number (`now / 86400`) and requests admitted in it |
//! | `sw`, `sc` | minute window of the strikes and refused requests counted in it |
//! | `bu` | ban end; banned while `bu > now` |
//! | `lv`, `lu` | ban level (how many bans in a row) and when it decays back to 0 |
//! | `la` | when a request was last admitted |
//! | `rd`, `rc` | day window of the refusals, and requests refused in it (full window or a ban's start) |
//!
//! Beside them, one sorted set per environment, `<prefix>:bans`, indexes the active bans (member
//! the key id, score the ban's end), so listing them is one call. It is a key of its own slot,
//! so the store writes it in a call of its own when a ban starts or is lifted: a request never
//! runs a script across two slots.
//!
//! The clock is Redis `TIME`, read inside the script, so every gateway node agrees on windows.
//! The rules are those of `quota::KeyState::acquire`; the store behaviour suite runs the same
//! tests against this script and that function.

/// Decides one request.
///
/// - `KEYS[1]`: the key's hash, `<prefix>:quota:{<key id>}`.
/// - `ARGV[1]`: requests allowed per minute; `ARGV[2]`: per day.
/// - `ARGV[3]`: refused requests allowed in one minute before a ban.
/// - `ARGV[4]`: seconds after a ban's end before the ban level decays to 0.
/// - `ARGV[5..]`: ban lengths in seconds by level; the last one repeats.
///
/// Returns `{outcome, now, minute_count, day_count, ban_until}` with outcome 0 admitted,
/// 1 limited, 2 banned, 3 banned by this very request. The hash expires when nothing in it can matter any more: the end of the
/// day, or the ban level's decay if later.
pub const ACQUIRE: &str = r#"
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1])
local mw = math.floor(now / 60)
local dw = math.floor(now / 86400)
local f = redis.call('HMGET', key, 'mw', 'mc', 'dw', 'dc', 'sw', 'sc', 'bu', 'lv', 'lu', 'rd', 'rc')
-- Only a newer window starts from zero: one window behind the stored one (a failover to a
-- lagging clock) the stored window keeps counting (quota::ahead_by_one).
if tonumber(f[1]) == mw + 1 then mw = mw + 1 end
if tonumber(f[3]) == dw + 1 then dw = dw + 1 end
local mc = 0
if tonumber(f[1]) == mw then mc = tonumber(f[2]) or 0 end
local dc = 0
if tonumber(f[3]) == dw then dc = tonumber(f[4]) or 0 end
local bu = tonumber(f[7]) or 0
if bu > now then
  return {2, now, mc, dc, bu}
end
local lu = tonumber(f[9]) or 0
local day_end = (dw + 1) * 86400
if mc < tonumber(ARGV[1]) and dc < tonumber(ARGV[2]) then
  mc = mc + 1
  dc = dc + 1
  redis.call('HSET', key, 'mw', mw, 'mc', mc, 'dw', dw, 'dc', dc, 'la', now)
  redis.call('EXPIREAT', key, math.max(day_end, lu))
  return {0, now, mc, dc, 0}
end
local rc = 1
if tonumber(f[10]) == dw then rc = (tonumber(f[11]) or 0) + 1 end
local sc = 0
if tonumber(f[5]) == mw then sc = tonumber(f[6]) or 0 end
sc = sc + 1
local outcome = 1
local lv = tonumber(f[8]) or 0
if sc > tonumber(ARGV[3]) then
  if lu <= now then lv = 0 end
  local last = #ARGV
  local index = math.min(5 + lv, last)
  bu = now + tonumber(ARGV[index])
  lv = lv + 1
  lu = bu + tonumber(ARGV[4])
  sc = 0
  outcome = 3
else
  bu = 0
end
redis.call('HSET', key, 'mw', mw, 'mc', mc, 'dw', dw, 'dc', dc, 'sw', mw, 'sc', sc,
  'bu', bu, 'lv', lv, 'lu', lu, 'rd', dw, 'rc', rc)
redis.call('EXPIREAT', key, math.max(day_end, lu))
return {outcome, now, mc, dc, bu}
"#;

/// Ends a ban now and forgets the strikes; the ban level stays, so the next ban still escalates.
///
/// - `KEYS[1]`: the key's hash.
///
/// Returns 1 when a ban was active, 0 otherwise.
pub const LIFT_BAN: &str = r#"
local now = tonumber(redis.call('TIME')[1])
local bu = tonumber(redis.call('HGET', KEYS[1], 'bu')) or 0
if bu <= now then return 0 end
redis.call('HSET', KEYS[1], 'bu', 0, 'sc', 0)
return 1
"#;

/// Reads a key's ban.
///
/// - `KEYS[1]`: the key's hash.
///
/// Returns the ban's end (Unix seconds) when one is active, 0 otherwise.
pub const BAN_OF: &str = r#"
local now = tonumber(redis.call('TIME')[1])
local bu = tonumber(redis.call('HGET', KEYS[1], 'bu')) or 0
if bu <= now then return 0 end
return bu
"#;

/// Records a ban in the index (`ban_end` 0: removes it), drops ended ones, and expires the
/// index after the last ban in it ends. Listing is a plain read (`ZRANGEBYSCORE`), so it works
/// on a full Redis or a replica too.
///
/// - `KEYS[1]`: the ban index, `<prefix>:bans`.
/// - `ARGV[1]`: the key id; `ARGV[2]`: the ban's end, Unix seconds, or 0.
pub const INDEX_BAN: &str = r#"
local now = tonumber(redis.call('TIME')[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if tonumber(ARGV[2]) == 0 then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('EXPIREAT', KEYS[1], tonumber(last[2]) + 1)
return 1
"#;

/// The store probe: the same kind of work as [`ACQUIRE`] (`TIME`, a read and a write on a hash
/// with an expiry), on a key no request uses, so it fails wherever requests would.
///
/// - `KEYS[1]`: `<prefix>:probe`.
pub const PROBE: &str = r#"
local now = tonumber(redis.call('TIME')[1])
redis.call('HINCRBY', KEYS[1], 'n', 1)
redis.call('EXPIREAT', KEYS[1], now + 60)
return 1
"#;

/// Reads a key's counts in the current windows (the window rule of [`ACQUIRE`]).
///
/// - `KEYS[1]`: the key's hash.
///
/// Returns `{now, minute_count, day_count, refused_today, last_admitted}`.
pub const USAGE: &str = r#"
local now = tonumber(redis.call('TIME')[1])
local mw = math.floor(now / 60)
local dw = math.floor(now / 86400)
local f = redis.call('HMGET', KEYS[1], 'mw', 'mc', 'dw', 'dc', 'rd', 'rc', 'la')
if tonumber(f[1]) == mw + 1 then mw = mw + 1 end
if tonumber(f[3]) == dw + 1 then dw = dw + 1 end
local mc = 0
if tonumber(f[1]) == mw then mc = tonumber(f[2]) or 0 end
local dc = 0
if tonumber(f[3]) == dw then dc = tonumber(f[4]) or 0 end
local rc = 0
if tonumber(f[5]) == dw then rc = tonumber(f[6]) or 0 end
return {now, mc, dc, rc, tonumber(f[7]) or 0}
"#;

/// Zeroes a key's minute and day counts; windows, strikes and bans stay.
///
/// - `KEYS[1]`: the key's hash.
pub const RESET_USAGE: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'mc', 0, 'dc', 0)
end
return 1
"#;
