-- rollback: release a branch's locks, drop its staged set, leave the aborted tombstone.
-- KEYS: 1 tx hash, 2 ws list, 3 prepared zset, then either nothing (the lock keys are the
--       staged header's: see the rules in common.lua; none when nothing was staged, and a
--       prepare still on its way then finds the tombstone and refuses) or 4 .. 3+n the lock
--       keys of the staged header, declared (on Redis Cluster, always)
-- ARGV: 1 gid, 2 prefix, 3 tombstone ttl (s)
-- Reply: {'OK'} | {'STATE', 'committed' or 'committing'} (a commit got there first: nothing
--        is undone; the caller finishes a 'committing' one) | {'KEYS', n} (declared keys that
--        are not the staged header's: pass them again)
local gid, prefix, ttl = ARGV[1], ARGV[2], ARGV[3]
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'committed' or state == 'committing' then return {'STATE', state} end
if state == 'aborted' then
  redis.call('ZREM', KEYS[3], gid)
  return {'OK'}
end
local locks = {}
local head = redis.call('LRANGE', KEYS[2], 0, 1)
if head[1] == MAGIC then
  local n = tonumber(head[2]) or 0
  if n > 0 then
    local keys = redis.call('LRANGE', KEYS[2], 2, 1 + n)
    for i = 1, #keys do locks[i] = prefix .. 'lock:' .. keys[i] end
  end
end
if #KEYS > 3 then
  if #KEYS ~= 3 + #locks then return {'KEYS', #locks} end
  for i = 1, #locks do
    if KEYS[3 + i] ~= locks[i] then return {'KEYS', #locks} end
  end
end
release(locks, 0, #locks, gid)
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'state', 'aborted', 'ts', now_ms())
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('ZREM', KEYS[3], gid)
return {'OK'}
