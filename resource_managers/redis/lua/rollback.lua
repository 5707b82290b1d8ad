-- rollback: release a branch's locks, drop its staged set, leave the aborted tombstone.
-- KEYS: 1 tx hash, 2 ws list, 3 prepared zset, 4 .. 3+n lock keys
-- ARGV: 1 gid, 2 prefix, 3 tombstone ttl (s)
-- Reply: {'OK'} | {'STATE', 'committed'} | {'KEYS', n} (pass the n lock keys of the staged set)
local gid, prefix, ttl = ARGV[1], ARGV[2], ARGV[3]
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'committed' then return {'STATE', state} end
if state == 'aborted' then
  redis.call('ZREM', KEYS[3], gid)
  return {'OK'}
end
local n, keys = 0, {}
local head = redis.call('LRANGE', KEYS[2], 0, 1)
if head[1] == MAGIC then
  n = tonumber(head[2]) or 0
  if n > 0 then keys = redis.call('LRANGE', KEYS[2], 2, 1 + n) end
end
if #KEYS ~= 3 + n then return {'KEYS', n} end
for i = 1, n do
  if KEYS[3 + i] ~= prefix .. 'lock:' .. keys[i] then return {'KEYS', n} end
end
release(3, n, gid)
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'state', 'aborted', 'ts', now_ms())
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('ZREM', KEYS[3], gid)
return {'OK'}
