-- one-phase commit: check and apply a write set at once (the branch is the only participant).
-- It leaves a short-lived committed marker, so a call repeated after a lost reply (redis-py
-- retries on connection errors by default) finds it instead of applying the writes twice.
-- KEYS: 1 marker (tx hash), 2 .. n+1 lock keys, n+2 .. 2n+1 data keys
-- ARGV: 1 gid, 2 prefix, 3 n, 4 number of watches, 5 marker ttl (s), then (data key index,
--       fingerprint) per watch, then the write set as one packed argument (decode)
-- Reply: {'OK'} | {'STATE', state} | {'CHANGED', key} | {'LOCKED', key, owner}
--        | {'INVALID', key, message} | {'BAD', what}
local gid, prefix, n, watches = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local state = redis.call('HGET', KEYS[1], 'state')
if state then return {'STATE', state} end
local bad = check_layout(1, n, prefix)
if bad then return {'BAD', bad} end
local changed = changed_watch(6, watches, 1 + n)
if changed then return {'CHANGED', changed} end
local locked, owner = other_lock(1, n, gid)
if locked then return {'LOCKED', locked, owner} end
local packed = 6 + 2 * watches
local src = #ARGV == packed and decode(ARGV[packed])
if not src then return {'BAD', 'the packed write set is malformed'} end
local allowed = key_set(KEYS, 1 + n, n)
local sets = {}
local count = plain_sets(src, 1, #src, allowed, sets)
if count then
  mset_pairs(sets, count)
else
  local ops, err = parse(src, 1, #src, allowed)
  if not ops then return {'BAD', err} end
  local index, key, message = validate(ops)
  if index then return {'INVALID', key, message} end
  apply(ops)
end
redis.call('HSET', KEYS[1], 'state', 'committed')
redis.call('EXPIRE', KEYS[1], ARGV[5])
return {'OK'}
