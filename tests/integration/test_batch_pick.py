"""``pick.lua``'s batch kin against a real Redis: what one pick takes with a batch task."""

from __future__ import annotations

import json
from typing import Any

import redis

from sits_queue.broker.keys import QueueKeys, score_base
from sits_queue.broker.scripts import Scripts

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
    """The ids one pick returned: the picked one, then its kin."""
    return [picked[0].decode()] + [picked[i].decode() for i in range(5, len(picked), 3)]


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
    # The poison one is parked by the plain pick; the restored one runs alone
    assert taken(pick(redis_client, scripts, window=256, consumer="B")) == ["crashed"]
    assert pick(redis_client, scripts, window=256, consumer="B") == 0
    assert redis_client.hexists(KEYS.dead, "poison")


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
