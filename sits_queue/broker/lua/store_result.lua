-- store_result.lua: write a task's state and result unless it already succeeded.
-- KEYS:
--   1 the task's result key (celery-task-meta-<id>, with the global key prefix)
-- ARGV: 1 the encoded result meta (JSON)  2 expiry in ms (0: none)
-- Returns 1 if stored (and published to the key's channel), 0 if a SUCCESS was there.
--
-- Celery's Redis backend does the same in two round trips (GET, then SET + PUBLISH),
-- and a task tracked as STARTED pays them twice. Here it is one call, and atomic: no
-- second delivery of a task can overwrite its SUCCESS between the read and the write.
local current = redis.call('GET', KEYS[1])
if current then
  local ok, meta = pcall(cjson.decode, current)
  if ok and type(meta) == 'table' and meta['status'] == 'SUCCESS' then
    return 0
  end
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
