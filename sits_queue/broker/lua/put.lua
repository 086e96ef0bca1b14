-- put.lua: enqueue one message, or many (ARGV repeats in groups of five).
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
-- ARGV (per message): id, payload JSON, meta JSON, score base ((levels - level) * 2^32),
--                      SLA class ("~class": a task the statistics do not count, such as
--                      a pre-warm: announced, but no arrival counted)
-- Returns {messages enqueued, waiting after}: equal when the queue was empty before, so
-- the caller (re-)registers the queue exactly when it appears.
--
-- One variadic HSET/ZADD per slice of messages instead of four calls per message: a
-- chunk of 200 costs Redis about a third of the time, which is what bulk enqueue and the
-- workers' picks waiting behind it feel. Slices keep unpack() under Lua's C-stack limit.
--
-- A put runs whole or leaves the queue as it was: one that failed after writing a
-- message was retried by the producer, and its task ran twice. A key of another type
-- (written by hand or by another program) is met by the write that touches it, not
-- checked before every put (four TYPE calls, a third of this script's time for one
-- message): that write's failure undoes the writes before it, and the refusal names the
-- key. The waiting ZADD comes last: nothing after it can fail on a key's type.
local SLICE = 500
local n = math.floor(#ARGV / 5)
if n == 0 then return {0, redis.call('ZCARD', KEYS[1])} end
-- The arrival counter wraps at 2^32 so it never carries into the priority bits; one
-- INCRBY reserves the chunk's n consecutive values, kept in ARGV order.
local first = redis.pcall('INCRBY', KEYS[5], n)
if type(first) ~= 'number' then
  redis.call('GET', KEYS[5])  -- a key of another type: Redis's refusal, nothing written
  redis.call('SET', KEYS[5], n)  -- a value INCRBY refuses (another program's): anew
  first = n
end
first = first - n
local arrivals, announced = {}, {}
for m = 0, n - 1 do
  local cls = ARGV[m * 5 + 5]
  if string.sub(cls, 1, 1) == '~' then
    announced[string.sub(cls, 2)] = true
  else
    arrivals[cls] = (arrivals[cls] or 0) + 1
    announced[cls] = true
  end
end
for cls, count in pairs(arrivals) do add_count(KEYS[10], cls, count) end

local written = 0  -- messages whose writes may have been made
-- The writes so far undone; the refusal naming KEYS[i] if it is of another type, else
-- the write's own error.
local function undo(i, failed)
  for s = 0, written - 1, SLICE do
    local ids = {}
    for m = s, math.min(written, s + SLICE) - 1 do ids[#ids + 1] = ARGV[m * 5 + 1] end
    redis.pcall('HDEL', KEYS[2], unpack(ids))
    redis.pcall('HDEL', KEYS[3], unpack(ids))
    redis.pcall('ZREM', KEYS[1], unpack(ids))
  end
  for cls, count in pairs(arrivals) do redis.pcall('HINCRBY', KEYS[10], cls, -count) end
  return wrong_type(i) or failed
end

local done = redis.pcall('ZADD', KEYS[4], 0, 'ready')
if type(done) == 'table' then return undo(4, done) end
for s = 0, n - 1, SLICE do
  local payloads, metas, scores = {}, {}, {}
  for m = s, math.min(n, s + SLICE) - 1 do
    local i = m * 5 + 1
    local id = ARGV[i]
    local seq = (first + m + 1) % 4294967296
    payloads[#payloads + 1] = id
    payloads[#payloads + 1] = ARGV[i + 1]
    metas[#metas + 1] = id
    metas[#metas + 1] = ARGV[i + 2]
    -- %.0f: Lua's default number format would round scores above 1e14.
    scores[#scores + 1] = string.format('%.0f', tonumber(ARGV[i + 3]) + seq)
    scores[#scores + 1] = id
  end
  written = math.min(n, s + SLICE)
  done = redis.pcall('HSET', KEYS[2], unpack(payloads))
  if type(done) == 'table' then return undo(2, done) end
  done = redis.pcall('HSET', KEYS[3], unpack(metas))
  if type(done) == 'table' then return undo(3, done) end
  done = redis.pcall('ZADD', KEYS[1], unpack(scores))
  if type(done) == 'table' then return undo(1, done) end
end
-- Running tasks of lower classes listen here (workers/slices.py): a put of a class
-- that outranks them is their cue to check whether to yield their slot.
for cls, _ in pairs(announced) do redis.call('PUBLISH', KEYS[1] .. ':put', cls) end
return {n, redis.call('ZCARD', KEYS[1])}
