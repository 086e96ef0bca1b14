"""Script calls by SHA against a real Redis: the synchronous and the split send/reply
paths, a server that forgot its scripts, and connections always going back to the pool."""

from __future__ import annotations

import json

import pytest
import redis

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
