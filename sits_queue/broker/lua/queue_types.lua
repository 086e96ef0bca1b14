-- queue_types.lua: prepended to the scripts that must never stop half-way (scripts.py
-- CHECKED). A key of another type than the layout's (written by hand or by another
-- program) fails the command that touches it, and a script's writes before an error
-- stay: a pick that had taken a message off the queue lost it. Such a script checks the
-- keys it touches first, so it runs whole or writes nothing.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH  11 checkpoints HASH  12 yield claims HASH  13 held HASH
--   14 skipped HASH
local QUEUE_TYPES = {'zset', 'hash', 'hash', 'zset', 'string', 'zset', 'hash', 'hash',
                     'hash', 'hash', 'hash', 'hash', 'hash', 'hash'}

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

-- Whether a stored count is one INCRBY/HINCRBY takes (a whole number under 2^63).
local function is_count(text)
  return text ~= nil and string.match(text, '^%d+$') ~= nil and #text < 19
end

-- HINCRBY field by n; a count that is no integer (another program's, which HINCRBY
-- refuses) starts again at n.
local function add_count(key, field, n)
  local before = redis.call('HGET', key, field)
  if before == false or is_count(before) then
    redis.call('HINCRBY', key, field, n)
  else
    redis.call('HSET', key, field, n)
  end
end
