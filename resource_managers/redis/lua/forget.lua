-- forget: drop the marker or tombstone of a completed branch (never of a prepared one, nor of
-- one whose commit is under way).
-- KEYS: 1 tx hash.  Reply: 1 if dropped, 0 if nothing (or still prepared)
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'prepared' or state == 'committing' then return 0 end
return redis.call('DEL', KEYS[1])
