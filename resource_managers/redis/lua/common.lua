-- twopc Redis branch library: prepended to every twopc script (see scripts.py).
--
-- Rules every script keeps:
-- * Data arrives only through KEYS and ARGV; no data is ever part of the script's text.
-- * The prepare and one-phase scripts declare every key they read or write in KEYS: lock keys
--   are passed and checked against prefix .. 'lock:' .. key, never just computed and used.
-- * A redis.call error aborts a script but keeps its earlier writes, so every script finishes
--   all of its checks (validate) before its first write.
-- * The exception to both: commit (of plain SETs) and rollback declare the branch's own keys
--   (tx hash, staged list, prepared set) and take the data and lock keys from the staged
--   set's header, which the prepare wrote from keys it declared. That spares phase two reading
--   the keys back and sending them again (0.4 s of a 250,000-key branch's 1.9 s commit,
--   measured). Redis checks an undeclared key only when a call touches it (an ACL refusing it),
--   so such a call can fail after earlier writes; those two scripts order their writes so that
--   the next call goes on safely from any such stop (see commit.lua). On Redis Cluster the
--   caller declares the keys anyway (a node importing the slot serves a one-key command on an
--   undeclared key that still lives elsewhere), and a write set that is not plain SETs is
--   committed with every key declared.

-- A write set is a flat array of [command, key, nargs, arg1 .. argn] repeated; a staged write
-- set (the ws list) starts with the header [MAGIC, n, key1 .. keyn], the keys the branch locked.

local MAGIC = 'twopc-ws-1'
local WRONGTYPE = 'WRONGTYPE Operation against a key holding the wrong kind of value'
local NOT_INTEGER = 'ERR value is not an integer or out of range'
local HASH_NOT_INTEGER = 'ERR hash value is not an integer'
local OVERFLOW = 'ERR increment or decrement would overflow'
local MAX_ID = '18446744073709551615-18446744073709551615'
-- Lua numbers are doubles, exact only below 2^53, so a 64-bit integer is kept as a pair
-- {a, b} = a * 10^9 + b with 0 <= b < 10^9, which makes sums and overflow checks exact.
local BILLION = 1000000000
local MAX_A, MAX_B = 9223372036, 854775807
local MIN_A, MIN_B = -9223372037, 145224192
-- unpack() fails beyond ~8000 values: variadic commands are sent in chunks of this many
local CHUNK = 1000

-- per command: the type it needs (false: any), whether its arguments may be sent in chunks,
-- and its exact number of arguments where that is fixed
local NEEDS = {
  SET = 'string', DEL = false, EXPIRE = false, INCRBY = 'string', HSET = 'hash', HDEL = 'hash',
  HINCRBY = 'hash', SADD = 'set', SREM = 'set', ZADD = 'zset', ZREM = 'zset', ZINCRBY = 'zset',
  LPUSH = 'list', RPUSH = 'list', XADD = 'stream',
}
local CHUNKED = {HSET = true, HDEL = true, SADD = true, SREM = true, ZADD = true, ZREM = true,
  LPUSH = true, RPUSH = true}
local ARITY = {DEL = 0, EXPIRE = 1, INCRBY = 1, HINCRBY = 2, ZINCRBY = 2}

local function now_ms()
  local t = redis.call('TIME')
  return string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end

local function fingerprint(key)
  local dump = redis.call('DUMP', key)
  if dump then return redis.sha1hex(dump) end
  return ''
end

-- a watch holds: the key is as it was when the branch read it. A watch is 'S' and the SHA-1
-- of a string's value (read by GET: the client's cheap read), or the SHA-1 of the key's DUMP
-- (any type), or '' for a key that did not exist
local function unchanged(key, want)
  if string.byte(want, 1) == 83 then -- 'S'
    return redis.call('TYPE', key)['ok'] == 'string'
      and 'S' .. redis.sha1hex(redis.call('GET', key)) == want
  end
  return fingerprint(key) == want
end

-- KEYS[base + 1 .. base + n] must be the lock keys of KEYS[base + n + 1 .. base + 2n]
local function check_layout(base, n, prefix)
  if n == nil or #KEYS ~= base + 2 * n then return 'wrong number of keys' end
  for i = 1, n do
    if KEYS[base + i] ~= prefix .. 'lock:' .. KEYS[base + n + i] then return 'lock key mismatch' end
  end
  return nil
end

