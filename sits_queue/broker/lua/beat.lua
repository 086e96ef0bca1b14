-- beat.lua: a holder's heartbeat: the deadline base of the messages it holds pushed to its
-- time now, only for ids still unacked (one acked meanwhile is not brought back).
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV[1]: now (unix s, the holder's clock set to Redis's); ARGV[2]: its beat period (s);
-- ARGV[3..]: the ids it holds. Returns how many deadlines it moved.
local refused = wrong_type(6)
if refused then return refused end
local now, n = ARGV[1], 0
for first = 3, #ARGV, 1000 do  -- (in slices: Lua's unpack has a stack limit)
  local args = {}
  for i = first, math.min(#ARGV, first + 999) do
    args[#args + 1] = now
    args[#args + 1] = ARGV[i]
  end
  n = n + redis.call('ZADD', KEYS[6], 'XX', 'CH', unpack(args))
end
-- (a sweep record of another type: the beat stands, the sweeps refuse to run there)
pcall(served, tonumber(ARGV[2]))
return n
