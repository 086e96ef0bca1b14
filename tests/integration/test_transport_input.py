"""The transport against producers, writers and consumers other than SITS's own: kombu
consumers without acks, headers beyond plain JSON, foreign headers, malformed payloads on
the consuming path, and queue names it must refuse. Real Redis, in-process."""

from __future__ import annotations

import datetime
import decimal
import json
import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Consumer, Producer, Queue

from sits_queue.broker.keys import QueueKeys, queues_registry
from sits_queue.errors import InvalidQueueName
from sits_queue.priority.rescore import Rescorer
from tests.integration.test_transport import build_app, kombu_message

KEYS = QueueKeys.for_queue("celery")


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    app = build_app(redis_url, visibility_timeout_s=4.0)
    yield app
    app.close()


def consume(conn: Connection, no_ack: bool, timeout_s: float = 0.5) -> list[str]:
    """Drain the default queue through a kombu ``Consumer`` (``basic_consume``, the path
    a worker takes); each task's first argument, in order."""
    got: list[str] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body[0][0])
        if not no_ack:
            message.ack()

    with Consumer(conn, [Queue("celery")], callbacks=[on_message], no_ack=no_ack,
                  accept=["json"]):
        try:
            while True:
                conn.drain_events(timeout=timeout_s)
        except TimeoutError:
            pass
    return got


def sweep_after_the_visibility_timeout(app: Celery, redis_client: redis.Redis) -> None:
    """What any consumer does for a message whose holder went silent: restore it."""
    for tag in redis_client.zrange(KEYS.unacked, 0, -1):
        redis_client.zadd(KEYS.unacked, {tag: time.time() - 60})
    with app.connection_for_write() as conn:
        ch = conn.default_channel
        ch.basic_consume("celery", no_ack=False, callback=lambda *a: None, consumer_tag="s")
        ch.qos._last_sweep = -1e9
        ch.qos.restore_visible()


def forgotten(redis_client: redis.Redis) -> bool:
    """Nothing of the queue's messages is left: not waiting, unacked, stored or dead."""
    return not any(redis_client.exists(k) for k in (KEYS.waiting, KEYS.unacked,
                                                     KEYS.payloads, KEYS.meta, KEYS.saved))


# -- no_ack consumers -------------------------------------------------------------------------


def test_a_no_ack_get_takes_the_message_for_good(app: Celery,
                                                 redis_client: redis.Redis) -> None:
    app.tasks["t.echo"].delay("once")
    # Given a kombu consumer that does not ack (basic_get with no_ack)
    with app.connection_for_write() as conn:
        ch = conn.default_channel
        ch.queue_declare("celery")
        message = ch.basic_get("celery", no_ack=True)
        assert message.payload[0] == ["once"]
        assert not ch.qos._delivered  # nothing held, so nothing heartbeated
    # Then nothing is left unacked, and no sweep brings it back (stock kombu's no_ack)
    assert forgotten(redis_client)
    sweep_after_the_visibility_timeout(app, redis_client)
    with app.connection_for_write() as conn:
        assert conn.default_channel.basic_get("celery") is None


def test_a_no_ack_consumer_takes_its_messages_for_good(app: Celery,
                                                       redis_client: redis.Redis) -> None:
    for tag in ("a", "b", "c"):
        app.tasks["t.echo"].delay(tag)
    with app.connection_for_write() as conn:
        assert consume(conn, no_ack=True) == ["a", "b", "c"]
    assert forgotten(redis_client)
    sweep_after_the_visibility_timeout(app, redis_client)
    with app.connection_for_write() as conn:
        assert consume(conn, no_ack=False) == []


def test_an_acking_consumer_still_holds_until_it_acks(app: Celery,
                                                      redis_client: redis.Redis) -> None:
    app.tasks["t.echo"].delay("held")
    with app.connection_for_write() as conn:
        message = conn.default_channel.basic_get("celery")
        assert redis_client.zcard(KEYS.unacked) == 1
        message.ack()
    assert forgotten(redis_client)


