-- take_outbox.lua: the next batch of a site's outbox for the sync pass to send, kept
-- aside (not popped) until the pass says its peer has it (done_outbox.lua): a pass that
-- dies between taking and sending leaves the batch to the next pass instead of losing it.
-- Order holds: a batch left over is taken again before any newer entry.
-- KEYS: 1 outbox LIST (entries, oldest first), 2 taken LIST (a token, then the batch)
-- ARGV: 1 most entries to take, 2 a fresh token for a new batch
-- Returns {'left', token, entries...}: the batch an earlier pass left taken, if any; else
-- {'new', token, entries...}; {} when there is nothing to send.
local left = redis.call('LRANGE', KEYS[2], 0, -1)
if #left > 0 then
  table.insert(left, 1, 'left')
  return left
end
local batch = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
if #batch == 0 then
  return {}
end
redis.call('LTRIM', KEYS[1], #batch, -1)
redis.call('RPUSH', KEYS[2], ARGV[2])
-- in chunks: unpack() of thousands of values overflows Lua's C stack
for i = 1, #batch, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(batch, i, math.min(i + 999, #batch)))
end
table.insert(batch, 1, ARGV[2])
table.insert(batch, 1, 'new')
return batch
