-- The nginx+Lua peer of pet-gateway (bench/peers.py): what an operator would write in OpenResty
-- style to do the gateway's job on its admitted path, so the CPU per request of the two can be
-- compared like with like. In the access phase, per request:
--
--   1. `Authorization: Bearer <key>`: missing → 401; the key's SHA-256 (OpenSSL's, through
--      LuaJIT's FFI), as 64 hex digits, looked up in the keys loaded at start-up from the same
--      keys file and plans folder the gateway reads → 401 when unknown;
--   2. the key's minute and day windows counted: in a shared dict (`ngx.shared.counters:incr`,
--      one counter per key and window instance, expiring with the window), or in Redis with ONE
--      round trip (EVALSHA of a script that increments both counters, sets their expiry when it
--      creates them and undoes the increments when either is over its limit). When Redis fails,
--      the windows are counted in the shared dict instead and the log says store_degraded=true
--      (the gateway's default `on_store_error = "local"` does the same);
--   3. over either limit → 429 with Retry-After and the gateway's JSON Error body; else the
--      gateway's rate-limit headers (RateLimit-Policy, RateLimit, X-RateLimit-Limit, -Remaining,
--      -Reset, computed as the gateway computes them), and $key_id, $plan, $store_us and
--      $store_degraded set for the upstream request's headers and the access log; nginx then
--      proxies (nginx-lua.conf.in).

local ffi = require "ffi"
local redis = require "redis"

local ngx = ngx
local floor = math.floor
local sub = string.sub
local band, rshift = bit.band, bit.rshift

ffi.cdef [[
unsigned char *SHA256(const char *d, size_t n, unsigned char *md);
typedef struct { long tv_sec; long tv_nsec; } peer_timespec;
int clock_gettime(int clk_id, peer_timespec *tp);
]]

-- nginx links OpenSSL, so its SHA256 is usually in the process already; else load libcrypto.
local function crypto_lib()
  if pcall(function() return ffi.C.SHA256 end) then
    return ffi.C
  end
  for _, name in ipairs({ "crypto", "libcrypto.so.3", "libcrypto.so.1.1" }) do
    local ok, lib = pcall(ffi.load, name)
    if ok then
      return lib
    end
  end
  error("no SHA256 in this process and no libcrypto to load")
end

local crypto = crypto_lib()
local digest = ffi.new("unsigned char[32]")
local hex_out = ffi.new("char[64]")
local HEX = ffi.new("char[17]", "0123456789abcdef")
local ts = ffi.new("peer_timespec")
local CLOCK_MONOTONIC = 1

-- The bearer key's SHA-256 as 64 lowercase hex digits: the form the keys file holds.
local function sha256_hex(s)
  crypto.SHA256(s, #s, digest)
  for i = 0, 31 do
    local b = digest[i]
    hex_out[2 * i] = HEX[rshift(b, 4)]
    hex_out[2 * i + 1] = HEX[band(b, 15)]
  end
  return ffi.string(hex_out, 64)
end

local function now_us()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, ts)
  return tonumber(ts.tv_sec) * 1000000 + floor(tonumber(ts.tv_nsec) / 1000)
end

local M = {}

-- Set once by init() in the master, inherited by every worker.
local keys = {}        -- sha256 hex → { id, plan, minute, day, policy, m_prefix, d_prefix }
local use_redis = false
local redis_host, redis_port = "127.0.0.1", 6379
local REDIS_TIMEOUT_MS = 1000  -- bench/bench.py's store_timeout_ms for its Redis gateways
local POOL_IDLE_MS, POOL_SIZE = 60000, 64