def test_a_malformed_payload_a_no_ack_consumer_meets_is_dead_lettered(
        app: Celery, redis_client: redis.Redis) -> None:
    app.tasks["t.echo"].delay("good")
    garbage = kombu_message(properties={"delivery_info": 5})
    redis_client.hset(KEYS.payloads, "bad-1", garbage)
    redis_client.zadd(KEYS.waiting, {"bad-1": 0})
    with app.connection_for_write() as conn:
        assert consume(conn, no_ack=True) == ["good"]
    record = json.loads(redis_client.hget(KEYS.dead, "bad-1"))
    assert "properties.delivery_info is not an object" in record["reason"]
    assert record["payload"] == garbage.decode()
    assert forgotten(redis_client)


# -- malformed payloads on the consuming path -------------------------------------------------


@pytest.mark.parametrize("garbage", [
    kombu_message(properties={"delivery_info": 5}),
    kombu_message(headers={"x": {"__type__": "uuid", "__value__": 5}}),
    kombu_message(body="eA==", properties={"body_encoding": "rot13"}),
])
def test_a_consumer_passes_over_a_malformed_payload(app: Celery, redis_client: redis.Redis,
                                                   garbage: bytes) -> None:
    # Given a bad payload at the head, in front of a good message
    app.tasks["t.echo"].delay("good")
    redis_client.hset(KEYS.payloads, "bad-1", garbage)
    redis_client.zadd(KEYS.waiting, {"bad-1": 0})
    # When a consumer drains the queue (drain_events raised, with the message stuck
    # unacked and held by no one)
    with app.connection_for_write() as conn:
        assert consume(conn, no_ack=False) == ["good"]
    # Then the bad one is dead-lettered, nothing is left unacked
    assert "malformed payload" in json.loads(redis_client.hget(KEYS.dead, "bad-1"))["reason"]
    assert forgotten(redis_client)


@pytest.mark.parametrize("error", [ValueError, KeyError])
def test_in_a_worker_a_message_its_consumer_raises_on_is_dead_lettered(
        app: Celery, redis_client: redis.Redis, error: type[Exception]) -> None:
    from sits_queue.broker import intake

    echo = app.tasks["t.echo"]
    for text in ("bad", "good"):  # (no result kept: one alive past Redis retries at GC)
        echo.apply_async((text,), ignore_result=True)
    got: list[str] = []

    def on_message(body: Any, message: Any) -> None:
        if body[0][0] == "bad":  # Celery's consumer failing on a message it cannot take
            raise error("cannot take it")
        got.append(body[0][0])
        message.ack()

    def drain() -> None:
        with app.connection_for_write() as conn, Consumer(
                conn, [Queue("celery")], callbacks=[on_message], accept=["json"]):
            try:
                while True:
                    conn.drain_events(timeout=0.5)
            except TimeoutError:
                pass

    # A plain kombu consumer's callback error reaches its caller, as on any transport
    with pytest.raises(error):
        drain()
    sweep_after_the_visibility_timeout(app, redis_client)
    # In a worker it would stop the event loop (a KeyError: read as a lost connection):
    # the message is dead-lettered with the error instead, and the rest is served
    intake.in_worker()
    try:
        drain()
    finally:
        intake.in_worker(False)
    assert got == ["good"]
    (record,) = [json.loads(v) for v in redis_client.hvals(KEYS.dead)]
    assert record["reason"].startswith(f"consumer refused it: {error.__name__}: ")
    assert forgotten(redis_client)


def test_in_a_worker_a_lost_connection_a_consumer_raises_is_no_dead_letter(
        app: Celery, redis_client: redis.Redis) -> None:
    """(Channel.refuse: the worker reconnects and the message runs later; the request
    guard, workers/request.py, asks the channel the same)"""
    from sits_queue.broker import intake

    app.tasks["t.echo"].apply_async(("x",), ignore_result=True)

    def on_message(body: Any, message: Any) -> None:
        raise redis.ConnectionError("Redis went away")

    intake.in_worker()
    try:
        with app.connection_for_write() as conn, Consumer(
                conn, [Queue("celery")], callbacks=[on_message], accept=["json"]), \
                pytest.raises(redis.ConnectionError):
            conn.drain_events(timeout=2)
    finally:
        intake.in_worker(False)
    # Not dead-lettered: held, and back in the queue when the consumer closed
    assert redis_client.hlen(KEYS.dead) == 0
    assert redis_client.zcard(KEYS.waiting) == 1


