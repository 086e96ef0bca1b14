-- pick.lua: pop the best waiting message and record it as unacked, atomically, so a
-- popped message is never outside both the queue and the unacked set.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
-- ARGV: now (unix s), max redeliveries before dead-lettering, consumer ('' for none)
-- Returns {id, payload, times redelivered, checkpoint or false}; else the number of
-- messages passed over because this consumer released them and their hold has not run
-- out (0 when nothing is waiting at all: the caller waits for a put instead).
-- The checkpoint is what the task saved when it last yielded its slot.
local now, max_redeliveries = ARGV[1], tonumber(ARGV[2])
local consumer = ARGV[3] or ''
local passed = {}  -- score, id pairs of held messages, put back as they were

local function restore_passed()
  if #passed > 0 then redis.call('ZADD', KEYS[1], unpack(passed)) end
  if redis.call('ZCARD', KEYS[1]) > 0 then redis.call('ZADD', KEYS[4], 0, 'ready') end
end

for _ = 1, 64 do
  local head = redis.call('ZPOPMIN', KEYS[1])
  if #head == 0 then break end
  local id, score = head[1], head[2]
  local held = redis.call('HGET', KEYS[13], id)
  local mine = false
  if held then
    -- "<consumer> <until> <releases>"; a hold that ran out stays for its count
    -- (release.lua doubles the next one), and ack drops it.
    local who, till = string.match(held, '^(%S*) (%S+)')
    mine = who == consumer and tonumber(till) ~= nil and tonumber(till) > tonumber(now)
  end
  local payload = (not mine) and redis.call('HGET', KEYS[2], id)
  if mine then
    passed[#passed + 1] = score
    passed[#passed + 1] = id
  elseif payload then
    local times = tonumber(redis.call('HGET', KEYS[8], id) or '0')
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
    else
      redis.call('ZADD', KEYS[6], now, id)
      redis.call('HDEL', KEYS[12], id)
      redis.call('HSET', KEYS[7], id, score)
      restore_passed()
      return {id, payload, times, redis.call('HGET', KEYS[11], id)}
    end
  end
  -- An id without a payload was acked or purged mid-flight: nothing to deliver, skip it.
end
restore_passed()
return #passed / 2