-- `name = "value"` and `name = 123` lines of the gateway's TOML files (the only shapes the
-- keys file and the plans use); nothing else of TOML is needed here.
local function toml_fields(path)
  local f = assert(io.open(path))
  local records, current = {}, nil
  for line in f:lines() do
    if line:match("^%s*%[%[key%]%]") then
      current = {}
      records[#records + 1] = current
    else
      local name, value = line:match('^%s*([%w_]+)%s*=%s*"(.-)"')
      if not name then
        name, value = line:match("^%s*([%w_]+)%s*=%s*(%d+)")
        value = tonumber(value)
      end
      if name then
        current = current or {}
        if #records == 0 then records[1] = current end
        current[name] = value
      end
    end
  end
  f:close()
  return records
end

local function load_plan(plans_dir, name)
  local p = toml_fields(plans_dir .. "/" .. name .. ".toml")[1] or {}
  local minute = assert(p.requests_per_minute, name .. ": no requests_per_minute")
  local day = assert(p.requests_per_day, name .. ": no requests_per_day")
  return {
    minute = minute,
    day = day,
    -- RateLimit-Policy, as the gateway writes it: the same for every response of the plan.
    policy = '"minute";q=' .. minute .. ';w=60, "day";q=' .. day .. ';w=86400',
  }
end

--- Loads the keys and their plans (init_by_lua: once, in the master) and picks the store.
function M.init(opts)
  local plans = {}
  local prefix = (opts.key_prefix or "peer") .. ":"  -- counters of two peers on one Redis apart
  for _, k in ipairs(toml_fields(opts.keys_file)) do
    if k.sha256 and not k.revoked_at then
      local plan = plans[k.plan] or load_plan(opts.plans_dir, k.plan)
      plans[k.plan] = plan
      keys[k.sha256:lower()] = {
        id = k.id, plan = k.plan, minute = plan.minute, day = plan.day, policy = plan.policy,
        m_prefix = prefix .. k.id .. ":m:", d_prefix = prefix .. k.id .. ":d:",
      }
    end
  end
  use_redis = opts.store == "redis"
  redis_host, redis_port = opts.redis_host or redis_host, opts.redis_port or redis_port
end

local counters = ngx.shared.counters

-- The windows counted in the shared dict: (minute count, day count, admitted), or nil when the
-- dict fails (full).
local function count_shared(rec, mk, dk, m_ttl, d_ttl)
  local m = counters:incr(mk, 1, 0, m_ttl)
  local d = counters:incr(dk, 1, 0, d_ttl)
  if not m or not d then
    return nil
  end
  if m > rec.minute or d > rec.day then
    counters:incr(mk, -1)
    counters:incr(dk, -1)
    return m - 1, d - 1, false
  end
  return m, d, true
end

-- Runs inside Redis: both counters incremented, their expiry set when created, both undone
-- when either is over its limit. Returns { admitted (1 or 0), minute count, day count }.
local SCRIPT = [[
local m = redis.call('INCR', KEYS[1])
if m == 1 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
local d = redis.call('INCR', KEYS[2])
if d == 1 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
if m > tonumber(ARGV[3]) or d > tonumber(ARGV[4]) then
  redis.call('DECR', KEYS[1])
  redis.call('DECR', KEYS[2])
  return {0, m - 1, d - 1}
end
return {1, m, d}
]]
local script_sha = nil  -- per worker, from SCRIPT LOAD at first use

local function evalsha(r, rec, mk, dk, m_ttl, d_ttl)
  if not script_sha then
    local sha, err = r:call("SCRIPT", "LOAD", SCRIPT)
    if not sha then
      return sha, err
    end
    script_sha = sha
  end
  return r:call("EVALSHA", script_sha, 2, mk, dk, m_ttl, d_ttl, rec.minute, rec.day)
end

-- The windows counted in Redis, one round trip: (minute count, day count, admitted), or nil
-- when Redis failed (the connection is closed then, not pooled).
local function count_redis(rec, mk, dk, m_ttl, d_ttl)
  local r, err = redis.connect(redis_host, redis_port, REDIS_TIMEOUT_MS)
  if not r then
    ngx.log(ngx.WARN, "redis: ", err)
    return nil
  end
  local res
  res, err = evalsha(r, rec, mk, dk, m_ttl, d_ttl)
  if res == false and sub(err, 1, 8) == "NOSCRIPT" then
    script_sha = nil  -- Redis restarted or flushed its scripts: load it again
    res, err = evalsha(r, rec, mk, dk, m_ttl, d_ttl)
  end
  if not res then
    ngx.log(ngx.WARN, "redis: ", err)
    if res == nil then
      r:close()
    else
      r:keepalive(POOL_IDLE_MS, POOL_SIZE)
    end
    return nil
  end
  r:keepalive(POOL_IDLE_MS, POOL_SIZE)
  return res[2], res[3], res[1] == 1
end

-- The gateway's rate-limit headers. The binding window (X-RateLimit-*): on an admission the
-- one with the least room left (the minute on a tie); on a refusal the refusing window that
-- resets last. Returns the binding window's reset (epoch seconds).
local function rate_headers(rec, now, m, d, admitted, m_reset, d_reset)
  local m_left = rec.minute - m
  local d_left = rec.day - d
  if m_left < 0 then m_left = 0 end
  if d_left < 0 then d_left = 0 end
  local day_binds
  if admitted then
    day_binds = d_left < m_left
  else
    day_binds = d + 1 > rec.day
  end
  local h = ngx.header
  h["RateLimit-Policy"] = rec.policy
  h["RateLimit"] = '"minute";r=' .. m_left .. ";t=" .. (m_reset - now)
    .. ', "day";r=' .. d_left .. ";t=" .. (d_reset - now)
  if day_binds then
    h["X-RateLimit-Limit"], h["X-RateLimit-Remaining"], h["X-RateLimit-Reset"] = rec.day, d_left, d_reset
    return d_reset
  end
  h["X-RateLimit-Limit"], h["X-RateLimit-Remaining"], h["X-RateLimit-Reset"] = rec.minute, m_left, m_reset
  return m_reset
end

-- The gateway's Error bodies, byte for byte.
local MISSING = '{"code":"unauthorized","message":"an API key is required: send Authorization: '
  .. 'Bearer <API_KEY>","status":401}'
local UNKNOWN = '{"code":"unauthorized","message":"the API key is not valid","status":401}'
local LIMITED = '{"code":"rate_limited","message":"rate limit exceeded; retry after the number '
  .. 'of seconds in Retry-After","status":429}'

-- Answers the request here with a JSON Error (the upstream never sees it).
local function refuse(status, body)
  ngx.status = status
  local h = ngx.header
  h["Content-Type"] = "application/json"
  h["Content-Length"] = #body
  h["Cache-Control"] = "no-store"
  if status == 401 then
    h["WWW-Authenticate"] = "Bearer"
  end
  ngx.print(body)
  return ngx.exit(ngx.HTTP_OK)
end

--- access_by_lua: authenticate, count, refuse or let nginx proxy.
function M.access()
  local var = ngx.var
  local auth = var.http_authorization
  if not auth or sub(auth, 1, 7) ~= "Bearer " then
    return refuse(401, MISSING)
  end
  local rec = keys[sha256_hex(sub(auth, 8))]
  if not rec then
    return refuse(401, UNKNOWN)
  end

  local now = ngx.time()
  local m_window, d_window = floor(now / 60), floor(now / 86400)
  local m_reset, d_reset = (m_window + 1) * 60, (d_window + 1) * 86400
  local mk, dk = rec.m_prefix .. m_window, rec.d_prefix .. d_window
  local m_ttl, d_ttl = m_reset - now + 1, d_reset - now + 1

  local started = now_us()
  local m, d, admitted
  if use_redis then
    m, d, admitted = count_redis(rec, mk, dk, m_ttl, d_ttl)
    if m == nil then
      var.store_degraded = "true"
    end
  end
  if m == nil then
    m, d, admitted = count_shared(rec, mk, dk, m_ttl, d_ttl)
  end
  var.store_us = now_us() - started
  var.key_id = rec.id
  var.plan = rec.plan
  if m == nil then
    return  -- neither store answered: admitted without counting (as `open` would)
  end

  local reset = rate_headers(rec, now, m, d, admitted, m_reset, d_reset)
  if not admitted then
    local retry = reset - now
    ngx.header["Retry-After"] = retry < 1 and 1 or retry
    return refuse(429, LIMITED)
  end
end

return M
