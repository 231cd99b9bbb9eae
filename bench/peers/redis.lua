-- A minimal Redis client for the nginx+Lua peer (bench/peers.py): Debian ships no
-- lua-resty-redis, and the peer needs only what lua-resty-redis would do on its path: a
-- cosocket from nginx's keep-alive pool, one command sent as a RESP array of bulk strings, one
-- reply read (integer, simple string, bulk string, array or error), the socket handed back to
-- the pool. Like lua-resty-redis: a transport failure returns nil and a message; an error reply
-- from Redis returns false and its message.

local tcp = ngx.socket.tcp
local byte = string.byte
local sub = string.sub
local tonumber = tonumber
local tostring = tostring
local null = ngx.null

local M = {}
local mt = { __index = M }

--- A client on a pooled connection to host:port (a new connection only when the pool has none).
function M.connect(host, port, timeout_ms)
  local sock = tcp()
  sock:settimeout(timeout_ms)
  local ok, err = sock:connect(host, port)
  if not ok then
    return nil, err
  end
  return setmetatable({ sock = sock }, mt)
end

-- One command as a RESP array of bulk strings, as the fragments `sock:send` takes (it writes a
-- table of strings without joining them first).
local function encode(args)
  local n = #args
  local out = { "*", tostring(n), "\r\n" }
  local i = 4
  for k = 1, n do
    local a = tostring(args[k])
    out[i], out[i + 1], out[i + 2], out[i + 3] = "$", tostring(#a), "\r\n", a
    out[i + 4] = "\r\n"
    i = i + 5
  end
  return out
end

local read_reply

-- One reply. Errors nested in an array come back as false in their place.
read_reply = function(sock)
  local line, err = sock:receive()  -- a line, without its CRLF
  if not line then
    return nil, err
  end
  local kind = byte(line)
  if kind == 58 then      -- ':' integer
    return tonumber(sub(line, 2))
  elseif kind == 43 then  -- '+' simple string
    return sub(line, 2)
  elseif kind == 45 then  -- '-' error
    return false, sub(line, 2)
  elseif kind == 36 then  -- '$' bulk string
    local len = tonumber(sub(line, 2))
    if len < 0 then
      return null
    end
    local data, rerr = sock:receive(len + 2)
    if not data then
      return nil, rerr
    end
    return sub(data, 1, len)
  elseif kind == 42 then  -- '*' array
    local n = tonumber(sub(line, 2))
    if n < 0 then
      return null
    end
    local arr = {}
    for k = 1, n do
      local v, verr = read_reply(sock)
      if v == nil then
        return nil, verr
      end
      arr[k] = v
    end
    return arr
  end
  return nil, "unexpected reply: " .. line
end

--- Sends one command (its arguments as given) and reads its reply.
function M:call(...)
  local sock = self.sock
  local ok, err = sock:send(encode({ ... }))
  if not ok then
    return nil, err
  end
  return read_reply(sock)
end

--- Hands the connection back to the pool (`idle_ms`, `pool_size`); the client is spent after it.
function M:keepalive(idle_ms, pool_size)
  return self.sock:setkeepalive(idle_ms, pool_size)
end

--- Closes the connection (after a transport error: its stream may hold half a reply).
function M:close()
  return self.sock:close()
end

return M
