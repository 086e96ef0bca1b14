"""Acks in a worker are sent without waiting for Redis's reply (``Channel._ack``,
``broker/fanout.py``): on a real Redis, what is owed is read later, a refused ack
(``NOSCRIPT`` after a script flush) or one whose connection was lost runs again, a
plain consumer's ack is still awaited, and a real worker acks every task."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.asynchronous import Hub

from sits_queue.app import make_app
from sits_queue.broker.fanout import DeferredCommands
from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from tests.waiting import wait_for

KEYS = QueueKeys.for_queue("celery")


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    application = make_app(replace(SitsConfig(redis_url=redis_url)), main="acks_test")

    @application.task(name="t.echo", shared=False)
    def echo(tag: str) -> str:
        return tag

    yield application
    application.close()


@pytest.fixture
def in_a_worker(app: Celery) -> Iterator[Any]:
    """A consuming channel whose transport is registered with an event loop (a kombu
    hub, as in a worker), and a picked message."""
    app.tasks["t.echo"].delay("a")
    conn = app.connection_for_write()
    queue = conn.SimpleQueue("celery")
    channel = queue.consumer.channel
    hub = Hub()
    conn.transport.register_with_event_loop(conn.connection, hub)
    yield queue, channel
    conn.transport._hub = None
    hub.close()
    queue.close()
    conn.release()


def test_an_ack_in_a_worker_does_not_wait_for_the_reply(in_a_worker: Any,
                                                        redis_client: redis.Redis) -> None:
    queue, channel = in_a_worker
    message = queue.get(block=False)
    assert redis_client.zcard(KEYS.unacked) == 1
    message.ack()
    # Then the reply is owed (sent, not read) and the ack took effect in Redis
    assert channel._deferred.pending == 1
    wait_for(lambda: redis_client.zcard(KEYS.unacked) == 0, 5, "the ack")
    assert redis_client.hlen(KEYS.payloads) == 0
    channel.qos.restore_visible()  # the periodic sweep reads what is owed
    assert channel._deferred.pending == 0


def test_an_ack_refused_with_noscript_runs_again(in_a_worker: Any,
                                                redis_client: redis.Redis) -> None:
    queue, channel = in_a_worker
    message = queue.get(block=False)
    # Given a Redis that lost its scripts (restarted, or SCRIPT FLUSH)
    redis_client.script_flush()
    message.ack()
    wait_for(lambda: (channel._deferred.poll(), channel._deferred.pending)[1] == 0, 5,
             "the refused ack's reply")
    # Then the ack ran again with the scripts loaded, and the message is gone for good
    assert redis_client.zcard(KEYS.unacked) == 0
    assert redis_client.hlen(KEYS.payloads) == 0


def test_a_plain_consumers_ack_is_awaited(app: Celery, redis_client: redis.Redis) -> None:
    app.tasks["t.echo"].delay("b")
    with app.connection_for_write() as conn:
        queue = conn.SimpleQueue("celery")
        message = queue.get(block=False)
        message.ack()
        assert queue.consumer.channel._deferred.pending == 0
        assert redis_client.zcard(KEYS.unacked) == 0  # at once: no reply was owed
        queue.close()


def test_an_error_reply_goes_to_its_commands_handler(redis_url: str,
                                                     redis_client: redis.Redis) -> None:
    pool = redis.ConnectionPool.from_url(redis_url)
    deferred = DeferredCommands()
    errors: list[redis.RedisError] = []
    redis_client.set("not-a-counter", "text")
    deferred.send(pool, [("INCR", "not-a-counter")], errors.append)
    deferred.send(pool, [("INCR", "counter")], errors.append)
    wait_for(lambda: (deferred.poll(), deferred.pending)[1] == 0, 5, "the replies")
    assert len(errors) == 1 and isinstance(errors[0], redis.ResponseError)
    assert redis_client.get("counter") == b"1"
    deferred.close()
    pool.disconnect()


def test_send_or_run_runs_the_awaited_form_when_it_cannot_send_or_is_refused(
        redis_url: str, redis_client: redis.Redis) -> None:
    deferred = DeferredCommands()
    ran: list[str] = []
    # Nothing listens there: the command cannot be sent, so it runs awaited at once
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        dead = redis.ConnectionPool(host="127.0.0.1", port=free.getsockname()[1])
    deferred.send_or_run(dead, ("INCR", "never"), lambda: ran.append("unsent"))
    assert ran == ["unsent"] and deferred.pending == 0
    # Sent, refused (an error reply): it runs awaited when the reply is read
    pool = redis.ConnectionPool.from_url(redis_url)
    redis_client.set("not-a-counter", "text")
    deferred.send_or_run(pool, ("INCR", "not-a-counter"), lambda: ran.append("refused"))
    deferred.send_or_run(pool, ("INCR", "counter"), lambda: ran.append("wrong"))
    deferred.settle()
    assert ran == ["unsent", "refused"] and redis_client.get("counter") == b"1"
    # ... or its own handler is told instead, when it has one
    told: list[redis.RedisError] = []
    deferred.send_or_run(pool, ("INCR", "not-a-counter"), lambda: ran.append("not me"),
                         told.append)
    deferred.close()
    assert ran == ["unsent", "refused"] and isinstance(told[0], redis.ResponseError)
    pool.disconnect()


def test_a_lost_connection_tells_every_owed_command(redis_url: str,
                                                    redis_client: redis.Redis) -> None:
    pool = redis.ConnectionPool.from_url(redis_url)
    deferred = DeferredCommands()
    errors: list[redis.RedisError] = []
    deferred.send(pool, [("PING",)], errors.append)
    wait_for(lambda: (deferred.poll(), deferred.pending)[1] == 0, 5, "the first reply")
    held = deferred._conn
    host, port = held._sock.getsockname()[:2]
    # Given commands sent while Redis holds back writes (no reply yet), then their
    # connection killed before Redis answers them
    redis_client.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
    try:
        deferred.send(pool, [("INCR", "lost-1"), ("INCR", "lost-2")], errors.append)
        assert redis_client.client_kill(f"{host}:{port}")
    finally:
        redis_client.client_unpause()
    wait_for(lambda: (deferred.poll(), deferred.pending)[1] == 0, 5, "the lost replies")
    # Then each owed command was told its connection was lost, and a new one works
    assert [type(e) for e in errors] == [redis.ConnectionError, redis.ConnectionError]
    assert deferred._conn is None and held is not None
    deferred.send(pool, [("INCR", "after")], errors.append)
    deferred.close()
    assert redis_client.get("after") == b"1" and len(errors) == 2
    pool.disconnect()


def test_a_worker_acks_every_task_though_scripts_are_flushed(
        spawn: Any, client_app: Celery, redis_client: redis.Redis) -> None:
    worker = spawn(concurrency=1)
    slow = client_app.tasks["w.slow"]
    first = slow.delay("k1", 1.0)
    wait_for(lambda: redis_client.get("test:started:k1") == b"1", 30, "the task to start")
    redis_client.script_flush()  # its ack is likely to meet NOSCRIPT
    assert first.get(timeout=30) == "k1"
    wait_for(lambda: redis_client.zcard(KEYS.unacked) == 0, 10, "the first ack")
    results = [slow.delay(f"k{i}", 0.0) for i in range(2, 20)]
    assert [r.get(timeout=30) for r in results] == [f"k{i}" for i in range(2, 20)]
    wait_for(lambda: redis_client.zcard(KEYS.unacked) == 0, 10, "the acks")
    assert redis_client.hlen(KEYS.payloads) == 0
    assert int(redis_client.get("test:started:k1") or 0) == 1  # acked once, not rerun
    assert "could not ack" not in worker.log()
