-- undead.lua: drop the dead-letter record a requeue put back, and only that one. A
-- pick may have met the requeued message between its put and this call and
-- dead-lettered it again (it is as broken as before): that new record must stay, or
-- the message would be nowhere (not waiting, not held, not dead).
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
-- ARGV: 1 message id, 2 the dead-letter record as the requeue read it
-- Returns 1 when that record was dropped, 0 when another one is there now (or none).
if redis.call('HGET', KEYS[9], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[9], ARGV[1])
end
return 0
