"""The QoS in-process against a real Redis: which give-backs count as a redelivery
(more than ``max_redeliveries`` dead-letter a message as poison), and what the heartbeat
thread extends. Real workers: ``test_redelivery.py``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import state as worker_state

from sits_queue.app import make_app
from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from tests.integration.conftest import served
from tests.waiting import wait_for

KEYS = QueueKeys.for_queue("celery")


def build_app(redis_url: str, **overrides: Any) -> Celery:
    app = make_app(replace(SitsConfig(redis_url=redis_url), **overrides), main="qos_test")

    @app.task(name="t.echo", shared=False)
    def echo(tag: str) -> str:
        return tag

    return app


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    application = build_app(redis_url, max_redeliveries=2, visibility_timeout_s=4.0)
    yield application
    application.close()


@dataclass(eq=False)
class StartedRequest:
    """Stands for a Celery request the worker accepted (what ``active_requests`` holds)."""

    message: Any


@pytest.fixture
def started() -> Iterator[set[StartedRequest]]:
    """Requests put here are the worker's started ones for the test's length."""
    requests: set[StartedRequest] = set()
    yield requests
    for request in requests:
        worker_state.active_requests.discard(request)


def hold(app: Celery) -> tuple[Any, Any, Any]:
    """A consuming channel and the message it picked (held, unacked)."""
    conn = app.connection_for_write()
    channel = conn.channel()
    channel.basic_consume("celery", no_ack=False, callback=lambda message: None,
                          consumer_tag="c")
    message = channel.basic_get("celery")
    assert message is not None
    return conn, channel, message


def close(conn: Any, channel: Any) -> None:
    channel.close()
    conn.release()


def test_a_clean_close_gives_back_what_it_held_without_counting_it(
        app: Celery, redis_client: redis.Redis) -> None:
    app.tasks["t.echo"].delay("healthy")
    # Given a consumer that takes the message and closes cleanly, more often than
    # max_redeliveries (a worker restarted or reconnected before starting it)
    for _ in range(4):
        conn, channel, _message = hold(app)
        close(conn, channel)
        # Then it waits again, its redelivery count untouched
        assert redis_client.zcard(KEYS.waiting) == 1
        assert redis_client.zcard(KEYS.unacked) == 0
        assert redis_client.hlen(KEYS.redelivered) == 0
    # And the next consumer gets it, neither dead-lettered nor flagged as redelivered
    conn, channel, message = hold(app)
    assert message.payload[0] == ["healthy"]
    assert not message.delivery_info.get("redelivered")
    message.ack()
    close(conn, channel)
    assert redis_client.hlen(KEYS.dead) == 0


def test_a_started_task_given_back_at_close_counts(
        app: Celery, redis_client: redis.Redis, started: set[StartedRequest]) -> None:
    app.tasks["t.echo"].delay("poison")
    for times in (1, 2, 3):
        conn, channel, message = hold(app)
        # Given the worker started the task (Celery accepted its request)...
        request = StartedRequest(message)
        started.add(request)
        worker_state.active_requests.add(request)
        channel.qos.note_started()
        # When it stops before it ends (a cold shutdown cancels it) and its channel closes
        worker_state.active_requests.discard(request)
        close(conn, channel)
        # Then the give-back counts: this task may be what brought its worker down
        assert redis_client.hget(KEYS.redelivered, message.delivery_tag) == str(times).encode()
    # And one more than max_redeliveries (2) dead-letters it as poison at the next pick
    conn = app.connection_for_write()
    channel = conn.channel()
    assert channel.basic_get("celery") is None
    close(conn, channel)
    assert "poison" in redis_client.hget(KEYS.dead, message.delivery_tag).decode()


def test_a_task_still_running_at_close_is_kept_and_acked_through_the_closed_channel(
        app: Celery, redis_client: redis.Redis, started: set[StartedRequest]) -> None:
    """A lost connection with Redis up: Celery reconnects and lets its running task
    go on; it acks through the channel closed meanwhile (after kombu dropped its pool,
    which crashed the worker)."""
    app.tasks["t.echo"].delay("running")
    conn, channel, message = hold(app)
    request = StartedRequest(message)
    started.add(request)
    worker_state.active_requests.add(request)
    try:
        # When its channel closes while the task runs
        close(conn, channel)
        # Then its message stays held, uncounted, and is beaten on
        assert redis_client.zscore(KEYS.unacked, message.delivery_tag) is not None
        assert redis_client.hget(KEYS.redelivered, message.delivery_tag) is None
        redis_client.zadd(KEYS.unacked, {message.delivery_tag: time.time() - 3.5})
        wait_for(lambda: (redis_client.zscore(KEYS.unacked, message.delivery_tag) or 0)
                 > time.time() - 2, 3, "the beat of the closed channel")
    finally:
        worker_state.active_requests.discard(request)
    # And its ack, when it ends, goes through
    message.ack()
    assert redis_client.zcard(KEYS.unacked) == 0 and redis_client.hlen(KEYS.payloads) == 0


def test_a_task_cancelled_at_a_cold_shutdown_counts(
        app: Celery, redis_client: redis.Redis, started: set[StartedRequest]) -> None:
    app.tasks["t.echo"].delay("hung")
    conn, channel, message = hold(app)
    # Given a task the worker started, seen started by a sweep tick of the event loop
    request = StartedRequest(message)
    started.add(request)
    worker_state.active_requests.add(request)
    channel.qos.restore_visible()
    # When a cold shutdown cancels it (Celery forgets the request) and then closes
    worker_state.active_requests.discard(request)
    close(conn, channel)
    # Then the give-back still counts
    assert redis_client.hget(KEYS.redelivered, message.delivery_tag) == b"1"
    assert redis_client.zcard(KEYS.waiting) == 1


def test_a_requeue_counts(app: Celery, redis_client: redis.Redis) -> None:
    app.tasks["t.echo"].delay("requeued")
    conn, channel, message = hold(app)
    # Celery's task_reject_on_worker_lost: the pool child running it died
    message.requeue()
    assert redis_client.hget(KEYS.redelivered, message.delivery_tag) == b"1"
    close(conn, channel)
    assert redis_client.hget(KEYS.redelivered, message.delivery_tag) == b"1"


def test_the_heartbeat_thread_keeps_a_held_message_while_the_consumer_is_busy(
        app: Celery, redis_client: redis.Redis) -> None:
    app.tasks["t.echo"].delay("long")
    conn, channel, message = hold(app)
    # Given a deadline about to run out, and a consumer whose own thread is busy (as a
    # solo pool's task blocks the event loop: nothing here turns it)
    redis_client.zadd(KEYS.unacked, {message.delivery_tag: time.time() - 3.5})
    # Then the heartbeat thread pushes it within a third of the visibility timeout (4 s)
    wait_for(lambda: (redis_client.zscore(KEYS.unacked, message.delivery_tag) or 0)
             > time.time() - 2, 3, "the heartbeat thread")
    message.ack()
    close(conn, channel)


def test_the_heartbeat_never_extends_a_message_it_gave_back(
        app: Celery, redis_client: redis.Redis) -> None:
    app.tasks["t.echo"].delay("a")
    app.tasks["t.echo"].delay("b")
    conn, channel, message = hold(app)
    requeued = channel.basic_get("celery")
    # Given messages this consumer gave back (released, or requeued after a crash)...
    channel.qos.release(message.delivery_tag)
    requeued.requeue()
    # ...that other consumers hold now, past their deadlines
    other_conn, other, first = hold(app)
    second = other.basic_get("celery")
    old = time.time() - 60
    redis_client.zadd(KEYS.unacked, {first.delivery_tag: old, second.delivery_tag: old})
    # When this consumer beats
    channel.qos.heartbeat()
    # Then their deadlines are untouched: it does not hold them any more
    assert redis_client.zscore(KEYS.unacked, first.delivery_tag) == pytest.approx(old, abs=1.0)
    assert redis_client.zscore(KEYS.unacked, second.delivery_tag) == pytest.approx(old, abs=1.0)
    first.ack()
    second.ack()
    close(other_conn, other)
    close(conn, channel)


def test_a_message_whose_ack_failed_is_not_beaten_for_good(
        app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    app.tasks["t.echo"].delay("ran")
    conn, channel, message = hold(app)
    # Given an ack that fails (Redis away: Celery logs it and never acks again)

    def lost(queue: str, tags: list[str]) -> None:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1")

    monkeypatch.setattr(channel, "_ack", lost)
    with pytest.raises(redis.ConnectionError):
        channel.qos.ack(message.delivery_tag)
    # Then the consumer does not hold it any more: its slot is free, no beat keeps it
    # (it stayed held, beaten as long as the process lived, never restored)
    held = [t for tags in channel.qos._held_by_queue().values() for t in tags]
    assert message.delivery_tag not in held and channel.qos.can_consume()
    old = time.time() - 60
    redis_client.zadd(KEYS.unacked, {message.delivery_tag: old})
    channel.qos.heartbeat()
    assert redis_client.zscore(KEYS.unacked, message.delivery_tag) == pytest.approx(old, abs=1)
    # and the sweep restores it, past its visibility timeout, to run again
    served(redis_client)  # (the queue served until now: no gap holds the sweep)
    channel.qos.restore_visible()
    assert redis_client.zscore(KEYS.waiting, message.delivery_tag) is not None
    close(conn, channel)


def test_the_heartbeat_thread_stops_when_its_channel_closes(app: Celery) -> None:
    app.tasks["t.echo"].delay("x")
    conn, channel, message = hold(app)
    heartbeat = channel.qos._heartbeat
    assert heartbeat is not None and heartbeat.alive()
    message.ack()
    close(conn, channel)
    assert not heartbeat.alive()


def test_each_consuming_channel_sweeps_its_own_queues(
        app: Celery, redis_client: redis.Redis) -> None:
    """kombu's poller sweeps through its first consuming channel only (its unacked index
    is global); ours are per queue: a dead worker's messages in the queues of any other
    channel of the connection (which came first was arbitrary) were never restored."""
    for queue in ("qa", "qb"):
        app.tasks["t.echo"].apply_async((queue,), queue=queue)
    with app.connection_for_write() as dead:  # a worker that took both, then died
        channel = dead.channel()
        taken = [channel.basic_get(queue) for queue in ("qa", "qb")]
        assert all(taken)
        channel.qos._delivered.clear()  # it gives nothing back: it died
        channel.close()
    stale = time.time() - 3600
    for queue in ("qa", "qb"):
        unacked = QueueKeys.for_queue(queue).unacked
        redis_client.zadd(unacked, dict.fromkeys(redis_client.zrange(unacked, 0, -1), stale))
    conn = app.connection_for_write()
    conn.ensure_connection()
    channels = [conn.channel(), conn.channel()]
    for channel, queue in zip(channels, ("qa", "qb"), strict=True):
        channel.basic_consume(queue, no_ack=False, callback=lambda m: None, consumer_tag=queue)
        served(redis_client, queue)  # (served until now: no gap holds the sweeps)
    conn.transport.cycle.maybe_restore_messages()
    for queue in ("qa", "qb"):
        keys = QueueKeys.for_queue(queue)
        assert redis_client.zcard(keys.waiting) == 1 and redis_client.zcard(keys.unacked) == 0
    for channel in channels:
        channel.close()
    conn.release()
