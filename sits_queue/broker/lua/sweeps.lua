-- sweeps.lua: prepended to the scripts that tell Redis a queue is being served (restore.lua,
-- the visibility sweeps; beat.lua, the holders' heartbeats). KEYS[16], the queue's
-- sweep HASH: 'at', Redis's time when one last ran; 'every', that caller's period (s);
-- 'hold', until when no sweep restores anything.
--
-- A gap longer than the callers' period allows, by Redis's own clock: Redis was not
-- serving (stopped, hung, restarted from its data), or no worker of the queue was live.
-- Nobody could beat meanwhile: counted silent, every holder's messages went back and ran
-- twice (a pick or a sweep sent before a stall runs after it with its time of then). So
-- whichever comes first after the gap, a beat or a sweep, holds the sweeps for two
-- periods, the holders' time to beat. Beats come from each holder's own thread every
-- period, whatever its event loop does (a solo pool running a long task does not sweep):
-- they keep the record fresh between its sweeps.
local SWEEP_KEPT_S = 86400  -- (the record of a queue no one serves any more goes)

-- Notes a caller of period ``period`` (s) now; returns until when sweeps hold (or nil).
local function served(period)
  local t = redis.call('TIME')
  local clock = tonumber(t[1]) + tonumber(t[2]) / 1e6
  local last = redis.call('HMGET', KEYS[16], 'at', 'every', 'hold')
  local at, every, hold = tonumber(last[1] or ''), tonumber(last[2] or ''),
                          tonumber(last[3] or '')
  local span = math.max(period, every or 0)
  -- No record: nothing held, nothing to keep (a reply queue read without acks leaves
  -- none). Messages held with no record of the queue served: a stall before its first
  -- beat or sweep would not show as a gap (a probe: 2 of 3,000 tasks ran twice after a
  -- stall 2 s into a burst from fresh workers), so it counts as one.
  if not at and redis.call('ZCARD', KEYS[6]) == 0 then return nil end
  if not at or clock - at > 1.75 * span then
    hold = clock + 2 * span
    redis.call('HSET', KEYS[16], 'hold', hold)
  end
  redis.call('HSET', KEYS[16], 'at', clock, 'every', period)
  redis.call('EXPIRE', KEYS[16], SWEEP_KEPT_S)
  if hold and clock < hold then return hold end
  return nil
end
