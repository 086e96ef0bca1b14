-- done_outbox.lua: a taken outbox batch is at the peer; forget it, unless it is no
-- longer the one taken (a pass that outlived its lock: the next pass sent the batch
-- again and took a newer one, which must stay).
-- KEYS: 1 taken LIST (a token, then the batch)
-- ARGV: 1 the batch's token
-- Returns 1 if the batch was forgotten, else 0.
if redis.call('LINDEX', KEYS[1], 0) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
