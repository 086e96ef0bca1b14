-- release.lua: give delivered messages back, untouched, because the worker chose not to
-- start them (e.g. its device lacks the VRAM the task declares). Like restore.lua with
-- explicit ids, but the redelivery counter is NOT incremented: the message did not crash
-- anyone, so it must never be dead-lettered as a poison message for being released.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
-- ARGV: releasing consumer, now (unix s), first hold (s; 0 for none), longest hold (s),
--       then ids
-- With a hold, pick.lua does not offer these messages back to that consumer for the
-- hold (it takes the tasks behind them instead); every other consumer may take them at
-- once. The hold doubles each time the same consumer releases the same message again,
-- up to the longest: a worker that keeps finding a task too big for it looks at it
-- less and less often. The record ("<consumer> <until> <releases>") outlives the hold
-- for that count; ack, dead-lettering and purge drop it.
-- Returns {number released, the hold given to the last of them (s)}.
local n, hold = 0, 0
local consumer, now = ARGV[1], tonumber(ARGV[2])
local first, longest = tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 5, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', KEYS[6], id) == 1 then
    local score = redis.call('HGET', KEYS[7], id)
    redis.call('HDEL', KEYS[7], id)
    if redis.call('HEXISTS', KEYS[2], id) == 1 then
      -- Same place as before the pick: releasing must not cost the task its priority.
      redis.call('ZADD', KEYS[1], score or 0, id)
      if first > 0 then
        local releases = 0
        local record = redis.call('HGET', KEYS[13], id)
        if record then
          local who, _, count = string.match(record, '^(%S*) (%S+) (%d+)$')
          if who == consumer then releases = tonumber(count) + 1 end
        end
        hold = math.min(longest, first * 2 ^ releases)
        redis.call('HSET', KEYS[13], id,
                   consumer .. ' ' .. string.format('%.3f', now + hold) .. ' ' .. releases)
      end
      n = n + 1
    end
  end
end
if n > 0 then redis.call('ZADD', KEYS[4], 0, 'ready') end
-- A string: a Lua number would reach the client truncated to an integer.
return {n, tostring(hold)}
