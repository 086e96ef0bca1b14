"""``pick.lua``'s batch kin against a real Redis: what one pick takes with a batch task."""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import pytest
import redis

from sits_queue.app import make_app
from sits_queue.broker.keys import QueueKeys, score_base
from sits_queue.broker.meta import compact_json
from sits_queue.broker.scripts import Scripts
from sits_queue.config import SitsConfig
from sits_queue.errors import InvalidTaskOptions
from sits_queue.shards import apply_sharded

KEYS = QueueKeys.for_queue("batch-pick")
NOW = 1000.0
KEY_A = "t.embed|enc|medium"
KEY_B = "t.embed|other|medium"


def put(client: redis.Redis, scripts: Scripts, items: list[tuple[str, str | None, int | None]],
        priority: float = 1.0) -> None:
    """Enqueue (id, batch key, max batch) items, in that order, at one priority."""
    args: list[Any] = []
    for task_id, key, most in items:
        meta = {"c": "medium", "m": "enc", "b": key, "bn": most, "t": NOW, "task": "t"}
        args += [task_id, json.dumps({"id": task_id}), json.dumps(meta),
                 score_base(priority), "medium"]
    scripts.run("put", KEYS, args, client)


def pick(client: redis.Redis, scripts: Scripts, window: int, consumer: str = "A") -> Any:
    return scripts.run("pick", KEYS, [NOW, 5, consumer, window], client)


def taken(picked: Any) -> list[str]:
    """The ids one pick returned: the picked one, then its kin (not the ids of poison
    messages it dead-lettered on its way, a list at the end when there are any)."""
    end = len(picked) - 1 if isinstance(picked[-1], list) else len(picked)
    return [picked[0].decode()] + [picked[i].decode() for i in range(5, end, 3)]


