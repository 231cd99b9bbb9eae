//! Every Lua script the Redis store runs, in one place, each with its KEYS and ARGV.
//!
//! All of one quota's state (an API key's, or the key it shares counts with) is one Redis
//! string, `<prefix>:windows:{<quota id>}`: a single key cannot span Redis Cluster slots, the
//! braces make the id its hash tag should more keys join it, and the environment's prefix keeps
//! production and staging apart on a shared Redis.
//!
//! The string is little-endian unsigned 32-bit integers (Lua's `struct`), Unix seconds for
//! times: nine fixed fields, then three per window the quota counts in (36 + 12 × n bytes):
//!
//! | # | field | meaning |
//! |---|---|---|
//! | 1, 2 | `sw`, `sc` | minute (`now / 60`) of the strikes, and refused requests counted in it |
//! | 3 | `bu` | ban end; banned while `bu > now` |
//! | 4, 5 | `lv`, `lu` | ban level (how many bans in a row) and when it decays back to 0 |
//! | 6, 7 | `rd`, `rc` | day (`now / 86400`) of the refusals, and requests refused in it (a full window or a ban's start) |
//! | 8 | `la` | when a request was last admitted |
//! | 9 | `ex` | when the string expires, as last set: a window that moves on sets it again only when it would end later (a `1s` window moves every second; the month rarely) |
//! | then, per window | `e`, `w`, `c` | the window's length (`keys::limits::Every::code`: seconds, 0 for the calendar month), which instance of it (`Every::index`), and the units counted there |
//!
//! Windows are kept by length, not by position, so a plan edit that adds or drops a window leaves
//! every other window's count where it was; keys of several plans sharing one quota (a
//! customer's) keep each length their plans name, up to six (beyond that a window that has ended
//! gives its place, else the last one). Every field fits 32 bits because limits are capped at
//! 2^32 - 1 (`keys::limits`) and windows and seconds fit until 2106.
//!
//! One string rather than a hash of fields, because a script's `redis.call` costs Redis about a
//! microsecond plus a little per argument: a `GET` and a `SET` of one value are what lets one
//! Redis core decide several hundred thousand requests a second (bench/RESULTS.md).
//!
//! The version before this one kept twelve fields (minute and day only) in
//! `<prefix>:state:{<id>}`, 48 bytes. A quota with no `windows` string yet is read from that
//! string, its minute and day counts carried over into the `1m` and `1d` windows, and once
//! written in the new form the old string is deleted: an upgrade keeps every count and ban.
//! Nodes still on the old version keep writing the old string until they are upgraded, so
//! upgrade all of an environment's nodes together (deploy/README.md, "Upgrading to 0.2.0: the
//! packed quota state"). The scripts themselves need Redis 6.2 or later (`SET ... EXAT`) and its
//! Lua `struct` library, the shipped config 7.0 (the book, "Redis"); the probe runs the same
//! commands, so an older Redis shows as failing.
//!
//! A quota with a concurrency (a plan's `concurrency`, a key's own) keeps its requests in flight
//! beside its state, in `<prefix>:leases:{<quota id>}` (same hash tag, so same slot): pairs of
//! little-endian unsigned 32-bit integers, `(end, count)`, how many of its requests hold a
//! lease ending at that second (Redis `TIME`). An admitted request takes a lease ending a lease
//! length from now and gives it back (`release`) when it ends; a request that outlives it renews
//! it; a lease nobody gives back (a node killed, a release lost) ends by itself, so a place is
//! never held for good. Leases of one second are alike, so the pairs number at most the lease
//! length's seconds whatever the concurrency, and the string expires with its last lease. A
//! string of its own rather than fields in the state: the state's form is unchanged (a node of
//! the version before reads it as it always has, and quotas without a concurrency cost Redis
//! nothing more), and only quotas with a concurrency pay a `GET` and a `SET` more per batch.
//!
//! Beside them, one sorted set per environment, `<prefix>:bans`, indexes the active bans (member
//! the key id, score the ban's end), so listing them is one call. It is a key of its own slot,
//! so the store writes it in a call of its own when a ban starts or is lifted: a request never
//! runs a script across two slots.
//!
//! The top consumers' index (`GET /usage/top`) is one sorted set per period,
//! `{<prefix>:top:day:<index>}` and `{<prefix>:top:month:<index>}`, written by plain pipelined
//! commands once a second per node, no script and no request (`redis/top.rs`).
//!
//! The clock is Redis `TIME`, read inside the script, so every gateway node agrees on windows.
//! The rules are those of `quota::rules::KeyState::acquire`; the store behaviour suite runs the
//! same tests against this script (batched and one decision per call) and that function.