-- the first of the data keys whose lock (KEYS[base + 1 .. base + n]) another branch holds:
-- (data key, owner), or nil. One EXISTS per chunk answers the common case, no lock at all
local function other_lock(base, n, gid)
  local any = false
  for i = base + 1, base + n, CHUNK do
    if redis.call('EXISTS', unpack(KEYS, i, math.min(i + CHUNK - 1, base + n))) > 0 then
      any = true
      break
    end
  end
  if not any then return nil end
  for i = 1, n do
    local owner = redis.call('GET', KEYS[base + i])
    if owner and owner ~= gid then return KEYS[base + n + i], owner end
  end
  return nil
end

local function key_set(keys, first, n)
  local set = {}
  for i = first + 1, first + n do set[keys[i]] = true end
  return set
end


local function push(list, src, from, to)
  for i = from, to, CHUNK do
    redis.call('RPUSH', list, unpack(src, i, math.min(i + CHUNK - 1, to)))
  end
end

-- take the locks KEYS[first + 1 .. first + n] for gid: one MSET per chunk, not a SET per key
-- (the caller has checked that no other branch holds one)
local function lock_all(first, n, gid)
  for i = first + 1, first + n, CHUNK do
    local pairs_, count = {}, 0
    for j = i, math.min(i + CHUNK - 1, first + n) do
      pairs_[count + 1], pairs_[count + 2], count = KEYS[j], gid, count + 2
    end
    redis.call('MSET', unpack(pairs_, 1, count))
  end
end

-- release the locks among keys[first + 1 .. first + n] that gid holds: one MGET and one DEL per
-- chunk, not a GET and a DEL per key
local function release(keys, first, n, gid)
  for i = first + 1, first + n, CHUNK do
    local last = math.min(i + CHUNK - 1, first + n)
    local owners = redis.call('MGET', unpack(keys, i, last))
    local mine, count = {}, 0
    for j = i, last do
      if owners[j - i + 1] == gid then
        count = count + 1
        mine[count] = keys[j]
      end
    end
    if count > 0 then redis.call('DEL', unpack(mine, 1, count)) end
  end
end

-- the header of a staged write set: n and the index of the first op, or nil
local function header(ws)
  if ws[1] ~= MAGIC then return nil end
  local n = tonumber(ws[2])
  if n == nil or #ws < 2 + n then return nil end
  return n, 3 + n
end

-- the write set as prepare and one-phase receive it, one argument (see _writeset.pack): each
-- field a 4-byte little-endian length, then its bytes. The flat array, or nil if malformed
-- Eight fields per struct.unpack while eight remain (half the time of one per call, measured
-- on a 250,000-key write set): the first call that finds fewer raises before it assigns
-- anything, and the rest are read one at a time, where a malformed blob raises for good.
-- (written out: a function library may not call string.rep while it loads)
local EIGHT = '<I4c0I4c0I4c0I4c0I4c0I4c0I4c0I4c0'

local function unpack_eights(blob, out, state)
  local count, pos, unpack_ = state[1], state[2], struct.unpack
  while true do
    local f1, f2, f3, f4, f5, f6, f7, f8, nxt = unpack_(EIGHT, blob, pos)
    out[count + 1], out[count + 2], out[count + 3], out[count + 4] = f1, f2, f3, f4
    out[count + 5], out[count + 6], out[count + 7], out[count + 8] = f5, f6, f7, f8
    count, pos = count + 8, nxt
    state[1], state[2] = count, pos
  end
end

local function unpack_fields(blob, out, state)
  local count, pos, size = state[1], state[2], #blob
  while pos <= size do
    count = count + 1
    out[count], pos = struct.unpack('<I4c0', blob, pos)
  end
  return out
end

local function decode(blob)
  local out, state = {}, {0, 1}
  pcall(unpack_eights, blob, out, state) -- always ends by raising, at the last eight or before
  local ok, fields = pcall(unpack_fields, blob, out, state)
  if ok then return fields end
  return nil
end

-- A write set of nothing but plain SETs (SET key value: a command that cannot fail, whatever
-- the key holds), every key in allowed (nil: a chunk of a set the prepare checked): the number
-- of (key, value) entries, with the pairs put in out when it is given; else nil. Such a set
-- needs no simulation and no op tables (the two were most of a 250,000-key Spark partition's
-- prepare and commit, measured); anything else goes through parse and validate.
local function plain_sets(src, from, to, allowed, out)
  if (to - from + 1) % 4 ~= 0 then return nil end
  local count = 0
  for i = from, to, 4 do
    local key = src[i + 1]
    if src[i] ~= 'SET' or src[i + 2] ~= '1' or (allowed and not allowed[key]) then return nil end
    if out then out[count + 1], out[count + 2] = key, src[i + 3] end
    count = count + 2
  end
  return count
