-- arm.lua: set a queue's wake-up marker again if messages wait in it. Called after a
-- blocking wait that may have taken the marker is given up (broker/wait.py), or when a
-- wait woke for a queue its channel no longer consumes: the wake-up goes back to the
-- queue's other consumers instead of being lost.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV: none.
-- Returns 1 if the marker is set, 0 if nothing waits (then no key is made: a deleted
-- reply queue stays deleted).
if redis.call('ZCARD', KEYS[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[4], 0, 'ready')
-- A reply queue's keys expire together (kombu's x-expires); a marker made here would
-- otherwise outlive them.
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[4], ttl) end
return 1
