"""Script calls by SHA against a real Redis: the synchronous and the split send/reply
paths, a server that forgot its scripts, and connections always going back to the pool."""

from __future__ import annotations

import json

import pytest
import redis

from sits_queue import status
from sits_queue.broker.keys import QueueKeys
from sits_queue.broker.scripts import Scripts

KEYS = QueueKeys.for_queue("scripts-test")


def put_args(ids: list[str]) -> list[str]:
    meta = json.dumps({"c": "low"})
    return [a for i in ids for a in (i, "{}", meta, "0", "low")]


def in_use(client: redis.Redis) -> int:
    return len(client.connection_pool._in_use_connections)  # type: ignore[attr-defined]


def test_split_call_returns_the_reply_and_frees_its_connection(
        redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    scripts.load_all(redis_client)
    # Given a put sent now and read later
    reply = scripts.start("put", KEYS, put_args(["a", "b"]), redis_client)
    assert in_use(redis_client) == 1  # held until the reply is read
    assert reply() == [2, 2]
    assert in_use(redis_client) == 0
    assert redis_client.zrange(KEYS.waiting, 0, -1) == [b"a", b"b"]


@pytest.mark.parametrize("split", [False, True])
def test_a_server_that_forgot_its_scripts_reloads_them_and_runs_once(
        redis_client: redis.Redis, split: bool) -> None:
    scripts = Scripts.register()
    # Given a server whose script cache was flushed (a restart loses it too)
    redis_client.script_flush()
    args = put_args(["x"])
    # When a script is called: NOSCRIPT, reload, retry
    if split:
        got = scripts.start("put", KEYS, args, redis_client)()
    else:
        got = scripts.run("put", KEYS, args, redis_client)
    # Then it ran exactly once (the arrival counter moved by one) and is cached again
    assert got == [1, 1]
    assert int(redis_client.get(KEYS.seq) or 0) == 1
    assert all(redis_client.script_exists(*scripts.shas.values()))
    assert in_use(redis_client) == 0


def test_a_script_error_surfaces_and_the_connection_stays_usable(
        redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    scripts.load_all(redis_client)
    # Given a waiting key of the wrong type, so ZADD inside put.lua fails
    redis_client.set(KEYS.waiting, "not a zset")
    reply = scripts.start("put", KEYS, put_args(["y"]), redis_client)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        reply()
    # Then the connection went back to the pool in a clean state
    assert in_use(redis_client) == 0
    redis_client.delete(KEYS.waiting)
    assert scripts.start("put", KEYS, put_args(["z"]), redis_client)() == [1, 1]


# -- preempt.lua ------------------------------------------------------------------------------
def waiting_task(client: redis.Redis, task_id: str, sla_class: str, enqueued_at: float,
                 score: int) -> None:
    client.zadd(KEYS.waiting, {task_id: score})
    client.hset(KEYS.meta, task_id, json.dumps({"c": sla_class, "t": enqueued_at}))


def preempt(scripts: Scripts, client: redis.Redis, running: str, now: float,
            *outranking: str) -> object:
    state = json.dumps({"step": running})  # what the runner would resume from
    return scripts.run("preempt", KEYS, [running, now, 0.005, 1.0, state, *outranking],
                       client)


def one_running(client: redis.Redis) -> tuple[Scripts, float]:
    """The scripts, and the time at which the task "run" is held by its worker."""
    now = 1000.0
    client.zadd(KEYS.unacked, {"run": now})
    return Scripts.register(), now


def test_preempt_claims_one_yield_per_urgent_waiting_task(redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    now = 1000.0
    redis_client.zadd(KEYS.unacked, {"run-1": now, "run-2": now, "run-3": now})
    # Given two high tasks waiting for 10 ms, ahead of a low one
    waiting_task(redis_client, "h1", "high", now - 0.01, 1)
    waiting_task(redis_client, "h2", "high", now - 0.01, 2)
    waiting_task(redis_client, "l1", "low", now - 5, 3)
    # Then one running low task yields for each, and a third finds nothing left to yield for
    assert preempt(scripts, redis_client, "run-1", now, "high", "medium") == b"h1"
    assert preempt(scripts, redis_client, "run-2", now, "high", "medium") == b"h2"
    assert preempt(scripts, redis_client, "run-3", now, "high", "medium") is None
    # And each yielder's state was kept in the same step as its claim; none for the third
    assert {k: json.loads(v) for k, v in redis_client.hgetall(KEYS.checkpoints).items()} == {
        b"run-1": {"step": "run-1"}, b"run-2": {"step": "run-2"}}
    # And a claim lapses after its time (its yielder died): then another may claim
    assert preempt(scripts, redis_client, "run-3", now + 1.5, "high", "medium") == b"h1"


def test_preempt_waits_for_a_free_slot_to_win_and_ignores_lesser_classes(
        redis_client: redis.Redis) -> None:
    scripts, now = one_running(redis_client)
    waiting_task(redis_client, "h", "high", now - 0.001, 1)
    # Waited 1 ms < the 5 ms least wait: ask again soon
    assert preempt(scripts, redis_client, "run", now, "high") == b"wait"
    # A medium runner does not yield for a task of its own or a lower class
    redis_client.delete(KEYS.waiting, KEYS.meta)
    waiting_task(redis_client, "m", "medium", now - 1, 1)
    assert preempt(scripts, redis_client, "run", now, "high") is None
    # Nor does a task its worker no longer holds (restored elsewhere meanwhile)
    redis_client.delete(KEYS.waiting, KEYS.meta)
    waiting_task(redis_client, "h", "high", now - 1, 1)
    assert preempt(scripts, redis_client, "gone", now, "high") is None
    # A garbled scoring record is skipped, not an error
    redis_client.hset(KEYS.meta, "h", "not json")
    assert preempt(scripts, redis_client, "run", now, "high") is None
    # No verdict but a claim keeps a checkpoint (a waiting task with one is a resumption)
    assert redis_client.hlen(KEYS.checkpoints) == 0


def test_preempt_yields_only_for_a_task_ahead_of_the_runners_own_place(
        redis_client: redis.Redis) -> None:
    """(a task the rescoring pass aged past the waiting urgent ones, and picked at that
    score, yielded for them over and over: put back ahead of them, it was picked again
    at once, and they waited all the same)"""
    scripts, now = one_running(redis_client)
    redis_client.hset(KEYS.saved, "run", 5)  # its score when it was picked
    waiting_task(redis_client, "h", "high", now - 1, 7)
    assert preempt(scripts, redis_client, "run", now, "high") is None
    assert redis_client.hlen(KEYS.checkpoints) == 0 and redis_client.hlen(KEYS.yields) == 0
    redis_client.zadd(KEYS.waiting, {"h": 5})  # level with it: still picked first
    assert preempt(scripts, redis_client, "run", now, "high") is None
    redis_client.zadd(KEYS.waiting, {"h": 4})
    assert preempt(scripts, redis_client, "run", now, "high") == b"h"
    # a saved score that is no number (another program's) is no place to compare
    redis_client.delete(KEYS.yields, KEYS.checkpoints)
    redis_client.hset(KEYS.saved, "run", "junk")
    redis_client.zadd(KEYS.waiting, {"h": 7})
    assert preempt(scripts, redis_client, "run", now, "high") == b"h"


def test_preempt_does_not_yield_for_a_task_whose_eta_is_not_due(
        redis_client: redis.Redis) -> None:
    """(the freed slot only put it in the worker's timer, and the yielder resumed)"""
    scripts, now = one_running(redis_client)
    waiting_task(redis_client, "later", "high", now - 1, 1)
    redis_client.hset(KEYS.meta, "later", json.dumps({"c": "high", "t": now - 1,
                                                      "eta": now + 8}))
    waiting_task(redis_client, "now", "high", now - 1, 2)
    assert preempt(scripts, redis_client, "run", now, "high") == b"now"  # the one behind
    redis_client.delete(KEYS.yields, KEYS.checkpoints)
    redis_client.zrem(KEYS.waiting, "now")
    assert preempt(scripts, redis_client, "run", now, "high") is None
    assert preempt(scripts, redis_client, "run", now + 8.5, "high") == b"later"  # due


def test_a_claim_stands_through_the_pick_and_the_ack_drops_it_and_the_checkpoint(
        redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    assert scripts.run("put", KEYS, put_args(["h"]), redis_client) == [1, 1]
    redis_client.hset(KEYS.yields, "h", 1.0)
    redis_client.hset(KEYS.checkpoints, "h", "{}")
    picked = scripts.run("pick", KEYS, [1000.0, 5], redis_client)
    assert picked[0] == b"h"
    assert redis_client.hlen(KEYS.yields) == 1  # (dropped by its ack, or it runs out)
    assert redis_client.hlen(KEYS.checkpoints) == 1  # kept while the task runs
    scripts.run("ack", KEYS, ["h"], redis_client)
    assert redis_client.hlen(KEYS.checkpoints) == 0 and redis_client.hlen(KEYS.yields) == 0


def test_an_urgent_task_given_back_unstarted_gets_no_second_yielder(
        redis_client: redis.Redis) -> None:
    """(a worker picked the urgent task for the slot a yield freed and a beat task of its
    control queue too, one slot for two, and gave the urgent one back: the pick had
    dropped its claim, and the other running task yielded for it as well)"""
    scripts = Scripts.register()
    now = 1000.0
    redis_client.zadd(KEYS.unacked, {"run-1": now, "run-2": now})
    waiting_task(redis_client, "h", "high", now - 0.01, 1)
    redis_client.hset(KEYS.payloads, "h", "{}")
    # Given run-1 yielded for h, and h was picked and given back unstarted
    assert preempt(scripts, redis_client, "run-1", now, "high") == b"h"
    assert scripts.run("pick", KEYS, [now, 5], redis_client)[0] == b"h"
    assert scripts.run("release", KEYS, ["w1", now, 0, 0, "h"], redis_client)[0] == 1
    # Then run-2 does not yield for it while run-1's claim stands (a slot frees for it)
    assert preempt(scripts, redis_client, "run-2", now + 0.01, "high") is None
    # and may once the claim ran out with h still waiting
    assert preempt(scripts, redis_client, "run-2", now + 1.5, "high") == b"h"


def test_the_marker_is_set_while_messages_wait_and_cleared_by_the_pick_that_empties(
        redis_client: redis.Redis) -> None:
    """(a consumer reads the markers before it picks, broker/transport.py: a marker left
    on an empty queue sent each fast pick there, and woke each wait, for nothing)"""
    scripts = Scripts.register()
    assert scripts.run("put", KEYS, put_args(["a", "b"]), redis_client) == [2, 2]
    redis_client.delete(KEYS.marker)  # (as a wait takes it)
    assert scripts.run("pick", KEYS, [1000.0, 5], redis_client)[0] == b"a"
    assert redis_client.zcard(KEYS.marker) == 1  # "b" waits: set again
    assert scripts.run("pick", KEYS, [1000.0, 5], redis_client)[0] == b"b"
    assert redis_client.zcard(KEYS.marker) == 0  # none waits
    assert scripts.run("put", KEYS, put_args(["c"]), redis_client) == [1, 1]
    assert redis_client.zcard(KEYS.marker) == 1
    assert scripts.run("pick", KEYS, [1000.0, 5], redis_client)[0] == b"c"
    assert scripts.run("pick", KEYS, [1000.0, 5], redis_client) == 0
    assert redis_client.zcard(KEYS.marker) == 0


def release(scripts: Scripts, client: redis.Redis, consumer: str, now: float,
            task_id: str) -> tuple[int, float]:
    n, hold = scripts.run("release", KEYS, [consumer, now, 0.25, 1.0, task_id], client)
    return int(n), float(hold)


def test_a_released_message_is_held_off_from_its_releaser_only(
        redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    now = 1000.0
    assert scripts.run("put", KEYS, put_args(["big", "small"]), redis_client) == [2, 2]
    # Given consumer A picked "big" and released it (first hold 0.25 s)
    assert scripts.run("pick", KEYS, [now, 5, "A"], redis_client)[0] == b"big"
    assert release(scripts, redis_client, "A", now, "big") == (1, 0.25)
    # Then A is offered the task behind it, and when only "big" is left, A is told so
    assert scripts.run("pick", KEYS, [now + 0.1, 5, "A"], redis_client)[0] == b"small"
    assert scripts.run("pick", KEYS, [now + 0.1, 5, "A"], redis_client) == 1
    assert redis_client.zrange(KEYS.waiting, 0, -1) == [b"big"]  # in place, untouched
    assert redis_client.zcard(KEYS.marker) == 1  # others are still woken for it
    # While any other consumer may take it at once
    assert scripts.run("pick", KEYS, [now + 0.1, 5, "B"], redis_client)[0] == b"big"
    assert release(scripts, redis_client, "B", now + 0.1, "big") == (1, 0.25)
    # And A each time it is offered again: its hold doubles per release by A, to the cap
    # (B's release in between kept A's count)
    holds = []
    t = now + 1
    for _ in range(4):
        assert scripts.run("pick", KEYS, [t, 5, "A"], redis_client)[0] == b"big"
        _, hold = release(scripts, redis_client, "A", t, "big")
        holds.append(hold)
        t += hold + 0.01
    assert holds == [0.5, 1.0, 1.0, 1.0]
    # A yield gives no hold; ack forgets the record; an empty queue is 0, not a hold
    assert scripts.run("pick", KEYS, [t, 5, "A"], redis_client)[0] == b"big"
    assert scripts.run("release", KEYS, ["A", t, 0, 0, "big"], redis_client) == [1, b"0"]
    assert scripts.run("pick", KEYS, [t, 5, "A"], redis_client)[0] == b"big"
    scripts.run("ack", KEYS, ["big", "small"], redis_client)
    assert redis_client.hlen(KEYS.held) == 0
    assert scripts.run("pick", KEYS, [t, 5, "A"], redis_client) == 0


def test_each_releaser_keeps_its_own_hold(redis_client: redis.Redis) -> None:
    """(one record per message: two workers each giving back a '1/h' task undid the
    other's hold and passed it back and forth hundreds of times a second)"""
    scripts = Scripts.register()
    now = 1000.0
    assert scripts.run("put", KEYS, put_args(["slow"]), redis_client) == [1, 1]
    for consumer in ("A", "B"):
        assert scripts.run("pick", KEYS, [now, 5, consumer], redis_client)[0] == b"slow"
        assert release(scripts, redis_client, consumer, now, "slow") == (1, 0.25)
    # Neither is offered it again within its hold; a third consumer is
    for consumer in ("A", "B"):
        assert scripts.run("pick", KEYS, [now + 0.1, 5, consumer], redis_client) == 1
    assert status.holds_in_force(redis_client.hvals(KEYS.held), now + 0.1) == 1
    assert scripts.run("pick", KEYS, [now + 0.1, 5, "C"], redis_client)[0] == b"slow"
    # A record of the old single-entry shape reads as before
    redis_client.hset(KEYS.held, "slow", f"C {now + 5:.3f} 2")
    assert release(scripts, redis_client, "C", now + 1, "slow") == (1, 1.0)  # its 4th
    assert status.holds_in_force(redis_client.hvals(KEYS.held), now + 1.5) == 1


def test_a_releaser_reaches_the_task_behind_more_held_ones_than_a_page(
        redis_client: redis.Redis) -> None:
    """(a pick popped 64 at most: a worker that had released 70 big tasks at the head
    was told "all held" for ever, the small one behind them never reached)"""
    scripts = Scripts.register()
    now = 1000.0
    big = [f"big{i:03d}" for i in range(70)]
    scripts.run("put", KEYS, put_args([*big, "small"]), redis_client)
    for task_id in big:
        assert scripts.run("pick", KEYS, [now, 5, "A"], redis_client)[0] == task_id.encode()
    scripts.run("release", KEYS, ["A", now, 60, 600, *big], redis_client)
    order = redis_client.zrange(KEYS.waiting, 0, -1, withscores=True)
    assert scripts.run("pick", KEYS, [now + 1, 5, "A"], redis_client)[0] == b"small"
    # the held ones stay where they were, with their scores; A is told how many it holds
    assert redis_client.zrange(KEYS.waiting, 0, -1, withscores=True) == order[:-1]
    assert scripts.run("pick", KEYS, [now + 1, 5, "A"], redis_client) == 70
    assert scripts.run("pick", KEYS, [now + 1, 5, "B"], redis_client)[0] == b"big000"


def test_a_late_ack_of_a_restored_message_leaves_nothing_of_it(
        redis_client: redis.Redis) -> None:
    """(its yield claim and affinity skip stamp, set while it waited again, stayed)"""
    scripts = Scripts.register()
    scripts.run("put", KEYS, put_args(["late"]), redis_client)
    assert scripts.run("pick", KEYS, [1000.0, 5, "A"], redis_client)[0] == b"late"
    assert scripts.run("restore", KEYS, [2000.0, 10], redis_client) == 1  # A went silent
    redis_client.hset(KEYS.yields, "late", 1.0)
    redis_client.hset(KEYS.skipped, "late", 1500.0)
    scripts.run("ack", KEYS, ["late"], redis_client)  # A was alive after all
    for key in (KEYS.waiting, KEYS.unacked, KEYS.payloads, KEYS.meta, KEYS.yields,
                KEYS.skipped, KEYS.redelivered, KEYS.saved):
        assert not redis_client.exists(key), key


def test_a_crash_restore_keeps_the_checkpoint_for_the_next_run(
        redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    scripts.run("put", KEYS, put_args(["t"]), redis_client)
    # Given a task that yielded once (checkpoint saved) and is running again
    assert scripts.run("pick", KEYS, [1000.0, 5, "A"], redis_client)[3] is None
    redis_client.hset(KEYS.checkpoints, "t", '{"done": 7}')
    # When its worker dies and the message is restored (restore.lua with explicit ids)
    assert scripts.run("restore", KEYS, ["-", 0, "t"], redis_client) == 1
    # Then the next run is handed the progress it had saved
    picked = scripts.run("pick", KEYS, [1001.0, 5, "B"], redis_client)
    assert picked[0] == b"t" and json.loads(picked[3]) == {"done": 7}
    assert int(picked[2]) == 1  # and the crash counts as a redelivery, as before


@pytest.mark.parametrize(("eta_from_now", "counted"), [(600.0, 0), (-1.0, 1), (None, 1)])
def test_a_crash_restore_counts_only_what_may_have_started(
        redis_client: redis.Redis, eta_from_now: float | None, counted: int) -> None:
    """(a worker holding a countdown task in Celery's timer that crashed had it counted as a
    redelivery: a few crashes in a long countdown dead-lettered it as poison, never run)"""
    import time

    scripts = Scripts.register()
    meta = {"c": "low"} if eta_from_now is None else {"c": "low",
                                                       "eta": time.time() + eta_from_now}
    scripts.run("put", KEYS, ["t", "{}", json.dumps(meta), "0", "low"], redis_client)
    assert scripts.run("pick", KEYS, [1000.0, 5, "A"], redis_client)[0] == b"t"
    assert scripts.run("restore", KEYS, [2000.0, 10], redis_client) == 1  # A went silent
    picked = scripts.run("pick", KEYS, [3000.0, 5, "B"], redis_client)
    assert picked[0] == b"t" and int(picked[2]) == counted


@pytest.mark.parametrize(("due_after_beat_s", "counted"), [(30.0, 0), (10.0, 1)])
def test_a_task_due_after_its_holder_died_is_not_counted(
        redis_client: redis.Redis, due_after_beat_s: float, counted: int) -> None:
    """(a worker that died a little before a countdown task fell due had it counted: the
    sweep came after the due time, and a crash per countdown crept toward poison)"""
    import time

    scripts = Scripts.register()
    beat = time.time() - 100  # the holder's last beat; it beat each 20 s until it died
    meta = {"c": "low", "eta": beat + due_after_beat_s}  # due by now, in both cases
    scripts.run("put", KEYS, ["t", "{}", json.dumps(meta), "0", "low"], redis_client)
    assert scripts.run("pick", KEYS, [beat, 5, "A"], redis_client)[0] == b"t"
    # Due past the beat it missed: it died before the task was due (not counted); due
    # within it: it may have started (counted). (The queue's other workers sweep it: no
    # gap holds the sweep.)
    redis_client.hset(KEYS.sweep, mapping={"at": time.time(), "every": 20.0})
    assert scripts.run("restore", KEYS, [beat + 60, 10, beat + 86400, 20.0],
                       redis_client) == 1
    picked = scripts.run("pick", KEYS, [time.time(), 5, "B"], redis_client)
    assert picked[0] == b"t" and int(picked[2]) == counted


def test_after_a_gap_in_the_sweeps_none_restores_until_the_holders_have_beaten(
        redis_client: redis.Redis) -> None:
    """(Redis stalled past the visibility timeout: nobody could beat meanwhile, and the
    first sweep after it restored, and ran twice, what live workers held)"""
    scripts = Scripts.register()
    period = 2.0

    def clock() -> float:
        seconds, micros = redis_client.time()
        return seconds + micros / 1e6

    def sweep() -> int:
        now = clock()
        return int(scripts.run("restore", KEYS, [now - 3 * period, 10, now + 86_400, period],
                               redis_client))

    # A queue nothing is held of keeps no record (a reply queue read without acks)
    assert sweep() == 0 and not redis_client.exists(KEYS.sweep)
    scripts.run("put", KEYS, put_args(["a", "b", "c"]), redis_client)
    for _ in range(3):
        scripts.run("pick", KEYS, [clock() - 60, 5, "A"], redis_client)  # silent a minute
    redis_client.zadd(KEYS.unacked, {"c": clock()}, xx=True)  # c's holder beats
    # Given messages held and no record of the queue served yet (a stall before the
    # first sweep or beat would not show as a gap): counted as one, held
    assert sweep() == 0 and redis_client.hexists(KEYS.sweep, "hold")
    # Given sweeps every period since: a silent holder's messages go back at once
    redis_client.hdel(KEYS.sweep, "hold")
    redis_client.zadd(KEYS.unacked, {"b": clock()}, xx=True)
    assert sweep() == 1 and set(redis_client.zrange(KEYS.unacked, 0, -1)) == {b"b", b"c"}
    # When the last sweep was longer ago than the sweeps' period allows (Redis stalled)
    redis_client.zadd(KEYS.unacked, {"b": clock() - 60}, xx=True)  # its beats missed
    redis_client.hset(KEYS.sweep, "at", clock() - 10 * period)
    # Then no sweep restores anything for two periods, the holders' time to beat
    assert sweep() == 0 and sweep() == 0
    hold = float(redis_client.hget(KEYS.sweep, "hold") or 0)
    assert clock() + period < hold <= clock() + 2 * period
    # and a restore of named ids (a worker giving its own back) is not held
    assert scripts.run("restore", KEYS, ["-", 0, "c"], redis_client) == 1
    # And once the hold is over, a holder still silent loses its message
    redis_client.hset(KEYS.sweep, "hold", clock() - 0.001)
    assert sweep() == 1 and redis_client.zcard(KEYS.unacked) == 0
    ttl = redis_client.ttl(KEYS.sweep)
    assert 0 < ttl <= 86_400  # (a queue no one sweeps any more leaves no record for good)


def test_a_holders_beat_keeps_the_queue_heard_and_after_a_gap_holds_the_sweeps(
        redis_client: redis.Redis) -> None:
    """(beat.lua: a solo worker sweeps only between its tasks, further apart than a gap
    allows; its heartbeat thread's beats, every period, tell Redis the queue is served)"""
    scripts = Scripts.register()
    period = 2.0

    def clock() -> float:
        seconds, micros = redis_client.time()
        return seconds + micros / 1e6

    scripts.run("put", KEYS, put_args(["a", "b"]), redis_client)
    for _ in range(2):
        scripts.run("pick", KEYS, [clock() - 60, 5, "A"], redis_client)
    # A beat pushes the deadlines of the ids still unacked, and notes the queue served
    # (the first, messages held without a record: as after a gap, it holds)
    assert scripts.run("beat", KEYS, [clock(), period, "a", "gone"], redis_client) == 1
    assert redis_client.zscore(KEYS.unacked, "a") > clock() - 1
    assert redis_client.zscore(KEYS.unacked, "gone") is None  # (not brought back)
    at = float(redis_client.hget(KEYS.sweep, "at") or 0)
    assert clock() - 1 < at <= clock() and redis_client.hexists(KEYS.sweep, "hold")
    redis_client.hdel(KEYS.sweep, "hold")
    scripts.run("beat", KEYS, [clock(), period, "a"], redis_client)  # (a record now)
    assert not redis_client.hexists(KEYS.sweep, "hold")
    # so a sweep a long while after the last sweep, beats between, restores at once
    now = clock()
    assert scripts.run("restore", KEYS, [now - 3 * period, 10, now + 86_400, period],
                       redis_client) == 1
    # The first beat after a gap (a Redis stall) holds the sweeps, as a sweep would
    redis_client.hset(KEYS.sweep, "at", clock() - 10 * period)
    scripts.run("beat", KEYS, [clock() - 30, period, "a"], redis_client)  # (sent long ago)
    now = clock()
    assert scripts.run("restore", KEYS, [now - 3 * period, 10, now + 86_400, period],
                       redis_client) == 0
    # and a sweep record of another type stops no beat
    redis_client.delete(KEYS.sweep)
    redis_client.set(KEYS.sweep, "another program's")
    assert scripts.run("beat", KEYS, [clock(), period, "a"], redis_client) == 1


def test_a_sweep_record_of_another_type_refuses_the_sweep_and_writes_nothing(
        redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    scripts.run("put", KEYS, put_args(["a"]), redis_client)
    scripts.run("pick", KEYS, [1000.0, 5, "A"], redis_client)
    redis_client.set(KEYS.sweep, "another program's")
    with pytest.raises(redis.ResponseError, match="SITS_WRONGTYPE"):
        scripts.run("restore", KEYS, [2000.0, 10, 3000.0, 2.0], redis_client)
    assert redis_client.zrange(KEYS.unacked, 0, -1) == [b"a"]


def test_of_the_runners_that_could_yield_the_lowest_class_does(
        redis_client: redis.Redis, redis_url: str) -> None:
    """(the first runner to ask was granted the yield: a medium task gave its slot to a
    high one while a low task ran beside it)"""
    import time

    from sits_queue.config import SitsConfig
    from sits_queue.workers.slices import Running, Slicer

    # a wide extra wait per class below, so that nothing here depends on the test's speed
    config = SitsConfig(redis_url=redis_url, yield_wait_ms=2.0, yield_rank_wait_ms=5000.0)
    queue = "scripts-test"
    past_slice = time.monotonic() - 60.0
    medium = Running(queue, "run-m", "medium", past_slice)
    low = Running(queue, "run-l", "low", past_slice)
    redis_client.zadd(KEYS.unacked, {"run-m": 1000.0, "run-l": 1000.0})
    # Given a high task that has waited 1 s, and a child running each task
    waiting_task(redis_client, "h", "high", time.time() - 1.0, 1)
    children = Slicer(config, redis_client), Slicer(config, redis_client)
    # Then the medium one, asking first, is told to wait; the low one yields
    assert children[0].claim(medium, time.monotonic(), {"at": "m"}) is False
    assert children[1].claim(low, time.monotonic(), {"at": "l"}) is True
    assert json.loads(redis_client.hget(KEYS.checkpoints, "run-l") or "") == {"at": "l"}
    assert not redis_client.hexists(KEYS.checkpoints, "run-m")
    # And with no low task asking, the medium one yields once the extra wait has passed
    redis_client.delete(KEYS.waiting, KEYS.meta, KEYS.yields, KEYS.checkpoints)
    waiting_task(redis_client, "h2", "high", time.time() - 6.0, 1)
    assert Slicer(config, redis_client).claim(medium, time.monotonic(), None) is True


def test_a_large_state_is_sent_once_then_only_with_a_granted_yield(
        redis_client: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """(a task carrying its results so far re-serialised and re-sent its whole state at
    every ask: every 0.2 s, and every 2 ms while an urgent task's wait ran; at 20 MB
    that was twice the task's own work)"""
    import time

    from sits_queue.config import SitsConfig
    from sits_queue.workers import slices

    made: list[int] = []
    real = slices.state_json

    def counting(state: object) -> str:
        out = real(state)
        made.append(len(out))
        return out

    monkeypatch.setattr(slices, "state_json", counting)
    config = SitsConfig(redis_url=redis_url, yield_wait_ms=2.0)
    runner = slices.Running("scripts-test", "run-big", "low", time.monotonic() - 60.0)
    redis_client.zadd(KEYS.unacked, {"run-big": 1000.0})
    slicer = slices.Slicer(config, redis_client)
    state = {"results": ["x" * 1000] * 100}  # ~100 KB of JSON
    # Given nothing urgent waiting: the first ask sends it, the next ones do not
    for _ in range(5):
        slicer._next_check = 0.0  # (each an ask of the broker, not one skipped)
        assert slicer.claim(runner, time.monotonic(), state) is False
    assert len(made) == 1 and made[0] > slices.INLINE_STATE_BYTES
    # When an urgent task has waited long enough, the yield is granted, and the state
    # as it is then is kept as the checkpoint before the task gives its message back
    state["results"].append("last")
    waiting_task(redis_client, "h", "high", time.time() - 1.0, 1)
    slicer._next_check = 0.0
    assert slicer.claim(runner, time.monotonic(), state) is True
    assert len(made) == 2
    assert json.loads(redis_client.hget(KEYS.checkpoints, "run-big") or "") == state
    assert redis_client.hexists(KEYS.yields, "h")


def test_a_deferred_state_that_is_no_json_gives_its_claim_up(
        redis_client: redis.Redis, redis_url: str) -> None:
    import time

    from sits_queue.config import SitsConfig
    from sits_queue.workers import slices

    config = SitsConfig(redis_url=redis_url, yield_wait_ms=2.0)
    runner = slices.Running("scripts-test", "run-odd", "low", time.monotonic() - 60.0)
    redis_client.zadd(KEYS.unacked, {"run-odd": 1000.0})
    slicer = slices.Slicer(config, redis_client)
    state: dict[str, object] = {"results": ["x" * 1000] * 100}
    assert slicer.claim(runner, time.monotonic(), state) is False
    # Given a state that stopped being JSON data (a set) while it was not sent
    state["seen"] = {1, 2}
    waiting_task(redis_client, "h", "high", time.time() - 1.0, 1)
    slicer._next_check = 0.0
    with pytest.raises(TypeError, match="yield_point state must be JSON data"):
        slicer.claim(runner, time.monotonic(), state)
    # Then no checkpoint stands, and the urgent task is free for another runner to yield
    assert not redis_client.hexists(KEYS.checkpoints, "run-odd")
    assert not redis_client.hexists(KEYS.yields, "h")