end

-- the pairs plain_sets found, applied as one MSET per CHUNK pairs (a later value of a key
-- wins, as it would one SET at a time)
local function mset_pairs(flat, count)
  for i = 1, count, 2 * CHUNK do
    redis.call('MSET', unpack(flat, i, math.min(i + 2 * CHUNK - 1, count)))
  end
end

local function parse(src, from, to, allowed)
  local ops, i = {}, from
  while i <= to do
    local cmd, key, n = src[i], src[i + 1], tonumber(src[i + 2] or '')
    if NEEDS[cmd] == nil or key == nil or n == nil or n < 0 or i + 2 + n > to
        or (ARITY[cmd] ~= nil and n ~= ARITY[cmd]) then
      return nil, 'malformed write set at ' .. i
    end
    if not allowed[key] then return nil, 'a key of the write set is not in KEYS' end
    ops[#ops + 1] = {cmd = cmd, key = key, src = src, a = i + 3, n = n}
    i = i + 3 + n
  end
  return ops
end

-- validation: simulate the write set on the current data, types and values, without writing

-- a Redis integer (as string2ll accepts it) as a pair, or nil
local function parse_int(v)
  if type(v) == 'table' then return v end
  if #v == 0 or #v > 20 then return nil end
  local neg = string.sub(v, 1, 1) == '-'
  local digits = neg and string.sub(v, 2) or v
  if digits == '0' then
    if neg then return nil end
    return {0, 0}
  end
  if #digits > 19 or not string.find(digits, '^[1-9]%d*$') then return nil end
  if #digits == 19 and digits > (neg and '9223372036854775808' or '9223372036854775807') then
    return nil
  end
  local high, low = 0, tonumber(string.sub(digits, -9))
  if #digits > 9 then high = tonumber(string.sub(digits, 1, #digits - 9)) end
  if not neg then return {high, low} end
  if low > 0 then return {-high - 1, BILLION - low} end
  return {-high, 0}
end

-- x + y, or nil when it leaves the signed 64-bit range
local function add_int(x, y)
  local a, b = x[1] + y[1], x[2] + y[2]
  if b >= BILLION then a, b = a + 1, b - BILLION end
  if a > MAX_A or (a == MAX_A and b > MAX_B) or a < MIN_A or (a == MIN_A and b < MIN_B) then
    return nil
  end
  return {a, b}
end

local function positive(x)
  return x[1] > 0 or (x[1] == 0 and x[2] > 0)
end

local function parse_double(v)
  if type(v) == 'number' then return v end
  local lower = string.lower(v)
  if lower == 'inf' or lower == '+inf' then return math.huge end
  if lower == '-inf' then return -math.huge end
  local number = tonumber(v)
  if number == nil or number ~= number then return nil end
  return number
end

local function u64cmp(x, y)
  if #x ~= #y then return #x < #y and -1 or 1 end
  if x == y then return 0 end
  return x < y and -1 or 1
end

local function id_greater(a, b)
  local ams, aseq = string.match(a, '^(%d+)-(%d+)$')
  local bms, bseq = string.match(b, '^(%d+)-(%d+)$')
  if not ams or not bms then return false end
  local c = u64cmp(ams, bms)
  if c ~= 0 then return c > 0 end
  return u64cmp(aseq, bseq) > 0
end

local function stream_last(key)
  local info = redis.call('XINFO', 'STREAM', key)
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then return info[i + 1] end
  end
  return '0-0'
end

local function sim_type(st, key)
  local t = st.types[key]
  if t == nil then
    t = redis.call('TYPE', key)['ok']
    st.types[key] = t
  end
  return t
end

-- the key now holds a new value of type t that the simulation knows completely
local function sim_reset(st, key, t)
  st.types[key], st.fresh[key], st.str[key], st.sub[key], st.size[key] = t, true, nil, {}, 0
  st.xlast[key] = (t == 'stream') and '0-0' or nil
end

-- a field's value / a member's score / set membership: the simulation's if it has one, else
-- the server's (false when absent)
local function sim_sub(st, key, member, command)
  local overlay = st.sub[key]
  if overlay == nil then
    overlay = {}
    st.sub[key] = overlay
  end
  local v = overlay[member]
  if v ~= nil then return v end
  if st.fresh[key] then return false end
  v = redis.call(command, key, member)
  if v == 0 then return false end -- SISMEMBER
  return v
end

local SIZE = {hash = 'HLEN', set = 'SCARD', zset = 'ZCARD'}
local MEMBER = {hash = 'HGET', set = 'SISMEMBER', zset = 'ZSCORE'}

-- Removing a collection's last member deletes the key, and what follows (SET NX, a command of
-- another type) depends on that, so keys that lose members have their size counted exactly.
local function sim_count(st, key, t, member, adding)
  if not st.track[key] then return end
  local size = st.size[key]
  if size == nil then
    size = st.fresh[key] and 0 or redis.call(SIZE[t], key)
  end
  local existed = sim_sub(st, key, member, MEMBER[t]) ~= false
  if adding and not existed then size = size + 1 end
  if not adding and existed then size = size - 1 end
  st.size[key] = size
