-- store_result.lua: write a task's state and result unless it already succeeded (or, for
-- a STARTED written ahead of its run, ended).
-- KEYS:
--   1 the task's result key (celery-task-meta-<id>, with the global key prefix)
-- ARGV: 1 the encoded result meta (JSON)  2 expiry in ms (0: none)
--       3 (optional) '1': a STARTED written before the task runs (a batch's members at
--         its start, workers/batched.py), kept off a FAILURE or REVOKED too: a task
--         revoked meanwhile stays so
-- Returns 1 if stored (and published to the key's channel), 0 if a SUCCESS was there
-- (with ARGV[3], any of the three).
--
-- Celery's Redis backend does the same in two round trips (GET, then SET + PUBLISH),
-- and a task tracked as STARTED pays them twice. Here it is one call, and atomic: no
-- second delivery of a task can overwrite its SUCCESS between the read and the write.
local kept = {SUCCESS = true}
if ARGV[3] == '1' then
  kept['FAILURE'] = true
  kept['REVOKED'] = true
end

local function keeps(record)
  local ok, meta = pcall(cjson.decode, record)
  if not ok then
    -- Python's JSON writes a lone surrogate (a string from os.fsdecode, an argument kept
    -- by result_extended) as a \udcxx escape, which cjson refuses: read as "not a
    -- SUCCESS", the record was overwritten by a redelivery's STARTED or FAILURE. Any
    -- surrogate escape, put as another escape of the same length, leaves the JSON valid
    -- whatever precedes it; only the status is read.
    ok, meta = pcall(cjson.decode, (string.gsub(record, '\\u[dD][89abcdefABCDEF]%x%x',
                                                '\\u003f')))
  end
  if ok then return type(meta) == 'table' and kept[meta['status']] == true end
  -- Still unreadable (nested past cjson's depth): the status as Python's JSON writes it,
  -- at the top level or not; keeping a record in doubt loses no success.
  for status in pairs(kept) do
    if string.find(record, '"status": "' .. status .. '"', 1, true) then return true end
  end
  return false
end

-- Celery writes the status first ('{"status": "STARTED", ...'): read there, a record is
-- neither copied into the script nor decoded whole. With result_extended it holds the
-- task's arguments: 100 MB of them held all of Redis ~0.9 s at every state write.
local LEAD = '{"status": "'
local head = redis.call('GETRANGE', KEYS[1], 0, #LEAD + 7)
if string.sub(head, 1, #LEAD) == LEAD then
  local status = string.match(string.sub(head, #LEAD + 1), '^(%u+)"')
  if status and kept[status] then return 0 end
elseif head ~= '' then  -- another writer's layout: read whole
  local current = redis.call('GET', KEYS[1])
  if current and keeps(current) then return 0 end
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
