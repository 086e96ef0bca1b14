"""Dead letters are deleted ``dead_letter_ttl_s`` after they were dead-lettered, by the
rescoring pass, at most once per sweep period across every beat; never with a TTL of 0."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from sits_queue.broker import deadletters
from sits_queue.broker.keys import QueueKeys
from sits_queue.priority.rescore import Rescorer, sweep_period_s
from tests.integration.test_transport import build_app

TTL_S = 600.0


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    app = build_app(redis_url, dead_letter_ttl_s=TTL_S)
    yield app
    app.close()


def reject(app: Celery, queue: str, *tags: str) -> dict[str, str]:
    """Send a task per tag to ``queue``, pick each and reject it (a dead letter, as a
    consumer's ``reject()`` makes one): {tag: its dead letter's id}."""
    for tag in tags:
        app.tasks["t.echo"].apply_async((tag,), queue=queue)
    ids = {}
    with app.connection_for_write() as conn:
        q = conn.SimpleQueue(queue)
        for _ in tags:
            message = q.get(block=False)
            ids[message.payload[0][0]] = message.delivery_tag
            message.reject()
        q.close()
    return ids


def backdate(client: redis.Redis, queue: str, message_id: str, age_s: float) -> None:
    """Make a dead letter ``age_s`` old, as if the pass ran that much later."""
    dead = QueueKeys.for_queue(queue).dead
    record = json.loads(client.hget(dead, message_id))
    client.hset(dead, message_id, json.dumps({**record, "at": time.time() - age_s}))


def test_letters_past_their_ttl_go_and_the_others_stay(
        app: Celery, redis_client: redis.Redis) -> None:
    ids = reject(app, "celery", "old", "young", "junk")
    ids.update(reject(app, "other", "old2"))
    backdate(redis_client, "celery", ids["old"], TTL_S + 5)
    backdate(redis_client, "celery", ids["young"], TTL_S - 60)
    backdate(redis_client, "other", ids["old2"], 3 * TTL_S)
    # records another program wrote, without a readable time: left for a person to drop
    dead = QueueKeys.for_queue("celery").dead
    redis_client.hset(dead, ids["junk"], b"{not json")
    redis_client.hset(dead, "huge", '{"reason": "x", "at": 1' + "0" * 400 + "}")
    assert Rescorer(app.sits, redis_client).rescore_all() is not None
    assert set(redis_client.hkeys(dead)) == {ids["young"].encode(), ids["junk"].encode(),
                                             b"huge"}
    # and listed as unreadable (an OverflowError stopped the sweep and `sitsq dead`)
    listed = {d.id: d.reason for d in deadletters.read(redis_client, dead)}
    assert listed["huge"] == listed[ids["junk"]] == "(unreadable record)"
    assert redis_client.hlen(QueueKeys.for_queue("other").dead) == 0


def test_between_sweeps_a_pass_reads_no_dead_letter(
        app: Celery, redis_client: redis.Redis) -> None:
    rescorer = Rescorer(app.sits, redis_client)
    (message_id,) = reject(app, "celery", "later").values()
    assert rescorer.expire_dead_letters(rescorer.queues(), time.time()) == 0  # young
    backdate(redis_client, "celery", message_id, TTL_S + 5)
    # Another beat's pass within the period leaves it...
    assert Rescorer(app.sits, redis_client).rescore_all() is not None
    assert redis_client.hexists(QueueKeys.for_queue("celery").dead, message_id)
    # ...and the first pass after the period takes it
    pttl = redis_client.pttl("sits:state:dead-sweep")
    assert 0 < pttl <= sweep_period_s(TTL_S) * 1000
    redis_client.delete("sits:state:dead-sweep")  # the period, elapsed
    assert rescorer.expire_dead_letters(rescorer.queues(), time.time()) == 1
    assert not redis_client.hexists(QueueKeys.for_queue("celery").dead, message_id)


def test_a_lowered_ttl_sweeps_at_once_not_when_the_old_period_ends(
        redis_url: str, redis_client: redis.Redis) -> None:
    """(a sweep under the default week-long TTL marked the next due in an hour: a TTL
    lowered to 30 s then deleted nothing for up to that hour)"""
    week = build_app(redis_url, dead_letter_ttl_s=7 * 86400)
    short = build_app(redis_url, dead_letter_ttl_s=30)
    try:
        (message_id,) = reject(short, "celery", "old").values()
        backdate(redis_client, "celery", message_id, 60)
        assert Rescorer(week.sits, redis_client).expire_dead_letters(["celery"],
                                                                     time.time()) == 0
        assert redis_client.pttl("sits:state:dead-sweep") > 3_000_000  # the hour's mark
        rescorer = Rescorer(short.sits, redis_client)
        assert rescorer.expire_dead_letters(["celery"], time.time()) == 1
        assert 0 < redis_client.pttl("sits:state:dead-sweep") <= sweep_period_s(30) * 1000
        # and within its own period it waits as before
        (later,) = reject(short, "celery", "later").values()
        backdate(redis_client, "celery", later, 60)
        assert rescorer.expire_dead_letters(["celery"], time.time()) == 0
        # a mark with no life (set by hand) holds no sweep off for good
        redis_client.set("sits:state:dead-sweep", 1)
        assert rescorer.expire_dead_letters(["celery"], time.time()) == 1
    finally:
        week.close()
        short.close()


def test_a_ttl_of_zero_keeps_every_letter(redis_url: str, redis_client: redis.Redis) -> None:
    app = build_app(redis_url, dead_letter_ttl_s=0)
    try:
        (message_id,) = reject(app, "celery", "kept").values()
        backdate(redis_client, "celery", message_id, 10 * 365 * 86400)
        assert Rescorer(app.sits, redis_client).rescore_all() is not None
        assert redis_client.hexists(QueueKeys.for_queue("celery").dead, message_id)
        assert not redis_client.exists("sits:state:dead-sweep")
    finally:
        app.close()


def test_a_large_hash_is_expired_a_chunk_at_a_time(redis_client: redis.Redis) -> None:
    dead = QueueKeys.for_queue("big").dead
    now = time.time()
    records = {f"m{i}": json.dumps({"reason": "r", "at": now - (100 if i % 3 else 1),
                                    "payload": "{}"}) for i in range(1200)}
    redis_client.hset(dead, mapping=records)
    assert deadletters.expire(redis_client, dead, now - 50, chunk=100) == 800
    assert redis_client.hlen(dead) == 400


def test_the_sweep_period_is_a_24th_of_the_ttl_within_a_second_and_an_hour() -> None:
    assert sweep_period_s(TTL_S) == 25.0
    assert sweep_period_s(1.0) == 1.0
    assert sweep_period_s(1_209_600.0) == 3600.0


def test_a_letter_of_a_payload_that_is_not_utf8_is_read_and_expires(
        app: Celery, redis_client: redis.Redis) -> None:
    """(dead.lua's cjson copies such a payload's bytes into the record: it read as
    '(unreadable record)', its reason and age lost, and it never expired)"""
    from sits_queue.broker.scripts import Scripts

    keys = QueueKeys.for_queue("celery")
    redis_client.hset(keys.payloads, "bin", b"\xff\xfe\x00garbage\x80")
    redis_client.zadd(keys.waiting, {"bin": 1})
    Scripts.register().run_on("dead", keys.all(), [time.time() - TTL_S - 5,
                                                   "malformed payload", "bin"], redis_client)
    record = redis_client.hget(keys.dead, "bin")
    with pytest.raises(UnicodeDecodeError):
        record.decode()  # as stored: the bytes themselves
    (letter,) = deadletters.read(redis_client, keys.dead)
    assert letter.reason == "malformed payload" and letter.at is not None
    assert deadletters.expire(redis_client, keys.dead, time.time() - TTL_S) == 1
    assert not redis_client.hexists(keys.dead, "bin")


def test_a_dead_lettered_task_s_failed_event_names_it_and_the_worker(
        app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """(a poison task's event came from the process's default name, gen<pid>@host, which
    Flower listed as a worker of its own, online; and without the task's name and
    arguments, which no task-received had given it: Flower showed "-")"""
    (message_id,) = reject(app, "celery", "parked").values()
    app.conf.worker_send_task_events = True
    monkeypatch.setattr(deadletters, "event_hostname", "w1@probe")  # (set at its start)
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe("*celeryev*")
    while pubsub.get_message(timeout=0.1) is not None:
        pass
    assert deadletters.fail_tasks(redis_client, QueueKeys.for_queue("celery").dead,
                                  [message_id], app.backend) == 1
    message = pubsub.get_message(timeout=5)
    pubsub.close()
    assert message is not None
    envelope = json.loads(message["data"])
    body = envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    event = json.loads(body)
    assert event["type"] == "task-failed" and event["hostname"] == "w1@probe"
    assert event["name"] == "t.echo" and event["args"] == "('parked',)"
    assert "DeadLettered" in event["exception"]
