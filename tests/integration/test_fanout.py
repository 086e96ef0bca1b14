"""Fanout publishes (events, broadcasts) that do not wait for Redis's reply, on a real
Redis: nothing is lost or reordered, replies owed stay bounded, a closed channel owes
nothing, errors surface."""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Producer

from sits_queue.app import TRANSPORT
from sits_queue.broker import fanout
from sits_queue.embedded import EmbeddedRedis

EXCHANGE = Exchange("sits.fanout.test", type="fanout")


def connection(url: str, **options: Any) -> Connection:
    return Connection(url, transport=TRANSPORT, transport_options=options)


def received(sub: Any, n: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        message = sub.get_message(timeout=0.1)
        if message is not None:
            out.append(json.loads(message["data"]))
    return out


def body(message: dict[str, Any]) -> Any:
    """The published object (kombu's virtual transport base64-encodes message bodies)."""
    return json.loads(base64.b64decode(message["body"]))


@pytest.fixture
def subscriber(redis_client: redis.Redis) -> Iterator[Any]:
    sub = redis_client.pubsub(ignore_subscribe_messages=True)
    yield sub
    sub.close()


def test_every_publish_arrives_in_order_and_replies_owed_stay_bounded(
        redis_url: str, subscriber: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "MAX_PENDING", 8)
    subscriber.psubscribe("/*.sits.fanout.test*")
    with connection(redis_url) as conn:
        channel = conn.default_channel
        producer = Producer(channel, exchange=EXCHANGE)
        owed = []
        for i in range(200):
            producer.publish({"i": i}, routing_key="k", serializer="json")
            owed.append(channel._deferred.pending)
        # Then at most MAX_PENDING replies were ever owed (the rest read as they came)
        assert max(owed) <= 8
        bodies = [body(m) for m in received(subscriber, 200)]
        assert [b["i"] for b in bodies] == list(range(200))
        pool = channel.pool
        # And closing the channel reads what is owed and gives the connection back
        channel.close()
        assert channel._deferred.pending == 0
        assert not pool._in_use_connections


def test_the_key_prefix_applies_to_the_fanout_topic(redis_url: str, subscriber: Any) -> None:
    subscriber.psubscribe("tenant-a:/*")
    with connection(redis_url, global_keyprefix="tenant-a:") as conn:
        Producer(conn.default_channel, exchange=EXCHANGE).publish({"x": 1}, routing_key="k")
        assert [body(m) for m in received(subscriber, 1)] == [{"x": 1}]


def test_a_refused_publish_is_logged_and_the_next_ones_still_go(
        redis_url: str, redis_client: redis.Redis, subscriber: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a Redis user that may not PUBLISH to one topic (an error reply, not a drop)
    redis_client.execute_command("ACL", "SETUSER", "fanout-test", "on", ">pw", "~*",
                                 "&/*.sits.fanout.test*", "+@all")
    host_port = redis_url.split("//", 1)[1].rsplit("/", 1)[0]
    limited = f"redis://fanout-test:pw@{host_port}/0"
    denied = Exchange("sits.denied.test", type="fanout")
    subscriber.psubscribe("/*.sits.fanout.test*")
    try:
        with connection(limited) as conn, caplog.at_level(logging.WARNING):
            channel = conn.default_channel
            Producer(channel, exchange=denied).publish({"no": 1}, routing_key="k")
            Producer(channel, exchange=EXCHANGE).publish({"yes": 1}, routing_key="k")
            channel.close()
        # Then the refusal is in the log, and the allowed message arrived all the same
        assert "Redis refused a fanout publish" in caplog.text
        assert [body(m) for m in received(subscriber, 1)] == [{"yes": 1}]
    finally:
        redis_client.execute_command("ACL", "DELUSER", "fanout-test")


def test_a_publish_to_a_dead_server_raises_then_recovers(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    port = server.port
    try:
        with connection(url) as conn:
            channel = conn.default_channel
            producer = Producer(channel, exchange=EXCHANGE)
            producer.publish({"i": 0}, routing_key="k")
            # When the server goes away, a publish fails loudly (no silent drop)...
            server.stop()
            with pytest.raises((redis.ConnectionError, OSError)):
                for _ in range(3):  # the first write may land in the socket buffer
                    producer.publish({"i": 1}, routing_key="k")
                    time.sleep(0.05)
            # ...and once it is back, publishing works again on a fresh connection
            server = EmbeddedRedis(tmp_path / "redis", port=port)
            server.start()
            sub = redis.Redis.from_url(url).pubsub(ignore_subscribe_messages=True)
            sub.psubscribe("/*.sits.fanout.test*")
            producer.publish({"i": 2}, routing_key="k")
            assert [body(m) for m in received(sub, 1)] == [{"i": 2}]
            sub.close()
    finally:
        server.stop()
