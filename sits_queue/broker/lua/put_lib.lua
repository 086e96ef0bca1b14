-- put_lib.lua: the put itself, prepended (after queue_types.lua) to put.lua and
-- requeue.lua (scripts.py LIBRARIES). The caller has checked the key types first.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
--
-- One variadic HSET/ZADD per slice of messages instead of four calls per message: a
-- chunk of 200 costs Redis about a third of the time, which is what bulk enqueue and the
-- workers' picks waiting behind it feel. Slices keep unpack() under Lua's C-stack limit.
-- The sequence and the arrivals are read before any message is written, by calls that
-- fail on a key of another type, and a value of theirs their INCRBY refuses starts again.
local SLICE = 500

-- Enqueue the messages of args, groups of five (put.lua's ARGV: id, payload JSON, meta
-- JSON, score base, SLA class or "~class"); returns {messages enqueued, waiting after}.
local function put_messages(args)
  local n = math.floor(#args / 5)
  if n == 0 then return {0, redis.call('ZCARD', KEYS[1])} end
  -- The arrival counter wraps at 2^32 so it never carries into the priority bits; one
  -- INCRBY reserves the chunk's n consecutive values, kept in args order.
  local first = redis.pcall('INCRBY', KEYS[5], n)
  if type(first) ~= 'number' then
    redis.call('GET', KEYS[5])  -- a key of another type: Redis's refusal, nothing written
    redis.call('SET', KEYS[5], n)  -- a value INCRBY refuses (another program's): anew
    first = n
  end
  first = first - n
  local arrivals, announced = {}, {}
  for m = 0, n - 1 do
    local cls = args[m * 5 + 5]
    if string.sub(cls, 1, 1) == '~' then
      announced[string.sub(cls, 2)] = true
    else
      arrivals[cls] = (arrivals[cls] or 0) + 1
      announced[cls] = true
    end
  end
  for cls, count in pairs(arrivals) do add_count(KEYS[10], cls, count) end
  for s = 0, n - 1, SLICE do
    local payloads, metas, scores = {}, {}, {}
    for m = s, math.min(n, s + SLICE) - 1 do
      local i = m * 5 + 1
      local id = args[i]
      local seq = (first + m + 1) % 4294967296
      payloads[#payloads + 1] = id
      payloads[#payloads + 1] = args[i + 1]
      metas[#metas + 1] = id
      metas[#metas + 1] = args[i + 2]
      -- %.0f: Lua's default number format would round scores above 1e14.
      scores[#scores + 1] = string.format('%.0f', tonumber(args[i + 3]) + seq)
      scores[#scores + 1] = id
    end
    redis.call('HSET', KEYS[2], unpack(payloads))
    redis.call('HSET', KEYS[3], unpack(metas))
    redis.call('ZADD', KEYS[1], unpack(scores))
  end
  redis.call('ZADD', KEYS[4], 0, 'ready')
  -- Running tasks of lower classes listen here (workers/slices.py): a put of a class
  -- that outranks them is their cue to check whether to yield their slot.
  for cls, _ in pairs(announced) do redis.call('PUBLISH', KEYS[1] .. ':put', cls) end
  return {n, redis.call('ZCARD', KEYS[1])}
end
