-- release.lua: give delivered messages back, untouched, because the worker chose not to
-- start them (e.g. its device lacks the VRAM the task declares). Like restore.lua with
-- explicit ids, but the redelivery counter is NOT incremented: the message did not crash
-- anyone, so it must never be dead-lettered as a poison message for being released.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH
-- ARGV: ids
-- Returns the number released.
local n = 0
for i = 1, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', KEYS[6], id) == 1 then
    local score = redis.call('HGET', KEYS[7], id)
    redis.call('HDEL', KEYS[7], id)
    if redis.call('HEXISTS', KEYS[2], id) == 1 then
      -- Same place as before the pick: releasing must not cost the task its priority.
      redis.call('ZADD', KEYS[1], score or 0, id)
      n = n + 1
    end
  end
end
if n > 0 then redis.call('ZADD', KEYS[4], 0, 'ready') end
return n
