-- put.lua: enqueue one message, or many (ARGV repeats in groups of five); the put
-- itself is put_lib.lua's.
-- KEYS (all hash-tagged {queue}, same order for every script):
--   1 waiting ZSET  2 payloads HASH  3 meta HASH  4 marker ZSET  5 seq STRING
--   6 unacked ZSET  7 saved-score HASH  8 redelivered HASH  9 dead-letter HASH
--   10 arrivals HASH (class -> messages ever enqueued)  11 checkpoints HASH
--   12 yield claims HASH  13 held HASH (released by a consumer, not offered back to it)
--   14 skipped HASH (id -> when a pick first passed it over at the head, by affinity)
--   15 idle SET (ids held by a worker that said it has not started them yet)
--   16 sweep HASH (the visibility sweeps' last time, and a hold after a gap)
--   17 holders HASH (id -> the consumer holding it unacked: its worker died, holders.py)
-- ARGV (per message): id, payload JSON, meta JSON, score base ((levels - level) * 2^32),
--                      SLA class ("~class": a task the statistics do not count, such as
--                      a pre-warm: announced, but no arrival counted)
-- Returns {messages enqueued, waiting after}: equal when the queue was empty before, so
-- the caller (re-)registers the queue exactly when it appears.
--
-- A put runs whole or writes no message: one that failed after writing a message was
-- retried by the producer, and its task ran twice. The keys a message is written to are
-- checked first (four TYPE calls: undoing writes instead could not tell a field this put
-- overwrote, a waiting message's under the same id, from one it added).
local refused = wrong_type(1, 2, 3, 4)
if refused then return refused end
return put_messages(ARGV)