end

local function sim_string(st, key, t)
  if t == 'none' then return {0, 0} end
  local v = st.str[key]
  if v == nil then v = redis.call('GET', key) end
  return parse_int(v)
end

local function sim_set(st, op)
  local src, a, n = op.src, op.a, op.n
  local nx, xx, i = false, false, a + 1
  while i <= a + n - 1 do
    local flag = src[i]
    if flag == 'NX' then nx = true
    elseif flag == 'XX' then xx = true
    elseif flag == 'EX' or flag == 'PX' then
      local ttl = parse_int(src[i + 1] or '')
      if ttl == nil or not positive(ttl) then return "ERR invalid expire time in 'set' command" end
      i = i + 1
    else return 'ERR syntax error' end
    i = i + 1
  end
  if n < 1 or (nx and xx) then return 'ERR syntax error' end
  if nx or xx then
    local exists = sim_type(st, op.key) ~= 'none'
    if (nx and exists) or (xx and not exists) then return nil end
  end
  sim_reset(st, op.key, 'string')
  st.str[op.key] = src[a]
  return nil
end

local function sim_xadd(st, op, t)
  local key, id = op.key, op.src[op.a]
  if op.n < 3 or op.n % 2 ~= 1 then return 'ERR wrong number of arguments for XADD' end
  if t == 'none' then sim_reset(st, key, 'stream') end
  local last = st.xlast[key]
  if last == nil then last = stream_last(key) end
  if id == '*' then
    if last == MAX_ID then return 'ERR The stream has exhausted the last possible ID' end
    st.xlast[key] = 'auto'
    return nil
  end
  if last == 'auto' then
    return 'ERR an explicit stream id after an automatic one in one branch cannot be checked'
  end
  if not id_greater(id, last) then
    return 'ERR The ID specified in XADD is equal or smaller than the target stream top item'
  end
  st.xlast[key] = id
  return nil
end

