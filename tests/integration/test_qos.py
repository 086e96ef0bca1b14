"""The QoS in-process against a real Redis: which give-backs count as a redelivery
(more than ``max_redeliveries`` dead-letter a message as poison). Real workers:
``test_redelivery.py``."""

from __future__ import annotations

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
        # When its channel closes before the task ends (a reconnect, a stop)
        close(conn, channel)
        worker_state.active_requests.discard(request)
        # Then the give-back counts: this task may be what brought its worker down
        assert redis_client.hget(KEYS.redelivered, message.delivery_tag) == str(times).encode()
    # And one more than max_redeliveries (2) dead-letters it as poison at the next pick
    conn = app.connection_for_write()
    channel = conn.channel()
    assert channel.basic_get("celery") is None
    close(conn, channel)
    assert "poison" in redis_client.hget(KEYS.dead, message.delivery_tag).decode()


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

