-- prepare: make the branch's write set durable and promise to commit it.
-- KEYS: 1 tx hash, 2 ws list, 3 prepared zset, 4 .. 3+n lock keys, 4+n .. 3+2n data keys
-- ARGV: 1 gid, 2 prefix, 3 n, 4 number of watches, then (data key index, fingerprint) per
--       watch, then the write set as one packed argument (decode)
-- Reply: {'OK'} | {'STATE', state} | {'CHANGED', key} | {'LOCKED', key, owner}
--        | {'INVALID', key, message} | {'BAD', what}
local gid, prefix, n, watches = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'prepared' then return {'OK'} end -- a repeated prepare (its answer was lost)
if state then return {'STATE', state} end -- 'aborted': the tombstone refuses a late prepare
local bad = check_layout(3, n, prefix)
if bad then return {'BAD', bad} end
local changed = changed_watch(5, watches, 3 + n)
if changed then return {'CHANGED', changed} end
local locked, owner = other_lock(3, n, gid)
if locked then return {'LOCKED', locked, owner} end
local packed = 5 + 2 * watches
local src = #ARGV == packed and decode(ARGV[packed])
if not src then return {'BAD', 'the packed write set is malformed'} end
local allowed = key_set(KEYS, 3 + n, n)
local plain = plain_sets(src, 1, #src, allowed, nil) and '1' or '0'
if plain == '0' then
  local ops, err = parse(src, 1, #src, allowed)
  if not ops then return {'BAD', err} end
  local index, key, message = validate(ops)
  if index then return {'INVALID', key, message} end
end
-- every check passed: from here on, only writes that cannot fail
lock_all(3, n, gid)
redis.call('DEL', KEYS[2])
local head = {MAGIC, tostring(n)}
for i = 1, n do head[2 + i] = KEYS[3 + n + i] end
push(KEYS[2], head, 1, #head)
push(KEYS[2], src, 1, #src)
local now = now_ms()
redis.call('HSET', KEYS[1], 'state', 'prepared', 'ts', now, 'plain', plain)
redis.call('ZADD', KEYS[3], now, gid)
return {'OK'}
