-- undead.lua: drop the dead-letter records a requeue put back, and only those. A pick
-- may have met a requeued message between its put and this call and dead-lettered it
-- again (it is as broken as before): that new record must stay, or the message would
-- be nowhere (not waiting, not held, not dead).
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
-- ARGV: pairs of (message id, its dead-letter record as the requeue read it)
-- Returns how many records were dropped (one another pick wrote meanwhile is kept).
local dropped = 0
for i = 1, #ARGV - 1, 2 do
  if redis.call('HGET', KEYS[9], ARGV[i]) == ARGV[i + 1] then
    dropped = dropped + redis.call('HDEL', KEYS[9], ARGV[i])
  end
end
return dropped
