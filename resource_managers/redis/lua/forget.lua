-- forget: drop the marker or tombstone of a completed branch (never of a prepared one).
-- KEYS: 1 tx hash.  Reply: 1 if dropped, 0 if nothing (or still prepared)
if redis.call('HGET', KEYS[1], 'state') == 'prepared' then return 0 end
return redis.call('DEL', KEYS[1])
