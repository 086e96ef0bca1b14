-- join.lua: the rows a running generation batch takes while it decodes
-- (continuous batching, workers/joins.py). The worker's main process picks waiting
-- tasks of the batch's key and pushes their pool jobs here; the pool child running the
-- batch takes them between decode steps; when the batch ends, the child closes it, so
-- nothing pushed afterwards is lost: a refused push runs as a job of its own.
-- KEYS (hash-tagged {queue} like the queue's own keys, one pair per running batch):
--   1 jobs LIST (pushed by the main process, taken by the child, oldest first)
--   2 state HASH: room (rows the child can take now), taken (jobs taken in all),
--     closed (1 once the batch ended), d:<call index> (a taken job the child declined)
-- ARGV: op, then
--   'push', ttl s, job...: append the jobs unless closed; returns 1, else 0 (closed)
--   'room', ttl s, n: the child has room for n more rows; returns 1, else 0 (closed)
--   'take', n: up to n jobs, oldest first (counted in 'taken', out of 'room'); returns
--     them
--   'decline', index: the taken job at that call index is not run by the batch
--   'close': no more jobs; returns {taken, jobs left untaken, declined call index...}
--     (a main process whose child died learns which taken jobs never ran)
-- The ttl bounds how long a pair outlives a worker that died holding it.
local op = ARGV[1]
if op == 'push' or op == 'room' then
  if redis.call('HGET', KEYS[2], 'closed') then return 0 end
  if op == 'push' then
    redis.call('RPUSH', KEYS[1], unpack(ARGV, 3))
    redis.call('EXPIRE', KEYS[1], ARGV[2])
  else
    redis.call('HSET', KEYS[2], 'room', ARGV[3])
  end
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  return 1
elseif op == 'take' then
  local n = tonumber(ARGV[2]) or 0
  if n < 1 then return {} end
  local jobs = redis.call('LPOP', KEYS[1], n)
  if not jobs then return {} end
  redis.call('HINCRBY', KEYS[2], 'taken', #jobs)
  -- the rows they take are not free any more: no second pick for them before the
  -- child offers its room again
  redis.call('HINCRBY', KEYS[2], 'room', -#jobs)
  return jobs
elseif op == 'decline' then
  redis.call('HSET', KEYS[2], 'd:' .. ARGV[2], 1)
  return 1
elseif op == 'close' then
  redis.call('HSET', KEYS[2], 'closed', 1, 'room', 0)
  local left = redis.call('LLEN', KEYS[1])
  redis.call('DEL', KEYS[1])
  local reply = {tonumber(redis.call('HGET', KEYS[2], 'taken') or '0'), left}
  for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
    local index = string.match(field, '^d:(%d+)$')
    if index then reply[#reply + 1] = tonumber(index) end
  end
  return reply
end
return redis.error_reply('join.lua: unknown op ' .. tostring(op))
