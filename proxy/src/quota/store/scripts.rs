//! Every Lua script the Redis store runs, in one place, each with its KEYS and ARGV.
//!
//! All of one API key's state is one Redis string, `<prefix>:state:{<key id>}`: a single key
//! cannot span Redis Cluster slots, the braces make the key id its hash tag should more keys
//! join it, and the environment's prefix keeps production and staging apart on a shared Redis.
//!
//! The string is twelve little-endian unsigned 32-bit integers (48 bytes, Lua's
//! `struct.pack('<IIIIIIIIIIII', ...)`), Unix seconds for times:
//!
//! | # | field | meaning |
//! |---|---|---|
//! | 1, 2 | `mw`, `mc` | minute window number (`now / 60`) and requests admitted in it |
//! | 3, 4 | `dw`, `dc` | day window number (`now / 86400`) and requests admitted in it |
//! | 5, 6 | `sw`, `sc` | minute window of the strikes and refused requests counted in it |
//! | 7 | `bu` | ban end; banned while `bu > now` |
//! | 8, 9 | `lv`, `lu` | ban level (how many bans in a row) and when it decays back to 0 |
//! | 10, 11 | `rd`, `rc` | day window of the refusals, and requests refused in it (full window or a ban's start) |
//! | 12 | `la` | when a request was last admitted |
//!
//! One string rather than a hash of fields, because a script's `redis.call` costs Redis about a
//! microsecond plus a little per argument: a `GET` and a `SET` of one value are what lets one
//! Redis core decide several hundred thousand requests a second (bench/RESULTS.md). Counts fit
//! 32 bits because plan and key limits are capped at 2^32 - 1 (`plans.rs`).
//!
//! Versions before this form kept the same fields in a hash, `<prefix>:quota:{<key id>}`. A key
//! with no string yet is read from that hash (a key not in KEYS, but under the same hash tag, so
//! in the same slot) and, once written in the new form, the hash is deleted: an upgrade keeps
//! every count and ban, and an old hash never comes back. Nodes still on the old version keep
//! writing the hash until they are upgraded, so upgrade all of an environment's nodes together
//! (deploy/README.md). The scripts need Redis 6.2 or later (`SET ... EXAT`) and its Lua
//! `struct` library; the probe runs the same commands, so an older Redis shows as failing.
//!
//! Beside them, one sorted set per environment, `<prefix>:bans`, indexes the active bans (member
//! the key id, score the ban's end), so listing them is one call. It is a key of its own slot,
//! so the store writes it in a call of its own when a ban starts or is lifted: a request never
//! runs a script across two slots.
//!
//! The clock is Redis `TIME`, read inside the script, so every gateway node agrees on windows.
//! The rules are those of `quota::KeyState::acquire`; the store behaviour suite runs the same
//! tests against this script (batched and one decision per call) and that function.

/// The state's reader and writer, the first lines of every script that touches a key's state.
///
/// `load(key)` returns the state as a table and where it came from (also its `from`): 2 the
/// packed string, 1 the hash of an older version, 0 nowhere (every field 0). `save(key, s, from)` writes it back,
/// keeping the string's expiry unless `s.expire` is set or the string is new, in which case it
/// expires when nothing in it can matter any more: the end of its day, or the ban level's
/// decay if later.
macro_rules! state_lua {
    () => {
        r#"
local FORMAT = '<IIIIIIIIIIII'
-- Built whole by one constructor: a table grown field by field is rehashed as it grows, which
-- cost more than the rest of a decision.
local function state(mw, mc, dw, dc, sw, sc, bu, lv, lu, rd, rc, la)
  return {mw = mw, mc = mc, dw = dw, dc = dc, sw = sw, sc = sc, bu = bu, lv = lv, lu = lu,
    rd = rd, rc = rc, la = la, from = 0, write = false, expire = false}
end
local function load(key)
  local v = redis.call('GET', key)
  if v then
    local s = state(struct.unpack(FORMAT, v))
    s.from = 2
    return s, 2
  end
  local old = string.gsub(key, ':state:{', ':quota:{', 1)
  local f = redis.call('HMGET', old, 'mw', 'mc', 'dw', 'dc', 'sw', 'sc', 'bu', 'lv', 'lu', 'rd', 'rc', 'la')
  local from = 0
  for i = 1, 12 do
    if f[i] then from = 1 end
    f[i] = tonumber(f[i]) or 0
  end
  local s = state(unpack(f))
  s.from = from
  return s, from
end
local function u32(x)
  if x < 0 then return 0 end
  if x > 4294967295 then return 4294967295 end
  return x
end
local function save(key, s, from)
  if from == 1 then
    -- Carried over: the old hash goes, so it cannot come back once this state expires.
    redis.call('DEL', (string.gsub(key, ':state:{', ':quota:{', 1)))
  end
  local v = struct.pack(FORMAT, u32(s.mw), u32(s.mc), u32(s.dw), u32(s.dc), u32(s.sw),
    u32(s.sc), u32(s.bu), u32(s.lv), u32(s.lu), u32(s.rd), u32(s.rc), u32(s.la))
  if s.expire or from ~= 2 then
    redis.call('SET', key, v, 'EXAT', u32(math.max((s.dw + 1) * 86400, s.lu)))
  else
    redis.call('SET', key, v, 'KEEPTTL')
  end
end
-- Only a newer window starts from zero: one window behind the stored one (a failover to a
-- lagging clock) the stored window keeps counting (quota::ahead_by_one).
local function windows(s, now)
  local mw = math.floor(now / 60)
  local dw = math.floor(now / 86400)
  if s.mw == mw + 1 then mw = mw + 1 end
  if s.dw == dw + 1 then dw = dw + 1 end
  if s.mw ~= mw then s.mw = mw; s.mc = 0 end
  if s.dw ~= dw then s.dw = dw; s.dc = 0; s.expire = true end
end
"#
    };
}