/// The state's reader and writer and the window arithmetic, the first lines of every script
/// that touches a quota's state.
///
/// `load(key)` returns the state as a table and where it came from (also its `from`): 2 the
/// `windows` string, 1 the older 48-byte string, 0 nowhere (every field 0, no windows).
/// `save(key, s)` writes it back, keeping the string's expiry unless its `EXPIRE` flag is set or the
/// string is new, in which case it expires when nothing in it can matter any more: the end of
/// its last window, or the ban level's decay if later.
macro_rules! state_lua {
    () => {
        r#"
-- A state is one flat array, built whole by one constructor (a table grown field by field is
-- rehashed as it grows, which costs more than the rest of a decision): at 1..4 its number of
-- windows, where it came from (`load`), whether to write it and whether to work its expiry out
-- again; at 5..13 the nine fixed fields (SW .. EX); then per window j its length, instance and
-- count at 11 + 3j, 12 + 3j and 13 + 3j.
local N, FROM, WRITE, EXPIRE = 1, 2, 3, 4
local SW, SC, BU, LV, LU, RD, RC, LA, EX = 5, 6, 7, 8, 9, 10, 11, 12, 13
local MAX = 4294967295
-- Written out, not built: a script's top level runs on every call.
local FORMATS = {[0] = '<IIIIIIIII', '<IIIIIIIIIIII', '<IIIIIIIIIIIIIII', '<IIIIIIIIIIIIIIIIII',
  '<IIIIIIIIIIIIIIIIIIIII', '<IIIIIIIIIIIIIIIIIIIIIIII', '<IIIIIIIIIIIIIIIIIIIIIIIIIII'}
-- A GET that reads a key of another type (a stray write, an old tool) as no state, logged, rather
-- than fail the script: in a batch that would fail every other quota's decision with it. The
-- state's `SET` then replaces it. Any other error (an ACL refusal, say) is raised as before.
local function get_string(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v.err then
    if string.sub(v.err, 1, 9) ~= 'WRONGTYPE' then error(v) end
    redis.log(redis.LOG_WARNING, 'pet-gateway: quota state ' .. key .. ' is not a string (' ..
      v.err .. '); it starts again')
    return nil
  end
  return v
end
local function load(key)
  local v = get_string(key)
  if v then
    local n = (#v - 36) / 12
    if FORMATS[n] then
      return {n, 2, false, false, struct.unpack(FORMATS[n], v)}
    end
    redis.log(redis.LOG_WARNING, 'pet-gateway: quota state ' .. key .. ' is unreadable (' ..
      #v .. ' bytes); it starts again')
  end
  local old = get_string((string.gsub(key, ':windows:{', ':state:{', 1)))
  if old and #old == 48 then
    local mw, mc, dw, dc, sw, sc, bu, lv, lu, rd, rc, la = struct.unpack('<IIIIIIIIIIII', old)
    return {2, 1, false, false, sw, sc, bu, lv, lu, rd, rc, la, 0, 60, mw, mc, 86400, dw, dc,
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
  end
  -- Room for six windows from the start.
  return {0, 0, false, false, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0}
end
local function u32(x)
  if x < 0 then return 0 end
  if x > MAX then return MAX end
  return x
end
-- keys::limits: the month holding `now` (months since January 1970), and the first second of
-- month `index` (Howard Hinnant's civil date algorithms).
local function month_of(now)
  local z = math.floor(now / 86400) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return (y - 1970) * 12 + m - 1
end
local function month_start(index)
  local y = math.floor(index / 12) + 1970
  local m = index % 12 + 1
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local doy = math.floor((153 * ((m + 9) % 12) + 2) / 5)
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return (era * 146097 + doe - 719468) * 86400
end
-- The instance of length `e` holding `now`, and the first second after instance `w`.
local function index_of(e, now)
  if e == 0 then return month_of(now) end
  return math.floor(now / e)
end
local function end_of(e, w)
  if e == 0 then return month_start(w + 1) end
  return (w + 1) * e
end
local function save(key, s)
  if s[FROM] == 1 then
    -- Carried over: the old string goes, so it cannot come back once this state expires.
    redis.call('DEL', (string.gsub(key, ':windows:{', ':state:{', 1)))
  end
  local n = s[N]
  local exat = s[FROM] ~= 2 or s[EXPIRE]
  if exat then
    -- Refusals and strikes are counted by the day: kept to its end even with no window.
    local at = math.max(s[LU], (s[RD] + 1) * 86400)
    for j = 1, n do at = math.max(at, end_of(s[11 + 3 * j], s[12 + 3 * j])) end
    s[EX] = u32(at)
  end
  local v = struct.pack(FORMATS[n], unpack(s, SW, EX + 3 * n))
  if exat then
    redis.call('SET', key, v, 'EXAT', math.max(s[EX], 1))
  else
    redis.call('SET', key, v, 'KEEPTTL')
  end
end
-- A window's instance moved to `w`: the state must live past its end.
local function outlive(s, e, w)
  if not s[EXPIRE] and end_of(e, w) > s[EX] then s[EXPIRE] = true end
end
-- The slot of length `e`, or nil.
local function slot_of(s, e)
  for j = 1, s[N] do
    if s[11 + 3 * j] == e then return j end
  end
  return nil
end
-- Whether length `e` is one of flat set `set`'s (see ACQUIRE).
local function in_set(set, e)
  for k = 1, set[1] do
    if set[3 * k - 1] == e then return true end
  end
  return false
end
-- quota::rules::KeyState::put: slot `j` when it still holds length `e`, else its own, else a
-- new one, else the slot of a length the set lacks, one whose window has ended first (there is
-- always one: the set has at most six lengths and `e` has no slot). The expiry is worked out
-- again when a window starts.
local function put(s, j, e, w, c, now, set)
  if j == nil or s[11 + 3 * j] ~= e then j = slot_of(s, e) end
  if j == nil then
    if s[N] < 6 then
      s[N] = s[N] + 1
      j = s[N]
    else
      j = 6
      local foreign = nil
      for k = 1, 6 do
        local ek = s[11 + 3 * k]
        if not in_set(set, ek) then
          if s[12 + 3 * k] < index_of(ek, now) then foreign = k; break end
          foreign = foreign or k
        end
      end
      j = foreign or j
    end
    s[11 + 3 * j] = e
    s[12 + 3 * j] = -1
  end
  if s[12 + 3 * j] ~= w then outlive(s, e, w) end
  s[12 + 3 * j] = w
  if c > MAX then c = MAX end
  s[13 + 3 * j] = c
end
-- quota::rules::KeyState::current: the instance of length `e` to count in (the stored one when
-- it is exactly one ahead of `cur`: a clock that stepped back), its count and its slot.
local function current(s, e, cur)
  local j = slot_of(s, e)
  if j == nil then return cur, 0, nil end
  local w = s[12 + 3 * j]
  if w == cur + 1 then return w, s[13 + 3 * j], j end
  if w == cur then return cur, s[13 + 3 * j], j end
  return cur, 0, j
end
"#
    };
}

/// A quota's leases (`<prefix>:leases:{<quota id>}`, see the module's header), read and written
/// by the scripts that take, give back, renew or count them.
///
/// `load_leases(key, now)` reads the leases of the quota whose state is `key`, without those
/// ended at `now` or ending more than `MAX_LEASE_SECS` (600) and a minute after it (a clock that
/// went back; the minute spares a replica's clock a little behind its primary's after a
/// failover),
/// as a table: `key` the leases' own key, `ends` and `counts` its pairs,
/// `total` the requests in flight, `dirty` whether it must be written. `take(l, end)` adds one
/// lease ending at `end` and returns `end`; `give_back(l, end)` removes one ending at `end`, if
/// any; `save_leases(l)` writes them back if changed, expiring with the last one (or deletes
/// them when none is left).
macro_rules! leases_lua {
    () => {
        r#"
local function load_leases(key, now)
  local lk = (string.gsub(key, ':windows:{', ':leases:{', 1))
  local l = {key = lk, ends = {}, counts = {}, total = 0, dirty = false}
  local v = get_string(lk)
  -- A missing key reads as false in a script.
  if not v then return l end
  local n = #v / 8
  -- At most one pair per second of the longest lease; a longer string was not written by a
  -- gateway (and unpacking it whole would overflow Lua's stack).
  if n ~= math.floor(n) or n > 1024 then
    redis.log(redis.LOG_WARNING, 'pet-gateway: leases ' .. lk .. ' are unreadable (' .. #v ..
      ' bytes); they start again')
    l.dirty = true
    return l
  end
  local f = {struct.unpack('<' .. string.rep('II', n), v)}
  for j = 1, n do
    local e, c = f[2 * j - 1], f[2 * j]
    if e > now and e <= now + 660 and c > 0 then
      local k = #l.ends + 1
      l.ends[k], l.counts[k] = e, c
      l.total = l.total + c
    else
      l.dirty = true
    end
  end
  return l
end
local function take(l, e)
  local ends, counts = l.ends, l.counts
  local j = #ends
  while j > 0 and ends[j] ~= e do j = j - 1 end
  if j == 0 then
    j = #ends + 1
    ends[j], counts[j] = e, 0
  end
  counts[j] = counts[j] + 1
  l.total = l.total + 1
  l.dirty = true
  return e
end
local function give_back(l, e)
  local ends, counts = l.ends, l.counts
  for j = #ends, 1, -1 do
    if ends[j] == e and counts[j] > 0 then
      counts[j] = counts[j] - 1
      l.total = l.total - 1
      l.dirty = true
      return
    end
  end
end
local function save_leases(l)
  if not l.dirty then return end
  local packed, last = {}, 0
  for j = 1, #l.ends do
    if l.counts[j] > 0 then
      packed[#packed + 1] = struct.pack('<II', l.ends[j], l.counts[j])
      if l.ends[j] > last then last = l.ends[j] end
    end
  end
  if #packed == 0 then
    redis.call('DEL', l.key)
  else
    redis.call('SET', l.key, table.concat(packed), 'EXAT', last)
  end
end
"#
    };
}

/// A region's units held (issue 48; `quota::regions`): what the global store granted this
/// region of each window instance of a quota, in `<prefix>:held:{<quota id>}` (the state's hash
/// tag): the identity of the Redis server that wrote it (its run id and replication id, `INFO`:
/// 80 characters), then per
/// instance four little-endian unsigned 32-bit integers, `(e, w, held, final_until)`: the
/// window's length code, its instance, the units held, and until when (Unix seconds) the global
/// store was found to have none left to grant (a refusal then counts a strike, as a full window's
/// does). A region admits only while every enforced window's count stays within what it holds.
///
/// Written under another identity, the units are forfeited: a Redis restarted (a new run id; its
/// AOF may lack its last writes) or a replica promoted (a new replication id; it may lack the
/// primary's last writes, and a primary demoted then promoted again keeps its run id but not its
/// replication id) could have lost counts of units already spent, and spending its held units
/// again would pass the limit. A forfeited or missing instance holds what it has counted, so nothing
/// more can be spent until the global store grants more (`HOLD`).
///
/// `boot_id()` is that identity: the run id read once a server's life when `ACQUIRE` runs as a
/// function (the library's locals live as long as the server's copy of the library), the
/// replication id once a run (`read_boot()`). `load_held(key)` reads the record of the state `key` as a table
/// (`e`, `w`, `n`, `f`: the four fields by position; `forfeit`: written under another run id);
/// `held_index(r, e, w)` finds an instance; `save_held(r, now)` writes the record back without
/// the instances ended by `now`, expiring with the last; `short_of(s, set, cost, now, r)` says whether a
/// decision fits what is held: 0 it does, 1 short, 2 short where the global store has none left;
/// `held_out` appends each window's units held to the answer.
macro_rules! regional_lua {
    () => {
        r#"
local run_id, boot = nil, nil
local function read_boot()
  if run_id == nil then
    run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
  end
  local replid = string.match(redis.call('INFO', 'replication'), 'master_replid:(%x+)') or ''
  boot = run_id .. replid
end
local function boot_id()
  if boot == nil then read_boot() end
  return boot
end
local function load_held(key)
  local r = {key = (string.gsub(key, ':windows:{', ':held:{', 1)), e = {}, w = {}, n = {},
    f = {}, forfeit = false}
  local v = get_string(r.key)
  if not v then return r end
  local b = boot_id()
  local n = (#v - #b) / 16
  if n < 0 or n ~= math.floor(n) or n > 64 or string.sub(v, 1, #b) ~= b then
    r.forfeit = true
    return r
  end
  local f = {struct.unpack('<' .. string.rep('IIII', n), v, #b + 1)}
  for j = 1, n do
    r.e[j], r.w[j], r.n[j], r.f[j] = f[4 * j - 3], f[4 * j - 2], f[4 * j - 1], f[4 * j]
  end
  return r
end
local function held_index(r, e, w)
  for j = 1, #r.e do
    if r.e[j] == e and r.w[j] == w then return j end
  end
  return nil
end
local function short_of(s, set, cost, now, r)
  local short = 0
  for k = 1, set[1] do
    if set[3 * k + 1] ~= math.huge then
      local e = set[3 * k - 1]
      local w, c = current(s, e, set[3 * k])
      local j = held_index(r, e, w)
      local held = 0
      if j then held = r.n[j] end
      if c + cost > held then
        if j and r.f[j] > now then return 2 end
        short = 1
      end
    end
  end
  return short
end
local function save_held(r, now)
  local packed, last = {}, 0
  for j = 1, #r.e do
    local ends = end_of(r.e[j], r.w[j])
    if ends > now then
      packed[#packed + 1] = struct.pack('<IIII', r.e[j], r.w[j], r.n[j], r.f[j])
      if ends > last then last = ends end
    end
  end
  if #packed == 0 then
    redis.call('DEL', r.key)
  else
    redis.call('SET', r.key, boot_id() .. table.concat(packed), 'EXAT', last)
  end
end
local function held_out(s, set, now, r, out, at)
  for k = 1, set[1] do
    local e = set[3 * k - 1]
    local w = current(s, e, set[3 * k])
    local j = held_index(r, e, w)
    out[at + k] = j and r.n[j] or 0
  end
end
"#
    };
}

/// [`ACQUIRE`]'s library part (see [`ACQUIRE_LIBRARY`]).
macro_rules! acquire_library_lua {
    () => {
        concat!(
            state_lua!(),
            leases_lua!(),
            regional_lua!(),
            r#"
-- The head (`ARGV[1]`) read: `head` its numbers, `sets` each set of limits flat: its number of
-- windows m, then per window k at 3k - 1, 3k and 3k + 1 its length, its instance at `now` and
-- the most it may hold before a request (a shadow window's is unbounded: it never refuses),
-- then at 3m + 2 its concurrency (0: none), and at 21 its answer's width (`parse_head`).
--
-- Kept by the head's bytes: loaded as a Redis Function, this library's locals outlive a call,
-- and a fleet sends few distinct heads (one per ban policy and mix of plans in a run), so a
-- run mostly finds its head read already; a script run by EVALSHA starts with none each time.
-- The table is a memo of a pure function of the bytes (and of `now` for the instances, worked
-- out again when the clock moves), so what it holds never changes a decision; at most 64 are
-- kept (then it starts again), so an odd mix of plans cannot make it grow.
local heads, nheads = {}, 0
local function parse_head(H)
  -- In one call when it is short (as it nearly always is: a dozen numbers); a call returns at
  -- most some 8,000 values (Lua's stack), and many sets of limits or a long ban ladder are
  -- longer.
  local head
  local nh = #H / 8
  if nh <= 256 then
    head = {struct.unpack('<' .. string.rep('i8', nh), H)}
  else
    head = {}
    local full = '<' .. string.rep('i8', 256)
    for first = 1, nh, 256 do
      local take = math.min(256, nh - first + 1)
      local chunk = {struct.unpack(take == 256 and full or '<' .. string.rep('i8', take), H,
        8 * (first - 1) + 1)}
      for k = 1, take do head[first + k - 1] = chunk[k] end
    end
  end
  local p = 5 + head[3]
  local sets = {}
  for i = 1, head[p] do
    p = p + 1
    local m = head[p]
    -- Whole from the start, room for six windows: a table grown an element at a time is
    -- reallocated as it grows, which cost more than reading the set.
    local set = {m, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
    for k = 1, m do
      local limit = head[p + 2 * k]
      set[3 * k - 1] = head[p + 2 * k - 1]
      if limit < 0 then set[3 * k + 1] = math.huge else set[3 * k + 1] = limit end
    end
    set[3 * m + 2] = head[p + 2 * m + 1]
    sets[i] = set
    p = p + 1 + 2 * m
  end
  -- After the sets, 1 for a region's decisions (`regional_lua`); nothing (nil) otherwise. Each
  -- set's answer's width (before a lease's two numbers) at 21: a region's carries the units
  -- held after the counts.
  local regional = head[p + 1] == 1
  for i = 1, #sets do
    local set = sets[i]
    set[21] = 1 + set[1] * (regional and 2 or 1)
  end
  return {head = head, sets = sets, now = -1, regional = regional}
end
local function read_head(H, now)
  local h = heads[H]
  if h == nil then
    h = parse_head(H)
    if nheads >= 64 then heads, nheads = {}, 0 end
    heads[H], nheads = h, nheads + 1
  end
  if h.now ~= now then
    local sets = h.sets
    for i = 1, #sets do
      local set = sets[i]
      for k = 1, set[1] do set[3 * k] = index_of(set[3 * k - 1], now) end
    end
    h.now = now
  end
  return h
end
"#
        )
    };
}

/// [`ACQUIRE`]'s run (see [`ACQUIRE_RUN`]).
macro_rules! acquire_run_lua {
    () => {
        r#"
local now = tonumber(redis.call('TIME')[1])
local H, E = ARGV[1], ARGV[2]
if #H % 8 ~= 0 or #E % 24 ~= 0 then
  return redis.error_reply('pet-gateway: ACQUIRE wants packed arguments (a node of another version?)')
end
local h = read_head(H, now)
-- Looked up once a run, not once an entry (a global's lookup is a table's).
local unpack_numbers = struct.unpack
local head, sets = h.head, h.sets
local strikes, decay, lengths = head[1], head[2], head[3]
local lease_secs = head[4 + lengths]
-- A region's decisions (issue 48): each quota's units held (`load_held`), read once a run.
-- `short`: the last decision's finding (`short_of`).
local regional, helds, short = h.regional, nil, 0
-- The server's identity is read again each run of a region's decisions: a promotion changes it
-- without reloading the library.
if regional then read_boot() end
-- The leases of the quotas this batch touches, each read once: `of(key)` (see `leases_lua`).
-- Made when a run first needs them, as are `WS` and `JS` below: most runs need neither.
local held, held_order = nil, nil
local function leases_of(key)
  if held == nil then held, held_order = {}, {} end
  local l = held[key]
  if l == nil then
    l = load_leases(key, now)
    held[key] = l
    held_order[#held_order + 1] = key
  end
  return l
end
local states, order, out = {}, {}, {now}
-- One decision's instances and slots, reused from decision to decision; its counts go straight
-- into the answer.
local WS, JS = nil, nil
local minute, day = math.floor(now / 60), math.floor(now / 86400)
-- The answer's length so far (`#out` is a search on every call).
local at = 1
local pos = 1
local last_s, last_set, last_exact = nil, nil, false
for _ = 1, #E / 24 do
  local ki, which, cost
  ki, which, cost, pos = unpack_numbers('<i8i8i8', E, pos)
  local key = KEYS[ki]
  if which < -1 then
    local l = leases_of(key)
    for _ = 1, -1 - which do give_back(l, cost) end
  elseif which < 0 then
    local l = leases_of(key)
    give_back(l, cost)
    out[at + 1], out[at + 2] = take(l, now + lease_secs), l.total
    at = at + 2
  else
  local s = states[key]
  if s == nil then
    s = load(key)
    states[key] = s
    order[#order + 1] = key
  end
  local set = sets[which]
  local m = set[1]
  local most = set[3 * m + 2]
  local l = nil
  if most > 0 then l = leases_of(key) end
  local fits, outcome = true, 0
  local n = s[N]
  local matched = 0
  -- The usual case, and the fast path: the state holds exactly these lengths, in this order
  -- (it was written under these limits), so window k is slot k. A decision of the same quota
  -- under the same limits as the one before takes that one's finding: only the slow path
  -- below changes a state's lengths, and it is taken only where the finding was false (and
  -- handles any state).
  local exact = last_exact
  if s ~= last_s or set ~= last_set then
    exact = n == m
    if exact then
      for k = 1, m do
        if s[11 + 3 * k] ~= set[3 * k - 1] then exact = false; break end
      end
    end
    last_s, last_set, last_exact = s, set, exact
  end
  if exact then
    for k = 1, m do
      local cur, stored = set[3 * k], s[12 + 3 * k]
      local c = 0
      if stored == cur or stored == cur + 1 then c = s[13 + 3 * k] end
      out[at + 1 + k] = c
      if c + cost > set[3 * k + 1] then fits = false end
    end
  end
  -- current(), inline, for any other state.
  if not exact and WS == nil then WS, JS = {}, {} end
  for k = 1, exact and 0 or m do
    local e, cur = set[3 * k - 1], set[3 * k]
    local w, c, j = cur, 0, nil
    -- A state written under these limits keeps their order: window k is usually slot k.
    if k <= n and s[11 + 3 * k] == e then
      j = k
    else
      for q = 1, n do
        if s[11 + 3 * q] == e then j = q; break end
      end
    end
    if j ~= nil then
      matched = matched + 1
      local stored = s[12 + 3 * j]
      if stored == cur + 1 then w = stored end
      if stored == w then c = s[13 + 3 * j] end
    end
    WS[k], JS[k] = w, j
    out[at + 1 + k] = c
    if c + cost > set[3 * k + 1] then fits = false end
  end
  -- A region's decision: the units held go after the counts, and a decision short of them is
  -- refused below (one test a decision elsewhere).
  if regional then
    if helds == nil then helds = {} end
    local r = helds[key]
    if r == nil then
      r = load_held(key)
      helds[key] = r
    end
    held_out(s, set, now, r, out, at + 1 + m)
    short = 0
    if fits and s[BU] <= now then short = short_of(s, set, cost, now, r) end
    if short > 0 then fits = false end
  end
  if s[BU] > now then
    outcome = 2
  elseif fits and l ~= nil and l.total >= most then
    -- Every window has room, but the concurrency is in flight: nothing counted, no strike.
    outcome = 4
  elseif fits and exact then
    for k = 1, m do
      local cur, stored = set[3 * k], s[12 + 3 * k]
      local c = out[at + 1 + k] + cost
      out[at + 1 + k] = c
      if stored ~= cur and stored ~= cur + 1 then
        outlive(s, set[3 * k - 1], cur)
        s[12 + 3 * k] = cur
      end
      if c > MAX then c = MAX end
      s[13 + 3 * k] = c
    end
    s[LA] = now
    s[WRITE] = true
    outcome = 0
  elseif fits then
    if matched < n then
      -- quota::rules::KeyState::count_elsewhere: running windows of this state the set lacks
      -- (a customer's keys on plans of other windows) spend the cost too.
      for q = 1, n do
        local e = s[11 + 3 * q]
        if not in_set(set, e) then
          local cur, stored = index_of(e, now), s[12 + 3 * q]
          if stored == cur or stored == cur + 1 then
            s[13 + 3 * q] = math.min(s[13 + 3 * q] + cost, MAX)
          end
        end
      end
    end
    for k = 1, m do
      local c = out[at + 1 + k] + cost
      out[at + 1 + k] = c
      local j, w, e = JS[k], WS[k], set[3 * k - 1]
      if j ~= nil and s[11 + 3 * j] == e and c <= MAX then
        if s[12 + 3 * j] ~= w then
          outlive(s, e, w)
          s[12 + 3 * j] = w
        end
        s[13 + 3 * j] = c
      else
        put(s, j, e, w, c, now, set)
      end
    end
    s[LA] = now
    s[WRITE] = true
    outcome = 0
  elseif short == 1 then
    -- Every window has room, but the region holds too few units: nothing counted, no strike.
    -- (Short where the global budget was found spent, 2, is refused below as a full window.)
    outcome = 5
  else
    if s[RD] == day then
      s[RC] = math.min(s[RC] + 1, MAX)
    else
      s[RD], s[RC] = day, 1
      if (day + 1) * 86400 > s[EX] then s[EXPIRE] = true end
    end
    if s[SW] == minute then s[SC] = math.min(s[SC] + 1, MAX) else s[SW] = minute; s[SC] = 1 end
    outcome = 1
    if s[SC] > strikes then
      if s[LU] <= now then s[LV] = 0 end
      s[BU] = u32(now + head[3 + math.min(s[LV] + 1, lengths)])
      s[LV] = u32(s[LV] + 1)
      s[LU] = u32(s[BU] + decay)
      s[SC] = 0
      s[EXPIRE] = true
      outcome = 3
    end
    s[WRITE] = true
  end
  -- The outcome and the ban's end in one number, `outcome + 8 * ban_until`: each number of the
  -- answer costs Redis some 870 instructions to write, a sixth of a decision. Exact: a ban's
  -- end fits 32 bits, and Lua's numbers hold 53.
  if s[BU] > now then outcome = outcome + 8 * s[BU] end
  out[at + 1] = outcome
  at = at + set[21]
  if l ~= nil then
    if outcome == 0 then
      out[at + 1] = take(l, now + lease_secs)
    else
      out[at + 1] = 0
    end
    out[at + 2] = l.total
    at = at + 2
  end
  end
end
for _, key in ipairs(order) do
  local s = states[key]
  if s[WRITE] then save(key, s) end
end
for _, key in ipairs(held_order or {}) do
  save_leases(held[key])
end
return out
"#
    };
}

/// Decides a batch of requests (group commit: one script run for every decision queued while
/// the previous run was in flight; a batch of one at low load), and gives back or renews the
/// leases of requests in flight that ride along. Entries are taken in the order given, so
/// several of one quota in a batch are counted exactly as if sent one by one. Each quota's state
/// (and its leases) is read once and written once per batch, with one `GET` and one `SET`.
///
/// The numbers travel packed, each a little-endian signed 64-bit integer (`struct`'s `i8`), in
/// two strings: Redis turns each argument into a string and `tonumber` parses it with `strtod`,
/// some 2,600 instructions a number, against about 700 for one unpacked (bench/RESULTS.md,
/// issue 33); a quota's key is sent once however many entries of the run name it.
///
/// - `KEYS`: the quotas' states, each once, `<prefix>:windows:{<quota id>}`; a quota's leases
///   are `<prefix>:leases:{<quota id>}`, the same key with `leases` for `windows`. On a Redis
///   Cluster every key of one batch is in one slot.
/// - `ARGV[1]`, the head: refused requests allowed in one minute before a ban; seconds after a
///   ban's end before the ban level decays to 0; *n*, how many ban lengths follow, and the ban
///   lengths in seconds by level, the last one repeating; a lease's length, seconds; *L*, how
///   many sets of limits follow, and each set: *m*, its number of windows, then per window its
///   length code (`Every::code`) and its limit, negative for a shadow window (counted, never
///   refusing), then its concurrency (0: none); then 1 for a region's decisions (admitted only
///   out of the units the region holds, `regional_lua`), nothing otherwise.
/// - `ARGV[2]`, the entries, three numbers each: the number of its quota's key in `KEYS`, then
///   a decision's set of limits (from 1) and its cost; or -1 and the end of a lease to renew; or
///   `-1 - n` and the end of `n` leases to give back.
///
/// Returns `now` (the script's clock, once), then in entry order: per decision `1 + m`
/// integers, `{outcome + 8 * ban_until, count_1..count_m}` (`ban_until` 0 when no ban is in
/// force; the counts in its set's window order, its cost included when admitted), and two more
/// when its set has a concurrency, `{lease_end, in_flight}` (the end of the lease it took, 0
/// when none, and the quota's requests in flight); outcome 0 admitted, 1 limited, 2 banned, 3
/// banned by this very request, 4 refused for the concurrency (nothing counted, no strike), 5
/// a region's, refused for too few units held (nothing counted, no strike); a region's
/// decisions carry `m` more after the counts, the units held of each window's instance; per
/// renewal `{lease_end, in_flight}`; nothing per release. Every number of the answer costs Redis
/// as much to write as a tenth of a decision, hence the outcome and the ban's end in one.
///
/// Run as a Redis Function where the server allows it (`redis/function.rs`): [`ACQUIRE_LIBRARY`]
/// once, then [`ACQUIRE_RUN`] per call; otherwise as this script, both parts per call.
pub const ACQUIRE: &str = concat!(acquire_library_lua!(), acquire_run_lua!());

/// What [`ACQUIRE`] defines before it runs: the state's and the leases' functions and the
/// reader of its head. As a Redis Function library (`redis/function.rs`) this part runs once,
/// when the library is loaded, rather than on every call as a script's top level does.
pub const ACQUIRE_LIBRARY: &str = acquire_library_lua!();

/// [`ACQUIRE`]'s run, the body of the Redis Function that `redis/function.rs` registers
/// (`KEYS` and `ARGV` its parameters).
pub const ACQUIRE_RUN: &str = acquire_run_lua!();

/// Ends a ban now and forgets the strikes; the ban level stays, so the next ban still escalates.
///
/// - `KEYS[1]`: the quota's state.
/// - `ARGV[1]`, optional: lift only a ban ending no later than this (Unix seconds). A ban lifted
///   in another region (issue 48, `redis::ban_feed`) is lifted here only while the region's
///   ends no later than the lifted one's (a later end is a ban started since), in one run so
///   that no ban starts between the look and the lift.
///
/// Returns 1 when a ban was lifted, 0 otherwise.
pub const LIFT_BAN: &str = concat!(
    state_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local s = load(KEYS[1])
if s[BU] <= now or (ARGV[1] and s[BU] > tonumber(ARGV[1])) then return 0 end
s[BU] = 0
s[SC] = 0
save(KEYS[1], s)
return 1
"#
);

/// Writes a ban started in another region (issue 48, `redis::ban_feed`) into this region's
/// state of the quota: its end moves to the later of the two; level and strikes stay this
/// region's, and the state lives at least to the ban's end.
///
/// - `KEYS[1]`: the quota's state.
/// - `ARGV[1]`: the ban's end, Unix seconds.
///
/// Returns 1 when the ban's end moved, 0 otherwise (already as late, or ended).
pub const IMPORT_BAN: &str = concat!(
    state_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local till = tonumber(ARGV[1])
if till <= now then return 0 end
local s = load(KEYS[1])
if s[BU] >= till then return 0 end
s[BU] = u32(till)
if s[LU] < till then s[LU] = u32(till) end
s[EXPIRE] = true
save(KEYS[1], s)
return 1
"#
);

/// Reads a quota's ban.
///
/// - `KEYS[1]`: the quota's state.
///
/// Returns the ban's end (Unix seconds) when one is active, 0 otherwise.
pub const BAN_OF: &str = concat!(
    state_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local s = load(KEYS[1])
if s[BU] <= now then return 0 end
return s[BU]
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
/// of packed state, the month arithmetic), on a key no request uses, so it fails wherever
/// requests would, a Redis too old for the scripts (before 6.2) included.
///
/// - `KEYS[1]`: `<prefix>:probe-state`.
pub const PROBE: &str = concat!(
    state_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local s = load(KEYS[1])
s[LA] = now
put(s, nil, 0, index_of(0, now), 0, now, {1, 0, 0, 0})
s[EXPIRE] = true
save(KEYS[1], s)
return 1
"#
);

/// Reads a quota's counts in its current windows (the window rule of [`ACQUIRE`]) and its
/// requests in flight.
///
/// - `KEYS[1]`: the quota's state (its leases beside it, as for [`ACQUIRE`]).
///
/// Returns `{now, refused_today, last_admitted, ban_until, in_flight, e_1, count_1, …}`
/// (ban_until 0 when not banned; a pair per window length the state counts in, its current
/// instance's count).
pub const USAGE: &str = concat!(
    state_lua!(),
    leases_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local s = load(KEYS[1])
local rc = 0
if s[RD] == math.floor(now / 86400) then rc = s[RC] end
local bu = 0
if s[BU] > now then bu = s[BU] end
local out = {now, rc, s[LA], bu, load_leases(KEYS[1], now).total}
for j = 1, s[N] do
  local e = s[11 + 3 * j]
  local _, c = current(s, e, index_of(e, now))
  out[#out + 1] = e
  out[#out + 1] = c
end
return out
"#
);

/// Zeroes a quota's counts in every window; windows, strikes and bans stay. In a region, the
/// units it holds go too (they were held against the counts: kept, the zeroed counts would be
/// spent again past what the global store granted).
///
/// - `KEYS[1]`: the quota's state.
/// - `ARGV[1]`: 1 in a region, 0 otherwise.
pub const RESET_USAGE: &str = concat!(
    state_lua!(),
    r#"
if ARGV[1] == '1' then redis.call('DEL', (string.gsub(KEYS[1], ':windows:{', ':held:{', 1))) end
local s = load(KEYS[1])
if s[FROM] ~= 0 then
  for j = 1, s[N] do s[13 + 3 * j] = 0 end
  save(KEYS[1], s)
end
return 1
"#
);

/// Adds units the global store granted to a region to what it holds (`regional_lua`), in the
/// region's Redis. An instance the record does not hold yet (or no longer holds: forfeited by a
/// restart, expired) starts from what the region has counted there, so only the new units can
/// be spent. Instances that have ended are dropped; the record expires with the last one.
///
/// - `KEYS[1]`: the quota's state (the record is `<prefix>:held:{<quota id>}` beside it).
/// - `ARGV[1]`: packed little-endian signed 64-bit integers, four per instance: the window's
///   length code, its instance, the units granted, and until when (Unix seconds, 0: not) the
///   global store is known to have none left of it.
///
/// Returns the units held of each instance after it.
pub const HOLD: &str = concat!(
    state_lua!(),
    regional_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local s = load(KEYS[1])
local r = load_held(KEYS[1])
local E, out = ARGV[1], {}
for i = 1, #E / 32 do
  local e, w, units, fin = struct.unpack('<i8i8i8i8', E, 32 * (i - 1) + 1)
  local j = held_index(r, e, w)
  if j == nil then
    j = #r.e + 1
    local sw, c = current(s, e, w)
    if sw ~= w then c = 0 end
    r.e[j], r.w[j], r.n[j], r.f[j] = e, w, c, 0
  end
  r.n[j] = u32(r.n[j] + units)
  if fin > r.f[j] then r.f[j] = u32(fin) end
  out[i] = r.n[j]
end
save_held(r, now)
return out
"#
);

/// Takes back what a region holds and has not spent of a quota's current and next instances,
/// once no request of the quota was admitted in the region for a while (its traffic moved or
/// stopped), to be given back to the global store: from then on the region holds only what it
/// counted there. The instances are the region's Redis clock's, so a node's clock cannot name
/// one that has ended (whose spent units a slot moved on no longer shows).
///
/// - `KEYS[1]`: the quota's state.
/// - `ARGV[1]`: how long (seconds) the quota must have had no admission in this region;
///   `ARGV[2]`: packed little-endian signed 64-bit integers, two per window: its length code,
///   and the fewest spare units worth giving back (fewer stay: a quiet key's unit or two is not
///   worth a call, nor its next request's wait for a grant).
///
/// Returns 1 when the quota was idle that long (0: it is still admitted here), then three
/// numbers per instance given back: its length code, which instance, the units taken.
pub const GIVE: &str = concat!(
    state_lua!(),
    regional_lua!(),
    r#"
local now = tonumber(redis.call('TIME')[1])
local s = load(KEYS[1])
if now - s[LA] < tonumber(ARGV[1]) then return {0} end
local r = load_held(KEYS[1])
local E, out, changed = ARGV[2], {1}, false
for i = 1, #E / 16 do
  local e, least = struct.unpack('<i8i8', E, 16 * (i - 1) + 1)
  local cur = index_of(e, now)
  for w = cur, cur + 1 do
    local j, k = held_index(r, e, w), slot_of(s, e)
    -- Only where the state's slot counts `w`, or an earlier instance (nothing counted in `w`
    -- yet): a slot counting a later one (the clock stepped back) or none (never counted, or
    -- given to another length) cannot say what `w` spent.
    if j and k and s[12 + 3 * k] <= w then
      local c = 0
      if s[12 + 3 * k] == w then c = s[13 + 3 * k] end
      if r.n[j] >= c + least then
        out[#out + 1], out[#out + 2], out[#out + 3] = e, w, r.n[j] - c
        r.n[j] = c
        changed = true
      end
    end
  end
end
if changed then save_held(r, now) end
return out
"#
);