# -- headers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [
    float("inf"), datetime.datetime(2026, 1, 2, 3, 4, 5), uuid.UUID(int=7), b"\x00abc",
    decimal.Decimal("1.5"), 2**70, {"nested": [datetime.date(2026, 1, 2)]},
], ids=["inf", "datetime", "uuid", "bytes", "decimal", "bigint", "nested-date"])
def test_header_values_come_back_as_kombus_json_sends_them(app: Celery, value: Any) -> None:
    with app.connection_for_write() as conn:
        ch = conn.default_channel
        ch.queue_declare("celery")
        Producer(ch).publish({"k": 1}, routing_key="celery", headers={"h": value})
        got = ch.basic_get("celery")
        assert got.headers["h"] == value and type(got.headers["h"]) is type(value)
        got.ack()


def test_a_nan_header_comes_back_nan(app: Celery) -> None:
    with app.connection_for_write() as conn:
        ch = conn.default_channel
        ch.queue_declare("celery")
        Producer(ch).publish({"k": 1}, routing_key="celery", headers={"h": float("nan")})
        got = ch.basic_get("celery")
        assert math.isnan(got.headers["h"])
        got.ack()


def test_a_foreign_header_past_a_floats_range_is_scheduled_with_defaults(
        app: Celery, redis_client: redis.Redis) -> None:
    with app.connection_for_write() as conn:
        Producer(conn.default_channel).publish(
            {"x": 1}, routing_key="celery", headers={"sits": {"context_tokens": 10**400}})
    (task_id,) = redis_client.zrange(KEYS.waiting, 0, -1)
    meta = json.loads(redis_client.hget(KEYS.meta, task_id))
    assert meta["n"] == 0 and meta["c"] == app.sits.default_class


# -- queue names ------------------------------------------------------------------------------


def test_an_empty_queue_name_is_refused_where_it_enters(app: Celery,
                                                         redis_client: redis.Redis) -> None:
    with app.connection_for_write() as conn:
        ch = conn.default_channel
        # (a declare without a name gets one from kombu, as from an AMQP server)
        assert ch.queue_declare("").queue.startswith("amq.gen-")
        with pytest.raises(InvalidQueueName):
            Producer(ch).publish({"x": 1}, routing_key="")
        with pytest.raises(InvalidQueueName):
            ch.basic_consume("", no_ack=False, callback=lambda *a: None, consumer_tag="e")
    assert not redis_client.keys("sits:{}:*")
    assert b"" not in redis_client.smembers(queues_registry())


def test_a_bad_name_in_the_queue_registry_does_not_stop_the_passes(
        app: Celery, redis_client: redis.Redis) -> None:
    # Given a registry an older version (or a hand) left an unusable name in
    app.tasks["t.echo"].delay("x")
    redis_client.sadd(queues_registry(), "", "a{b}")
    # Then the rescoring pass walks the usable queues and skips the rest
    rescorer = Rescorer(app.sits, redis_client)
    assert rescorer.queues() == ["celery"]
    assert rescorer.rescore_all() is not None


def test_statistics_another_writer_corrupted_do_not_stop_the_passes(
        app: Celery, redis_client: redis.Redis) -> None:
    from sits_queue.broker.keys import stats_key
    from sits_queue.priority.rescore import counter_key, hot_key, latency_key

    cfg = app.sits
    app.tasks["t.echo"].delay("x")
    # Given statistics with fields no worker writes: words, infinities, NaN, a number
    # past a float's range, a negative latency (each raised, failing every pass)
    junk = ["abc", "inf", "nan", str(10**400)]
    redis_client.lpush(latency_key(cfg, "high"), "120.5", "-5", *junk)
    redis_client.hset(counter_key(cfg, "done"), mapping={"high": 3, "low": "abc",
                                                         "medium": "inf"})
    redis_client.hset(hot_key(cfg), mapping={"gpt": 4, "x": "nan", "y": "1e400"})
    redis_client.hset(KEYS.arrivals, mapping={"high": 3, "low": "lots"})
    # Then the pass goes on, from the readable fields alone
    assert Rescorer(cfg, redis_client).rescore_all() is not None
    snapshot = json.loads(redis_client.get(stats_key()))
    assert snapshot["classes"]["high"]["p95_ms"] == 120.5
    assert snapshot["classes"]["high"]["bandwidth_compliance"] == 1.0  # 3 of 3
    assert snapshot["hotness"] == {"gpt": 1.0}
