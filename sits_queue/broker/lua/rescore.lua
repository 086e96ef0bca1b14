-- rescore.lua: rewrite the priority part of waiting messages' scores, keeping arrival order.
-- A message that was picked meanwhile is not in the waiting set and stays untouched (XX).
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)
-- ARGV: pairs of (id, score base)
-- Returns the number rewritten.
local n = 0
for i = 1, #ARGV, 2 do
  local old = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if old then
    local seq = tonumber(old) % 4294967296
    redis.call('ZADD', KEYS[1], 'XX', string.format('%.0f', tonumber(ARGV[i + 1]) + seq), ARGV[i])
    n = n + 1
  end
end
return n
