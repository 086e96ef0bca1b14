-- preempt.lua: should a running task give its slot up now? Claims the yield atomically,
-- so that of the many tasks that hear about one urgent arrival only one steps aside.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV: running message id, now (unix s), least wait before yielding for a task (s),
--       how long a claim stands (s), the running task's state (JSON) to keep when it
--       yields ('': the caller keeps it itself once granted, a large state), then the
--       classes that outrank the running task
-- On a claim the state is saved as the running task's checkpoint in the same step, so
-- a yield never stands without what it resumes from (and costs one round trip); a
-- large one the runner sends only when granted, before it gives its message back.
-- Returns the id yielded for when the best waiting task is of an outranking class, is
-- ahead of the running task's own place (its saved score: back in the queue it would
-- be picked again at once), has waited at least the least wait (a slot that frees on
-- its own gets it first), and no other running task has claimed to yield for it;
-- 'wait' when only the least wait is missing (ask again soon); false otherwise.
local running, now = ARGV[1], tonumber(ARGV[2])
local least_wait, claim_s, state = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
-- Only a task this worker still holds may claim (not one already restored elsewhere).
if not redis.call('ZSCORE', KEYS[6], running) then return false end
local outranking = {}
for i = 6, #ARGV do outranking[ARGV[i]] = true end
-- The best few waiting tasks, best first: one claimed already (another task is yielding
-- for it) lets the next urgent one find its own yielder at once.
-- A task aged past the waiting urgent ones by the rescoring pass (it was picked at that
-- score) yielded for them over and over, put back ahead of them each time.
local mine = tonumber(redis.call('HGET', KEYS[7], running) or '')
local best = redis.call('ZRANGE', KEYS[1], 0, 7, 'WITHSCORES')
for i = 1, #best, 2 do
  local id = best[i]
  if mine and mine <= tonumber(best[i + 1]) then return false end
  local raw = redis.call('HGET', KEYS[3], id)
  local ok, meta = false, nil
  if raw then ok, meta = pcall(cjson.decode, raw) end
  -- Scores follow class weight but for aging and decay: stop at the first that does not
  -- outrank the runner rather than digging for one further down.
  if not ok or type(meta) ~= 'table' or not outranking[meta.c] then return false end
  local claimed = tonumber(redis.call('HGET', KEYS[12], id))
  -- A task with a checkpoint already ran and yielded: it resumes when a slot frees, and
  -- displaces no one (one urgent arrival must not cascade down the classes). Nor does
  -- one whose ETA is not due: the freed slot only put it in a worker's timer, and the
  -- yielder took its slot back.
  local resuming = redis.call('HEXISTS', KEYS[11], id) == 1
  local early = type(meta.eta) == 'number' and meta.eta > now
  if not resuming and not early and not (claimed and now - claimed < claim_s) then
    if now - (tonumber(meta.t) or now) < least_wait then return 'wait' end
    redis.call('HSET', KEYS[12], id, now)
    if state ~= '' then redis.call('HSET', KEYS[11], running, state) end
    return id
  end
end
return false
