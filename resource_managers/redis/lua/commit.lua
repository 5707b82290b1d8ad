-- commit: apply a prepared branch's staged write set, release its locks, leave a marker.
-- KEYS: 1 tx hash, 2 ws list, 3 prepared zset; for a write set that is not plain SETs also
--       4 .. 3+n lock keys, 4+n .. 3+2n data keys (the staged header's, declared)
-- ARGV: 1 gid, 2 prefix, 3 tombstone ttl (s), 4 at most this many SETs per call (0: all)
-- Reply: {'OK'} | {'MORE'} (a bounded step is done: call again)
--        | {'KEYS'} (declare the staged keys: this write set is not plain SETs)
--        | {'STATE', state or ''}
--        | {'BROKEN', key, message} (someone made the write set invalid; nothing written)
--        | {'LOST', what} (the staged set is missing or malformed)
--
-- Plain SETs (the prepare recorded plain = '1') take their keys from the staged header, on a
-- standalone server without declaring them (see the rules in common.lua; on Redis Cluster the
-- caller declares them, checked against the header, because a node importing the slot would
-- serve a one-key command on an undeclared key that still lives on the other node). An
-- undeclared key is checked only when a call touches it (an ACL refusing it), so such a call
-- may fail after earlier writes of the script stand. The order makes that harmless: first the SETs, under the locks, which
-- only re-applying (the same values) can follow; then 'applied' in the record; then the locks,
-- each released at most once (release checks the owner); then the end. The record says
-- 'committing' from the first SET on, so a rollback undoes nothing, and the next commit call
-- goes on from what the record says. With ARGV[4] > 0 a call applies at most that many SETs
-- and releases at most that many locks, so a large branch commits in bounded steps.
-- Any other write set is checked and applied in one call with every key declared.
local gid, prefix, ttl = ARGV[1], ARGV[2], ARGV[3]
local limit = tonumber(ARGV[4] or '') or 0
local LOST = {'LOST', 'the staged write set is missing or malformed'}

-- whether the data keys KEYS declares (after check_layout, which checks their lock keys) are
-- the staged header's, list[off + 1 .. off + n]
local function declares(list, off, n)
  for i = 1, n do
    if KEYS[3 + n + i] ~= list[off + i] then return false end
  end
  return true
end

local function finish()
  redis.call('DEL', KEYS[2])
  redis.call('HDEL', KEYS[1], 'applied', 'released')
  redis.call('HSET', KEYS[1], 'state', 'committed', 'ts', now_ms())
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('ZREM', KEYS[3], gid)
  return {'OK'}
end

-- plain SETs: the next SETs (at most bound), else the next locks (at most bound), else the end
local function plain_step(n, count, bound)
  local done = tonumber(redis.call('HGET', KEYS[1], 'applied') or '0')
  if done < count then
    local from = 2 + n + 4 * done
    local slice = redis.call('LRANGE', KEYS[2], from, from + 4 * bound - 1)
    local sets = {}
    local pairs_ = plain_sets(slice, 1, #slice, nil, sets)
    if not pairs_ or #slice == 0 then return LOST end
    -- first a write Redis allows at maxmemory (a field no record being committed has): after
    -- one, a script may go on growing memory; a function has allow-oom instead
    redis.call('HDEL', KEYS[1], 'reason')
    redis.call('HSET', KEYS[1], 'state', 'committing')
    mset_pairs(sets, pairs_)
    done = done + #slice / 4
    redis.call('HSET', KEYS[1], 'applied', done)
    if done < count then return {'MORE'} end
  end
  local freed = tonumber(redis.call('HGET', KEYS[1], 'released') or '0')
  if freed < n then
    local keys = redis.call('LRANGE', KEYS[2], 2 + freed, 1 + math.min(freed + bound, n))
    local locks = {}
    for i = 1, #keys do locks[i] = prefix .. 'lock:' .. keys[i] end
    redis.call('HDEL', KEYS[1], 'reason') -- as above
    redis.call('HSET', KEYS[1], 'state', 'committing')
    release(locks, 0, #locks, gid)
    freed = freed + #keys
    redis.call('HSET', KEYS[1], 'released', freed)
    if freed < n then return {'MORE'} end
  end
  return finish()
end

local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'prepared' and state ~= 'committing' then return {'STATE', state or ''} end
local head = redis.call('LRANGE', KEYS[2], 0, 1)
local n, size = tonumber(head[2] or ''), redis.call('LLEN', KEYS[2])
if head[1] ~= MAGIC or n == nil or size < 2 + n then return LOST end
if state == 'committing' or redis.call('HGET', KEYS[1], 'plain') == '1' then
  if (size - 2 - n) % 4 ~= 0 then return LOST end
  -- declared (on Redis Cluster, always): they must be the staged header's
  if #KEYS > 3 and (check_layout(3, n, prefix)
      or not declares(redis.call('LRANGE', KEYS[2], 2, 1 + n), 0, n)) then
    return {'KEYS'}
  end
  local count = (size - 2 - n) / 4
  return plain_step(n, count, limit > 0 and limit or count + n + 1)
end
if #KEYS == 3 and n > 0 then return {'KEYS'} end
if check_layout(3, n, prefix) then return {'KEYS'} end -- before reading the whole set
local ws = redis.call('LRANGE', KEYS[2], 0, -1)
local first
n, first = header(ws)
if n == nil then return LOST end
if not declares(ws, 2, n) then return {'KEYS'} end
local ops, err = parse(ws, first, #ws, key_set(KEYS, 3 + n, n))
if not ops then return {'LOST', err} end
local index, key, message = validate(ops)
local now = now_ms()
release(KEYS, 3, n, gid)
if index then
  -- a writer outside twopc changed a key so that a command would fail half-way: apply nothing
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'state', 'aborted', 'ts', now, 'reason',
    'commit found ' .. key .. ': ' .. message)
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('ZREM', KEYS[3], gid)
  return {'BROKEN', key, message}
end
apply(ops)
return finish()
