-- forget.lua: delete a queue that holds nothing any more (a departed worker's direct
-- queue, a stray reply queue): its counters and bookkeeping go too, in one atomic step,
-- so a put racing the check either lands first (and the queue is kept) or finds it gone
-- and starts it afresh.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV: none
-- Returns 1 when the queue was forgotten, 0 when it still holds something (waiting,
-- unacked, dead-lettered or checkpointed messages, or payloads).
if redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[6], KEYS[9], KEYS[11]) > 0 then
  return 0
end
redis.call('DEL', unpack(KEYS))
return 1
