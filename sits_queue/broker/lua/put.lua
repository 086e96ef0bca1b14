-- put.lua: enqueue one message, or many (ARGV repeats in groups of five).
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)
-- ARGV (per message): id, payload JSON, meta JSON, score base ((levels - level) * 2^32),
--                      SLA class
-- Returns {messages enqueued, waiting after}: equal when the queue was empty before, so
-- the caller (re-)registers the queue exactly when it appears.
local n = 0
for i = 1, #ARGV, 5 do
  local id = ARGV[i]
  -- The counter wraps at 2^32 so it never carries into the priority bits.
  local seq = redis.call('INCR', KEYS[5]) % 4294967296
  local score = tonumber(ARGV[i + 3]) + seq
  redis.call('HSET', KEYS[2], id, ARGV[i + 1])
  redis.call('HSET', KEYS[3], id, ARGV[i + 2])
  -- %.0f: Lua's default number format would round scores above 1e14.
  redis.call('ZADD', KEYS[1], string.format('%.0f', score), id)
  redis.call('HINCRBY', KEYS[10], ARGV[i + 4], 1)
  n = n + 1
end
if n > 0 then redis.call('ZADD', KEYS[4], 0, 'ready') end
return {n, redis.call('ZCARD', KEYS[1])}
