"""Times compared across hosts are on Redis's clock (``broker/clock.py``), whatever the
clock of the host that took them says. One process stands for each host in turn: its
``time.time`` is shifted, and the measured offset forgotten as it changes hosts.

(Each host read its own clock: a producer an hour behind put tasks that had "waited" an
hour, above every fresh task of any class, and an hour of latency in its class's p95; a
worker five minutes behind had its running task restored by another's sweep.)"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import redis
from celery import Celery

from sits_queue.app import make_app
from sits_queue.broker import clock
from sits_queue.broker.keys import QueueKeys
from sits_queue.config import SitsConfig
from sits_queue.priority.rescore import Rescorer

KEYS = QueueKeys.for_queue("celery")
_real_time = time.time


@contextmanager
def host(monkeypatch: pytest.MonkeyPatch, skew_s: float) -> Iterator[None]:
    """This process as a host whose clock is ``skew_s`` off."""
    clock.forget()
    monkeypatch.setattr(time, "time", lambda: _real_time() + skew_s)
    try:
        yield
    finally:
        monkeypatch.setattr(time, "time", _real_time)
        clock.forget()


def redis_now(r: redis.Redis) -> float:
    seconds, micros = r.time()
    return seconds + micros / 1e6


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    application = make_app(replace(SitsConfig(redis_url=redis_url), visibility_timeout_s=4.0),
                           main="skew_test")

    @application.task(name="t.echo", shared=False)
    def echo(tag: str) -> str:
        return tag

    yield application
    application.close()


@pytest.mark.parametrize("skew_s", [-3600.0, 3600.0])
def test_a_skewed_producers_task_is_put_at_redis_time(
        app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
        skew_s: float) -> None:
    with host(monkeypatch, skew_s):
        app.tasks["t.echo"].apply_async(("skewed",), sla_class="low")
    with host(monkeypatch, 0.0):
        app.tasks["t.echo"].apply_async(("fresh",), sla_class="high")
    now = redis_now(redis_client)
    metas = {m: json.loads(v) for m, v in redis_client.hgetall(KEYS.meta).items()}
    payloads = {m: json.loads(v) for m, v in redis_client.hgetall(KEYS.payloads).items()}
    assert len(metas) == 2
    for tag, meta in metas.items():
        # the wait starts, and the latency will be taken from, the put on Redis's clock
        assert abs(meta["t"] - now) < 5, meta
        assert abs(payloads[tag]["headers"]["sits_submitted_at"] - now) < 5
    # And a rescoring pass on a host of the right time keeps the class order: the low
    # task put by the skewed producer has not "waited" an hour, nor is it an hour young
    with host(monkeypatch, 0.0):
        Rescorer(app.sits, redis_client).rescore_all()
    first = redis_client.zrange(KEYS.waiting, 0, 0)[0]
    assert payloads[first]["headers"]["argsrepr"] == "('fresh',)"


def test_a_worker_behind_keeps_its_running_task_from_another_workers_sweep(
        app: Celery, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    app.tasks["t.echo"].delay("running")
    conn = app.connection_for_write()
    other = app.connection_for_write()
    try:
        with host(monkeypatch, -300.0):  # five minutes behind, far past the 4 s timeout
            channel = conn.channel()
            channel.basic_consume("celery", no_ack=False, callback=lambda m: None,
                                  consumer_tag="behind")
            message = channel.basic_get("celery")
            assert message is not None
            channel.qos.heartbeat()
        with host(monkeypatch, 0.0):
            sweeper = other.channel()
            sweeper.basic_consume("celery", no_ack=False, callback=lambda m: None,
                                  consumer_tag="sweeper")
            sweeper.qos.restore_visible()
        # Then the task stays with the worker running it: nothing restored to run twice
        assert redis_client.zcard(KEYS.unacked) == 1
        assert redis_client.zcard(KEYS.waiting) == 0
        assert redis_client.hlen(KEYS.redelivered) == 0
        with host(monkeypatch, -300.0):
            message.ack()
    finally:
        for c in (conn, other):
            c.release()
