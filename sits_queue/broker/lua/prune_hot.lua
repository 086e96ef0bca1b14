-- prune_hot.lua: forget models whose decayed call count has faded out, so the hotness
-- hash does not keep every model ever called. Conditional, in one step: a model a
-- worker called meanwhile (HINCRBYFLOAT since the pass read it) is kept.
-- KEYS: 1 hotness HASH (model -> decayed call count; not per queue: one per deployment)
-- ARGV: the count below which a model is forgotten, then the models to look at
-- Returns how many were forgotten.
local floor = tonumber(ARGV[1])
local gone = 0
for i = 2, #ARGV do
  local count = tonumber(redis.call('HGET', KEYS[1], ARGV[i]))
  if count ~= nil and count < floor then
    gone = gone + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return gone