def test_a_pick_takes_the_kin_up_to_max_batch_and_leaves_the_rest(
        redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    put(redis_client, scripts, [("a1", KEY_A, 3), ("b1", KEY_B, 3), ("a2", KEY_A, 3),
                                ("x", None, None), ("a3", KEY_A, 3), ("a4", KEY_A, 3)])
    # When a worker picks the head (a batch task with max_batch 3)
    picked = pick(redis_client, scripts, window=256)
    # Then it takes two of its kin too, nearest first; other keys and plain tasks stay
    assert taken(picked) == ["a1", "a2", "a3"]
    assert [x.decode() for x in redis_client.zrange(KEYS.waiting, 0, -1)] == ["b1", "x", "a4"]
    # Each taken message is unacked with its score kept, as a plainly picked one is
    assert redis_client.zcard(KEYS.unacked) == 3
    assert redis_client.hlen(KEYS.saved) == 3
    assert picked[6] == b'{"id": "a2"}' and picked[7] == 0
    # And the next pick of a batch task takes its own kin only
    assert taken(pick(redis_client, scripts, window=256)) == ["b1"]
    assert taken(pick(redis_client, scripts, window=256)) == ["x"]


@pytest.mark.parametrize("key", ['t."quoted"|enc|medium', "t.back\\slash|enc|medium",
                                 "t.tab\tname|enc|medium", "t.résumé|enc|medium"])
def test_kin_are_found_whatever_the_key_json_escapes(redis_client: redis.Redis,
                                                     key: str) -> None:
    """The records are written as the producer writes them (compact_json): a key that
    JSON escapes was never found in their text, and such tasks never batched."""
    scripts = Scripts.register()
    args: list[Any] = []
    for task_id in ("a1", "a2", "a3"):
        meta = {"c": "medium", "b": key, "bn": 8, "t": NOW, "task": "t"}
        args += [task_id, json.dumps({"id": task_id}), compact_json(meta),
                 score_base(1.0), "medium"]
    put(redis_client, scripts, [("other", KEY_A, 8)])
    scripts.run("put", KEYS, args, redis_client)
    assert taken(pick(redis_client, scripts, window=256)) == ["other"]
    assert taken(pick(redis_client, scripts, window=256)) == ["a1", "a2", "a3"]


def test_window_zero_or_a_plain_task_takes_one(redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    put(redis_client, scripts, [("a1", KEY_A, 8), ("a2", KEY_A, 8), ("a3", KEY_A, 8)])
    assert taken(pick(redis_client, scripts, window=0)) == ["a1"]
    # The window bounds how deep the kin are looked for
    assert taken(pick(redis_client, scripts, window=1)) == ["a2", "a3"]
    assert pick(redis_client, scripts, window=256) == 0


def test_max_batch_one_never_gathers(redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    put(redis_client, scripts, [("a1", KEY_A, 1), ("a2", KEY_A, 1)])
    assert taken(pick(redis_client, scripts, window=256)) == ["a1"]


def test_held_and_restored_kin_are_left_for_others(redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    put(redis_client, scripts, [("a1", KEY_A, 8), ("held", KEY_A, 8), ("poison", KEY_A, 8),
                                ("crashed", KEY_A, 8), ("a5", KEY_A, 8)])
    # Given "held" released by A a moment ago, "poison" restored 9 times (limit 5) and
    # "crashed" restored once (its worker died with it)
    redis_client.hset(KEYS.held, "held", f"A {NOW + 5} 1")
    redis_client.hset(KEYS.redelivered, "poison", 9)
    redis_client.hset(KEYS.redelivered, "crashed", 1)
    picked = pick(redis_client, scripts, window=256)
    assert taken(picked) == ["a1", "a5"]
    # The held one goes to another consumer, alone: the restored one is no one's kin
    assert taken(pick(redis_client, scripts, window=256, consumer="B")) == ["held"]
    # The poison one is parked by the plain pick, which says so; the restored one runs alone
    picked = pick(redis_client, scripts, window=256, consumer="B")
    assert taken(picked) == ["crashed"] and picked[-1] == [b"poison"]
    assert pick(redis_client, scripts, window=256, consumer="B") == 0
    assert redis_client.hexists(KEYS.dead, "poison")


def test_a_pick_that_meets_only_poison_names_it_with_the_count(
        redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    put(redis_client, scripts, [("poison", KEY_A, 8)])
    redis_client.hset(KEYS.redelivered, "poison", 9)
    assert pick(redis_client, scripts, window=256) == [0, [b"poison"]]
    assert pick(redis_client, scripts, window=256) == 0


def test_a_restored_message_runs_alone(redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    put(redis_client, scripts, [("crashed", KEY_A, 8), ("a2", KEY_A, 8), ("a3", KEY_A, 8)])
    redis_client.hset(KEYS.redelivered, "crashed", 1)
    picked = pick(redis_client, scripts, window=256)
    assert taken(picked) == ["crashed"] and picked[2] == 1
    assert taken(pick(redis_client, scripts, window=256)) == ["a2", "a3"]


def test_a_batch_of_a_key_that_only_matches_as_a_substring_is_not_kin(
        redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    # "t.embed|enc|medium" is a substring of this key: the plain find must not decide
    put(redis_client, scripts, [("a1", KEY_A, 8), ("long", "x" + KEY_A, 8)])
    assert taken(pick(redis_client, scripts, window=256)) == ["a1"]


def test_a_no_ack_pick_forgets_what_it_takes_kin_and_checkpoint_included(
        redis_client: redis.Redis) -> None:
    scripts = Scripts.register()
    put(redis_client, scripts, [("a1", KEY_A, 3), ("b1", KEY_B, 3), ("a2", KEY_A, 3)])
    # Given a task that yielded its slot before (a checkpoint) and one restored once
    redis_client.hset(KEYS.checkpoints, "a1", '{"step": 4}')
    redis_client.hset(KEYS.redelivered, "b1", 1)
    # When a consumer that does not ack picks ('noack' instead of affinity arguments)
    picked = scripts.run("pick", KEYS, [NOW, 5, "A", 256, "noack"], redis_client)
    # Then it gets what an acking pick gets: the task, its checkpoint, its kin
    assert taken(picked) == ["a1", "a2"] and picked[3] == b'{"step": 4}'
    # but nothing of them stays behind to be acked, heartbeated or restored
    assert redis_client.zcard(KEYS.unacked) == 0 and redis_client.hlen(KEYS.saved) == 0
    assert not redis_client.hexists(KEYS.checkpoints, "a1")
    assert redis_client.hkeys(KEYS.payloads) == redis_client.hkeys(KEYS.meta) == [b"b1"]
    # and the restored one is still a restored one
    again = scripts.run("pick", KEYS, [NOW, 5, "A", 256, "noack"], redis_client)
    assert taken(again) == ["b1"] and again[2] == 1
    assert not redis_client.exists(KEYS.payloads, KEYS.meta, KEYS.redelivered)


# -- join mode and join.lua: a running batch's freed rows (workers/joins.py) --------------------

def join_pick(client: redis.Redis, scripts: Scripts, key: str, most: int,
              window: int = 256) -> list[str]:
    got = scripts.run("pick", KEYS, [NOW, 5, "A", window, "join", key, most], client)
    return [got[i].decode() for i in range(0, len(got), 3)]


def test_join_mode_takes_only_the_key_nearest_first_and_only_behind_a_head_of_it(
        redis_client: redis.Redis) -> None:
    """(joins were taken from behind any head: a batch of low generations took joins for
    up to batch_join_s past a high task at the head, which waited 5-13 s for its slot)"""
    scripts = Scripts.register()
    put(redis_client, scripts, [("b1", KEY_B, 8), ("a1", KEY_A, 8), ("x", None, None),
                                ("a2", KEY_A, 8), ("held", KEY_A, 8), ("crashed", KEY_A, 8),
                                ("a3", KEY_A, 8)])
    redis_client.hset(KEYS.held, "held", f"A {NOW + 5} 1")
    redis_client.hset(KEYS.redelivered, "crashed", 1)
    # another key heads the queue: it runs next, so no batch of A takes joins past it
    assert join_pick(redis_client, scripts, KEY_A, 2) == []
    assert join_pick(redis_client, scripts, KEY_B, 1) == ["b1"]
    # an A heads it: up to the count asked, whatever the tasks' own max batch, from the
    # window as a batch pick of the head gathers its kin; unacked like any pick
    assert join_pick(redis_client, scripts, KEY_A, 2) == ["a1", "a2"]
    assert redis_client.zcard(KEYS.unacked) == 3 and redis_client.hlen(KEYS.saved) == 3
    # a task of no batch heads it now: nothing joins
    assert join_pick(redis_client, scripts, KEY_A, 8) == []
    redis_client.zrem(KEYS.waiting, "x")
    # the head this consumer holds off is passed over; held and restored messages are
    # not taken; the window bounds the search
    assert join_pick(redis_client, scripts, KEY_A, 8, window=2) == []
    assert join_pick(redis_client, scripts, KEY_A, 8) == ["a3"]
    assert join_pick(redis_client, scripts, KEY_A, 8) == []
    assert join_pick(redis_client, scripts, KEY_B, 0) == []
    assert [x.decode() for x in redis_client.zrange(KEYS.waiting, 0, -1)] == [
        "held", "crashed"]


def test_join_lua_pushes_until_closed_and_counts_what_the_child_took(
        redis_client: redis.Redis) -> None:
    from sits_queue.workers import joins

    scripts = Scripts.register()
    keys = joins.join_keys("batch-pick", "job-1")

    def join(*args: Any) -> Any:
        return scripts.run_on("join", keys, list(args), redis_client)

    assert join("room", 60, 3) == 1 and redis_client.hget(keys[1], "room") == b"3"
    assert join("push", 60, "j1", "j2", "j3") == 1
    assert join("take", 2) == [b"j1", b"j2"] and join("take", 0) == []
    assert redis_client.hget(keys[1], "room") == b"1"  # taken rows are not free
    assert 0 < redis_client.ttl(keys[0]) <= 60 and 0 < redis_client.ttl(keys[1]) <= 60
    # closed: the state says how many the child took and the list is dropped (the
    # main process runs "j3" again); nothing more is pushed or offered
    assert join("close") == [2, 1]
    assert not redis_client.exists(keys[0])
    assert join("push", 60, "j4") == 0 and join("room", 60, 5) == 0
    assert join("take", 5) == [] and redis_client.hget(keys[1], "room") == b"0"
    with pytest.raises(redis.ResponseError, match="unknown op"):
        join("nonsense")


def test_shards_of_a_batch_task_run_one_a_pick_and_a_call_may_cap_its_batch(
        redis_client: redis.Redis, redis_url: str) -> None:
    """A shard is a batch of items already: shards of one job put back into one batch
    ran under one shard's time limit, and there was nothing left to stop early."""
    app = make_app(SitsConfig(redis_url=redis_url), main="shard-pick")

    @app.batch_inference_task(name="t.shard_embed", model="enc", max_batch=8, shared=False)
    def embed(engine: Any, calls: list[Any]) -> list[Any]:
        return calls

    @app.task(name="t.shard_plain", shared=False)
    def plain(items: list[Any]) -> list[Any]:
        return items

    keys, scripts = QueueKeys.for_queue("celery"), Scripts.register()
    dense = [base64.b64encode(random.Random(i).randbytes(40)).decode() for i in range(20)]
    job = apply_sharded(embed, dense, shard_items=4)
    assert len(job) == 5
    picks = [scripts.run("pick", keys, [NOW, 5, "A", 256], redis_client) for _ in range(5)]
    assert [len(taken(p)) for p in picks] == [1] * 5
    # a call capped at 2 leads a batch of 2; the task's own calls still gather up to 8
    for _ in range(3):
        embed.apply_async((["x"],), max_batch=2)
    embed.apply_async((["y"],))
    assert len(taken(scripts.run("pick", keys, [NOW, 5, "A", 256], redis_client))) == 2
    assert len(taken(scripts.run("pick", keys, [NOW, 5, "A", 256], redis_client))) == 2
    for bad in (0, 9, 2.0, True, "2", 10**400):
        with pytest.raises(InvalidTaskOptions, match="max_batch must be an integer in"):
            embed.apply_async((["z"],), max_batch=bad)
    with pytest.raises(InvalidTaskOptions, match="max_batch applies to batch tasks"):
        app.tasks["t.shard_plain"].apply_async((["z"],), max_batch=1)
    assert redis_client.zcard(keys.waiting) == 0
    app.close()


def test_batch_kin_a_delivery_failed_before_are_given_back_uncounted(
        redis_url: str, redis_client: redis.Redis) -> None:
    from kombu import Consumer, Queue

    from sits_queue.broker import intake

    app = make_app(SitsConfig(redis_url=redis_url), main="kin-handover")

    @app.batch_inference_task(name="t.kin_embed", model="m", max_batch=4, shared=False)
    def embed(engine: Any, calls: list[Any]) -> list[Any]:
        return calls

    keys = QueueKeys.for_queue("celery")
    for i in range(3):
        embed.delay(f"call{i}")
    handed: list[str] = []

    def lost(body: Any, message: Any) -> None:
        handed.append(message.delivery_tag)
        raise redis.ConnectionError("socket write failed")  # the connection went

    # Given a pick that took the three as one batch, and a hand-over that fails on the
    # first (in a worker, only a connection error gets through the delivery guard)
    intake.in_worker(True)
    try:
        with app.connection_for_write() as conn, \
                Consumer(conn, [Queue("celery")], callbacks=[lost]), \
                pytest.raises(redis.ConnectionError):
            conn.drain_events(timeout=5)
    finally:
        intake.in_worker(False)
    # Then the two never handed over are waiting again, not counted as crashes: they
    # stayed unacked, held by no one, and the sweep brought them back counted as
    # redelivered after the visibility timeout
    assert len(handed) == 1
    assert redis_client.zcard(keys.unacked) == 0 and redis_client.zcard(keys.waiting) == 3
    assert redis_client.hlen(keys.redelivered) == 0
    app.close()
