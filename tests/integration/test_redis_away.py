"""A consumer's channel when its Redis goes away (a server of the test's own, stopped
and started again): what it held is given back once Redis answers, even after the
closed channel is forgotten; and a wait connection the server closes while intake is
paused makes the loop reconnect, not spin."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu import Consumer, Producer, Queue
from kombu.asynchronous import Hub

from sits_queue.app import make_app
from sits_queue.broker import intake
from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from sits_queue.embedded import EmbeddedRedis
from tests.waiting import wait_for

QUEUE = QueueKeys.for_queue("away")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path / "redis", appendonly=True)
    server.start()
    redis.Redis.from_url(server.url).config_set("appendfsync", "always")
    yield server
    server.stop()


def test_what_a_forgotten_channel_held_is_given_back_once_redis_answers(
        server: EmbeddedRedis, tmp_path: Path) -> None:
    """The channel closed while Redis was away is a cycle nothing else holds once its
    consumer lets go (Celery drops unstarted tasks on a lost connection): the give-back
    it owes must not be collected with it, or the sweep restores them, counted."""
    url, port = server.url, server.port
    app = make_app(SitsConfig(redis_url=url, visibility_timeout_s=6), main="away-gc")
    with app.connection_for_write() as conn:
        for i in range(2):
            Producer(conn.default_channel).publish({"i": i}, routing_key="away",
                                                   declare=[Queue("away")])
    conn = app.connection_for_read()
    conn.connect()
    channel = conn.channel()
    held = [channel.basic_get("away") for _ in range(2)]
    assert all(m is not None for m in held)
    client = redis.Redis.from_url(url)
    assert client.zcard(QUEUE.unacked) == 2
    # When Redis goes away, the channel closes, and everything refers to it no more
    server.stop()
    channel.close()
    del channel, held
    conn.release()
    del conn
    gc.collect()
    back = EmbeddedRedis(tmp_path / "redis", port=port, password=server.password,
                         appendonly=True)
    back.start()
    try:
        # Then, Redis back, both wait again, uncounted
        client = redis.Redis.from_url(back.url)
        wait_for(lambda: client.zcard(QUEUE.waiting) == 2, 20, "the give-back")
        assert client.zcard(QUEUE.unacked) == 0 and client.hlen(QUEUE.redelivered) == 0
    finally:
        back.stop()
        app.close()


def test_a_wait_connection_closed_while_intake_is_paused_reconnects(
        server: EmbeddedRedis) -> None:
    """No wait in flight (intake paused) and the server closes the wait's connection:
    its socket reads as closed at every turn. The loop must raise the connection error
    (the worker reconnects), not turn on it at full speed."""
    app = make_app(SitsConfig(redis_url=server.url), main="away-spin")
    conn = app.connection_for_read()
    conn.connect()
    hub = Hub()
    try:
        conn.transport.register_with_event_loop(conn.connection, hub)
        consumer = Consumer(conn.default_channel, [Queue("away")],
                            callbacks=[lambda body, message: message.ack()])
        consumer.consume()
        intake.pause("test: host memory short")
        loop = hub.create_loop()
        for _ in range(3):
            next(loop)  # the wait connection is registered; no wait is sent
        killer = redis.Redis.from_url(server.url)
        assert killer.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        turns, deadline = 0, time.monotonic() + 2
        with pytest.raises(redis.ConnectionError):
            while time.monotonic() < deadline:
                next(loop)
                turns += 1
        assert turns < 1000
    finally:
        intake.pause(None)
        hub.close()
        conn.release()
        app.close()


def test_a_channel_closed_with_redis_away_closes_whole_with_its_fanout_queues(
        server: EmbeddedRedis) -> None:
    """kombu's close deletes a channel's auto-delete fanout queues (Celery's gossip and
    events consumers have one): with Redis away the connection error escaped the close,
    half done, and Celery's consumer, its connection already dropped, logged some 60 lines
    of "Error on restarting Gossip: AttributeError" at every outage."""
    from kombu import Exchange

    app = make_app(SitsConfig(redis_url=server.url), main="away-fanout")
    conn = app.connection_for_read()
    conn.connect()
    channel = conn.channel()
    gossip = Queue("w.gossip", Exchange("gossip", "fanout"), auto_delete=True)
    Consumer(channel, [gossip], callbacks=[lambda body, message: None]).consume()
    assert "w.gossip" in channel.auto_delete_queues
    # When Redis goes away and the channel closes
    server.stop()
    channel.close()  # Then it closes without raising, and whole
    assert channel.closed and channel._pool is None  # (its connections dropped too)
    conn.release()