local function sim_op(st, op)
  local cmd, key, src, a, n = op.cmd, op.key, op.src, op.a, op.n
  if cmd == 'SET' then return sim_set(st, op) end
  if cmd == 'DEL' then
    sim_reset(st, key, 'none')
    return nil
  end
  if cmd == 'EXPIRE' then
    local ttl = parse_int(src[a] or '')
    if ttl == nil then return NOT_INTEGER end
    if not positive(ttl) and sim_type(st, key) ~= 'none' then sim_reset(st, key, 'none') end
    return nil
  end
  local t, want = sim_type(st, key), NEEDS[cmd]
  if t ~= 'none' and t ~= want then return WRONGTYPE end
  if cmd == 'INCRBY' then
    local current, amount = sim_string(st, key, t), parse_int(src[a] or '')
    if current == nil or amount == nil then return NOT_INTEGER end
    local new = add_int(current, amount)
    if new == nil then return OVERFLOW end
    if t == 'none' then sim_reset(st, key, 'string') end
    st.str[key] = new
    return nil
  end
  if n < 1 then return 'ERR wrong number of arguments for ' .. cmd end
  if cmd == 'XADD' then return sim_xadd(st, op, t) end
  if t == 'none' and (cmd == 'HSET' or cmd == 'SADD' or cmd == 'ZADD' or cmd == 'LPUSH'
      or cmd == 'RPUSH' or cmd == 'HINCRBY' or cmd == 'ZINCRBY') then
    sim_reset(st, key, want)
    t = want
  end
  if t == 'none' then return nil end -- HDEL, SREM, ZREM of a missing key: nothing to do
  if st.sub[key] == nil then st.sub[key] = {} end
  local overlay = st.sub[key]
  if cmd == 'HSET' or cmd == 'ZADD' then
    if n % 2 ~= 0 then return 'ERR wrong number of arguments for ' .. cmd end
    for i = a, a + n - 1, 2 do
      if cmd == 'HSET' then
        sim_count(st, key, t, src[i], true)
        overlay[src[i]] = src[i + 1]
      else
        local score = parse_double(src[i])
        if score == nil then return 'ERR value is not a valid float' end
        sim_count(st, key, t, src[i + 1], true)
        overlay[src[i + 1]] = score
      end
    end
  elseif cmd == 'SADD' or cmd == 'SREM' then
    for i = a, a + n - 1 do
      sim_count(st, key, t, src[i], cmd == 'SADD')
      if st.track[key] then overlay[src[i]] = (cmd == 'SADD') end
    end
  elseif cmd == 'HDEL' or cmd == 'ZREM' then
    for i = a, a + n - 1 do
      sim_count(st, key, t, src[i], false)
      overlay[src[i]] = false
    end
  elseif cmd == 'HINCRBY' then
    local current = sim_sub(st, key, src[a], 'HGET')
    local amount = parse_int(src[a + 1] or '')
    if amount == nil then return NOT_INTEGER end
    sim_count(st, key, t, src[a], true)
    current = (current == false) and {0, 0} or parse_int(current)
    if current == nil then return HASH_NOT_INTEGER end
    local new = add_int(current, amount)
    if new == nil then return OVERFLOW end
    overlay[src[a]] = new
  elseif cmd == 'ZINCRBY' then
    local current = sim_sub(st, key, src[a + 1], 'ZSCORE')
    local amount = parse_double(src[a] or '')
    if amount == nil then return 'ERR value is not a valid float' end
    sim_count(st, key, t, src[a + 1], true)
    current = (current == false) and 0 or parse_double(current)
    local new = current + amount
    if new ~= new then return 'ERR resulting score is not a number (NaN)' end
    overlay[src[a + 1]] = new
  end
  if st.track[key] and SIZE[t] and st.size[key] == 0 then sim_reset(st, key, 'none') end
  return nil
end

-- nil if the whole write set would run without an error now, else (op index, key, message)
local function validate(ops)
  local st = {types = {}, fresh = {}, str = {}, sub = {}, xlast = {}, track = {}, size = {}}
  for _, op in ipairs(ops) do
    if op.cmd == 'HDEL' or op.cmd == 'SREM' or op.cmd == 'ZREM' then st.track[op.key] = true end
  end
  for i, op in ipairs(ops) do
    local err = sim_op(st, op)
    if err then return i, op.key, err end
  end
  return nil
end

local function apply_one(op)
  local last = op.a + op.n - 1
  if not CHUNKED[op.cmd] or op.n <= CHUNK then
    redis.call(op.cmd, op.key, unpack(op.src, op.a, last))
  else
    for i = op.a, last, CHUNK do
      redis.call(op.cmd, op.key, unpack(op.src, i, math.min(i + CHUNK - 1, last)))
    end
  end
end

-- Runs of SETs without options go as one MSET per CHUNK pairs: the same writes in the same
-- order (a later value of a key wins, as it would one SET at a time; MSET, like such a SET,
-- drops a TTL). A Spark partition is mostly that, and a redis.call per key, each its own
-- command in the AOF, was most of a large commit.
local function apply(ops)
  local run, count = {}, 0
  for _, op in ipairs(ops) do
    if op.cmd == 'SET' and op.n == 1 then
      run[count + 1], run[count + 2], count = op.key, op.src[op.a], count + 2
      if count >= 2 * CHUNK then
        redis.call('MSET', unpack(run, 1, count))
        count = 0
      end
    else
      if count > 0 then redis.call('MSET', unpack(run, 1, count)) end
      count = 0
      apply_one(op)
    end
  end
  if count > 0 then redis.call('MSET', unpack(run, 1, count)) end
end

-- watched keys: ARGV[p], ARGV[p + 1] = index into the data keys, fingerprint; nil or the key
local function changed_watch(p, count, data)
  for _ = 1, count do
    local key = KEYS[data + tonumber(ARGV[p])]
    if key == nil or not unchanged(key, ARGV[p + 1]) then return key or 'invalid watch index' end
    p = p + 2
  end
  return nil
end
