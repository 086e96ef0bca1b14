-- queue_types.lua: prepended to the scripts that must never stop half-way (scripts.py
-- LIBRARIES). A key of another type than the layout's (written by hand or by another
-- program) fails the command that touches it, and a script's writes before an error
-- stay: a pick that had taken a message off the queue lost it. Such a script checks the
-- keys it touches first, so it runs whole or writes nothing.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH  11 checkpoints HASH  12 yield claims HASH  13 held HASH
--   14 skipped HASH  15 idle SET
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
local QUEUE_TYPES = {'zset', 'hash', 'hash', 'zset', 'string', 'zset', 'hash', 'hash',
                     'hash', 'hash', 'hash', 'hash', 'hash', 'hash', 'set', 'hash',
                     'hash'}

-- An error reply naming the first of KEYS[i...] of a type it should not be; nil if none.
local function wrong_type(...)
  for _, i in ipairs({...}) do
    local kind = redis.call('TYPE', KEYS[i])['ok']
    if kind ~= 'none' and kind ~= QUEUE_TYPES[i] then
      return redis.error_reply('SITS_WRONGTYPE key ' .. KEYS[i] .. ' holds a ' .. kind
        .. ', not the ' .. QUEUE_TYPES[i] .. ' SITS keeps there (written by another '
        .. 'program?); nothing was done')
    end
  end
  return nil
end

-- HINCRBY field by n; a count HINCRBY refuses (no integer: another program's, or one
-- past 2^63) starts again at n. A key of another type: Redis's refusal, nothing written.
local function add_count(key, field, n)
  if type(redis.pcall('HINCRBY', key, field, n)) == 'table' then
    redis.call('HGET', key, field)
    redis.call('HSET', key, field, n)
  end
end
