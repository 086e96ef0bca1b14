-- release.lua: give delivered messages back, untouched, because the worker chose not to
-- start them (e.g. its device lacks the VRAM the task declares). Like restore.lua with
-- explicit ids, but the redelivery counter is NOT incremented: the message did not crash
-- anyone, so it must never be dead-lettered as a poison message for being released.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
-- ARGV: releasing consumer, hold until (unix s; 0 for no hold), then ids
-- With a hold, pick.lua does not offer these messages back to that consumer before then
-- (it takes the tasks behind them instead); every other consumer may take them at once.
-- Returns the number released.
local n = 0
local consumer, hold_until = ARGV[1], tonumber(ARGV[2])
for i = 3, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', KEYS[6], id) == 1 then
    local score = redis.call('HGET', KEYS[7], id)
    redis.call('HDEL', KEYS[7], id)
    if redis.call('HEXISTS', KEYS[2], id) == 1 then
      -- Same place as before the pick: releasing must not cost the task its priority.
      redis.call('ZADD', KEYS[1], score or 0, id)
      if hold_until > 0 then
        redis.call('HSET', KEYS[13], id, consumer .. ' ' .. ARGV[2])
      end
      n = n + 1
    end
  end
end
if n > 0 then redis.call('ZADD', KEYS[4], 0, 'ready') end
return n
