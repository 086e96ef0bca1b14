-- purge.lua: drop up to ARGV[1] waiting messages (one bounded chunk; call until 0).
-- Unacked messages are left alone, as kombu's purge does.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV: chunk size
-- Returns the ids removed (their replicas at a peer site go too, broker/sites.py).
local ids = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('HDEL', KEYS[8], id)
  redis.call('HDEL', KEYS[11], id)
  redis.call('HDEL', KEYS[13], id)
  redis.call('HDEL', KEYS[12], id)
  redis.call('HDEL', KEYS[14], id)
end
if redis.call('ZCARD', KEYS[1]) == 0 then redis.call('DEL', KEYS[4]) end
return ids
