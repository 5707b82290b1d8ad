-- commit: apply a prepared branch's staged write set, release its locks, leave a marker.
-- KEYS: 1 tx hash, 2 ws list, 3 prepared zset; the data and lock keys are the staged header's
--       (see the rules in common.lua)
-- ARGV: 1 gid, 2 prefix, 3 tombstone ttl (s)
-- Reply: {'OK'} | {'STATE', state or ''}
--        | {'BROKEN', key, message} (someone made the write set invalid; nothing written)
--        | {'LOST', what} (the staged set is missing or malformed)
local gid, prefix, ttl = ARGV[1], ARGV[2], ARGV[3]
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'prepared' then return {'STATE', state or ''} end
local ws = redis.call('LRANGE', KEYS[2], 0, -1)
local n, first = header(ws)
if n == nil then return {'LOST', 'the staged write set is missing or malformed'} end
local keys = staged_keys(ws, n, prefix)
local allowed = key_set(keys, n, n)
local sets, count = plain_sets(ws, first, #ws, allowed)
local ops, err, index, key, message
if not sets then
  ops, err = parse(ws, first, #ws, allowed)
  if not ops then return {'LOST', err} end
  index, key, message = validate(ops)
end
local now = now_ms()
release(keys, 0, n, gid)
redis.call('DEL', KEYS[2])
if index then
  -- a writer outside twopc changed a key so that a command would fail half-way: apply nothing
  redis.call('HSET', KEYS[1], 'state', 'aborted', 'ts', now, 'reason',
    'commit found ' .. key .. ': ' .. message)
else
  if sets then mset_pairs(sets, count) else apply(ops) end
  redis.call('HSET', KEYS[1], 'state', 'committed', 'ts', now)
end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('ZREM', KEYS[3], gid)
if index then return {'BROKEN', key, message} end
return {'OK'}
