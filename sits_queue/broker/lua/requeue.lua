-- requeue.lua: put dead-lettered messages back (`sitsq dead requeue`), each only if its
-- dead-letter record is still the one the requeue read, and drop those records and
-- their redelivery counts, in one step. Read, put and dropped in separate calls, two
-- requeues of the same letters at once both put them back: a worker that had picked a
-- message between the two puts ran it twice. And a record written anew between the put
-- and the drop (a worker that met the message dead-lettered it again) was deleted,
-- leaving the message nowhere. The put itself is put_lib.lua's.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV (per message): put.lua's five (id, payload JSON, meta JSON, score base, class),
--                      then its dead-letter record as the requeue read it
-- Returns {messages put back, waiting after, ids not put back (their record is gone or
-- another: requeued or dropped meanwhile, or dead-lettered anew)}.
local refused = wrong_type(1, 2, 3, 4, 8, 9)
if refused then return refused end
local args, taken, missed = {}, {}, {}
for i = 1, #ARGV - 5, 6 do
  local id = ARGV[i]
  if redis.call('HGET', KEYS[9], id) == ARGV[i + 5] then
    for j = 0, 4 do args[#args + 1] = ARGV[i + j] end
    taken[#taken + 1] = id
  else
    missed[#missed + 1] = id
  end
end
local put = put_messages(args)
-- (a message put back with its redelivery count would be parked again by its first pick)
for s = 1, #taken, SLICE do
  local slice = {unpack(taken, s, math.min(#taken, s + SLICE - 1))}
  redis.call('HDEL', KEYS[8], unpack(slice))
  redis.call('HDEL', KEYS[9], unpack(slice))
end
return {put[1], put[2], missed}
