-- restore.lua: put unacked messages back into the waiting set with the score they had.
-- Only ids still in the unacked set move, so a message acked meanwhile is never re-added.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV[1]: deadline ceiling (unix s) to restore every message picked/heartbeated before
--          it, or '-' to restore exactly the ids in ARGV[3..], or '=' to restore those
--          a consumer that died held (KEYS[17]): ARGV[2] names it, ARGV[3] is a bound
--          (unix s) its deadlines are under (one above it is a later holder's, which an
--          older worker's pick, writing no holder, left under the dead one's name),
--          ARGV[5] and ARGV[6] an HSCAN cursor and count through KEYS[17]; this mode
--          returns {number restored, the next cursor ('0': done)}
-- ARGV[2]: at most this many (with a ceiling)
-- ARGV[3]: with a ceiling, a horizon (unix s): a deadline base above it is no pick or
--          beat time any worker wrote (another program's, +inf included), and would
--          otherwise hold its message unacked for good; those are restored too
-- ARGV[4]: with a ceiling, the holders' heartbeat period (s; optional): the sweeps of
--          the queue's consumers come about that often
-- Returns the number restored; each counted as a redelivery unless it never started: its
-- holder said so (KEYS[15]: a task waiting in it for a rate-limit token), or its ETA is
-- still ahead, or came after its holder's last beat and the beat it missed.
-- (6 is read, or its ZREM fails, before anything is written)
local refused = wrong_type(1, 2, 4, 7, 8, 15, 16, 17)
if refused then return refused end
-- (after a gap in the queue's sweeps and beats, none restores for a while: sweeps.lua;
-- a holder known dead is no silence, nothing to wait for)
local period = tonumber(ARGV[4] or '')
local sweep = ARGV[1] ~= '-' and ARGV[1] ~= '='
if sweep and period and period > 0 and served(period) then return 0 end
local ids, cursor
if ARGV[1] == '-' then
  ids = {}
  for i = 3, #ARGV do ids[#ids + 1] = ARGV[i] end
elseif ARGV[1] == '=' then
  ids = {}
  local bound = tonumber(ARGV[3])
  local step = redis.call('HSCAN', KEYS[17], ARGV[5], 'COUNT', tonumber(ARGV[6]))
  cursor = step[1]
  local holders = step[2]
  for i = 1, #holders, 2 do
    if holders[i + 1] == ARGV[2] then
      local base = tonumber(redis.call('ZSCORE', KEYS[6], holders[i]) or '')
      if base == nil then  -- acked or given back by an older worker: no holder wrote
        redis.call('HDEL', KEYS[17], holders[i])
      elseif base < bound then
        ids[#ids + 1] = holders[i]
      end
    end
  end
else
  local limit = tonumber(ARGV[2])
  ids = redis.call('ZRANGE', KEYS[6], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, limit)
  if ARGV[3] and #ids < limit then
    local future = redis.call('ZRANGE', KEYS[6], '(' .. ARGV[3], '+inf', 'BYSCORE', 'LIMIT', 0,
                              limit - #ids)
    for _, id in ipairs(future) do ids[#ids + 1] = id end
  end
end
-- A message whose ETA is still ahead never started (its worker only held it in Celery's
-- timer): its restore is not counted, or worker crashes during a long countdown
-- dead-lettered tasks that never ran as poison. Nor one that fell due after its holder's
-- last beat (``base``) and the beat that holder then missed: it died before the task
-- was due (a crash a little before the due time was counted, the sweep coming after it).
local now = tonumber(redis.call('TIME')[1])
local function unstarted(id, base)
  local raw = redis.call('HGET', KEYS[3], id)
  if not raw then return false end
  local ok, meta = pcall(cjson.decode, raw)
  if not (ok and type(meta) == 'table' and type(meta.eta) == 'number') then return false end
  if meta.eta > now then return true end
  return period ~= nil and base ~= nil and meta.eta > base + period
end
local n = 0
for _, id in ipairs(ids) do
  local base = tonumber(redis.call('ZSCORE', KEYS[6], id) or '')
  if redis.call('ZREM', KEYS[6], id) == 1 then
    local score = redis.call('HGET', KEYS[7], id)
    redis.call('HDEL', KEYS[7], id)
    redis.call('HDEL', KEYS[17], id)
    if redis.call('HEXISTS', KEYS[2], id) == 1 then
      -- No saved score (older state), or one that is no number (another program's): the
      -- very front is safer than losing its place. (The text itself is kept: Lua's
      -- number format would round a score's 16 digits.)
      local value = tonumber(score or '')
      if value == nil or value ~= value then score = 0 end
      redis.call('ZADD', KEYS[1], score, id)
      local idle = redis.call('SREM', KEYS[15], id) == 1
      if not idle and not unstarted(id, base) then add_count(KEYS[8], id, 1) end
      n = n + 1
    end
  end
end
if n > 0 then redis.call('ZADD', KEYS[4], 0, 'ready') end
if cursor then return {n, cursor} end
return n
