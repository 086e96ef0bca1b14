-- dead.lua: move a message (waiting or unacked) to the dead-letter hash with a reason.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV: now (unix s), reason, ids
-- Returns how many records were written.
local n = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  local payload = redis.call('HGET', KEYS[2], id)
  if payload then
    redis.call('HSET', KEYS[9], id, cjson.encode({reason = ARGV[2], at = tonumber(ARGV[1]),
                                                payload = payload,
                                                meta = redis.call('HGET', KEYS[3], id)}))
    n = n + 1
  end
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', KEYS[6], id)
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('HDEL', KEYS[7], id)
  redis.call('HDEL', KEYS[8], id)
  redis.call('HDEL', KEYS[11], id)
  redis.call('HDEL', KEYS[13], id)
  redis.call('HDEL', KEYS[12], id)
  redis.call('HDEL', KEYS[14], id)
  redis.call('SREM', KEYS[15], id)
  redis.call('HDEL', KEYS[17], id)
end
return n
