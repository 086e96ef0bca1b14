-- ack.lua: forget delivered messages for good.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV: ids
-- Returns how many were still unacked.
-- An ack that comes after the sweep restored its message (the holder's heartbeat was
-- late) takes it out of the waiting set too: the task ran, and an id left waiting
-- without its payload would be counted as waiting until a pick skipped it.
local n = 0
for i = 1, #ARGV do
  local id = ARGV[i]
  n = n + redis.call('ZREM', KEYS[6], id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('HDEL', KEYS[7], id)
  redis.call('HDEL', KEYS[8], id)
  redis.call('HDEL', KEYS[11], id)
  -- (a yield claim or an affinity skip stamp it got while back in the waiting set)
  redis.call('HDEL', KEYS[12], id)
  redis.call('HDEL', KEYS[13], id)
  redis.call('HDEL', KEYS[14], id)
  redis.call('SREM', KEYS[15], id)
  redis.call('HDEL', KEYS[17], id)
end
return n
