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
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV: releasing consumer, now (unix s), first hold (s; 0 for none), longest hold (s),
--       then ids
-- With a hold, pick.lua does not offer these messages back to that consumer for the
-- hold (it takes the tasks behind them instead); every other consumer may take them at
-- once. The hold doubles each time the same consumer releases the same message again,
-- up to the longest: a worker that keeps finding a task too big for it looks at it
-- less and less often. The record ("<consumer> <until> <releases>", one for each
-- consumer that gave it back, space-separated: with one, two workers each giving back a
-- '1/h' task undid the other's hold, and passed it back and forth hundreds of times a
-- second) outlives the hold for that count, a consumer's for KEEP_S past its hold, at
-- most MOST of them; ack, dead-lettering and purge drop it.
-- Returns {number released, the hold given to the last of them (s)}.
local KEEP_S, MOST = 600, 32
local n, hold = 0, 0
local consumer, now = ARGV[1], tonumber(ARGV[2])
local first, longest = tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 5, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', KEYS[6], id) == 1 then
    local score = redis.call('HGET', KEYS[7], id)
    redis.call('HDEL', KEYS[7], id)
    redis.call('SREM', KEYS[15], id)
    if redis.call('HEXISTS', KEYS[2], id) == 1 then
      -- Same place as before the pick: releasing must not cost the task its priority.
      redis.call('ZADD', KEYS[1], score or 0, id)
      if first > 0 then
        local releases, kept = 0, {}
        local record = redis.call('HGET', KEYS[13], id)
        for who, till, count in string.gmatch(record or '', '(%S+) (%S+) (%d+)') do
          if who == consumer then
            releases = tonumber(count) + 1
          elseif (tonumber(till) or 0) > now - KEEP_S and #kept < MOST - 1 then
            kept[#kept + 1] = who .. ' ' .. till .. ' ' .. count
          end
        end
        hold = math.min(longest, first * 2 ^ releases)
        kept[#kept + 1] = consumer .. ' ' .. string.format('%.3f', now + hold) .. ' ' .. releases
        redis.call('HSET', KEYS[13], id, table.concat(kept, ' '))
      end
      n = n + 1
    end
    -- (last: a key of another type fails here, the message back in its queue already)
    redis.call('HDEL', KEYS[17], id)
  end
end
if n > 0 then redis.call('ZADD', KEYS[4], 0, 'ready') end
-- A string: a Lua number would reach the client truncated to an integer.
return {n, tostring(hold)}
