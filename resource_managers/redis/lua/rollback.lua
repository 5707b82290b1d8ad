-- rollback: release a branch's locks, drop its staged set, leave the aborted tombstone.
-- KEYS: 1 tx hash, 2 ws list, 3 prepared zset; the lock keys are the staged header's (see the
--       rules in common.lua; none when nothing was staged: a prepare still on its way then
--       finds the tombstone and refuses)
-- ARGV: 1 gid, 2 prefix, 3 tombstone ttl (s)
-- Reply: {'OK'} | {'STATE', 'committed' or 'committing'} (a commit got there first: nothing
--        is undone; a 'committing' branch is finished by the next commit call)
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
release(locks, 0, #locks, gid)
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'state', 'aborted', 'ts', now_ms())
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('ZREM', KEYS[3], gid)
return {'OK'}