/// Decides a batch of requests (group commit: one script run for every decision queued while
/// the previous run was in flight; a batch of one at low load). Requests are decided in the
/// order given, so several of one key in a batch are counted exactly as if sent one by one.
/// Each key's state is read once and written once per batch, with one `GET` and one `SET`.
///
/// - `KEYS[i]`: decision *i*'s state, `<prefix>:state:{<key id>}` (a key may repeat). On a
///   Redis Cluster every key of one batch is in one slot.
/// - `ARGV[1]`: refused requests allowed in one minute before a ban.
/// - `ARGV[2]`: seconds after a ban's end before the ban level decays to 0.
/// - `ARGV[3]`: *n*, how many ban lengths follow; `ARGV[4..3+n]`: ban lengths in seconds by
///   level, the last one repeating.
/// - `ARGV[3+n+2i-1]`, `ARGV[3+n+2i]`: decision *i*'s requests allowed per minute and per day.
///
/// Returns five integers per decision, `{outcome, now, minute_count, day_count, ban_until}`,
/// with outcome 0 admitted, 1 limited, 2 banned, 3 banned by this very request.
pub const ACQUIRE: &str = concat!(
    state_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local strikes = tonumber(ARGV[1])
local decay = tonumber(ARGV[2])
local lengths = tonumber(ARGV[3])
local states, order, out = {}, {}, {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local s = states[key]
  if s == nil then
    s = load(key)
    windows(s, now)
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
    s.write = true
    out[at + 1] = 0
  else
    if s.rd == s.dw then s.rc = s.rc + 1 else s.rd = s.dw; s.rc = 1 end
    if s.sw == s.mw then s.sc = s.sc + 1 else s.sw = s.mw; s.sc = 1 end
    out[at + 1] = 1
    s.bu = 0
    if s.sc > strikes then
      if s.lu <= now then s.lv = 0 end
      s.bu = u32(now + tonumber(ARGV[3 + math.min(s.lv + 1, lengths)]))
      s.lv = s.lv + 1
      s.lu = u32(s.bu + decay)
      s.sc = 0
      s.expire = true
      out[at + 1] = 3
    end
    s.write = true
  end
  out[at + 2] = now
  out[at + 3] = s.mc
  out[at + 4] = s.dc
  if s.bu > now then out[at + 5] = s.bu else out[at + 5] = 0 end
end
for _, key in ipairs(order) do
  local s = states[key]
  if s.write then save(key, s, s.from) end
end
return out
"#
);

/// Ends a ban now and forgets the strikes; the ban level stays, so the next ban still escalates.
///
/// - `KEYS[1]`: the key's state.
///
/// Returns 1 when a ban was active, 0 otherwise.
pub const LIFT_BAN: &str = concat!(
    state_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local s, from = load(KEYS[1])
if s.bu <= now then return 0 end
s.bu = 0
s.sc = 0
save(KEYS[1], s, from)
return 1
"#
);

/// Reads a key's ban.
///
/// - `KEYS[1]`: the key's state.
///
/// Returns the ban's end (Unix seconds) when one is active, 0 otherwise.
pub const BAN_OF: &str = concat!(
    state_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local s = load(KEYS[1])
if s.bu <= now then return 0 end
return s.bu
"#
);

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

/// The store probe: the same kind of work as [`ACQUIRE`] (`TIME`, a `GET` and a `SET ... EXAT`
/// of packed state), on a key no request uses, so it fails wherever requests would, a Redis
/// too old for the scripts (before 6.2) included.
///
/// - `KEYS[1]`: `<prefix>:probe-state`.
pub const PROBE: &str = concat!(
    state_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local s, from = load(KEYS[1])
s.la = now
s.dw = math.floor(now / 86400)
s.expire = true
save(KEYS[1], s, from)
return 1
"#
);

/// Reads a key's counts in the current windows (the window rule of [`ACQUIRE`]).
///
/// - `KEYS[1]`: the key's state.
///
/// Returns `{now, minute_count, day_count, refused_today, last_admitted, ban_until}` (ban_until
/// 0 when not banned).
pub const USAGE: &str = concat!(
    state_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local s = load(KEYS[1])
windows(s, now)
local rc = 0
if s.rd == s.dw then rc = s.rc end
local bu = 0
if s.bu > now then bu = s.bu end
return {now, s.mc, s.dc, rc, s.la, bu}
"#
);

/// Zeroes a key's minute and day counts; windows, strikes and bans stay.
///
/// - `KEYS[1]`: the key's state.
pub const RESET_USAGE: &str = concat!(
    state_lua!(),
    r#"
local s, from = load(KEYS[1])
if from ~= 0 then
  s.mc = 0
  s.dc = 0
  save(KEYS[1], s, from)
end
return 1
"#
);
