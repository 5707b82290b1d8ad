-- read: a key's type, optionally its fingerprint (for a watch), and some facts, all at once.
-- KEYS: 1 the key
-- ARGV: 1 '1' to fingerprint, then (fact, argument) pairs: S string, F field, M member,
--       Z score, L list length, N size of a hash, set or sorted set, T time to live (any type),
--       H every field and value of a hash, A every member of a set, R every item of a list
-- Reply: {type, fingerprint or nil, one value per fact (nil when the type does not match)}
local key = KEYS[1]
local t = redis.call('TYPE', key)['ok']
local out = {t, false}
if ARGV[1] == '1' then out[2] = fingerprint(key) end
for i = 2, #ARGV, 2 do
  local fact, arg, value = ARGV[i], ARGV[i + 1], false
  if fact == 'S' and t == 'string' then value = redis.call('GET', key)
  elseif fact == 'F' and t == 'hash' then value = redis.call('HGET', key, arg)
  elseif fact == 'M' and t == 'set' then value = redis.call('SISMEMBER', key, arg)
  elseif fact == 'Z' and t == 'zset' then value = redis.call('ZSCORE', key, arg)
  elseif fact == 'L' and t == 'list' then value = redis.call('LLEN', key)
  elseif fact == 'N' then value = SIZE[t] and redis.call(SIZE[t], key) or 0
  elseif fact == 'T' then value = redis.call('TTL', key)
  elseif fact == 'H' and t == 'hash' then value = redis.call('HGETALL', key)
  elseif fact == 'A' and t == 'set' then value = redis.call('SMEMBERS', key)
  elseif fact == 'R' and t == 'list' then value = redis.call('LRANGE', key, 0, -1) end
  out[#out + 1] = value
end
return out
