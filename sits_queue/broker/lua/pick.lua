-- pick.lua: pop the best waiting message and record it as unacked, atomically, so a
-- popped message is never outside both the queue and the unacked set.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV: now (unix s), max redeliveries before dead-lettering, consumer ('' for none),
--   batch window (0 or absent: no batching; else how deep to look for the picked
--   task's batch kin, workers/batched.py);
--   optional affinity (broker/affinity.py, whose choose() this mirrors): window,
--   priority ratio, max skip s, then name, weight pairs of what the consumer holds warm:
--   'm:<engine key>' (engines: '<model>' or '<model>@<precision>'), 'p:<prefix key>' (KV
--   of prompt prefixes), 'q:<precision>' (the device's advantage at a precision) and
--   'r:memory@<precision>', 'r:compute@<precision>' (its richness in the resource that
--   bounds a task at that precision, §3.1), with 'z:<precision>' pairs: its ridge
--   points, FLOP/byte (figures, not weights);
--   or, instead of affinity, 'join', a batch key, a count: join mode (below);
--   or, instead of affinity, 'noack': the consumer does not ack (kombu's no_ack), so what
--   it takes is forgotten at once, as ack.lua would, instead of recorded as unacked
-- Returns {id, payload, times redelivered, checkpoint or false, 1 if taken ahead of the
-- head by affinity else 0, then id, payload, times of each task taken with it as one
-- batch}; else the number of messages passed over because this consumer released them
-- and their hold has not run out (0 when nothing is waiting at all: the caller waits
-- for a put instead).
-- When the pick dead-lettered poison messages on its way (below), the table of their ids
-- comes last: the reply's one more element, or {number, ids} instead of the number (the
-- caller deletes their replicas at a peer site, broker/sites.py).
-- The checkpoint is what the task saved when it last yielded its slot.
-- Batch kin: waiting tasks whose scoring metadata has the picked task's batch key 'b'
-- (task, model, class), nearest the head first, up to its 'bn' in all; none for (and
-- none that is) a message restored after a crash.
-- Join mode returns only such kin of the given key, up to the count: {id, payload,
-- times, ...}, empty when none waits or the head is no such kin (a running batch's
-- free rows, workers/joins.py).
-- (1 and 13 are read before anything is written: a wrong type fails there, harmless)
local refused = wrong_type(2, 3, 4, 6, 7, 8, 9, 11, 12, 14, 17)
if refused then return refused end
local now, max_redeliveries = ARGV[1], tonumber(ARGV[2])
local consumer = ARGV[3] or ''
-- Most waiting messages one pick looks at (those this consumer holds, poison ones).
local MAX_SCAN = 4096
local poisoned = {}  -- ids dead-lettered as poison messages by this call
local SEQ_SPAN, LEVELS, LEVELS_PER_E = 4294967296, 2097151, 131072
-- affinity.py's FLOOR_SLACK: levels are whole, a floor's rounding error ~1e-9 of one
local FLOOR_SLACK = 1e-6

local function held_by_me(id)
  local held = redis.call('HGET', KEYS[13], id)
  if not held then return false end
  -- "<consumer> <until> <releases>", one per consumer that gave it back (release.lua);
  -- a hold that ran out stays for its count (the next one doubles), and ack drops it.
  for who, till in string.gmatch(held, '(%S+) (%S+) %d+') do
    if who == consumer then
      return tonumber(till) ~= nil and tonumber(till) > tonumber(now)
    end
  end
  return false
end

-- A waiting task's model, prefix key, precision and arithmetic intensity, from its
-- scoring metadata (nil where absent).
local function wants(id)
  local raw = redis.call('HGET', KEYS[3], id)
  if not raw then return nil, nil, nil, nil end
  local ok, record = pcall(cjson.decode, raw)
  if not ok or type(record) ~= 'table' then return nil, nil, nil, nil end
  local model, prefix, precision, ai = record['m'], record['px'], record['q'], record['ai']
  if type(model) ~= 'string' then model = nil end
  if type(prefix) ~= 'string' then prefix = nil end
  if type(precision) ~= 'string' then precision = nil end
  if type(ai) ~= 'number' then ai = nil end
  return model, prefix, precision, ai
end

-- The engine a task needs is held under '<model>@<precision>' when it asks for one. Its
-- prompt prefix counts only where that engine is warm: the KV is that engine's. Its
-- roofline bound here: memory below the ridge point at its precision (fp16 where it
-- names none), compute at or above it.
local function weight_of(warm, ridges, id)
  local model, prefix, precision, ai = wants(id)
  local engine = model
  if model and precision then engine = model .. '@' .. precision end
  local held = (engine and warm['m:' .. engine]) or 0
  local kv = 0
  if held > 0 and prefix then kv = warm['p:' .. prefix] or 0 end
  local bound = 0
  local ridge = ridges[precision or 'fp16']
  if ai and ridge then
    local at = '@' .. (precision or 'fp16')
    if ai < ridge then bound = warm['r:memory' .. at] or 0
    else bound = warm['r:compute' .. at] or 0 end
  end
  return held + kv + ((precision and warm['q:' .. precision]) or 0) + bound
end

-- The warmest task within the window and the priority ratio, if warmer than the head:
-- removed from the queue and returned as {id, score}; nil to take the head as usual.
-- A head passed over is stamped with the time (KEYS[14]); once it has been passed over
-- for max skip s, it is taken (delay scheduling: the wait counts from the first skip,
-- not from its enqueueing, or a deep backlog would switch affinity off).
local function affinity_pick()
  local window = tonumber(ARGV[5] or '')
  if window == nil or window < 2 or #ARGV < 9 then return nil end
  local ratio, max_skip = tonumber(ARGV[6]), tonumber(ARGV[7])
  local warm, tops, ridges = {}, {}, {}
  for i = 8, #ARGV - 1, 2 do
    local w = tonumber(ARGV[i + 1]) or 0
    local space = string.sub(ARGV[i], 1, 2)
    if space == 'z:' then
      ridges[string.sub(ARGV[i], 3)] = w
    else
      warm[ARGV[i]] = w
      if w > (tops[space] or 0) then tops[space] = w end
    end
  end
  local top = (tops['m:'] or 0) + (tops['p:'] or 0) + (tops['q:'] or 0) + (tops['r:'] or 0)
  local near = redis.call('ZRANGE', KEYS[1], 0, window - 1, 'WITHSCORES')
  if #near < 4 then return nil end
  local best_w = weight_of(warm, ridges, near[1])
  if best_w >= top or held_by_me(near[1]) then return nil end
  local since = tonumber(redis.call('HGET', KEYS[14], near[1]) or '')
  -- A stamp no pick of this clock wrote (inf, nan, ahead of now: a record made by hand,
  -- a worker whose clock runs ahead) passed the head over for good: stamped afresh.
  if since and not (since <= tonumber(now) and since > -math.huge) then
    since = nil
    redis.call('HDEL', KEYS[14], near[1])
  end
  if since and tonumber(now) - since >= max_skip then return nil end
  local head_level = LEVELS - math.floor(tonumber(near[2]) / SEQ_SPAN)
  local floor = math.log(1 + (math.exp(head_level / LEVELS_PER_E) - 1) / ratio) * LEVELS_PER_E
  local best
  for i = 3, #near - 1, 2 do
    local level = LEVELS - math.floor(tonumber(near[i + 1]) / SEQ_SPAN)
    -- (less a hair, as affinity.py: Lua has no log1p and expm1, and at a ratio of 1 the
    -- floor came out above the head's own level, refusing a task level with it)
    if level < floor - FLOOR_SLACK then break end
    local w = weight_of(warm, ridges, near[i])
    if w > best_w and not held_by_me(near[i]) then
      best, best_w = i, w
      if w >= top then break end
    end
  end
  if not best then return nil end
  if not since then redis.call('HSET', KEYS[14], near[1], now) end
  redis.call('ZREM', KEYS[1], near[best])
  return {near[best], near[best + 1]}
end

local forget = ARGV[5] == 'noack'

-- Marks one message as delivered: unacked from now, its score kept for a restore; for a
-- consumer that does not ack, gone for good instead (nothing would ever ack it, and a
-- restore would deliver it again). Read what the reply needs before.
-- A yield claim on it (preempt.lua) stands on until its ack drops it or it runs out: a
-- worker that picked an urgent task for a slot a yield freed, along with a task of
-- another queue, and gave the urgent one back (one slot, two picks), left it unclaimed,
-- and a second running task yielded for it (4 of ~200 urgent tasks, under a beat).
local function take(id, score)
  redis.call('HDEL', KEYS[14], id)
  if forget then
    redis.call('HDEL', KEYS[12], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[8], id)
    redis.call('HDEL', KEYS[11], id)
    redis.call('HDEL', KEYS[13], id)
    return
  end
  redis.call('ZADD', KEYS[6], now, id)
  redis.call('HSET', KEYS[7], id, score)
  if consumer ~= '' then redis.call('HSET', KEYS[17], id, consumer) end
end

-- Waiting tasks with batch key 'key' (task, model, class), nearest the head first
-- among the first ARGV[4], taken until 'taken' reaches 'most' (appended to reply as id,
-- payload, times). A message restored after a crash runs alone and is never taken as
-- kin: a batch that kills its worker must not carry innocent tasks towards the
-- poison-message limit.
local function kin(key, most, taken, reply)
  local window = tonumber(ARGV[4] or '') or 0
  if window < 1 or taken >= most then return end
  local near = redis.call('ZRANGE', KEYS[1], 0, window - 1, 'WITHSCORES')
  -- A key JSON writes escaped (a task named with a quote) is not found as it is in the
  -- record's text: those records are all decoded.
  local escaped = string.find(key, '[%c"\\]') ~= nil
  for i = 1, #near - 1, 2 do
    if taken >= most then break end
    local other = near[i]
    local meta = redis.call('HGET', KEYS[3], other)
    -- The plain find skips decoding the records that cannot match (most of them).
    if meta and (escaped or string.find(meta, key, 1, true)) and not held_by_me(other) then
      local good, record = pcall(cjson.decode, meta)
      local payload = redis.call('HGET', KEYS[2], other)
      local times = tonumber(redis.call('HGET', KEYS[8], other) or '0')
      -- A message restored too often is left for the plain pick, which parks it.
      if good and type(record) == 'table' and record['b'] == key and payload and times == 0 then
        redis.call('ZREM', KEYS[1], other)
        take(other, near[i + 1])
        reply[#reply + 1] = other
        reply[#reply + 1] = payload
        reply[#reply + 1] = times
        taken = taken + 1
      end
    end
  end
end

-- The picked task's batch kin (none for a restored message), up to its 'bn' in all.
local function gather(id, times, reply)
  if times > 0 then return end
  local raw = redis.call('HGET', KEYS[3], id)
  local ok, record = pcall(cjson.decode, raw or '')
  if not ok or type(record) ~= 'table' then return end
  local key, most = record['b'], tonumber(record['bn'])
  if type(key) ~= 'string' or most == nil or most < 2 then return end
  kin(key, most, 1, reply)
end

-- The marker says whether messages wait: set while some do, cleared once a pick leaves
-- none (every script that adds to 1 sets it in the same step), so a consumer that reads
-- markers before it picks (broker/transport.py) is not sent to an empty queue, nor woken.
local function mark_ready()
  if redis.call('ZCARD', KEYS[1]) > 0 then redis.call('ZADD', KEYS[4], 0, 'ready')
  else redis.call('ZREM', KEYS[4], 'ready') end
end

-- Whether the queue's next task in priority order (the first one this consumer does
-- not hold off) has batch key 'key': one this running batch could take itself.
local function head_is_kin(key)
  local window = math.max(1, tonumber(ARGV[4] or '') or 0)
  local near = redis.call('ZRANGE', KEYS[1], 0, window - 1)
  for _, id in ipairs(near) do
    if not held_by_me(id) then
      local ok, record = pcall(cjson.decode, redis.call('HGET', KEYS[3], id) or '')
      return ok and type(record) == 'table' and record['b'] == key
    end
  end
  return false
end

-- Join mode: a running generation batch has room for more rows (workers/joins.py):
-- only waiting tasks of its batch key, no head pick; and only while the head is one
-- of them. A batch does not yield its slot, and joins keep it running for up to
-- batch_join_s: taken from behind a more urgent task (a higher class, another model),
-- they held that task off for as long (a high task waited 5-13 s behind a stream of
-- low generations, 70 ms without joins).
if ARGV[5] == 'join' then
  local reply = {}
  if head_is_kin(ARGV[6]) then kin(ARGV[6], tonumber(ARGV[7]) or 0, 0, reply) end
  return reply
end

local chosen = affinity_pick()
local by_affinity = chosen and 1 or 0
-- Messages this consumer holds are read past where they wait, never popped: a worker
-- that released more than a page of them at the head (too big for its device) must
-- still reach the work behind them. Bounded, so one pick never holds Redis long.
local skip = 0
for _ = 1, MAX_SCAN do
  local head = chosen or redis.call('ZRANGE', KEYS[1], skip, skip, 'WITHSCORES')
  chosen = nil
  if #head == 0 then break end
  local id, score = head[1], head[2]
  local mine = held_by_me(id)
  if not mine then redis.call('ZREM', KEYS[1], id) end
  local payload = (not mine) and redis.call('HGET', KEYS[2], id)
  if mine then
    skip = skip + 1
  elseif payload then
    -- (a count that is no number, written by another program, is none: compared, it
    -- stopped the script with the message already off the queue)
    local times = tonumber(redis.call('HGET', KEYS[8], id) or '0') or 0
    if times > max_redeliveries then
      -- It was restored after a crash this many times: it is killing workers. Park it.
      local record = cjson.encode({reason = 'redelivered ' .. times .. ' times (poison message)',
                                   at = tonumber(now), payload = payload,
                                   meta = redis.call('HGET', KEYS[3], id)})
      redis.call('HSET', KEYS[9], id, record)
      redis.call('HDEL', KEYS[2], id)
      redis.call('HDEL', KEYS[3], id)
      redis.call('HDEL', KEYS[8], id)
      redis.call('HDEL', KEYS[11], id)
      redis.call('HDEL', KEYS[12], id)
      redis.call('HDEL', KEYS[13], id)
      redis.call('HDEL', KEYS[14], id)
      poisoned[#poisoned + 1] = id
    else
      local reply = {id, payload, times, redis.call('HGET', KEYS[11], id), by_affinity}
      gather(id, times, reply)
      take(id, score)
      mark_ready()
      if #poisoned > 0 then reply[#reply + 1] = poisoned end
      return reply
    end
  end
  -- An id without a payload was acked or purged mid-flight: nothing to deliver, skip it.
  by_affinity = 0
end
mark_ready()
if #poisoned > 0 then return {skip, poisoned} end
return skip
