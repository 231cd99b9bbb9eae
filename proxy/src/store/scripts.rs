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
//! tests against this script (batched and one decision per call) and that function.

/// Decides a batch of requests (group commit: one script run for every decision queued while
/// the previous run was in flight; a batch of one at low load). Requests are decided in the
/// order given, so several of one key in a batch are counted exactly as if sent one by one.
/// Each key's hash is read once and written once per batch, and its expiry set only when the
/// day window or the ban decay moved it: that is what brings a hot key's cost per decision
/// down to a fraction of a script run.
///
/// - `KEYS[i]`: decision *i*'s hash, `<prefix>:quota:{<key id>}` (a key may repeat). On a
///   Redis Cluster every key of one batch is in one slot.
/// - `ARGV[1]`: refused requests allowed in one minute before a ban.
/// - `ARGV[2]`: seconds after a ban's end before the ban level decays to 0.
/// - `ARGV[3]`: *n*, how many ban lengths follow; `ARGV[4..3+n]`: ban lengths in seconds by
///   level, the last one repeating.
/// - `ARGV[3+n+2i-1]`, `ARGV[3+n+2i]`: decision *i*'s requests allowed per minute and per day.
///
/// Returns five integers per decision, `{outcome, now, minute_count, day_count, ban_until}`,
/// with outcome 0 admitted, 1 limited, 2 banned, 3 banned by this very request. The hash
/// expires when nothing in it can matter any more: the end of the day, or the ban level's decay
/// if later.
pub const ACQUIRE: &str = r#"
local now = tonumber(redis.call('TIME')[1])
local mw0 = math.floor(now / 60)
local dw0 = math.floor(now / 86400)
local strikes = tonumber(ARGV[1])
local decay = tonumber(ARGV[2])
local lengths = tonumber(ARGV[3])
local states, order, out = {}, {}, {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local s = states[key]
  if s == nil then
    local f = redis.call('HMGET', key, 'mw', 'mc', 'dw', 'dc', 'sw', 'sc', 'bu', 'lv', 'lu', 'rd', 'rc')
    local smw, sdw = tonumber(f[1]), tonumber(f[3])
    -- Only a newer window starts from zero: one window behind the stored one (a failover to a
    -- lagging clock) the stored window keeps counting (quota::ahead_by_one).
    local mw, dw = mw0, dw0
    if smw == mw + 1 then mw = mw + 1 end
    if sdw == dw + 1 then dw = dw + 1 end
    s = {mw = mw, mc = 0, dw = dw, dc = 0, sw = tonumber(f[5]), sc = tonumber(f[6]) or 0,
         bu = tonumber(f[7]) or 0, lv = tonumber(f[8]) or 0, lu = tonumber(f[9]) or 0,
         rd = tonumber(f[10]), rc = tonumber(f[11]) or 0, write = 0, expire = sdw ~= dw}
    if smw == mw then s.mc = tonumber(f[2]) or 0 end
    if sdw == dw then s.dc = tonumber(f[4]) or 0 end
    states[key] = s
    order[#order + 1] = key
  end
  local at = #out
  local limit = 3 + lengths + 2 * i
  if s.bu > now then
    out[at + 1] = 2
  elseif s.mc < tonumber(ARGV[limit - 1]) and s.dc < tonumber(ARGV[limit]) then
    s.mc = s.mc + 1
    s.dc = s.dc + 1
    s.la = now
    if s.write == 0 then s.write = 1 end
    out[at + 1] = 0
  else
    if s.rd == s.dw then s.rc = s.rc + 1 else s.rd = s.dw; s.rc = 1 end
    if s.sw == s.mw then s.sc = s.sc + 1 else s.sw = s.mw; s.sc = 1 end
    out[at + 1] = 1
    s.bu = 0
    if s.sc > strikes then
      if s.lu <= now then s.lv = 0 end
      s.bu = now + tonumber(ARGV[3 + math.min(s.lv + 1, lengths)])
      s.lv = s.lv + 1
      s.lu = s.bu + decay
      s.sc = 0
      s.expire = true
      out[at + 1] = 3
    end
    s.write = 2
  end
  out[at + 2] = now
  out[at + 3] = s.mc
  out[at + 4] = s.dc
  if s.bu > now then out[at + 5] = s.bu else out[at + 5] = 0 end
end
for _, key in ipairs(order) do
  local s = states[key]
  if s.write == 1 then
    redis.call('HSET', key, 'mw', s.mw, 'mc', s.mc, 'dw', s.dw, 'dc', s.dc, 'la', s.la)
  elseif s.write == 2 then
    redis.call('HSET', key, 'mw', s.mw, 'mc', s.mc, 'dw', s.dw, 'dc', s.dc, 'sw', s.sw,
      'sc', s.sc, 'bu', s.bu, 'lv', s.lv, 'lu', s.lu, 'rd', s.rd, 'rc', s.rc)
    if s.la then redis.call('HSET', key, 'la', s.la) end
  end
  if s.write > 0 and s.expire then
    redis.call('EXPIREAT', key, math.max((s.dw + 1) * 86400, s.lu))
  end
end
return out
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
